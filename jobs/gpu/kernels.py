"""Kernel-level timings on CUDA, for docs/benchmarks.md: run by ``jobs/gpu/checks.sh kernels``.

1. K-Medoids' iterations (5 assignments, 4 updates) at DeiT-S size (B=256, N=196, 384 dims):
   the Triton kernels at several tilings against the one-hot torch iterations, on the same
   distances, and the whole weighted ``token_pool`` call, next to one bf16 DeiT-S block.
2. The patch embedding (16x16 stride-16 convolution, bf16, batch 256) with cuDNN autotuning off
   and on, channels-last, and as a reshape + matmul.

Prints a markdown table per part; each figure is the median of 20 timed calls (CUDA events).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import timm
import torch
import torch.nn.functional as F

from pipeline.pooling import kmedoids_triton as kt
from pipeline.pooling import token_pool
from pipeline.pooling.clustering import _SWAP_RTOL, _kmedoids_dense, sq_dists

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run under TRITON_INTERPRET=1
B = 256 if DEVICE == "cuda" else 2


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kmedoids_ms(d: torch.Tensor, w: torch.Tensor, start: torch.Tensor, block_n: int, block_j: int) -> float:
    """The Triton iterations' time at one tiling: d (B, N, N), w (B, N), start (B, K) medoids."""
    saved = kt._BLOCK_N, kt._BLOCK_J
    kt._BLOCK_N, kt._BLOCK_J = block_n, block_j
    try:
        return median_ms(lambda: kt.kmedoids_triton(d, w, start, 5, _SWAP_RTOL))
    finally:
        kt._BLOCK_N, kt._BLOCK_J = saved


def kmedoids_table() -> None:
    torch.set_float32_matmul_precision("high")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(B, 196, 384, device=DEVICE, generator=gen)
    w = torch.rand(B, 196, device=DEVICE, generator=gen) + 0.1
    w = w / w.amax(-1, keepdim=True)
    d = sq_dists(x)
    block = timm.create_model("deit_small_patch16_224").blocks[0].to(DEVICE).eval()
    tokens = torch.randn(B, 197, 384, device=DEVICE)
    with torch.inference_mode(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        block_ms = median_ms(lambda: block(tokens))
    print(f"one DeiT-S block, bf16, batch {B}: {block_ms:.3f} ms; distance matrix (sq_dists, TF32): "
          f"{median_ms(lambda: sq_dists(x)):.3f} ms\n")
    print("| K | torch one-hot iterations ms | Triton (BLOCK_N, BLOCK_J) ms ... | whole token_pool ms | same result |")
    print("|---:|---:|---|---:|---|")
    for k in (147, 98, 49):
        start = w.topk(k, dim=-1).indices
        torch_ms = median_ms(lambda: _kmedoids_dense(d, w, start, 5))  # noqa: B023 (called at once)
        cells = [f"({bn}, {bj}) {kmedoids_ms(d, w, start, bn, bj):.3f}" for bn in (16, 32) for bj in (64, 128)]
        pool_ms = median_ms(lambda: token_pool(x, k, weights=w, validate=False))  # noqa: B023
        med_t, assign_t = kt.kmedoids_triton(d, w, start, 5, _SWAP_RTOL)
        med_d, assign_d = _kmedoids_dense(d, w, start, 5)
        same = f"medoids {(med_t == med_d).float().mean():.4f}, assign {(assign_t == assign_d).float().mean():.4f}"
        print(f"| {k} | {torch_ms:.3f} | {'; '.join(cells)} | {pool_ms:.3f} | {same} |")


def patch_embed_table() -> None:
    conv = timm.create_model("deit_small_patch16_224").patch_embed.proj.to(DEVICE).eval()
    x = torch.randn(B, 3, 224, 224, device=DEVICE)
    w = conv.weight.reshape(384, -1)

    def unfold_matmul() -> torch.Tensor:  # (B, 3, 14, 16, 14, 16) -> (B, 196, 768) @ W^T
        p = x.to(torch.bfloat16).reshape(B, 3, 14, 16, 14, 16).permute(0, 2, 4, 1, 3, 5).reshape(B, 196, 768)
        return F.linear(p, w.to(torch.bfloat16), conv.bias.to(torch.bfloat16))

    rows = []
    with torch.inference_mode(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            rows.append((f"conv, cudnn.benchmark={bench}", median_ms(lambda: conv(x))))
        xl = x.contiguous(memory_format=torch.channels_last)
        conv_l = conv.to(memory_format=torch.channels_last)
        rows.append(("conv, channels-last input and weight, benchmark=True", median_ms(lambda: conv_l(xl))))
        rows.append(("reshape + matmul", median_ms(unfold_matmul)))
    torch.backends.cudnn.benchmark = False
    print("\n| patch embedding, bf16, batch 256 | ms |\n|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    print(torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run", torch.__version__)
    kmedoids_table()
    patch_embed_table()
