"""Paired timing, CPU: K-Medoids' iterations before (``_kmedoids_rows`` at commit c9803d9: ``index_add_`` of
the weighted distance rows into a (B, K, N) buffer that starts at +inf, ``min``, ``gather`` and ``argmin``)
against the native kernel now (``pipeline/pooling/native.c`` through ``tokenpool::kmedoids``).

Run from the repository root (git must reach commit c9803d9):

    python benchmarks/native_kmedoids.py > docs/data/cpu/2026-11-27_native-kernels/kmedoids_native.txt

B = 64, N = 196, 384 dims, 5 iterations, weighted (DeiT-S's first pooling block at batch 64); each
call pair is timed back to back, the ratio is native time / before time, medians over 15 pairs.
"""

import platform
import statistics
import subprocess
from functools import partial

import torch

from pipeline.bench.timing import time_paired
from pipeline.pooling import clustering, native

source = subprocess.run(["git", "show", "c9803d9:pipeline/pooling/clustering.py"], capture_output=True, text=True,
                        check=True).stdout
# the old module without its custom-op registrations (the op name is taken by the current module)
for line in ('@torch.library.custom_op("tokenpool::kmedoids", mutates_args=())',
             '@_kmedoids_op.register_kernel("cuda")', "@_kmedoids_op.register_fake"):
    source = source.replace(line, "")
# pool_segments has moved to pipeline.pooling.merge since; _kmedoids_rows does not use it
source = source.replace("    pool_segments,\n", "", 1)
before: dict = {}
exec(compile(source, "clustering@c9803d9", "exec"), before)

torch.set_num_threads(2)
print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
print("| K | before ms | native ms | native / before | same medoids and assignment |")
print("|---:|---:|---:|---:|---|")
for k in (147, 98, 49):
    gen = torch.Generator().manual_seed(k)
    x, scores = torch.randn(64, 196, 384, generator=gen), torch.rand(64, 196, generator=gen)
    w = clustering.effective_weights(x, scores, None)
    # the op iterates on the Gram matrix (since 2026-11-28); the code before took the distances
    start, g = scores.topk(k, dim=-1).indices, clustering.gram(x)
    d = clustering.dists_from_gram(g)
    old = before["_kmedoids_rows"](d, w, start, 5)
    new = clustering._kmedoids_op(g, w, start, 5)
    same = torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])
    olds, news = time_paired(partial(clustering._kmedoids_op, g, w, start, 5),
                             partial(before["_kmedoids_rows"], d, w, start, 5), warmup=1, repeats=15,
                             device=torch.device("cpu"))
    ratio = statistics.median(n / o for o, n in zip(olds, news))
    print(f"| {k} | {statistics.median(olds) * 1e3:.2f} | {statistics.median(news) * 1e3:.2f} | {ratio:.3f} | {same} |")
assert native.library() is not None, "the native kernel did not build"
