"""``pipeline bench kernels``: kernel-level timings on CUDA, for docs/benchmarks.md.

1. K-Medoids' iterations (5 assignments, 4 updates) at DeiT-S size (B=256, N=196, 384 dims), per K (``--ks``):
   the Triton kernels at several tilings, and the fused kernel (every iteration of an image in one
   program) at several tiles and warp counts, against the one-hot torch iterations, on the same
   distances, both also replayed from a CUDA graph (GPU time without launch cost), and the whole
   weighted ``token_pool`` call, next to one bf16 DeiT-S block.
2. K-Means' iterations in the Gram form (5 assignments, 4 updates) at the same size: the torch
   iterations eager, replayed from a CUDA graph and compiled by inductor (the CUDA path of the models),
   and the whole weighted K-Means ``token_pool`` call.
3. The patch embedding (16x16 stride-16 convolution, bf16, batch 256) with cuDNN autotuning off
   and on, channels-last, and as a reshape + matmul.
4. The clustering step's two dense products (the distance matrix and the weighted segment means)
   in the float32 the pooling code uses (TF32 where enabled) against bf16 inputs with float32
   accumulation and output, with each variant's error: the data for choosing their precision.

A markdown table per part; each figure is the median of 20 timed calls.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from functools import partial

import timm
import torch
from torch import Tensor

from pipeline.bench.timing import timed
from pipeline.errors import InputError, JobError
from pipeline.models.patch_embed import use_patch_embed
from pipeline.pooling import kmedoids_triton as kt
from pipeline.pooling import token_pool
from pipeline.pooling.clustering import SWAP_RTOL, gram, kmeans_gram_iterations, kmedoids_dense, sq_dists
from pipeline.pooling.common import one_hot
from pipeline.pooling.merge import means_dense, means_partition, pool_segments
from pipeline.runtime import cuda_settings, inference

Timer = Callable[[Callable[[], object]], float]


def _timer(device: str) -> Timer:
    """Median milliseconds of 20 calls timed by ``timing.timed`` (device synchronised around each), after
    3 warm-up calls, on CUDA; one call on the CPU, where this is a dry run under Triton's interpreter."""
    dev = torch.device(device)
    calls, warmup = (20, 3) if dev.type == "cuda" else (1, 0)

    def median_ms(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(timed(fn, dev) for _ in range(calls)) * 1e3
    return median_ms


def _graphed(fn: Callable[[], object], device: str) -> Callable[[], object] | None:
    """``fn`` captured in a CUDA graph (its replay), or None off CUDA: the replay times the GPU work
    alone, without the host's launch cost (Triton launches cost the host tens of us each)."""
    if device != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _deit_s_tokens(device: str, batch: int, seed: int) -> tuple[Tensor, Tensor]:
    """Random tokens (B, 196, 384) at DeiT-S size and weights (B, 196) in (0, 1], the largest 1 per image."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, 196, 384, device=device, generator=gen)
    w = torch.rand(batch, 196, device=device, generator=gen) + 0.1
    return x, w / w.amax(-1, keepdim=True)


def _timing_cells(timer: Timer, device: str, torch_fn: Callable[[], object], triton_fn: Callable[[], object],
                  tilings: dict[str, Callable[[], object]]) -> str:
    """The middle cells of a row: the torch iterations' ms, each Triton tiling's ms, and both replayed from
    a CUDA graph ("-" off CUDA)."""
    cells = "; ".join(f"{label} {timer(fn):.3f}" for label, fn in tilings.items())
    graphed = " / ".join("-" if g is None else f"{timer(g):.3f}"
                         for g in (_graphed(torch_fn, device), _graphed(triton_fn, device)))
    return f"{timer(torch_fn):.3f} | {cells} | {graphed}"


DEFAULT_KS = (147, 98, 49)  # DeiT-S's 196 tokens at keep rates 0.75, 0.5 and 0.25


def kmedoids_table(device: str, batch: int, ks: tuple[int, ...] = DEFAULT_KS) -> str:
    """K-Medoids' iterations at DeiT-S size (N=196, 384 dims), Triton against torch, per K."""
    timer = _timer(device)
    x, w = _deit_s_tokens(device, batch, seed=0)
    d, g = sq_dists(x), gram(x)
    block = timm.create_model("deit_small_patch16_224").blocks[0].to(device).eval()
    tokens = torch.randn(batch, 197, 384, device=device)
    with inference(device, "bf16" if device == "cuda" else "fp32"):  # weights cast once
        block_ms = timer(lambda: block(tokens))
    lines = [f"one DeiT-S block, bf16, batch {batch}: {block_ms:.3f} ms; distance matrix (sq_dists, TF32): "
             f"{timer(lambda: sq_dists(x)):.3f} ms", "",
             "| K | torch one-hot iterations ms | Triton (BLOCK_N, BLOCK_J), and fused in one program, ms "
             "| CUDA graph: torch / Triton ms "
             "| whole token_pool ms | same result |",
             "|---:|---:|---|---|---:|---|"]
    for k in ks:
        start = w.topk(k, dim=-1).indices
        tilings = {f"({bn}, {bj})": partial(kt.kmedoids_triton, d, w, start, 5, SWAP_RTOL, block_n=bn, block_j=bj)
                   for bn in (16, 32) for bj in (64, 128)}
        tilings |= {f"fused (tile {t}, {nw} warps)": partial(kt.kmedoids_fused_triton, d, w, start, 5, SWAP_RTOL,
                                                             tile=t, num_warps=nw)
                    for t, nw in ((16, 4), (32, 4), (32, 8))}
        # what the CUDA path runs: the fused kernel on the Gram matrix, each distance derived as it is read
        tilings |= {f"fused on the Gram matrix (tile {t}, {nw} warps)":
                    partial(kt.kmedoids_fused_triton, g, w, start, 5, SWAP_RTOL, gram=True, tile=t, num_warps=nw)
                    for t, nw in ((32, 4), (32, 8))}
        times = _timing_cells(timer, device, partial(kmedoids_dense, d, w, start, 5),
                              partial(kt.kmedoids_triton, d, w, start, 5, SWAP_RTOL), tilings)
        pool_ms = timer(partial(token_pool, x, k, weights=w, validate=False))
        med_t, assign_t = kt.kmedoids_triton(d, w, start, 5, SWAP_RTOL)
        med_f, assign_f = kt.kmedoids_fused_triton(g, w, start, 5, SWAP_RTOL, gram=True)
        med_d, assign_d = kmedoids_dense(d, w, start, 5)
        same = (f"medoids {(med_t == med_d).float().mean():.4f}, assign {(assign_t == assign_d).float().mean():.4f}; "
                f"fused {(med_f == med_d).float().mean():.4f}, {(assign_f == assign_d).float().mean():.4f}")
        lines.append(f"| {k} | {times} | {pool_ms:.3f} | {same} |")
    return "\n".join(lines)


def kmeans_table(device: str, batch: int, ks: tuple[int, ...] = DEFAULT_KS) -> str:
    """K-Means' Gram-form iterations at DeiT-S size (N=196, 384 dims), per K: the torch iterations eager,
    replayed from a CUDA graph and compiled by inductor (what a compiled model runs), and the whole weighted
    K-Means ``token_pool`` call. "same" compares the compiled iterations' assignment with the eager one's on
    CUDA; on the CPU dry run, the CPU path's op (native code) with the torch iterations."""
    timer = _timer(device)
    x, w = _deit_s_tokens(device, batch, seed=1)
    gram = torch.bmm(x, x.transpose(1, 2))
    compiled = torch.compile(kmeans_gram_iterations, fullgraph=True, dynamic=False) if device == "cuda" else None
    lines = [f"K-Means, batch {batch}: the Gram matrix (bmm, TF32) {timer(lambda: torch.bmm(x, x.transpose(1, 2))):.3f}"
             " ms", "",
             "| K | torch Gram-form iterations ms | CUDA graph ms | compiled (inductor) ms "
             "| whole K-Means token_pool ms | same assignment |",
             "|---:|---:|---:|---:|---:|---|"]
    for k in ks:
        start = w.topk(k, dim=-1).indices
        eager = partial(kmeans_gram_iterations, gram, w, start, 5)
        graphed = _graphed(eager, device)
        if compiled is None:
            fast, other = "-", torch.ops.tokenpool.kmeans_gram(gram, w, start, 5)
        else:
            fast, other = f"{timer(partial(compiled, gram, w, start, 5)):.3f}", compiled(gram, w, start, 5)
        pool_ms = timer(partial(token_pool, x, k, method="kmeans", weights=w, validate=False))
        same = (other == eager()).float().mean()
        lines.append(f"| {k} | {timer(eager):.3f} | {'-' if graphed is None else f'{timer(graphed):.3f}'} | {fast} "
                     f"| {pool_ms:.3f} | {same:.4f} |")
    return "\n".join(lines)


def patch_embed_table(device: str, batch: int) -> str:
    """DeiT-S's patch embedding in bf16: cuDNN autotuning off and on, channels-last, reshape + matmul."""
    timer = _timer(device)
    model = timm.create_model("deit_small_patch16_224")
    conv = model.patch_embed.proj.to(device).eval()
    use_patch_embed(model, "matmul")
    matmul = model.patch_embed.proj  # the same parameters
    x = torch.randn(batch, 3, 224, 224, device=device)

    rows = []
    previous = torch.backends.cudnn.benchmark
    try:
        with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            for bench in (False, True):
                torch.backends.cudnn.benchmark = bench
                rows.append((f"conv, cudnn.benchmark={bench}", timer(lambda: conv(x))))
            rows.append(("reshape + matmul (PatchMatmul, patch_embed: matmul)", timer(lambda: matmul(x))))
            xl = x.contiguous(memory_format=torch.channels_last)  # converts the shared weight: last
            conv_l = conv.to(memory_format=torch.channels_last)
            rows.append(("conv, channels-last input and weight, benchmark=True", timer(lambda: conv_l(xl))))
    finally:
        torch.backends.cudnn.benchmark = previous
    return "\n".join([f"| patch embedding, bf16, batch {batch} | ms |", "|---|---:|",
                      *(f"| {name} | {ms:.3f} |" for name, ms in rows)])


def _bf16_product(a: Tensor, b: Tensor) -> Tensor | None:
    """a @ b (batched) from bf16-rounded inputs, accumulated and returned in float32; None where this
    torch has no such kernel (``bmm`` with ``out_dtype`` exists on CUDA only)."""
    try:
        return torch.bmm(a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _bf16_distances(x: Tensor) -> Tensor | None:
    """``sq_dists`` with the Gram matrix from bf16-rounded tokens (norms from the same rounded tokens)."""
    gram = _bf16_product(x, x.transpose(1, 2))
    if gram is None:
        return None
    norms = x.bfloat16().float().square().sum(-1)
    return norms.unsqueeze(1) + norms.unsqueeze(2) - 2.0 * gram


def _bf16_means(x: Tensor, w: Tensor, assign: Tensor, k: int) -> Tensor | None:
    """Weighted segment means with the weighted one-hot matrix and the tokens rounded to bf16."""
    mw = (one_hot(assign, k, torch.float32) * w.unsqueeze(1)).bfloat16()
    sums = _bf16_product(mw, x)
    return None if sums is None else sums / mw.float().sum(-1, keepdim=True)


def precision_table(device: str, batch: int, k: int = 147) -> str:
    """The distance matrix and the weighted segment means at DeiT-S size (N=196, 384 dims, K=147),
    float32 (what the pooling code runs; TF32 where enabled) against bf16 inputs with float32 output.

    Errors are against float64: the distances' largest error relative to their mean, the means'
    largest absolute error (tokens of unit variance); for the distances also how many medoids and
    assignments K-Medoids (5 iterations) gives alike on both.
    """
    timer = _timer(device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, 196, 384, device=device, generator=gen)
    w = torch.rand(batch, 196, device=device, generator=gen) + 0.1
    w = w / w.amax(-1, keepdim=True)
    start = w.topk(k, dim=-1).indices
    d64 = sq_dists(x.double())
    d32 = sq_dists(x)
    med32, assign = kmedoids_dense(d32, w, start, 5)
    means64 = pool_segments(x.double(), w.double(), None, assign, k, None)[0]
    rows = []

    def row(name: str, fn: Callable[[], Tensor | None], error: Callable[[Tensor], str]) -> None:
        out = fn()
        rows.append(f"| {name} | no such kernel on {device} in this torch | - |" if out is None
                    else f"| {name} | {timer(fn):.3f} | {error(out)} |")

    def distance_error(d: Tensor) -> str:
        med, assign_d = kmedoids_dense(d, w, start, 5)
        return (f"max error / mean distance {((d.double() - d64).abs().amax() / d64.mean()):.2e}; K-Medoids alike: "
                f"medoids {(med == med32).float().mean():.4f}, assign {(assign_d == assign).float().mean():.4f}")

    def means_error(m: Tensor) -> str:
        return f"max abs error {(m.double() - means64).abs().amax():.2e}"

    row("distances (B, N, N), float32 (sq_dists)", lambda: sq_dists(x), distance_error)
    row("distances, bf16 tokens, float32 accumulation and output", lambda: _bf16_distances(x), distance_error)
    row("segment means (B, K, 384), tokenpool::cluster_means (one Triton kernel on CUDA, native code on the CPU), "
        "float32", lambda: pool_segments(x, w, None, assign, k, None)[0], means_error)
    row("segment means, one-hot bmm, float32", lambda: means_dense(x, w, assign, k, None), means_error)
    row("segment means, one-hot bmm, bf16 inputs, float32 output", lambda: _bf16_means(x, w, assign, k), means_error)
    row("segment means, index_add_ (atomic adds on CUDA, order not fixed)",
        lambda: means_partition(x, w, assign, k, None), means_error)
    tf32 = torch.backends.cuda.matmul.allow_tf32 if device == "cuda" else False
    return "\n".join([f"clustering step's dense products, batch {batch}, K {k} (float32 matmuls in TF32: {tf32})", "",
                      "| part | ms | error against float64 |", "|---|---:|---|", *rows])


def run_kernel_bench(device: str, batch: int, ks: tuple[int, ...] = DEFAULT_KS) -> str:
    """The four tables as markdown, the clustering tables at each K of ``ks``. CUDA, or the CPU under
    ``TRITON_INTERPRET=1`` (a dry run: one call per figure, which times the interpreter, not a kernel)."""
    if batch < 1:
        raise InputError(f"bench kernels --batch must be a positive number of images, got {batch}")
    if not ks or not all(1 <= k < 196 for k in ks):
        raise InputError(f"bench kernels --ks must list clusters between 1 and 195 (DeiT-S's 196 tokens), got "
                         f"{','.join(map(str, ks)) or 'none'}")
    if device == "cuda" and not torch.cuda.is_available():
        raise JobError("bench kernels --device cuda: no CUDA device is visible")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise JobError("bench kernels times Triton kernels on CUDA; on the CPU only a dry run under Triton's "
                       "interpreter exists: TRITON_INTERPRET=1 python -m pipeline bench kernels --device cpu --batch 2")
    title = torch.cuda.get_device_name() if device == "cuda" else "CPU dry run under TRITON_INTERPRET=1"
    with cuda_settings(device):
        return (f"{title}\n\n{kmedoids_table(device, batch, ks)}\n\n{kmeans_table(device, batch, ks)}\n\n"
                f"{patch_embed_table(device, batch)}\n\n"
                f"{precision_table(device, batch)}")
