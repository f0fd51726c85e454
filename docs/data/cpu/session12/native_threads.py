"""Paired timing, CPU: whole weighted ``token_pool`` calls (distances, native iterations, pooled means) with the
native kernels run on the calling thread only against split over ``torch.get_num_threads()`` threads.

    git checkout bf0122f && PYTHONPATH=. python docs/data/cpu/session12/native_threads.py > docs/data/cpu/session12/native_threads.txt

It ran at commit bf0122f, the only one with the threaded kernels (`native._MIN_PARALLEL`); the next commit
reverted them, as they gained nothing here.

B = 64, N = 196, 384 dims, 5 iterations (DeiT-S's first pooling block at batch 64), 2 threads; calls
alternate, the ratio is threaded time / one-thread time, medians over 21 pairs.
"""

import platform
import statistics
import time

import torch

from pipeline.pooling import native, token_pool

torch.set_num_threads(2)
assert native.library() is not None, "the native kernels did not build"
print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
print("| method | K | one thread ms | threaded ms | threaded / one thread | same result |")
print("|---|---:|---:|---:|---:|---|")
for method in ("kmedoids", "kmeans"):
    for k in (147, 98, 49):
        gen = torch.Generator().manual_seed(k)
        x, w = torch.randn(64, 196, 384, generator=gen), torch.rand(64, 196, generator=gen)

        def call(parallel_from: int):
            native._MIN_PARALLEL = parallel_from
            return token_pool(x, k, method=method, weights=w, validate=False)

        same = torch.equal(call(1 << 60).assign, call(0).assign)
        ones, threads = [], []
        for _ in range(21):
            t0 = time.perf_counter()
            call(1 << 60)
            t1 = time.perf_counter()
            call(0)
            t2 = time.perf_counter()
            ones.append(t1 - t0)
            threads.append(t2 - t1)
        ratio = statistics.median(t / o for o, t in zip(ones, threads))
        print(f"| {method} | {k} | {statistics.median(ones) * 1e3:.2f} | {statistics.median(threads) * 1e3:.2f} | "
              f"{ratio:.3f} | {same} |")
