"""``pipeline bench ops``: the cost of each downsampling method as a fraction of one transformer block.

Protocol (as ToMe's ``utils.benchmark``): warm up, synchronise the device, time ``repeats`` runs and
report medians with the interquartile range. Every method runs on the same input as the block, and
each timed call of a method is paired with a timed block call just before it: the reported share
is the median of the per-pair ratios, so it holds even on a noisy machine where speed drifts
between rows.
"""

from __future__ import annotations

import importlib.util
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
from torch import Tensor

from pipeline.config import BenchOpsConfig, BenchThroughputConfig, PoolingConfig
from pipeline.pooling import build_downsampler, pooled_count, significance


@dataclass(frozen=True)
class Timing:
    """One row: the method's median time and its median share of the paired block calls."""

    label: str
    keep: int | None
    median_s: float
    iqr_s: float
    share: float  # median over pairs of (method time / block time)
    block_median_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _median_iqr(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 4:
        return statistics.median(samples), max(samples) - min(samples)
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[2] - q[0]


def time_paired(fn: Callable[[], object], baseline: Callable[[], object], *, warmup: int, repeats: int,
                device: torch.device) -> tuple[list[float], list[float]]:
    """Times ``repeats`` (baseline, fn) pairs back to back after ``warmup`` calls of each; seconds."""
    for _ in range(warmup):
        baseline()
        fn()
    _sync(device)
    base, own = [], []
    for _ in range(repeats):
        base.append(_timed(baseline, device))
        own.append(_timed(fn, device))
    return base, own


@dataclass(frozen=True)
class BlockInputs:
    """What one block hands its downsampling step: the tokens and the block's attention statistics."""

    x: Tensor  # (B, P+N, M) block input, prefix tokens first
    tokens: Tensor  # (B, N, M) non-prefix tokens
    scores: Tensor  # (B, N) significance (eq. 4) from the block's attention
    keys: Tensor  # (B, N, head_dim) keys averaged over heads, the cheap metric


def block_inputs(block: torch.nn.Module, x: Tensor, num_prefix: int) -> BlockInputs:
    """Runs a timm ViT block's attention by hand to get its probabilities and keys."""
    attn = block.attn
    b, n, _ = x.shape
    qkv = attn.qkv(block.norm1(x)).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, _ = qkv.unbind(0)  # (B, H, P+N, hd)
    q, k = attn.q_norm(q), attn.k_norm(k)
    probs = (q * attn.scale @ k.transpose(-2, -1)).softmax(-1)  # (B, H, P+N, P+N)
    return BlockInputs(
        x=x,
        tokens=x[:, num_prefix:].contiguous(),
        scores=significance(probs)[:, num_prefix:].contiguous(),
        keys=k.mean(1)[:, num_prefix:].contiguous(),
    )


def load_tome_reference(path: str) -> Callable[[Tensor, Tensor, int], object]:
    """Loads ``tome/merge.py`` from a ToMe checkout; returns a call (tokens, metric, r) -> merged tokens."""
    source = Path(path) / "tome" / "merge.py"
    if not source.is_file():
        raise FileNotFoundError(f"bench.tome_reference: no tome/merge.py under {path}; point it at a ToMe checkout")
    spec = importlib.util.spec_from_file_location("tome_reference_merge", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(tokens: Tensor, metric: Tensor, r: int) -> object:
        merge, _ = module.bipartite_soft_matching(metric, r, class_token=False, distill_token=False)
        return module.merge_wavg(merge, tokens)

    return run


def method_rows(cfg: BenchOpsConfig, pooling: PoolingConfig, inputs: BlockInputs) -> list[tuple[str, int, Callable]]:
    """(label, K, call) for every method and K in the config; conv only at the K one conv layer gives."""
    dim = inputs.tokens.shape[-1]
    n = inputs.tokens.shape[1]
    rows = []
    for name in cfg.methods:
        options = {"iters": pooling.iters, "init": pooling.init} if name.endswith(("kmeans", "kmedoids")) else {}
        variants = [(name, options)]
        if name in ("kmedoids", "wkmedoids"):
            variants.append((f"{name} on keys", options | {"cluster_on": "metric"}))
        for label, opts in variants:
            step = build_downsampler(name, dim=dim, **opts)
            if name == "conv":
                step = step.to(inputs.tokens.device)
            for k in cfg.keep:
                if name == "conv" and k != pooled_count(n):
                    continue
                rows.append((label, k, _bind(step, inputs, k)))
    return rows


def _bind(step: Callable, inputs: BlockInputs, k: int) -> Callable[[], object]:
    gen = torch.Generator(device=inputs.tokens.device).manual_seed(0)
    return lambda: step(inputs.tokens, k, scores=inputs.scores, metric=inputs.keys, generator=gen, validate=False)


def distance_rows(inputs: BlockInputs) -> list[tuple[str, None, Callable[[], object]]]:
    """The N x N token distances alone: torch.cdist, and the Gram matmul that K-Medoids builds on."""
    x = inputs.tokens.float()
    return [
        ("distance matrix (torch.cdist)", None, lambda: torch.cdist(x, x, compute_mode="use_mm_for_euclid_dist")),
        ("Gram matrix (bmm)", None, lambda: torch.bmm(x, x.transpose(1, 2))),
    ]


def run_ops_benchmark(cfg: BenchOpsConfig, pooling: PoolingConfig, seed: int = 0,
                      log: Callable[[str], None] = print) -> list[Timing]:
    """Times every method row against the block, pair by pair."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench.device is 'cuda' but no CUDA device is visible; use --set bench.device=cpu")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    torch.manual_seed(seed)
    model = timm.create_model(cfg.model, pretrained=False).eval().to(device)
    n = model.patch_embed.num_patches
    bad = [k for k in cfg.keep if k >= n]
    if bad:
        raise ValueError(f"bench.keep: every K must be below the {n} tokens of {cfg.model}, got {bad}")
    block = model.blocks[0]
    x = torch.randn(cfg.batch, model.num_prefix_tokens + n, model.embed_dim, device=device)
    with torch.inference_mode():
        inputs = block_inputs(block, x, model.num_prefix_tokens)
        log(f"timing against {cfg.model} blocks[0] on ({cfg.batch}, {x.shape[1]}, {model.embed_dim})")
        rows = distance_rows(inputs) + method_rows(cfg, pooling, inputs)
        if cfg.tome_reference:
            reference = load_tome_reference(cfg.tome_reference)
            for k in cfg.keep:
                if n - k <= (n + 1) // 2:  # one ToMe call merges at most half the tokens
                    rows.append(("tome (reference)", k, lambda r=n - k: reference(inputs.tokens, inputs.keys, r)))
        timings = []
        for i, (label, k, call) in enumerate(rows, 1):
            base, own = time_paired(call, lambda: block(x), warmup=cfg.warmup, repeats=cfg.repeats, device=device)
            share = statistics.median(o / b for o, b in zip(own, base))
            timings.append(Timing(label, k, *_median_iqr(own), share, statistics.median(base)))
            log(f"[{i}/{len(rows)}] {label} K={k if k is not None else '-'}: {timings[-1].median_s * 1e3:.2f} ms, "
                f"{100 * share:.1f}% of the block")
    return timings


def machine_line(device: str) -> str:
    """The card (or CPU and thread count) and the library versions, for a benchmark's header."""
    if device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{where}; torch {torch.__version__}; timm {timm.__version__}; python {sys.version.split()[0]}"


def format_table(timings: list[Timing]) -> str:
    """A markdown table: the method's median and IQR, the paired block median, and the median share."""
    block_ms = statistics.median(t.block_median_s for t in timings) * 1e3
    lines = [
        f"block forward: {block_ms:.1f} ms (median over rows of each row's paired block median)",
        "",
        "| method | K | median ms | IQR ms | block ms | % of block |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in timings:
        keep = "-" if t.keep is None else str(t.keep)
        lines.append(f"| {t.label} | {keep} | {t.median_s * 1e3:.2f} | {t.iqr_s * 1e3:.2f} | "
                     f"{t.block_median_s * 1e3:.1f} | {100 * t.share:.1f} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class ThroughputResult:
    base_images_s: float
    pooled_images_s: float
    speedup: float  # median over pairs of (unmodified time / downsampled time)
    base_gflops: float
    pooled_gflops: float
    keep: list[int]

    @property
    def flops_ratio(self) -> float:
        return self.base_gflops / self.pooled_gflops

    @property
    def realised(self) -> float:
        """The fraction of the FLOP saving that shows up as speed: speed-up / GFLOPs ratio."""
        return self.speedup / self.flops_ratio


def run_throughput(cfg: BenchThroughputConfig, pooling: PoolingConfig,
                   log: Callable[[str], None] = print) -> ThroughputResult:
    """Times the downsampling model and the unmodified one in alternating calls on the same batch."""
    from pipeline.flops import count_flops
    from pipeline.models import create_model
    from pipeline.sparsity import level_keep

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_throughput.device is 'cuda' but no CUDA device is visible")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    keep = cfg.keep if cfg.keep is not None else (level_keep(cfg.model, cfg.level) if cfg.level is not None else None)
    options = {"iters": pooling.iters, "init": pooling.init} if cfg.method.endswith(("kmeans", "kmedoids")) else {}
    base = create_model(cfg.model).eval()
    pooled = create_model(cfg.model, method=cfg.method, keep=keep, options=options).eval()
    pooled.load_state_dict(base.state_dict(), strict=False)
    base_gflops, report = count_flops(base).total, count_flops(pooled)
    base, pooled = base.to(device), pooled.to(device)
    size = base.patch_embed.img_size[0]
    x = torch.randn(cfg.batch, 3, size, size, device=device)
    log(f"timing {cfg.model} with {cfg.method} against the unmodified model, batch {cfg.batch} ...")
    with torch.inference_mode():
        base_t, own_t = time_paired(lambda: pooled(x), lambda: base(x), warmup=cfg.warmup, repeats=cfg.repeats,
                                    device=device)
    return ThroughputResult(
        base_images_s=cfg.batch / statistics.median(base_t),
        pooled_images_s=cfg.batch / statistics.median(own_t),
        speedup=statistics.median(b / o for b, o in zip(base_t, own_t)),
        base_gflops=base_gflops, pooled_gflops=report.total, keep=report.keep,
    )


def format_throughput(cfg: BenchThroughputConfig, r: ThroughputResult) -> str:
    return "\n".join([
        f"model {cfg.model}, method {cfg.method}, batch {cfg.batch}, keep {','.join(map(str, r.keep))}",
        "| | images/s | GFLOPs |",
        "|---|---:|---:|",
        f"| unmodified | {r.base_images_s:.1f} | {r.base_gflops:.3f} |",
        f"| {cfg.method} | {r.pooled_images_s:.1f} | {r.pooled_gflops:.3f} |",
        "",
        f"speed-up {r.speedup:.3f}x (median of paired runs); GFLOPs ratio {r.flops_ratio:.3f}; "
        f"realised fraction {r.realised:.3f}",
    ])
