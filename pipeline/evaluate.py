"""Evaluating a trained checkpoint: top-1 on the validation set, GFLOPs (fvcore) and measured images/s.

Speed is measured where the model would be deployed: ``experiment.eval.device``, ``dtype`` and
``compile`` (``auto``: the GPU with bf16 and ``torch.compile`` where there is one, else the CPU in
fp32 eager), and the result records the setting it was measured in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from pipeline.bench.timing import default_calls, rate
from pipeline.config import Config, EvalConfig
from pipeline.runtime import (
    DTYPES,
    KernelChoice,
    compile_model,
    cuda_settings,
    inference,
    resolve_setting,
    step_marker,
)


@dataclass(frozen=True)
class Evaluation:
    top1: float
    gflops: float
    images_per_s: float
    images_per_s_spread: float
    num_images: int
    device: str
    dtype: str
    compile: str
    kernels: dict[str, str]  # what ran: ``models.selfcheck.kernel_record``

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def top1(model: nn.Module, config: Config, device: torch.device, dtype: str = "fp32") -> tuple[float, int]:
    """Top-1 (%) over the whole validation set with the validation loader of ``config``.

    The random and importance methods draw their tokens from torch's generator in every forward, so the
    pass runs on a generator seeded with ``config.seed`` (and the caller's state comes back after it):
    otherwise their top-1 depended on whatever the process had drawn before (two demo runs gave 63.35%
    and 63.85% for one random-selection checkpoint).
    """
    from pipeline.data.loaders import loader_spec, shared_loader
    from pipeline.models import data_config

    spec = loader_spec(config.data, data_config(model), train=False, seed=config.seed, device=str(device))
    correct = total = 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), inference(device, dtype):
        torch.manual_seed(config.seed)
        for images, labels in shared_loader(config.data.loader, spec):
            logits = model(images.to(device))
            correct += int((logits.argmax(-1) == labels.to(device)).sum())
            total += labels.numel()
    return 100.0 * correct / max(total, 1), total


def throughput(model: nn.Module, *, batch: int, warmup: int, repeats: int, device: torch.device,
               dtype: str = "fp32", compile: str = "none") -> tuple[float, float]:
    """Inference images/s at ``batch``: median over ``repeats`` timed samples, and the spread (max - min).

    A sample queues ``timing.default_calls`` calls back to back (10 on CUDA), in one held inference
    context (``runtime.inference``), as ``bench throughput`` times. ``compile`` compiles the model
    (fullgraph) first; the compiling call is part of the warm-up.
    """
    run = compile_model(model, compile, device)
    mark = step_marker(compile)
    images = torch.randn(batch, 3, *model.patch_embed.img_size, device=device)

    def forward() -> object:
        mark()
        return run(images)

    with inference(device, dtype):
        return rate(forward, items=batch, warmup=max(warmup, 1 if compile != "none" else 0), repeats=repeats,
                    device=device, calls=default_calls(device))


def evaluate_checkpoint(path: str, cfg: EvalConfig, *, cuda: bool | None = None,
                        kernels: KernelChoice | None = None) -> Evaluation:
    """Everything the select stage needs about one trained model, measured in ``cfg``'s setting with
    ``kernels`` (default all ``auto``; each fused kernel is checked on the device first)."""
    from pipeline.flops import count_flops
    from pipeline.models import set_kernels
    from pipeline.models.selfcheck import check_model, kernel_record
    from pipeline.train.checkpoint import model_from_checkpoint

    model, config, _ = model_from_checkpoint(path)
    flops = count_flops(model).total
    device, dtype, mode = resolve_setting(cfg.device, cfg.dtype, cfg.compile,
                                          torch.cuda.is_available() if cuda is None else cuda)
    target = torch.device(device)
    kernels = kernels or KernelChoice()
    model = set_kernels(model.to(target), kernels)
    check_model(model, target, DTYPES[dtype] or torch.float32)
    with cuda_settings(target):
        accuracy, count = top1(model, config, target, dtype)
        images_s, spread = throughput(model, batch=cfg.batch, warmup=cfg.warmup, repeats=cfg.repeats,
                                      device=target, dtype=dtype, compile=mode)
    return Evaluation(top1=accuracy, gflops=flops, images_per_s=images_s, images_per_s_spread=spread,
                      num_images=count, device=device, dtype=dtype, compile=mode,
                      kernels=kernel_record(kernels, target))
