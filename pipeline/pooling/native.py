"""The clustering iterations and the merge on the CPU as native code (``clustering_cpu.c``), built on first use and
cached.

K-Medoids' iterations (``kmedoids``, on the tokens and a matmul of the starting medoids' columns), K-Means'
(``kmeans_gram``, on the Gram matrices) and the weighted cluster means (``cluster_means``), each one call for a
batch; ``clustering`` and ``merge`` call them through custom ops, whose torch kernels run where the library is not at
hand. Each splits its batch over torch's threads in an OpenMP parallel region of torch's own runtime (threads of
another pool, Python's or the library's own, found torch's OpenMP threads still holding the cores after its matmul and
were no faster, docs/history.md).

The C source has no Python or torch headers, so it builds with the system's C compiler in about a
second; the library is kept in a cache folder under a name that hashes the source, the flags and the
machine and names the instruction sets it holds (``built_for``: on x86-64 a clone of each K-Medoids and means kernel
for the psABI levels v4, v3 and the baseline, the CPU's picked when it loads; K-Means' kernels are the baseline's),
so an edit rebuilds it and a second process (a Ray worker, a test) loads it, with or without a compiler. A library that
holds other instruction sets than its name says is never loaded (the torch iterations run, and a warning says to
delete it); ``instruction_set()`` names the level the kernels run at. Without a compiler ``library()`` returns None
and the caller runs the torch iterations (same results, slower); a failed build says why, once. The config's
``kernels.native: torch`` turns them off (``for_tensor(t, enabled=False)``).

Environment (where the library is built and kept, not whether it runs):
    PIPELINE_NATIVE_CACHE: the cache folder (default ``$XDG_CACHE_HOME/pipeline-native``, else
        ``~/.cache/pipeline-native``).
    PIPELINE_NATIVE_CLONES: ``0`` builds the baseline instruction set alone (no AVX2 or AVX-512 clone).
    CC: the C compiler (default ``cc``); it must take ``-fopenmp`` (GCC does; Clang needs libomp, a runtime of its
        own beside torch's libgomp), or the build fails, says so once, and the torch paths run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from pipeline.pooling.common import batch_offset

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("clustering_cpu.c")
# -ffp-contract=off: every product is rounded before it is added, as in the torch paths, so the costs
# are the same bits; no -march=native: a cache on shared storage may serve other CPUs (the source's
# target_clones give each K-Medoids and means kernel a clone per x86-64 level instead, picked where it loads);
# -fopenmp: each kernel splits the batch over torch's threads in one parallel region, on the OpenMP runtime torch
# loaded (the library links libgomp.so.1, which torch's wheels bring and have loaded by then).
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp")
NO_CLONES = "-DPIPELINE_NO_CLONES"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name -> argument types (pointers, sizes), for float32 ("_f32") and float64 ("_f64")
    "kmedoids": (_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_double, _I),
    "kmeans_gram": (_P, _P, _P, _P, _I, _I, _I, _I, _I),
    "cluster_means": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I),
}
_SUFFIX = {torch.float32: "_f32", torch.float64: "_f64"}


def cache_dir() -> Path:
    """Where built libraries are kept: ``PIPELINE_NATIVE_CACHE``, else the user's cache folder."""
    if os.environ.get("PIPELINE_NATIVE_CACHE"):
        return Path(os.environ["PIPELINE_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipeline-native"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def clones_wanted() -> bool:
    """Whether builds hold a clone per x86-64 level: on x86-64, unless ``PIPELINE_NATIVE_CLONES`` is 0."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("PIPELINE_NATIVE_CLONES") != "0"


def flags(clones: bool | None = None) -> tuple[str, ...]:
    """The compiler flags: ``FLAGS``, and ``NO_CLONES`` for a build of the baseline alone (default: unless
    ``clones_wanted``)."""
    return FLAGS + (() if (clones_wanted() if clones is None else clones) else (NO_CLONES,))


def built_for(clones: bool | None = None) -> str:
    """The instruction sets a build holds, as the library's ``clustering_built()`` names them: the x86-64 levels
    of its clones (``x86-64-v4,x86-64-v3,x86-64``), the x86-64 baseline alone, or another machine's baseline."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "baseline"
    return "x86-64-v4,x86-64-v3,x86-64" if NO_CLONES not in flags(clones) else "x86-64"


def library_path(clones: bool | None = None) -> Path:
    """The cached library for this source, these flags and this machine, named by the instruction sets it holds (a
    library built elsewhere, in a Docker image's build stage, loads where there is no compiler)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags(clones)).encode(), platform.machine().encode()):
        key.update(part)
    return cache_dir() / f"clustering_cpu-{built_for(clones).replace(',', '+')}-{key.hexdigest()[:16]}.so"


def build(compiler: str, target: Path, clones: bool | None = None) -> None:
    """Compiles the source into ``target``, through a temporary file and an atomic rename (processes
    that build at the same time each write their own file; the last rename wins, and all are equal)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags(clones), str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise OSError(f"{compiler} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded native library, built first if it is not in the cache; None when it cannot be had. A compiler
    that cannot build the clones (one older than GCC 12 or Clang 14) builds the baseline alone, and a cache that holds
    only the baseline's library (built so elsewhere) loads it without a compiler."""
    compiler = _compiler()
    options = [True, False] if clones_wanted() else [False]
    cached = [clones for clones in options if library_path(clones).exists()]
    for clones in cached[:1] or options:
        target = library_path(clones)
        try:
            if not target.exists():
                if compiler is None:
                    log.warning("no C compiler (%s) found: the clustering methods run their torch iterations on the "
                                "CPU (same results, slower); install one (apt-get install build-essential) or set CC",
                                os.environ.get("CC", "cc"))
                    return None
                build(compiler, target, clones)
        except (OSError, subprocess.SubprocessError) as err:
            if clones:
                log.warning("could not build the clustering CPU kernels with a clone per x86-64 level (%s): building "
                            "the baseline alone", err)
                continue
            log.warning("could not build the clustering CPU kernels into %s (%s): the torch iterations run instead "
                        "(same results, slower); set PIPELINE_NATIVE_CACHE to a writable folder or CC to a working "
                        "compiler", target.parent, err)
            return None
        try:
            return _checked(load(target), target, clones)
        except (OSError, AttributeError) as err:  # not a library, or not this source's
            log.warning("the clustering CPU kernels at %s cannot be used (%s): the torch iterations run instead "
                        "(same results, slower); delete the file to rebuild it", target, err)
            return None
    return None


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its kernels' signatures set (``_SIGNATURES``, each dtype's)."""
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        for suffix in _SUFFIX.values():
            getattr(lib, name + suffix).argtypes = args
            getattr(lib, name + suffix).restype = ctypes.c_int
    for name in ("clustering_built", "clustering_isa"):
        getattr(lib, name).restype = ctypes.c_char_p
    return lib


def _checked(lib: ctypes.CDLL, target: Path, clones: bool) -> ctypes.CDLL:
    """``lib`` where it holds the instruction sets its name says (``built_for``); else OSError (a library copied in
    under another's name, or from another build): the torch iterations run, and deleting the file rebuilds it."""
    held = lib.clustering_built().decode()
    if held != built_for(clones):
        raise OSError(f"it holds kernels for {held}, not the {built_for(clones)} its name says")
    return lib


ISA_NAMES = {"x86-64-v4": "AVX-512", "x86-64-v3": "AVX2 and FMA", "x86-64": "the x86-64 baseline"}


def instruction_set() -> str:
    """The instruction set the K-Medoids and means kernels run at here: ``x86-64-v4`` (AVX-512), ``x86-64-v3`` (AVX2
    and FMA), ``x86-64`` (the baseline), ``baseline`` (another machine's), or ``none`` where the library is not at
    hand. K-Means' kernels always run the baseline's code."""
    lib = library()
    return "none" if lib is None else lib.clustering_isa().decode()


def identity() -> str | None:
    """The library's name (the digest of its source, flags and machine) and the instruction set its K-Medoids and
    means kernels run here, ``clustering_cpu-x86-64-v4+x86-64-v3+x86-64-ac68be20f8306ba1.so at x86-64-v4``: what a
    latency table's key names the native kernels by, so that another kernel source or another CPU's clone measures a
    table of its own; None where no library is at hand."""
    lib = library()
    return None if lib is None else f"{Path(lib._name).name} at {lib.clustering_isa().decode()}"


def describe(enabled: bool = True) -> str:
    """One line for ``pipeline doctor``: the instruction set the kernels run at, the sets the library holds, where;
    ``enabled``: the config's ``kernels.native`` is not ``torch``."""
    if not enabled:
        return "off (kernels.native: torch): the torch iterations run"
    lib = library()
    if lib is None:
        return "none at hand: the torch iterations run (no C compiler, or a failed build: the warning above says why)"
    isa, held = lib.clustering_isa().decode(), lib.clustering_built().decode()
    name = f" ({ISA_NAMES[isa]})" if isa in ISA_NAMES else ""
    return (f"K-Medoids and the means running the {isa}{name} code of a library built for {held}, K-Means the "
            f"baseline's: "
            f"{lib._name}")


def for_tensor(t: Tensor, enabled: bool = True) -> ctypes.CDLL | None:
    """The library where the native kernels take a matrix like ``t`` (CPU float32 or float64) and ``enabled``
    (the config's ``kernels.native`` is not ``torch``), else None."""
    return library() if enabled and t.device.type == "cpu" and t.dtype in _SUFFIX else None


def _call(lib: ctypes.CDLL, name: str, *args: Tensor | float | None) -> None:
    """Calls ``name`` for the dtype of the first argument, on torch's number of threads (the last argument of every
    kernel; the same bits at any number); tensors go as the data pointers of contiguous copies (kept alive through the
    call), None as NULL."""
    args = tuple(a.contiguous() if isinstance(a, Tensor) else a for a in args)
    pointers = [a.data_ptr() if isinstance(a, Tensor) else a for a in args]
    if getattr(lib, name + _SUFFIX[args[0].dtype])(*pointers, torch.get_num_threads()) != 0:
        raise MemoryError(f"the clustering CPU kernel {name} could not allocate its workspace")


def kmedoids(lib: ctypes.CDLL, x: Tensor, w: Tensor | None, medoids: Tensor, iters: int, rtol: float,
             given: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """K-Medoids iterations: x (B, N, D) tokens (float32 or float64, CPU), w (B, N) or None, medoids (B, K) starting
    medoids -> (medoids (B, K) int64, last assignment (B, N) int64); ``rtol`` is the swap margin. Semantics:
    ``clustering._kmedoids``.

    The distances' columns of the tokens ``given`` (B, C), distinct in each image (default: the starting medoids),
    come from the products of one batched matmul here, derived as ``clustering.dists_from_gram`` derives them; the
    squared norms of the tokens not given, and any other distance the kernel reads (a medoid swapped in, two members
    of a cluster), are summed in its own fixed order (``clustering_cpu.c``'s ``_dot``) when it first reads them, so a
    distance may differ from ``clustering.sq_dists``' in its last bits and a near-tie may go the other way."""
    b, n, m = x.shape
    k = medoids.shape[1]
    med = torch.empty(b, k, dtype=torch.int64)
    assign = torch.empty(b, n, dtype=torch.int64)
    if not b:
        return med, assign
    _check_index(medoids, n, "medoids")
    if given is None:
        given = medoids
    else:
        _check_index(given, n, "given")
    x = x.contiguous()
    # the given rows (one index_select of the flattened tokens, rather than an expanded gather) times the tokens
    flat = (given.long() + batch_offset(b, n, x.device)).view(-1)
    rows = x.view(b * n, m).index_select(0, flat).view(b, -1, m)
    _call(lib, "kmedoids", x, torch.bmm(rows, x.transpose(1, 2)), given.long(), _weights(w, x), medoids.long(), med,
          assign, b, n, m, given.shape[1], k, iters, 1.0 - rtol)
    return med, assign


def kmeans_gram(lib: ctypes.CDLL, gram: Tensor, w: Tensor | None, start: Tensor, iters: int) -> Tensor:
    """K-Means iterations in the Gram form: gram (B, N, N) = X X^T (float32 or float64, CPU), w (B, N) or
    None, start (B, K) starting tokens -> last assignment (B, N) int64. Semantics: ``clustering._kmeans_gram``."""
    b, n, _ = gram.shape
    assign = torch.empty(b, n, dtype=torch.int64)
    _check_index(start, n, "start")
    if b:
        _call(lib, "kmeans_gram", gram, _weights(w, gram), start.long(), assign, b, n, start.shape[1], iters)
    return assign


def cluster_means(lib: ctypes.CDLL, x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None
                  ) -> Tensor:
    """Weighted cluster means: x (B, N, M) (float32 or float64, CPU), w (B, N) or None, assign (B, N) in [0, k),
    start (B, K) or None -> (B, K, M). Semantics and bits: ``merge._means_partition`` (each cluster's sum of
    w_i x_i in increasing token order, over its total weight; an empty cluster gives the token at its start)."""
    b, n, m = x.shape
    out = torch.empty(b, k, m, dtype=x.dtype)
    _check_index(assign, k, "assign")
    if start is not None:
        _check_index(start, n, "start")
    if b:
        _call(lib, "cluster_means", x, _weights(w, x), assign.long(), None if start is None else start.long(), out,
              b, n, m, k)
    return out


def _check_index(index: Tensor, bound: int, name: str) -> None:
    """IndexError unless every entry of ``index`` is in [0, bound): the kernels write and read at these indices
    unchecked (where torch's index ops would raise)."""
    if index.numel() and not (int(index.min()) >= 0 and int(index.max()) < bound):
        raise IndexError(f"the clustering CPU kernels' {name} must lie in [0, {bound}), got {int(index.min())} to "
                         f"{int(index.max())}")


def _weights(w: Tensor | None, like: Tensor) -> Tensor | None:
    return None if w is None else w.to(like.dtype)
