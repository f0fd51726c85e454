"""The clustering iterations and the merge on the CPU as native code (``clustering_cpu.c``), built on first use and
cached.

K-Medoids' iterations (``kmedoids``, on the tokens and a matmul of the starting medoids' columns), K-Means'
(``kmeans_gram``, on the Gram matrices) and the weighted cluster means (``cluster_means``), each one call for a
batch; ``clustering`` and ``merge`` call them through custom ops, whose torch kernels run where the library is not at
hand. Each splits its batch over torch's threads in an OpenMP parallel region of torch's own runtime (threads of
another pool, Python's or the library's own, found torch's OpenMP threads still holding the cores after its matmul and
were no faster, docs/history.md). Each wrapper checks its arguments' shapes, dtypes and values (``k >= 1``,
``0 <= rtol < 1``, indices in range, distinct medoids) before any C runs: the C reads and writes at them unchecked.

The C source has no Python or torch headers, so it builds with the system's C compiler in about a
second; the library is kept in a cache folder under a name that hashes the source without its comments, the flags,
the machine and the compiler's version, and names the instruction sets it holds (``built_for``: on x86-64 a clone of
each K-Medoids and means kernel for the psABI levels v4, v3 and the baseline, the CPU's picked when it loads;
K-Means' kernels are the baseline's), so an edit of the code (not of a comment) rebuilds it and a second process (a
Ray worker, a test) loads it, with or without a compiler. A process with a compiler builds the clones even where a
baseline library is cached. The library is written to a temporary file, made 0644 (a cache shared between users
loads) and renamed into place, with the SHA-256 of its bytes appended (``TRAILER``): a library that is truncated, not
an ELF shared object of this machine, or whose bytes changed is found before ``dlopen`` and rebuilt once, with one
warning. A library that holds other instruction sets than its name says is never loaded (the torch iterations run,
and a warning says to delete it); ``instruction_set()`` names the level the kernels run at. Without a compiler
``library()`` returns None and the caller runs the torch iterations (slower; K-Medoids computes some distances in
another order, so a near-tie may go the other way: the self-check's index tolerance); a failed build says why, once.
The config's ``kernels.native: torch`` turns them off (``for_tensor(t, enabled=False)``).

Environment (where the library is built and kept, not whether it runs):
    PIPELINE_NATIVE_CACHE: the cache folder (default ``$XDG_CACHE_HOME/pipeline-native``, else
        ``~/.cache/pipeline-native``).
    PIPELINE_NATIVE_CLONES: ``0`` builds the baseline instruction set alone (no AVX2 or AVX-512 clone).
    CC: the C compiler command, split as a shell splits it (``gcc -m64``; default ``cc``); it must take ``-fopenmp``
        (GCC does; Clang needs libomp, a runtime of its own beside torch's libgomp), or the build fails, says so
        once, and the torch paths run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
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


def compiler() -> list[str] | None:
    """The C compiler command from ``CC`` (default ``cc``), split as a shell splits it (``gcc -m64``), its program
    found on the PATH; None where it is not found."""
    try:
        words = shlex.split(os.environ.get("CC", "cc"))
    except ValueError:  # unbalanced quotes
        return None
    found = shutil.which(words[0]) if words else None
    return None if found is None else [found, *words[1:]]


@functools.cache
def _compiler_version(command: tuple[str, ...]) -> str:
    """What ``command --version`` prints (its exit status where it fails: the build will say why)."""
    try:
        proc = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unknown: {err}"
    return proc.stdout if proc.returncode == 0 else f"unknown: exit {proc.returncode}"


# a string or character literal (kept), or a comment (dropped)
_C_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*', re.S)


def source_code(text: str) -> str:
    """The C source ``text`` without its comments and the blank space they leave: each comment is one space, runs of
    blanks one space, and lines left empty (or holding a macro's bare line continuation) go; what the cache name
    hashes, so that a comment edit keeps the library (and the latency tables keyed by it)."""
    text = _C_TOKENS.sub(lambda t: t.group(0) if t.group(0)[0] in "\"'" else " ", text)
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line and line != "\\")


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


def _stem(clones: bool | None) -> str:
    """The library's name up to the compiler's part: the instruction sets, and the digest of the comment-free source,
    the flags and the machine."""
    key = hashlib.sha256()
    for part in (source_code(SOURCE.read_text()), " ".join(flags(clones)), platform.machine()):
        key.update(part.encode() + b"\0")
    return f"clustering_cpu-{built_for(clones).replace(',', '+')}-{key.hexdigest()[:16]}"


def _compiler_key(command: list[str]) -> str:
    """The digest of the compiler's version and its arguments from ``CC`` (not its path): a library built by another
    compiler is another file."""
    return hashlib.sha256("\0".join([_compiler_version(tuple(command)), *command[1:]]).encode()).hexdigest()[:8]


def library_path(clones: bool | None = None, command: list[str] | None = None) -> Path:
    """The cached library for this source, these flags, this machine and this compiler (``command``, default
    ``compiler()``), named by the instruction sets it holds. Without a compiler at hand: the newest library of this
    source and flags in the cache, whichever compiler built it (a library built elsewhere, in a Docker image's build
    stage, loads where there is no compiler), or, where there is none, the name of one built by no known compiler."""
    command = compiler() if command is None else command
    stem = _stem(clones)
    if command is None:
        cached = sorted(cache_dir().glob(f"{stem}-*.so"), key=lambda p: (p.stat().st_mtime, p.name))
        return cached[-1] if cached else cache_dir() / f"{stem}-none.so"
    return cache_dir() / f"{stem}-{_compiler_key(command)}.so"


TRAILER = b"pipeline-native-sha256:"  # then the 64 hex digits of the SHA-256 of every byte before it
_ELF_MACHINE = slice(18, 20)  # e_machine in an ELF header


def build(command: list[str], target: Path, clones: bool | None = None) -> None:
    """Compiles the source into ``target``, through a temporary file and an atomic rename (processes that build at
    the same time each write their own file; the last rename wins, and all are equal). The file is made 0644
    whatever the linker and ``mkstemp`` left (0711: another user could not load it) and ends with ``TRAILER`` and
    the digest of its bytes, which ``damage`` checks before ``dlopen``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*command, *flags(clones), str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise OSError(f"{' '.join(command)} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        with open(tmp, "rb+") as f:  # ld.so reads the segments the headers name; bytes after them are ignored
            data = f.read()
            f.write(TRAILER + hashlib.sha256(data).hexdigest().encode())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def damage(path: Path) -> str | None:
    """What is wrong with the library file at ``path``, None where nothing is: not an ELF shared object for this
    machine (its header against the running Python's), or no ``TRAILER`` with the digest of its bytes (truncated,
    damaged, or not written by ``build``). Checked before ``dlopen``, which dies of a truncated library (SIGBUS)."""
    data = path.read_bytes()
    with open(sys.executable, "rb") as f:
        own = f.read(64)
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF file"
    if own[:4] == b"\x7fELF" and (data[4:6] != own[4:6] or data[_ELF_MACHINE] != own[_ELF_MACHINE]):
        return "an ELF file for another machine"
    if int.from_bytes(data[16:18], "little" if data[5] == 1 else "big") != 3:  # e_type ET_DYN
        return "an ELF file that is not a shared object"
    size = len(TRAILER) + 64
    body, tail = data[:-size], data[-size:]
    if not tail.startswith(TRAILER):
        return "no digest at its end (truncated, or not written by this build)"
    if hashlib.sha256(body).hexdigest().encode() != tail[len(TRAILER):]:
        return "its bytes differ from the digest written with them"
    return None


# what the fallback warnings say of the torch iterations' results
NOT_THE_SAME = "they sum some distances in another order, so a near-tie may be assigned the other way"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded native library, built first if it is not in the cache; None when it cannot be had. A compiler
    that cannot build the clones (one older than GCC 12 or Clang 18) builds the baseline alone, and a cache that holds
    only the baseline's library (built so elsewhere) loads it without a compiler."""
    command = compiler()
    options = [True, False] if clones_wanted() else [False]
    if command is None:
        cached = [clones for clones in options if library_path(clones).exists()]
        if not cached:
            log.warning("no C compiler (%s) found: the clustering methods run their torch iterations on the CPU "
                        "(slower; %s); install one (apt-get install build-essential) or set CC",
                        os.environ.get("CC", "cc"), NOT_THE_SAME)
            return None
        return _healed(library_path(cached[0]), None, cached[0])
    for clones in options:
        target = library_path(clones, command)
        try:
            if not target.exists():
                build(command, target, clones)
        except (OSError, subprocess.SubprocessError) as err:
            if clones:
                log.warning("could not build the clustering CPU kernels with a clone per x86-64 level (%s): building "
                            "the baseline alone", err)
                continue
            log.warning("could not build the clustering CPU kernels into %s (%s): the torch iterations run instead "
                        "(slower; %s); set PIPELINE_NATIVE_CACHE to a writable folder or CC to a working compiler",
                        target.parent, err, NOT_THE_SAME)
            return None
        return _healed(target, command, clones)
    return None


def _healed(target: Path, command: list[str] | None, clones: bool) -> ctypes.CDLL | None:
    """The library at ``target`` loaded, rebuilt once first (with one warning) where it is damaged (``damage``);
    None, with a warning, where it cannot be had."""
    try:
        problem = damage(target)
        if problem is not None:
            if command is None:
                log.warning("the clustering CPU kernels at %s are damaged (%s) and no C compiler is at hand to rebuild "
                            "them: the torch iterations run instead (slower; %s); install one or set CC",
                            target, problem, NOT_THE_SAME)
                return None
            log.warning("the clustering CPU kernels at %s are damaged (%s): building them again", target, problem)
            build(command, target, clones)
            problem = damage(target)
            if problem is not None:
                raise OSError(f"built again, it is still damaged ({problem})")
        return _checked(load(target), target, clones)
    except (OSError, subprocess.SubprocessError, AttributeError, ValueError) as err:  # not this source's library
        log.warning("the clustering CPU kernels at %s cannot be used (%s): the torch iterations run instead "
                    "(slower; %s); delete the file to rebuild it", target, err, NOT_THE_SAME)
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
    held = lib.clustering_built().decode(errors="replace")
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
    """The library's name (the digests of its comment-free source, flags and machine, and of its compiler) and the
    instruction set its K-Medoids and means kernels run here,
    ``clustering_cpu-x86-64-v4+x86-64-v3+x86-64-ac68be20f8306ba1-5d1c0e2a.so at x86-64-v4``: what a
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
    status = getattr(lib, name + _SUFFIX[args[0].dtype])(*pointers, torch.get_num_threads())
    if status == -2:  # the C's own check of the sizes and the margin, behind the wrappers'
        raise ValueError(f"the clustering CPU kernel {name} refused its sizes or margin")
    if status != 0:
        raise MemoryError(f"the clustering CPU kernel {name} could not allocate its workspace")


def kmedoids(lib: ctypes.CDLL, x: Tensor, w: Tensor | None, medoids: Tensor, iters: int, rtol: float,
             given: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """K-Medoids iterations: x (B, N, D) tokens (float32 or float64, CPU), w (B, N) or None, medoids (B, K) starting
    medoids, distinct in each image, K >= 1 -> (medoids (B, K) int64, last assignment (B, N) int64); ``rtol`` in
    [0, 1) is the swap margin. Semantics: ``clustering._kmedoids``.

    The distances' columns of the tokens ``given`` (B, C), distinct in each image (default: the starting medoids),
    come from the products of one batched matmul here, derived as ``clustering.dists_from_gram`` derives them; the
    squared norms of the tokens not given, and any other distance the kernel reads (a medoid swapped in, two members
    of a cluster), are summed in its own fixed order (``clustering_cpu.c``'s ``_dot``) when it first reads them, so a
    distance may differ from ``clustering.sq_dists``' in its last bits and a near-tie may go the other way."""
    b, n, m = _tokens(x, "x")
    _check(w, (b, n), "w", floating=True)
    k = _check(medoids, (b, None), "medoids", floating=False)[1]
    if k < 1:
        raise ValueError(f"the clustering CPU kernels' K-Medoids needs K >= 1 medoids, got {k}")
    if not 0.0 <= rtol < 1.0:  # a margin of 1 or more keeps no medoid's cost positive: a swap to nothing
        raise ValueError(f"the clustering CPU kernels' swap margin rtol must lie in [0, 1), got {rtol}")
    _check_index(medoids, n, "medoids", distinct=True)
    if given is None:
        given = medoids
    else:
        _check(given, (b, None), "given", floating=False)
        _check_index(given, n, "given", distinct=True)
    med = torch.empty(b, k, dtype=torch.int64)
    assign = torch.empty(b, n, dtype=torch.int64)
    if not b:
        return med, assign
    x = x.contiguous()
    # the given rows (one index_select of the flattened tokens, rather than an expanded gather) times the tokens
    flat = (given.long() + batch_offset(b, n, x.device)).view(-1)
    rows = x.view(b * n, m).index_select(0, flat).view(b, given.shape[1], m)
    _call(lib, "kmedoids", x, torch.bmm(rows, x.transpose(1, 2)), given.long(), _weights(w, x), medoids.long(), med,
          assign, b, n, m, given.shape[1], k, iters, 1.0 - rtol)
    return med, assign


def kmeans_gram(lib: ctypes.CDLL, gram: Tensor, w: Tensor | None, start: Tensor, iters: int) -> Tensor:
    """K-Means iterations in the Gram form: gram (B, N, N) = X X^T (float32 or float64, CPU), w (B, N) or
    None, start (B, K) starting tokens, K >= 1 -> last assignment (B, N) int64. Semantics:
    ``clustering._kmeans_gram``."""
    b, n, _ = _tokens(gram, "gram")
    _check(gram, (b, n, n), "gram", floating=True)
    _check(w, (b, n), "w", floating=True)
    k = _check(start, (b, None), "start", floating=False)[1]
    if k < 1:
        raise ValueError(f"the clustering CPU kernels' K-Means needs K >= 1 starting tokens, got {k}")
    _check_index(start, n, "start")
    assign = torch.empty(b, n, dtype=torch.int64)
    if b:
        _call(lib, "kmeans_gram", gram, _weights(w, gram), start.long(), assign, b, n, k, iters)
    return assign


def cluster_means(lib: ctypes.CDLL, x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None
                  ) -> Tensor:
    """Weighted cluster means: x (B, N, M) (float32 or float64, CPU), w (B, N) or None, assign (B, N) in [0, k),
    k >= 1, start (B, K) or None -> (B, K, M). Semantics and bits: ``merge.means_partition`` (each cluster's sum of
    w_i x_i in increasing token order, over its total weight; an empty cluster gives the token at its start)."""
    b, n, m = _tokens(x, "x")
    if k < 1:
        raise ValueError(f"the clustering CPU kernels' means need k >= 1 clusters, got {k}")
    _check(w, (b, n), "w", floating=True)
    _check(assign, (b, n), "assign", floating=False)
    _check_index(assign, k, "assign")
    if start is not None:
        _check(start, (b, k), "start", floating=False)
        _check_index(start, n, "start")
    out = torch.empty(b, k, m, dtype=x.dtype)
    if b:
        _call(lib, "cluster_means", x, _weights(w, x), assign.long(), None if start is None else start.long(), out,
              b, n, m, k)
    return out


def _tokens(x: Tensor, name: str) -> tuple[int, int, int]:
    """The (B, N, M) of ``x``; TypeError unless it is a 3-D float32 or float64 CPU tensor (what the kernels read)."""
    if x.dim() != 3 or x.dtype not in _SUFFIX or x.device.type != "cpu":
        raise TypeError(f"the clustering CPU kernels' {name} must be a (B, N, M) float32 or float64 CPU tensor, got "
                        f"{tuple(x.shape)} {x.dtype} on {x.device}")
    return tuple(x.shape)


def _check(t: Tensor | None, shape: tuple[int | None, ...], name: str, floating: bool) -> tuple[int, ...]:
    """The shape of ``t`` where it is ``shape`` (None: any size) on the CPU, of a floating dtype or an integer one
    (``floating``); else ValueError (the shape) or TypeError (the dtype, the device). The kernels read ``t`` by these
    sizes: a broadcastable (1, N) where (B, N) is due would be read past its end. None passes."""
    if t is None:
        return ()
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("any" if d is None else str(d) for d in shape)
        raise ValueError(f"the clustering CPU kernels' {name} must be of shape ({want}), got {tuple(t.shape)}")
    integer = not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    if t.device.type != "cpu" or not (t.is_floating_point() if floating else integer):
        kind = "a floating" if floating else "an integer"
        raise TypeError(f"the clustering CPU kernels' {name} must be a CPU tensor of {kind} dtype, got {t.dtype} "
                        f"on {t.device}")
    return tuple(t.shape)


def _check_index(index: Tensor, bound: int, name: str, distinct: bool = False) -> None:
    """IndexError unless every entry of ``index`` is in [0, bound) and, with ``distinct``, no image (row) holds one
    twice: the kernels write and read at these indices unchecked (where torch's index ops would raise), and two equal
    medoids leave a cluster empty."""
    if index.numel() and not (int(index.min()) >= 0 and int(index.max()) < bound):
        raise IndexError(f"the clustering CPU kernels' {name} must lie in [0, {bound}), got {int(index.min())} to "
                         f"{int(index.max())}")
    if distinct and index.shape[-1] > 1:
        ordered = index.sort(-1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(-1).nonzero()
        if len(repeated):
            raise ValueError(f"the clustering CPU kernels' {name} must be distinct in each image; image "
                             f"{int(repeated[0])} holds one twice")


def _weights(w: Tensor | None, like: Tensor) -> Tensor | None:
    return None if w is None else w.to(like.dtype)
