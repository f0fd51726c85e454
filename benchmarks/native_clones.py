"""Paired timing, CPU: the native K-Medoids and K-Means of an earlier commit against today's, in one process.

    python benchmarks/native_clones.py --old-source docs/data/cpu/2026-12-07_native-clones/clustering_cpu_db5a098.c \
        [--threads 1,2] [--tolerance 0.01] [--smoke]

The earlier commit's ``clustering_cpu.c`` (``--old-source``: db5a098's, kept beside the figures by ``git show
db5a098:pipeline/pooling/clustering_cpu.c``) is built with its flags and called as its ``native.kmedoids`` was: on
the distances ``clustering.dists_from_gram`` writes from the Gram matrices (``clustering.gram``, timed with it), one
call for the batch; its K-Means as today's, on the Gram matrices. Today's K-Medoids runs on the tokens
(``native.kmedoids``: the matmul of the starting medoids' rows, timed with it, and the distances derived or computed
inside), as two builds: the clones (the CPU's level: AVX-512 here) and the baseline alone (``-DPIPELINE_NO_CLONES``,
no AVX2 or AVX-512 code); its K-Means has no clones (the baseline's code in both builds since the K-Means clone was
taken out). Each row is today's time over the earlier one's, paired block by block (``bench.paired``: the median of
the blocks' ratios with its 95% interval), on the same tokens and weights (B = 64, N = 196, M = 384, K = 98, 5
iterations, weighted: DeiT-S's first pooling block at batch 64), and says whether the medoids and assignments are
the same bits. ``--smoke``: a 2-image, 24-token problem, to check that it runs; its figures then mean nothing.
"""

import argparse
import ctypes
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from pipeline.bench.paired import SpeedSettings, paired_ratio, sample_timer
from pipeline.pooling import clustering, native

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "pipeline/pooling/clustering_cpu.c"
# The earlier kernel's signature: distances, weights, starting medoids, medoids out, assignment out, b, n, k, iters,
# the swap margin's complement.
_P, _I = ctypes.c_void_p, ctypes.c_int64
OLD_ARGS = (_P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_double)
OLD_KMEANS_ARGS = (_P, _P, _P, _P, _I, _I, _I, _I)  # Gram matrices, weights, starts, assignment out, b, n, k, iters


def build(source: str, flags: tuple[str, ...], out: Path) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    proc = subprocess.run(["cc", *flags, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def today(method: str, lib: ctypes.CDLL, x, g, w, start, iters):
    if method == "kmeans":
        return lambda: native.kmeans_gram(lib, g, w, start, iters)
    return lambda: native.kmedoids(lib, x, w, start, iters, clustering.SWAP_RTOL)


def earlier(method: str, lib: ctypes.CDLL, x, g, w, start, iters):
    """The earlier commit's CPU path: K-Medoids' Gram matrices and (B, N, N) distances in torch, then one kernel
    call for the batch; K-Means' kernel on the Gram matrices, as today."""
    if method == "kmeans":
        lib.kmeans_gram_f32.argtypes, lib.kmeans_gram_f32.restype = OLD_KMEANS_ARGS, ctypes.c_int
        return today(method, lib, x, g, w, start, iters)
    fn = lib.kmedoids_f32
    fn.argtypes, fn.restype = OLD_ARGS, ctypes.c_int
    b, n, _ = g.shape
    k = start.shape[1]

    def run():
        d = clustering.dists_from_gram(clustering.gram(x))
        med, assign = torch.empty(b, k, dtype=torch.int64), torch.empty(b, n, dtype=torch.int64)
        assert fn(d.data_ptr(), w.data_ptr(), start.data_ptr(), med.data_ptr(), assign.data_ptr(), b, n, k, iters,
                  1.0 - clustering.SWAP_RTOL) == 0
        return med, assign
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-source", type=Path, required=True, help="the earlier commit's clustering_cpu.c, whose "
                        "kmedoids_f32 takes the distances")
    parser.add_argument("--threads", default="1,2", help="torch threads to time at, comma-separated")
    parser.add_argument("--tolerance", type=float, default=0.01, help="the intervals' half-width aimed at")
    parser.add_argument("--cap-s", type=float, default=120.0, help="the most seconds a row may take")
    parser.add_argument("--smoke", action="store_true", help="a tiny problem: checks that it runs")
    args = parser.parse_args()
    which, source = str(args.old_source), args.old_source.read_text()
    b, n, m, k, iters = (2, 24, 16, 6, 5) if args.smoke else (64, 196, 384, 98, 5)
    gen = torch.Generator().manual_seed(0)
    x, scores = torch.randn(b, n, m, generator=gen), torch.rand(b, n, generator=gen)
    w = clustering.effective_weights(x, scores, None).contiguous()
    start, g = scores.topk(k, dim=-1).indices.contiguous(), clustering.gram(x)
    with tempfile.TemporaryDirectory() as tmp:
        old = ctypes.CDLL(str(build(source, native.FLAGS, Path(tmp) / "old.so")))
        baseline = native.load(build((ROOT / SOURCE).read_text(), (*native.FLAGS, native.NO_CLONES),
                                     Path(tmp) / "baseline.so"))
        clones = native.library()
        assert clones is not None, "the native kernels did not build"
        print(f"machine: {platform.processor() or platform.machine()}; torch {torch.__version__}; the earlier kernel: "
              f"{which}; today's K-Medoids clones run at {native.instruction_set()}")
        print(f"B = {b}, N = {n}, M = {m}, K = {k}, {iters} iterations, weighted; paired blocks, 95% intervals")
        print("| method | threads | today's build | time over the earlier | interval | blocks | same bits |")
        print("|---|---:|---|---:|---|---:|---|")
        for method in ("kmedoids", "kmeans"):
            for threads in [int(t) for t in args.threads.split(",")]:
                torch.set_num_threads(threads)
                reference = earlier(method, old, x, g, w, start, iters)
                want = reference()
                timer = sample_timer(torch.device("cpu"), clock="cpu" if threads == 1 else "wall")
                for name, lib in (("clones", clones), ("baseline alone", baseline)):
                    fn = today(method, lib, x, g, w, start, iters)
                    got = fn()
                    same = all(torch.equal(a, b) for a, b in zip(got, want)) if method == "kmedoids" else \
                        torch.equal(got, want)
                    settings = SpeedSettings(tolerance=args.tolerance, cap_s=args.cap_s, cap_key="--cap-s")
                    ratio = paired_ratio(fn, reference, timer=timer, settings=settings)
                    print(f"| {method} | {threads} | {name} | {ratio.ratio:.3f} | [{ratio.low:.3f}, {ratio.high:.3f}] "
                          f"| {ratio.blocks} ({ratio.stop}) | {same} |")


if __name__ == "__main__":
    main()
