"""Paired timing, CPU: K-Means' iterations in the feature form (explicit centres; what the code ran
before 2026-11-27) against the Gram form (centres as coefficients over the tokens), at DeiT-S size:
B = 64, N = 196, D = 384, 5 iterations, weighted, top-K start; the CPU path (``index_add_`` segment
sums for the feature form) and the CUDA path's dense ops (``dense_segments(True)``). Run from the
repo root:

    python benchmarks/kmeans_gram_form.py
"""
import time

import torch

from pipeline.pooling.clustering import _kmeans
from pipeline.pooling.common import dense_segments

torch.manual_seed(0)
for dense in (False, True):
    for k in (147, 98, 49):
        x = torch.randn(64, 196, 384)
        w = torch.rand(64, 196) + 0.1
        w = w / w.amax(-1, keepdim=True)
        start = w.topk(k, -1).indices
        ratios, pairs = [], []
        with dense_segments(dense):
            for i in range(12):
                t0 = time.perf_counter()
                a = _kmeans(x, w, start, 5, gram=False)
                t1 = time.perf_counter()
                g = _kmeans(x, w, start, 5, gram=True)
                t2 = time.perf_counter()
                if i >= 2:
                    ratios.append((t2 - t1) / (t1 - t0))
                    pairs.append((t1 - t0, t2 - t1))
        ratios.sort()
        feat = sorted(p[0] for p in pairs)[len(pairs) // 2] * 1e3
        gram = sorted(p[1] for p in pairs)[len(pairs) // 2] * 1e3
        path = "dense (CUDA path)" if dense else "CPU path"
        print(f"{path}, K={k}: feature form {feat:.1f} ms, Gram form {gram:.1f} ms, "
              f"median ratio {ratios[len(ratios) // 2]:.3f}, same assignments {torch.equal(a, g)}")
