"""``pipeline bench throughput``: downsampling models against the unmodified one, side by side.

Every method of the list runs against the same unmodified model, in the same dtype (autocast) and
compile mode, on the same batch: each timed sample of a downsampled model follows a timed sample of
the unmodified one, and the speed-up is the median of the per-pair time ratios. A sample queues
``calls`` calls back to back (10 on CUDA by default: throughput, as a serving loop runs), and
inference holds one autocast context across the calls, so neither model casts its weights again in
every forward (``runtime.inference``). ``--train`` times a whole optimizer step (forward,
backward, AdamW) instead of an inference forward. A ceiling row runs the same keep list with plain
random token dropping, the cheapest way to reach the same token counts. Each row also carries what
the model dispatches: aten ops of one forward (counted on the CPU, for the CPU path and for the
one-hot path that CUDA runs) and, on CUDA, kernel launches and the host's time to issue one call,
which says whether the model is bound by the host or by the GPU.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.bench.profiling import count_launches, count_ops, kernel_table
from pipeline.bench.timing import default_calls, host_seconds, time_paired
from pipeline.config import BenchLoopConfig, BenchThroughputConfig, PoolingConfig
from pipeline.errors import JobError
from pipeline.pooling.common import dense_segments
from pipeline.runtime import (
    DTYPES,
    KernelChoice,
    autocast,
    compile_model,
    cuda_settings,
    inference,
    step_marker,
    warm_up,
)
from pipeline.sparsity import level_keep

CEILING = "ceiling"  # the row label of plain random dropping at the same keep list


@dataclass(frozen=True)
class ThroughputRow:
    label: str
    gflops: float
    images_per_s: float
    speedup: float  # median over pairs of (unmodified time / this model's time)
    flops_ratio: float  # unmodified GFLOPs / this model's
    ops_cpu: int  # aten ops of one no-grad forward, CPU path
    ops_dense: int  # the same with the one-hot segment path that CUDA runs
    launches: int | None  # CUDA kernel launches of one call (None off CUDA)
    host_s: float | None  # seconds the host takes to issue one call, the device idle at its start (CUDA only)
    compile_s: float | None  # seconds of the first (compiling) call
    base_times: list[float]  # the unmodified model's paired times, seconds

    @property
    def realised(self) -> float:
        """The fraction of the FLOP saving that shows up as speed: speed-up / GFLOPs ratio."""
        return self.speedup / self.flops_ratio


@dataclass(frozen=True)
class ThroughputResult:
    base_images_per_s: float
    base_gflops: float
    base_ops: int
    base_launches: int | None
    base_host_s: float | None
    calls: int  # calls a timed sample
    keep: list[int]
    rows: list[ThroughputRow]


def bench_keep(cfg: BenchThroughputConfig | BenchLoopConfig) -> list[int] | None:
    """The keep list of a model benchmark: its ``keep``, or the paper's list at its ``level``."""

    if cfg.keep is not None:
        return cfg.keep
    return level_keep(cfg.model, cfg.level) if cfg.level is not None else None


def _op_counts(model: nn.Module, size: int) -> tuple[int, int]:
    """aten ops of one forward of a CPU copy at batch 2: (CPU path, CUDA's one-hot path)."""
    cpu = copy.deepcopy(model).cpu().eval()
    x = torch.randn(2, 3, size, size)
    with dense_segments(False):
        own = count_ops(lambda: cpu(x)).total
    with dense_segments(True):
        dense = count_ops(lambda: cpu(x)).total
    return own, dense


def _runner(model: nn.Module, cfg: BenchThroughputConfig, device: torch.device, x: torch.Tensor,
            labels: torch.Tensor) -> Callable[[], object]:
    """One timed call: an inference forward, or a training step (forward, loss, backward, AdamW)."""
    fn = compile_model(model, cfg.compile, device)
    mark = step_marker(cfg.compile)
    if not cfg.train:
        def forward() -> object:  # called in the inference context its caller holds (_held)
            mark()
            return fn(x)
        return forward
    # The fused (one-kernel) AdamW, for both models alike, as training builds it (train.recipe.fused).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return bare_step(fn, optimizer, F.cross_entropy, x, labels, device, cfg.dtype, mark)


def bare_step(fn: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, labels: torch.Tensor,
              device: torch.device, dtype: str, mark: Callable[[], None]) -> Callable[[], torch.Tensor]:
    """A training step and nothing else: forward, loss, backward and the optimizer's step on one batch
    already on the device (``bench throughput --train``, and the reference of ``bench loop``)."""
    def step() -> torch.Tensor:
        mark()
        with autocast(device, dtype):
            loss = loss_fn(fn(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss
    return step


def _held(cfg: BenchThroughputConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The context held around all the calls of one model's timing: inference keeps its weights' bf16 /
    fp16 copies in it; a training step changes its weights, so it enters autocast in each step."""
    return contextlib.nullcontext() if cfg.train else inference(device, cfg.dtype)


def _host_s(run: Callable[[], object], cfg: BenchThroughputConfig, device: torch.device) -> float | None:
    return host_seconds(run, device, cfg.repeats) if device.type == "cuda" else None


def _time_method(label: str, method: str, base: nn.Module, run_base: Callable[[], object], base_gflops: float,
                 keep: list[int] | None, x: torch.Tensor, labels: torch.Tensor, cfg: BenchThroughputConfig,
                 pooling: PoolingConfig, device: torch.device, log: Callable[[str], None], kernels: KernelChoice
                 ) -> tuple[ThroughputRow, Callable[[], object]]:
    """One method's row (its launches still None) and its runner, for ``_count_and_profile`` to visit."""
    from pipeline.flops import count_flops
    from pipeline.models import create_model
    from pipeline.models.selfcheck import check_model

    pooled = create_model(cfg.model, method=method, keep=keep, options=pooling.method_options(method),
                          patch_embed=cfg.patch_embed, kernels=kernels)
    pooled.load_state_dict(base.state_dict(), strict=False)
    gflops = count_flops(pooled).total
    ops_cpu, ops_dense = _op_counts(pooled, x.shape[-1])
    pooled = pooled.to(device).train(cfg.train)
    check_model(pooled, device, DTYPES[cfg.dtype] or torch.float32)
    run = _runner(pooled, cfg, device, x, labels)
    with _held(cfg, device):
        compile_s = warm_up(run, log=log, label=f"{label} ({cfg.compile})")
        log(f"timing {label} against the unmodified model, batch {cfg.batch}, {cfg.dtype}, "
            f"{'train step' if cfg.train else 'inference'}, {cfg.calls} call(s) a sample ...")
        base_t, own_t = time_paired(run, run_base, warmup=cfg.warmup, repeats=cfg.repeats, device=device,
                                    calls=cfg.calls)
        host_s = _host_s(run, cfg, device)
    row = ThroughputRow(
        label=label, gflops=gflops, images_per_s=cfg.batch / statistics.median(own_t),
        speedup=statistics.median(b / o for b, o in zip(base_t, own_t)), flops_ratio=base_gflops / gflops,
        ops_cpu=ops_cpu, ops_dense=ops_dense, launches=None, host_s=host_s,
        compile_s=None if cfg.compile == "none" else compile_s, base_times=base_t,
    )
    log(f"  {label}: {row.images_per_s:.1f} images/s, speed-up {row.speedup:.3f}x, realised {row.realised:.3f}")
    return row, run


def _count_and_profile(label: str, run: Callable[[], object], cfg: BenchThroughputConfig, device: torch.device,
                       log: Callable[[str], None]) -> int | None:
    """The launches of one call on CUDA (None elsewhere), and with ``cfg.profile`` its profile in the log.

    Both run torch.profiler, so they come after every timing of the run: after a profiling session Kineto
    leaves CUPTI attached (pytorch/pytorch#144455), which slows every later kernel launch.
    """
    with _held(cfg, device):
        launches = count_launches(run) if device.type == "cuda" else None
        if cfg.profile:
            log(f"profile of one call of {label}:\n{kernel_table(run)}")
    return launches


def run_throughput(cfg: BenchThroughputConfig, pooling: PoolingConfig,
                   log: Callable[[str], None] = print, kernels: KernelChoice | None = None) -> ThroughputResult:
    """Times every method of ``cfg.methods`` (and the ceiling) against the unmodified model, then counts
    launches and profiles (``_count_and_profile``); the pooled models run ``kernels`` (default ``auto``)."""
    from pipeline.flops import count_flops
    from pipeline.models import create_model

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise JobError("bench_throughput.device is 'cuda' but no CUDA device is visible")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    cfg = cfg.model_copy(update={"calls": cfg.calls or default_calls(device)})
    keep = bench_keep(cfg)
    torch.manual_seed(0)
    base = create_model(cfg.model, patch_embed=cfg.patch_embed)
    base_gflops = count_flops(base).total
    size = base.patch_embed.img_size[0]
    base_ops = _op_counts(base, size)[0]
    x = torch.randn(cfg.batch, 3, size, size, device=device)
    labels = torch.randint(0, base.num_classes, (cfg.batch,), device=device)
    base = base.to(device).train(cfg.train)
    methods = list(cfg.methods) + ([CEILING] if cfg.ceiling else [])
    timed = []
    with cuda_settings(device):
        run_base = _runner(base, cfg, device, x, labels)
        with _held(cfg, device):
            warm_up(run_base, log=log, label=f"unmodified {cfg.model} ({cfg.compile})")
            base_host_s = _host_s(run_base, cfg, device)
        for label in methods:
            method = "random" if label == CEILING else label
            timed.append(_time_method(label, method, base, run_base, base_gflops, keep, x, labels, cfg, pooling,
                                      device, log, kernels or KernelChoice()))
        base_launches = _count_and_profile("the unmodified model", run_base, cfg, device, log)
        rows = [replace(row, launches=_count_and_profile(row.label, run, cfg, device, log)) for row, run in timed]
    return ThroughputResult(base_images_per_s=cfg.batch / statistics.median(t for row in rows for t in row.base_times),
                            base_gflops=base_gflops, base_ops=base_ops, base_launches=base_launches,
                            base_host_s=base_host_s, calls=cfg.calls, keep=keep or [],
                            rows=rows)


def format_throughput(cfg: BenchThroughputConfig, r: ThroughputResult) -> str:
    kind = "training step (forward, backward, AdamW)" if cfg.train else "inference"
    launches = lambda n: "-" if n is None else str(n)  # noqa: E731
    host = lambda s: "-" if s is None else f"{s * 1e3:.2f}"  # noqa: E731
    lines = [
        f"model {cfg.model}, {kind}, batch {cfg.batch}, {cfg.dtype}, compile {cfg.compile}, "
        f"keep {','.join(map(str, r.keep)) or 'all'}, patch embedding {cfg.patch_embed} (every model), "
        f"{r.calls} call(s) a timed sample",
        "",
        "| model | GFLOPs | images/s | speed-up | GFLOPs ratio | realised | aten ops (CPU path / CUDA path) "
        "| CUDA launches | host ms a call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| unmodified | {r.base_gflops:.3f} | {r.base_images_per_s:.1f} | 1 | 1 | - | {r.base_ops} | "
        f"{launches(r.base_launches)} | {host(r.base_host_s)} |",
    ]
    for row in r.rows:
        label = "ceiling: random drop" if row.label == CEILING else row.label
        lines.append(f"| {label} | {row.gflops:.3f} | {row.images_per_s:.1f} | {row.speedup:.3f} | "
                     f"{row.flops_ratio:.3f} | {row.realised:.3f} | {row.ops_cpu} / {row.ops_dense} | "
                     f"{launches(row.launches)} | {host(row.host_s)} |")
    lines += ["", "speed-up: median over paired samples of (unmodified time / model time); realised = speed-up / "
              "GFLOPs ratio."]
    if r.base_host_s is not None:
        lines.append(f"host ms a call: the median time one call takes to return with the GPU idle at its start; a "
                     f"model whose host ms reaches its ms a call ({cfg.batch} images / (images/s)) is bound by the "
                     f"host's launch rate, not by the GPU.")
    compiled = [f"{row.label} {row.compile_s:.0f} s" for row in r.rows if row.compile_s is not None]
    if compiled:
        lines.append("first-call (compile) time: " + ", ".join(compiled))
    return "\n".join(lines)
