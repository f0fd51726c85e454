"""Paired timing, CPU: ``_kmedoids_rows`` (the update by ``index_add_`` into a (B, K, N) buffer) against a
candidate update that sums each token's own-cluster row with a (B, N, N) mask and picks every cluster's
cheapest member with two ``scatter_reduce`` minima. Both give the same medoids and assignments (checked
first); the candidate was slower, so the code kept ``index_add_`` (until session 12 replaced both by native
code: run this at commit c9803d9). Run from the repo root:

    PYTHONPATH=. python docs/data/cpu/session11/kmedoids_masked.py K   (K = 147, 98, 49)
"""
import time, sys
import torch
from pipeline.pooling.clustering import _SWAP_RTOL, _kmedoids_rows, sq_dists

def masked(d, w, medoids, iters):
    b, n, _ = d.shape
    k = medoids.shape[1]
    rows = d if w is None else d * w.unsqueeze(1)  # rows[b, i, j] = w_j d(i, j)
    own = torch.arange(k, device=d.device).expand(b, 1, k)
    token = torch.arange(n, device=d.device).expand(b, n)
    med = medoids.unsqueeze(1)
    def assign_to(med):
        return d.gather(2, med.expand(b, n, k)).argmin(-1).unsqueeze(1).scatter_(2, med, own)
    assign = assign_to(med)  # (B, 1, N)
    for _ in range(iters - 1):
        a = assign.view(b, n)
        cost = torch.where(a.unsqueeze(2) == assign, rows, 0.0).sum(-1)  # (B, N): own cluster's summed distances
        low = cost.new_full((b, k), torch.inf).scatter_reduce_(1, a, cost, "amin")
        best = torch.where(cost == low.gather(1, a), token, n)
        best = torch.full((b, k), n, device=d.device).scatter_reduce_(1, a, best, "amin")
        current = cost.gather(1, med.view(b, k))
        med = torch.where(low < current * (1.0 - _SWAP_RTOL), best, med.view(b, k)).unsqueeze(1)
        assign = assign_to(med)
    return med.view(b, k), assign.view(b, n)

torch.manual_seed(0)
for (b, n, m, k, it) in [(3, 30, 8, 7, 5), (2, 49, 16, 12, 3), (1, 196, 16, 147, 5), (4, 64, 5, 20, 5)]:
    x = torch.randn(b, n, m); w = torch.rand(b, n) + 0.1
    start = w.topk(k, -1).indices; d = sq_dists(x)
    for ww in (w / w.amax(-1, keepdim=True), None):
        got = masked(d, ww, start, it); want = _kmedoids_rows(d, ww, start, it)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
print("equal")
if len(sys.argv) > 1:
    b, n, m, k = 64, 196, 384, int(sys.argv[1])
    x = torch.randn(b, n, m); w = torch.rand(b, n) + 0.1; w = w / w.amax(-1, keepdim=True)
    start = w.topk(k, -1).indices; d = sq_dists(x)
    ratios = []
    for i in range(15):
        t0 = time.perf_counter(); _kmedoids_rows(d, w, start, 5); t1 = time.perf_counter(); masked(d, w, start, 5); t2 = time.perf_counter()
        if i >= 3: ratios.append((t2 - t1) / (t1 - t0)); print(f"rows {1e3*(t1-t0):.2f} ms, masked {1e3*(t2-t1):.2f} ms")
    ratios.sort(); print("median masked/rows", round(ratios[len(ratios)//2], 3))
