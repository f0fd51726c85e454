"""``pipeline bench loop``: the training loop against the bare step it runs, side by side.

The loop is the real ``train_one_epoch`` of ``pipeline.train.loop``: the loader's iteration, the copy
to the device, the debug hooks, the LR schedule, the step, the loss summed on the device and read every
``train.log_every`` steps. The bare step is what ``bench throughput --train`` times: forward, loss,
backward and the optimizer's step on a batch already on the device. Both use the same model, optimizer
(the recipe's fused AdamW), loss, batch, dtype and compile mode, and the loop reads batches already on
the device, so that **loop efficiency = loop images/s / step images/s** is the loop's own overhead, not
the loader's (``bench loader`` times that). The recipe is plain: no Mixup/CutMix, EMA, clipping or
label smoothing, which are training work rather than loop overhead.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pipeline.bench.profiling import DeviceReads
from pipeline.bench.throughput import bare_step, bench_keep
from pipeline.bench.timing import time_paired
from pipeline.config import BenchLoopConfig, Config, PoolingConfig, RecipeConfig, TrainConfig
from pipeline.errors import JobError
from pipeline.methods import downsamples
from pipeline.runtime import KernelChoice, compile_model, cuda_settings, step_marker, warm_up
from pipeline.train.session import LocalSession

PLAIN_RECIPE = {"mixup": 0.0, "cutmix": 0.0, "label_smoothing": 0.0, "ema": False, "clip_grad": None,
                "warmup_epochs": 0.0}


@dataclass(frozen=True)
class LoopRow:
    label: str
    step_images_per_s: float  # the bare step's
    loop_images_per_s: float  # train_one_epoch's
    efficiency: float  # median over pairs of (bare steps' time / the loop epoch's time)
    reads: int | None  # device reads of one loop epoch (DeviceReads; None under CUDA graphs)


class DeviceBatches:
    """A loader of ``steps`` batches that are already on the device: the same ``(x, labels)`` each step."""

    def __init__(self, x: torch.Tensor, labels: torch.Tensor, steps: int) -> None:
        self.x, self.labels, self.steps = x, labels, steps
        self.next_epoch = 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter([(self.x, self.labels)] * self.steps)


def _job(cfg: BenchLoopConfig, method: str, keep: list[int] | None, pooling: PoolingConfig,
         device: torch.device, kernels: KernelChoice):
    """A training job of ``method`` on ``DeviceBatches``: no Ray, no MLflow, no checkpoints."""
    from pipeline.models import create_model
    from pipeline.models.selfcheck import check_model
    from pipeline.train.loop import Job
    from pipeline.train.recipe import build_recipe

    mode = "finetune" if downsamples(method) else "base"
    config = Config(
        recipe=RecipeConfig(**PLAIN_RECIPE, amp=cfg.dtype == "bf16"),
        train=TrainConfig(mode=mode, workers=0, use_gpu=device.type == "cuda", compile=cfg.compile,
                          log_every=cfg.log_every, progress_bar=False),
    )
    model = create_model(cfg.model, method=method, keep=keep if downsamples(method) else None,
                         options=pooling.method_options(method), patch_embed=cfg.patch_embed,
                         kernels=kernels).to(device)
    check_model(model, device, torch.bfloat16 if cfg.dtype == "bf16" else torch.float32)
    size = model.patch_embed.img_size[0]
    x = torch.randn(cfg.batch, 3, size, size, device=device)
    labels = torch.randint(0, model.num_classes, (cfg.batch,), device=device)
    recipe = build_recipe(model, config.recipe, num_classes=model.num_classes, global_batch=cfg.batch,
                          steps_per_epoch=cfg.steps)
    run = compile_model(model, cfg.compile, device)
    return Job(config, LocalSession(config), model, run, recipe, DeviceBatches(x, labels, cfg.steps), None)


def _epoch_reads(job, epoch: Callable[[], object], compile_mode: str) -> int | None:
    """Device reads of one loop epoch; None under CUDA graphs, which a dispatch mode would disturb."""
    if compile_mode == "reduce-overhead":
        return None
    with DeviceReads() as reads:
        epoch()
    return reads.count


def time_method(cfg: BenchLoopConfig, method: str, keep: list[int] | None, pooling: PoolingConfig,
                device: torch.device, log: Callable[[str], None], kernels: KernelChoice | None = None) -> LoopRow:
    """One method's row: ``cfg.repeats`` pairs of (``cfg.steps`` bare steps, one loop epoch)."""
    from pipeline.train.loop import train_one_epoch

    job = _job(cfg, method, keep, pooling, device, kernels or KernelChoice())
    loader = job.train_loader
    step = bare_step(job.run, job.recipe.optimizer, job.recipe.loss, loader.x, loader.labels, device, cfg.dtype,
                     step_marker(cfg.compile))
    counter = [0]

    def bare_epoch() -> None:
        for _ in range(cfg.steps):
            step()

    def loop_epoch() -> None:
        _, counter[0] = train_one_epoch(job, 0, counter[0])

    label = method if downsamples(method) else "unmodified"
    warm_up(step, log=log, label=f"{label} (compile {cfg.compile})")
    log(f"timing {label}: {cfg.repeats} x ({cfg.steps} bare steps, one loop epoch of {cfg.steps} steps), "
        f"batch {cfg.batch}, {cfg.dtype}")
    bare_t, loop_t = time_paired(loop_epoch, bare_epoch, warmup=1, repeats=cfg.repeats, device=device)
    images = cfg.batch * cfg.steps
    row = LoopRow(label=label, step_images_per_s=images / statistics.median(bare_t),
                  loop_images_per_s=images / statistics.median(loop_t),
                  efficiency=statistics.median(b / o for b, o in zip(bare_t, loop_t)),
                  reads=_epoch_reads(job, loop_epoch, cfg.compile))
    log(f"  {label}: step {row.step_images_per_s:.1f} images/s, loop {row.loop_images_per_s:.1f} images/s, "
        f"efficiency {row.efficiency:.3f}")
    return row


def run_loop_bench(cfg: BenchLoopConfig, pooling: PoolingConfig, log: Callable[[str], None] = print,
                   kernels: KernelChoice | None = None) -> list[LoopRow]:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise JobError("bench_loop.device is 'cuda' but no CUDA device is visible")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    keep = bench_keep(cfg)
    with cuda_settings(device):
        return [time_method(cfg, method, keep, pooling, device, log, kernels) for method in cfg.methods]


COLUMNS = ("model", "bare step images/s", "loop images/s", "loop efficiency", "device reads an epoch")


def format_loop(cfg: BenchLoopConfig, rows: list[LoopRow]) -> str:
    keep = bench_keep(cfg)
    setting = (f"model {cfg.model}, training, batch {cfg.batch}, {cfg.dtype}, compile {cfg.compile}, "
               f"keep {','.join(map(str, keep)) if keep else 'all'}, {cfg.steps} steps an epoch, "
               f"log_every {cfg.log_every}, median of {cfg.repeats} pairs")
    cells = [(row.label, f"{row.step_images_per_s:.1f}", f"{row.loop_images_per_s:.1f}", f"{row.efficiency:.3f}",
              "-" if row.reads is None else str(row.reads)) for row in rows]
    table = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    table += ["| " + " | ".join(cell) + " |" for cell in cells]
    note = ("loop efficiency: median over pairs of (time of the bare steps / time of the loop's epoch of as many "
            "steps); both feed batches already on the device and share the model and its fused AdamW.")
    return "\n".join([setting, "", *table, "", note])
