"""Paired timing, CPU: K-Medoids' iterations in torch ops (``kmedoids_dense`` on ``sq_dists``: what runs without the
native kernel, with ``kernels.native: torch`` or no C compiler) against the native kernel that the CPU path runs
(``native.kmedoids``, ``pipeline/pooling/clustering_cpu.c``, on a matmul of the starting medoids' columns), on the
same tokens, each with its matmul; and the native kernel given every token's column of the distances (the whole Gram
matrix: what it took before it took the starting medoids' columns alone) against the default.

    python benchmarks/native_kmedoids.py [--smoke]

B = 64, N = 196, 384 dims, 5 iterations, weighted (DeiT-S's first pooling block at batch 64), K from 147 to 1; each
call pair is timed back to back, the ratios are native time / torch time and the starting medoids' columns' time / every
column's, medians over 15 pairs. ``--smoke``:
2 images of 24 tokens and one pair, to check that the script runs (its figures then mean nothing).
"""

import argparse
import platform
import statistics
from functools import partial

import torch

from pipeline.bench.timing import time_paired
from pipeline.pooling import clustering, native


def dense(x: torch.Tensor, w: torch.Tensor | None, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: the distances from the Gram matrices, then the dense iterations."""
    return clustering.kmedoids_dense(clustering.sq_dists(x), w, start, 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 images of 24 tokens, one pair: checks that it runs")
    args = parser.parse_args()
    lib = native.library()
    assert lib is not None, "the native kernels did not build"
    batch, n, dim, ks, repeats = ((2, 24, 48, (12, 6, 3), 1) if args.smoke else
                                  (64, 196, 384, (147, 98, 49, 20, 5, 1), 15))
    torch.set_num_threads(2)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print("| K | torch ms | native ms | native / torch | same medoids and assignment | every column given ms | "
          "starting medoids' columns / every column |")
    print("|---:|---:|---:|---:|---|---:|---:|")
    for k in ks:
        gen = torch.Generator().manual_seed(k)
        x, scores = torch.randn(batch, n, dim, generator=gen), torch.rand(batch, n, generator=gen)
        w = clustering.effective_weights(x, scores, None)
        start = scores.topk(k, dim=-1).indices
        torch_ops = partial(dense, x, w, start)
        kernel = partial(native.kmedoids, lib, x, w, start, 5, clustering.SWAP_RTOL)
        (med_t, assign_t), (med_n, assign_n) = torch_ops(), kernel()
        same = torch.equal(med_t, med_n) and torch.equal(assign_t, assign_n)
        olds, news = time_paired(kernel, torch_ops, warmup=1, repeats=repeats, device=torch.device("cpu"))
        ratio = statistics.median(n / o for o, n in zip(olds, news))
        every = partial(native.kmedoids, lib, x, w, start, 5, clustering.SWAP_RTOL,
                        given=torch.arange(n).expand(batch, n))
        alls, defaults = time_paired(kernel, every, warmup=1, repeats=repeats, device=torch.device("cpu"))
        given = statistics.median(d / a for a, d in zip(alls, defaults))
        print(f"| {k} | {statistics.median(olds) * 1e3:.2f} | {statistics.median(news) * 1e3:.2f} | {ratio:.3f} "
              f"| {same} | {statistics.median(alls) * 1e3:.2f} | {given:.3f} |")


if __name__ == "__main__":
    main()
