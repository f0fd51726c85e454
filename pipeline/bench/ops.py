"""``pipeline bench ops``: the cost of each downsampling method as a fraction of one transformer block,
and the aten ops (CUDA kernel launches on a GPU) one call of it dispatches.

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import timm
import torch
from torch import Tensor

from pipeline.bench.profiling import count_launches, count_ops
from pipeline.bench.timing import median_iqr, time_paired
from pipeline.config import BenchOpsConfig, PoolingConfig
from pipeline.errors import InputError, JobError, MissingFileError
from pipeline.methods import METHODS, build_downsampler
from pipeline.models.attention import attend


@dataclass(frozen=True)
class Timing:
    """One row: the method's median time and its median share of the paired block calls."""

    label: str
    keep: int | None
    median_s: float
    iqr_s: float
    share: float  # median over pairs of (method time / block time)
    block_median_s: float
    ops: int  # aten ops one call dispatches (a proxy for its eager launch overhead)
    launches: int | None  # CUDA kernel launches of one call (None off CUDA)


@dataclass(frozen=True)
class BlockInputs:
    """What one block hands its downsampling step: the tokens and the block's attention statistics."""

    x: Tensor  # (B, P+N, M) block input, prefix tokens first
    tokens: Tensor  # (B, N, M) non-prefix tokens
    scores: Tensor  # (B, N) significance (eq. 4) from the block's attention
    keys: Tensor  # (B, N, head_dim) keys averaged over heads, the cheap metric


def block_inputs(block: torch.nn.Module, x: Tensor, num_prefix: int) -> BlockInputs:
    """Runs a timm ViT block's attention as the downsampling models do, for its scores and keys."""
    _, stats = attend(block.attn, block.norm1(x), num_prefix=num_prefix, scores=True, keys=True)
    return BlockInputs(x=x, tokens=x[:, num_prefix:].contiguous(), scores=stats.scores.contiguous(),
                       keys=stats.keys.contiguous())


def load_tome_reference(path: str) -> Callable[[Tensor, Tensor, int], object]:
    """Loads ``tome/merge.py`` from a ToMe checkout; returns a call (tokens, metric, r) -> merged tokens."""
    source = Path(path) / "tome" / "merge.py"
    if not source.is_file():
        raise MissingFileError(f"bench.tome_reference: no tome/merge.py under {path}; point it at a ToMe checkout")
    spec = importlib.util.spec_from_file_location("tome_reference_merge", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(tokens: Tensor, metric: Tensor, r: int) -> object:
        merge, _ = module.bipartite_soft_matching(metric, r, class_token=False, distill_token=False)
        return module.merge_wavg(merge, tokens)

    return run


def method_rows(cfg: BenchOpsConfig, pooling: PoolingConfig, inputs: BlockInputs) -> list[tuple[str, int, Callable]]:
    """(label, K, call) for every method and K in the config. A method that takes ``cluster_on`` also
    gets a row matching in the other space; a learnable one only the K it can produce."""
    dim, n = inputs.tokens.shape[-1], inputs.tokens.shape[1]
    side = int(n ** 0.5)
    rows = []
    for name in cfg.methods:
        options = pooling.method_options(name)
        variants = [(name, options)]
        if "cluster_on" in options:
            other = "tokens" if options["cluster_on"] == "metric" else "metric"
            variants.append((f"{name} on {'keys' if other == 'metric' else 'tokens'}", options | {"cluster_on": other}))
        for label, opts in variants:
            for k in cfg.keep:
                try:
                    step = build_downsampler(name, dim=dim, grid=(side, side) if side * side == n else None, k=k,
                                             **opts)
                except ValueError:
                    if METHODS[name].learnable:  # this K is not one it can produce
                        continue
                    raise
                if isinstance(step, torch.nn.Module):
                    step = step.to(inputs.tokens.device)
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
        raise JobError("bench.device is 'cuda' but no CUDA device is visible; use --set bench.device=cpu")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    torch.manual_seed(seed)
    model = timm.create_model(cfg.model, pretrained=False).eval().to(device)
    n = model.patch_embed.num_patches
    bad = [k for k in cfg.keep if k >= n]
    if bad:
        raise InputError(f"bench.keep: every K must be below the {n} tokens of {cfg.model}, got {bad}")
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
            timings.append(Timing(label, k, *median_iqr(own), share, statistics.median(base), count_ops(call).total,
                                  None))
            log(f"[{i}/{len(rows)}] {label} K={k if k is not None else '-'}: {timings[-1].median_s * 1e3:.2f} ms, "
                f"{100 * share:.1f}% of the block")
        if device.type == "cuda":  # after every timing: a profiler session slows later launches (throughput.py)
            timings = [replace(t, launches=count_launches(call)) for t, (_, _, call) in zip(timings, rows)]
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
        "| method | K | median ms | IQR ms | block ms | % of block | aten ops | CUDA launches |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in timings:
        keep = "-" if t.keep is None else str(t.keep)
        launches = "-" if t.launches is None else str(t.launches)
        lines.append(f"| {t.label} | {keep} | {t.median_s * 1e3:.2f} | {t.iqr_s * 1e3:.2f} | "
                     f"{t.block_median_s * 1e3:.1f} | {100 * t.share:.1f} | {t.ops} | {launches} |")
    return "\n".join(lines)
