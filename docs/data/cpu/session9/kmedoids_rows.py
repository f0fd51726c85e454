"""K-Medoids' CPU iterations before and after session 9, timed in one run.

    python docs/data/cpu/session9/kmedoids_rows.py > docs/data/cpu/session9/kmedoids_rows.txt

"Before" is ``_kmedoids_rows`` at commit 31eeb6c (a (B, N, N) copy of the distances with an -inf
diagonal for the assignments), read from git; "now" is the working tree's (run it at commit c9803d9 or
earlier: session 12 replaced ``_kmedoids_rows`` by native code). Weighted, 5 iterations,
DeiT-S level-3 size B = 64, N = 196, M = 384, K = 98, top-K start, 2 threads. Each timed call of
one is followed by one of the other, on distances recomputed before each call (so neither finds
them in cache); 3 warm-up and 41 timed pairs; the figure is the median of the per-pair ratios.
"""

import statistics
import subprocess
import time
import types
from pathlib import Path

import torch

from pipeline.pooling import clustering
from pipeline.profiling import count_ops

ROOT = Path(__file__).resolve().parents[4]
torch.set_num_threads(2)
before = types.ModuleType("clustering_31eeb6c")
exec(subprocess.run(["git", "show", "31eeb6c:pipeline/pooling/clustering.py"], cwd=ROOT, check=True,
                    capture_output=True, text=True).stdout, before.__dict__)

gen = torch.Generator().manual_seed(0)
B, N, M, K = 64, 196, 384, 98
x, scores = torch.randn(B, N, M, generator=gen), torch.rand(B, N, generator=gen)
w = clustering.effective_weights(x, scores, None)
start = scores.topk(K, dim=-1).indices
d = clustering.sq_dists(x)
variants = {"before": before._kmedoids_rows, "now": clustering._kmedoids_rows}
results = {name: run(d, w, start, 5) for name, run in variants.items()}
same = all(torch.equal(a, b) for a, b in zip(results["before"], results["now"]))
print(f"same medoids and assignment: {same}")
for name, run in variants.items():
    print(f"aten ops a call, {name}: {sum(count_ops(lambda run=run: run(d, w, start, 5)).ops.values())}")

times = {name: [] for name in variants}
for i in range(44):
    for name, run in variants.items():
        d = clustering.sq_dists(x)
        t0 = time.perf_counter()
        run(d, w, start, 5)
        if i >= 3:
            times[name].append(time.perf_counter() - t0)
for name, ts in times.items():
    print(f"{name}: median {statistics.median(ts) * 1e3:.2f} ms")
ratios = [a / b for a, b in zip(times["now"], times["before"])]
print(f"now / before, median of {len(ratios)} paired ratios: {statistics.median(ratios):.3f}")
