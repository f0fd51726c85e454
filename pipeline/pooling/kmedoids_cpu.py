"""K-Medoids' iterations on the CPU as native code (``kmedoids_cpu.c``), built on first use and cached.

The C source has no Python or torch headers, so it builds with the system's C compiler in about a
second; the library is kept in a cache folder under a name that hashes the source, the flags, the
compiler and the machine, so an edit rebuilds it and a second process (a Ray worker, a test) loads it.
Without a compiler, or with ``PIPELINE_NATIVE=0``, ``library()`` returns None and the caller runs the
torch iterations (same results, slower); a failed build says why, once.

Environment:
    PIPELINE_NATIVE: ``0`` turns the native kernel off.
    PIPELINE_NATIVE_CACHE: the cache folder (default ``$XDG_CACHE_HOME/pipeline-native``, else
        ``~/.cache/pipeline-native``).
    CC: the C compiler (default ``cc``).
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kmedoids_cpu.c")
# -ffp-contract=off: every product is rounded before it is added, as in the torch paths, so the costs
# are the same bits; no -march=native: a cache on shared storage may serve other CPUs.
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off")
_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_double)
_FUNCTIONS = {torch.float32: "kmedoids_f32", torch.float64: "kmedoids_f64"}


def cache_dir() -> Path:
    """Where built libraries are kept: ``PIPELINE_NATIVE_CACHE``, else the user's cache folder."""
    if os.environ.get("PIPELINE_NATIVE_CACHE"):
        return Path(os.environ["PIPELINE_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipeline-native"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def library_path(compiler: str) -> Path:
    """The cached library for this source, these flags, this compiler and this machine."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), platform.machine().encode()):
        key.update(part)
    return cache_dir() / f"kmedoids_cpu-{key.hexdigest()[:16]}.so"


def build(compiler: str, target: Path) -> None:
    """Compiles the source into ``target``, through a temporary file and an atomic rename (processes
    that build at the same time each write their own file; the last rename wins, and all are equal)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise OSError(f"{compiler} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded native library, built first if it is not in the cache; None when it cannot be had."""
    if os.environ.get("PIPELINE_NATIVE", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (%s) found: K-Medoids runs the torch iterations on the CPU (same results, "
                    "slower); install one (apt-get install build-essential) or set CC",
                    os.environ.get("CC", "cc"))
        return None
    target = library_path(compiler)
    try:
        if not target.exists():
            build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("could not build K-Medoids' CPU kernel into %s (%s): the torch iterations run instead "
                    "(same results, slower); set PIPELINE_NATIVE_CACHE to a writable folder or CC to a working "
                    "compiler", target.parent, err)
        return None
    for name in _FUNCTIONS.values():
        getattr(lib, name).argtypes = _ARGS
        getattr(lib, name).restype = ctypes.c_int
    return lib


def supports(d: Tensor) -> bool:
    """Whether the native kernel takes distances like ``d``: CPU float32 or float64."""
    return d.device.type == "cpu" and d.dtype in _FUNCTIONS


def kmedoids_native(lib: ctypes.CDLL, d: Tensor, w: Tensor | None, medoids: Tensor, iters: int, rtol: float
                    ) -> tuple[Tensor, Tensor]:
    """K-Medoids iterations: d (B, N, N) distances (float32 or float64, CPU), w (B, N) of d's dtype or None,
    medoids (B, K) int64 starting medoids -> (medoids (B, K) int64, last assignment (B, N) int64).
    Semantics: ``clustering._kmedoids``; ``rtol`` is the swap margin."""
    b, n, _ = d.shape
    k = medoids.shape[1]
    d = d.contiguous()
    w = None if w is None else w.to(d.dtype).contiguous()
    start = medoids.to(torch.int64).contiguous()
    med = torch.empty(b, k, dtype=torch.int64)
    assign = torch.empty(b, n, dtype=torch.int64)
    if b == 0:
        return med, assign
    status = getattr(lib, _FUNCTIONS[d.dtype])(
        d.data_ptr(), None if w is None else w.data_ptr(), start.data_ptr(), med.data_ptr(), assign.data_ptr(),
        b, n, k, iters, 1.0 - rtol)
    if status != 0:
        raise MemoryError(f"K-Medoids' CPU kernel could not allocate its workspace for N = {n}, K = {k}")
    return med, assign
