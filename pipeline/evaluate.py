"""Evaluating a trained checkpoint: top-1 on the validation set, GFLOPs (fvcore) and measured speed.

Speed is a paired ratio (``bench.paired``): the model's time over the same architecture's unmodified model's
(the checkpoint's weights without its downsampling), both warm in this process, with a 95% interval, where the
model would be deployed: ``experiment.eval.device``, ``dtype`` and ``compile`` (``auto``: the GPU with bf16 and
``torch.compile`` where there is one, else the CPU in fp32 eager; on the CPU ``eval.threads``, one by default,
timed on the process's CPU clock). ``experiment.eval.runtime: onnxruntime`` times both networks exported to ONNX
(``pipeline.export``, checked against torch first) in ONNX Runtime on the CPU in float32, and its clock is named
``onnxruntime:cpu`` (or ``:wall``), so that the select stage never chains its ratios with torch's. The result records
the setting it was measured in; its images/s are the reference's own rate over the ratio (the select stage puts every
model on one scale).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.bench.paired import SpeedRatio, SpeedSettings, chain, paired_ratio, sample_timer
from pipeline.bench.timing import default_calls
from pipeline.config import Config, EvalConfig
from pipeline.errors import InputError
from pipeline.export import ExportError, check_onnx, export_onnx, session
from pipeline.runtime import (
    DTYPES,
    KernelChoice,
    compile_model,
    cuda_settings,
    dispatched,
    forget_dispatches,
    inference,
    resolve_setting,
    step_marker,
)
from pipeline.train.checkpoint import model_from_checkpoint


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
    kernels: dict[str, str]  # what the fused steps' dispatches ran: ``models.selfcheck.kernels_ran``
    speed_ratio: float = math.nan  # the model's time over its unmodified reference's (paired)
    speed_ratio_low: float = math.nan  # the ratio's 95% interval
    speed_ratio_high: float = math.nan
    speed_blocks: int = 0
    speed_stop: str = ""  # why the blocks stopped: ``bench.paired.STOPS``
    speed_seconds: float = 0.0  # wall time of the pilot and the blocks
    load_before: float = math.nan  # the 1-minute load average before and after the timing
    load_after: float = math.nan
    device_name: str | None = None  # ``bench.blocks.device_name`` of the device it was timed on: its spread record
    clock: str = ""  # the clock its speed was timed on (``speed_clock``): speeds on different clocks do not compare

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


@contextmanager
def cpu_threads(device: torch.device, threads: int):
    """torch's threads set to ``threads`` on the CPU for the block (restored after); nothing on a GPU."""
    saved = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def speed(run: Callable[[Tensor], Tensor], reference: Callable[[Tensor], Tensor], images: Tensor, *,
          device: torch.device, dtype: str, compile: str = "none", threads: int = 1,
          settings: SpeedSettings | None = None) -> SpeedRatio:
    """``run``'s time over ``reference``'s on ``images`` (B, 3, H, W), paired (``bench.paired``), in one held
    inference context (``runtime.inference``). A sample queues ``timing.default_calls`` calls (10 on CUDA, timed
    by CUDA events); on the CPU ``threads`` threads, one timed on its thread's CPU clock (more on wall time)."""
    mark = step_marker(compile)

    def model() -> object:
        mark()
        return run(images)

    def unmodified() -> object:
        mark()
        return reference(images)

    with inference(device, dtype), cpu_threads(device, threads):
        timer = sample_timer(device, calls=default_calls(device), clock=speed_clock(device, threads))
        return paired_ratio(model, unmodified, timer=timer, settings=settings or SpeedSettings())


def speed_clock(device: torch.device, threads: int, runtime: str = "torch") -> str:
    """The clock ``speed`` times on: ``cuda`` (CUDA events), ``cpu`` (the thread's CPU time, at one torch thread) or
    ``wall`` (the wall clock, at more threads, whose work the thread's clock would not count); prefixed by the runtime
    where it is not torch (``onnxruntime:cpu``: ONNX Runtime at one intra-op thread runs on the calling thread)."""
    clock = "cuda" if device.type == "cuda" else "cpu" if threads == 1 else "wall"
    return clock if runtime == "torch" else f"{runtime}:{clock}"


def eval_setting(cfg: EvalConfig, cuda: bool) -> tuple[str, str, str]:
    """(device, dtype, compile) of ``cfg``'s timing: ``runtime.resolve_setting``'s, or the CPU in float32 without
    torch.compile for ``runtime: onnxruntime``."""
    if cfg.runtime == "onnxruntime":
        return resolve_setting("cpu", "fp32", "none", False)
    return resolve_setting(cfg.device, cfg.dtype, cfg.compile, cuda)


def timed_form(model: nn.Module, cfg: EvalConfig, mode: str, device: torch.device, images: Tensor, *,
               label: str) -> Callable[[Tensor], object]:
    """What ``speed`` calls: ``model`` compiled in ``mode`` (torch), or its ONNX export (dynamic batch) in an ONNX
    Runtime session on ``cfg.threads`` threads, after the export's logits were checked against the model's on
    ``images`` (an ExportError names the difference)."""
    if cfg.runtime == "torch":
        return compile_model(model, mode, device)
    with tempfile.TemporaryDirectory() as tmp:  # the session holds the graph: the file may go
        path = export_onnx(model, os.path.join(tmp, "model.onnx"), label=label)
        check = check_onnx(model, path, images[:8].cpu(), label=label)
        if not check.passed:
            raise ExportError(f"{label}: the ONNX export the evaluation would time differs from torch ({check.line()})")
        sess = session(path, threads=cfg.threads)

    def run(x: Tensor) -> object:
        return sess.run(None, {"images": x.numpy()})
    return run


def speed_settings(cfg: EvalConfig) -> SpeedSettings:
    return SpeedSettings(tolerance=cfg.speed_tolerance, cap_s=cfg.speed_cap_s, warmup=max(cfg.warmup, 1))


def evaluate_checkpoint(path: str, cfg: EvalConfig, *, cuda: bool | None = None,
                        kernels: KernelChoice | None = None, model_config: Config | None = None) -> Evaluation:
    """Everything the select stage needs about one trained model, measured in ``cfg``'s setting with
    ``kernels`` (default all ``auto``; each fused kernel is checked on the device first at the model's shapes);
    ``kernels`` of the result is what the dispatches of its top-1 and timed calls ran. ``model_config``: evaluate the
    network it defines, on the checkpoint's weights, instead of the checkpoint's own (a method inserted into a base
    with no training, ``model_from_checkpoint``)."""
    from pipeline.bench.blocks import device_name
    from pipeline.flops import count_flops
    from pipeline.models import set_kernels
    from pipeline.models.selfcheck import check_model, kernels_ran

    model, config, _ = model_from_checkpoint(path, built=model_config)
    reference, _, _ = model_from_checkpoint(path, plain=True)  # the same weights, no downsampling
    flops = count_flops(model).total
    device, dtype, mode = eval_setting(cfg, torch.cuda.is_available() if cuda is None else cuda)
    target = torch.device(device)
    kernels = kernels or KernelChoice()
    model = set_kernels(model.to(target), kernels)
    reference = set_kernels(reference.to(target), kernels)
    check_model(model, target, DTYPES[dtype] or torch.float32)
    forget_dispatches()  # the FLOP count's CPU trace ran before: not this evaluation's record
    images = torch.randn(cfg.batch, 3, *model.patch_embed.img_size, device=target)
    with cuda_settings(target):
        accuracy, count = top1(model, config, target, dtype)
        top1_ran = dispatched()  # an export's check runs torch again below: not a timed call
        run = timed_form(model, cfg, mode, target, images, label=path)
        run_reference = timed_form(reference, cfg, mode, target, images, label=f"{path} (unmodified)")
        with inference(target, dtype):
            run(images)  # the timed form's first call: its dispatches join the record, the reference's do not
        ran = kernels_ran(dispatched() if cfg.runtime == "torch" else top1_ran)  # top-1's and the timed form's
        load_before = os.getloadavg()[0]
        ratio = speed(run, run_reference, images, device=target, dtype=dtype, compile=mode, threads=cfg.threads,
                      settings=speed_settings(cfg))
        load_after = os.getloadavg()[0]
    rate = cfg.batch / ratio.reference_s  # the reference's images/s in this process
    return Evaluation(top1=accuracy, gflops=flops, images_per_s=rate / ratio.ratio,
                      images_per_s_spread=rate / ratio.low - rate / ratio.high, num_images=count, device=device,
                      dtype=dtype, compile=mode, kernels=ran, speed_ratio=ratio.ratio, speed_ratio_low=ratio.low,
                      speed_ratio_high=ratio.high, speed_blocks=ratio.blocks, speed_stop=ratio.stop,
                      speed_seconds=ratio.seconds, load_before=load_before, load_after=load_after,
                      device_name=device_name(target), clock=speed_clock(target, cfg.threads, cfg.runtime))


@dataclass(frozen=True)
class Scale:
    """One speed scale for every width: each architecture's unmodified model against the anchor's (the first),
    paired, the anchor's images/s, and the anchor against a copy of itself (whose interval should cover 1); the clock
    and the device it was timed on, which the evaluations it scales must share."""

    anchor: str
    anchor_images_per_s: float
    references: dict[str, SpeedRatio]  # architecture -> its unmodified model's time over the anchor's
    self_check: SpeedRatio
    clock: str  # ``speed_clock``: the clock the scale was timed on
    device_name: str  # ``bench.blocks.device_name`` of the device it was timed on

    def images_per_s(self, arch: str, ratio: float, low: float, high: float) -> tuple[float, float, float]:
        """A model of ``arch`` timed at ``ratio`` [low, high] of its reference: images/s and the interval's ends on
        this scale (the reference's interval and the model's multiply, ``bench.paired.chain``)."""
        total = chain(SpeedRatio(ratio, low, high, 0, "", 0.0, 0.0), self.references[arch])
        rate = self.anchor_images_per_s
        return rate / total.ratio, rate / total.high, rate / total.low


def reference_scale(checkpoints: dict[str, str], cfg: EvalConfig, *, cuda: bool | None = None,
                    kernels: KernelChoice | None = None) -> Scale:
    """``Scale`` of the architectures in ``checkpoints`` (architecture -> any checkpoint of it, whose weights the
    unmodified model takes), timed in ``cfg``'s setting as the evaluate stage times (``speed``)."""
    from pipeline.models import set_kernels

    device, dtype, mode = eval_setting(cfg, torch.cuda.is_available() if cuda is None else cuda)
    target, kernels = torch.device(device), kernels or KernelChoice()

    def unmodified(path: str) -> tuple[Callable[[Tensor], Tensor], Tensor]:
        model = set_kernels(model_from_checkpoint(path, plain=True)[0].to(target), kernels)
        images = torch.randn(cfg.batch, 3, *model.patch_embed.img_size, device=target)
        return timed_form(model, cfg, mode, target, images, label=f"{path} (unmodified)"), images

    labels = list(checkpoints)
    anchor, images = unmodified(checkpoints[labels[0]])
    settings = speed_settings(cfg)
    with cuda_settings(target):
        copy, _ = unmodified(checkpoints[labels[0]])
        self_check = speed(copy, anchor, images, device=target, dtype=dtype, compile=mode, threads=cfg.threads,
                           settings=settings)
        references = {labels[0]: SpeedRatio(1.0, 1.0, 1.0, 0, "anchor", 0.0, 0.0)}
        for label in labels[1:]:
            run, own = unmodified(checkpoints[label])
            if own.shape != images.shape:
                raise InputError(f"architecture {label} takes {tuple(own.shape[1:])} images and {labels[0]} "
                                 f"{tuple(images.shape[1:])}: their speeds have no common scale")
            references[label] = speed(run, anchor, images, device=target, dtype=dtype, compile=mode,
                                      threads=cfg.threads, settings=settings)
    from pipeline.bench.blocks import device_name

    return Scale(labels[0], cfg.batch / self_check.reference_s, references, self_check,
                 speed_clock(target, cfg.threads, cfg.runtime), device_name(target))
