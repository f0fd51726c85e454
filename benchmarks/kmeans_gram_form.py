"""Paired timing, CPU: K-Means' iterations in the feature form (explicit centres) against the Gram form
(centres as coefficients over the tokens), at DeiT-S size: B = 64, N = 196, D = 384, 5 iterations,
weighted, top-K start. Two settings: the CPU path (``index_add_`` segment sums for the feature form, the
native kernel for the Gram form) and dense torch ops (``dense_segments(True)`` and
``kernels.kmeans: torch``: the ops the CUDA path traces when told to run torch instead of its
Triton kernel). Run from the repo root:

    python benchmarks/kmeans_gram_form.py [--smoke]

``--smoke``: 2 images of 24 tokens and one timed pair, to check that the script runs (its figures then mean nothing).
"""

import argparse
import time

import torch

from pipeline.pooling.clustering import _kmeans
from pipeline.pooling.common import dense_segments
from pipeline.runtime import KernelChoice

SETTINGS = {False: "CPU path (feature form: index_add_; Gram form: native kernel)",
            True: "dense torch ops (the CUDA path's ops with kernels.kmeans: torch)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 images of 24 tokens, one pair: checks that it runs")
    args = parser.parse_args()
    batch, n, dim, ks, pairs_n = (2, 24, 48, (12, 6, 3), 3) if args.smoke else (64, 196, 384, (147, 98, 49), 12)
    torch.manual_seed(0)
    for dense in (False, True):
        kernels = KernelChoice(kmeans="torch" if dense else "auto")
        for k in ks:
            x = torch.randn(batch, n, dim)
            w = torch.rand(batch, n) + 0.1
            w = w / w.amax(-1, keepdim=True)
            start = w.topk(k, -1).indices
            ratios, pairs = [], []
            with dense_segments(dense):
                for i in range(pairs_n):
                    t0 = time.perf_counter()
                    a = _kmeans(x, w, start, 5, gram=False, kernels=kernels)
                    t1 = time.perf_counter()
                    g = _kmeans(x, w, start, 5, gram=True, kernels=kernels)
                    t2 = time.perf_counter()
                    if i >= 2:  # two warm-up pairs
                        ratios.append((t2 - t1) / (t1 - t0))
                        pairs.append((t1 - t0, t2 - t1))
            ratios.sort()
            feat = sorted(p[0] for p in pairs)[len(pairs) // 2] * 1e3
            gram = sorted(p[1] for p in pairs)[len(pairs) // 2] * 1e3
            print(f"{SETTINGS[dense]}, K={k}: feature form {feat:.1f} ms, Gram form {gram:.1f} ms, "
                  f"median ratio {ratios[len(ratios) // 2]:.3f}, same assignments {torch.equal(a, g)}")

if __name__ == "__main__":
    main()
