"""Kernels alone, CPU: the native K-Medoids and K-Means iterations on a batch of 64 in one call against two
calls of 32 images each in two threads (ctypes releases the GIL). B = 64, N = 196, 384 dims, 5 iterations,
weighted; medians of 15 alternating pairs (ms). Run from the repo root:

    PYTHONPATH=. python docs/data/cpu/session12/native_threads_kernels.py > docs/data/cpu/session12/native_threads_kernels.txt
"""
import statistics
import time

import torch
from concurrent.futures import ThreadPoolExecutor
from pipeline.pooling import native, clustering as C
lib = native.library(); torch.set_num_threads(2)
pool = ThreadPoolExecutor(2)
for k in (147, 98, 49):
    g = torch.Generator().manual_seed(k)
    x, s = torch.randn(64,196,384,generator=g), torch.rand(64,196,generator=g)
    w = C.effective_weights(x, s, None); start = s.topk(k,-1).indices
    d = C.sq_dists(x); G = torch.bmm(x, x.transpose(1,2))
    def one_med(): return native.kmedoids(lib, d, w, start, 5, C._SWAP_RTOL)
    def two_med():
        f = [pool.submit(native.kmedoids, lib, d[i:i+32], w[i:i+32], start[i:i+32], 5, C._SWAP_RTOL) for i in (0,32)]
        r = [x.result() for x in f]; return torch.cat([r[0][0], r[1][0]]), torch.cat([r[0][1], r[1][1]])
    def one_km(): return native.kmeans_gram(lib, G, w, start, 5)
    def two_km():
        f = [pool.submit(native.kmeans_gram, lib, G[i:i+32], w[i:i+32], start[i:i+32], 5) for i in (0,32)]
        return torch.cat([x.result() for x in f])
    assert torch.equal(one_med()[0], two_med()[0]) and torch.equal(one_km(), two_km())
    for a, b in ((one_med, two_med), (one_km, two_km)):
        ta, tb = [], []
        for _ in range(15):
            t0=time.perf_counter(); a(); t1=time.perf_counter(); b(); t2=time.perf_counter()
            ta.append(t1-t0); tb.append(t2-t1)
        print(k, a.__name__, round(statistics.median(ta)*1e3,2), b.__name__, round(statistics.median(tb)*1e3,2))
