"""numba's on-disk cache for FFCV's compiled pipelines.

FFCV 1.0.2 compiles every operation of a loader's pipeline with ``numba.njit`` in each process that builds a
loader, and offers no option to cache the result: about 6 s of the first epoch here (a 16 px beton, 2 cores), paid
again by every DAG trial, Ray Train worker, evaluation and CLI process. With ``cache=True`` numba keeps the
machine code under ``__pycache__`` beside the source (or its user-wide cache dir, or ``NUMBA_CACHE_DIR``), and a
later process loads it in about 1.5 s. numba keys each entry on the function's bytecode, the values its closure
captured, the signature and the CPU, and drops it when the source file changes, so a pipeline with another
resolution or crop compiles its own entry.

Functions that reach "dynamic globals" (FFCV's ctypes memcpy, ``NormalizeImage``'s lookup table) cannot be
cached: numba compiles them as before and warns once per function; that warning is dropped here, and no other.
"""

import warnings

from numba import njit
from numba.core.errors import NumbaWarning

_UNCACHEABLE = "Cannot cache compiled function"


def cache_ffcv_compilation() -> None:
    """Make ``ffcv.pipeline.compiler.Compiler.compile`` ask numba for its disk cache, in this process (idempotent).

    The compiled code is the same as without the cache (same ``njit`` options); only where it comes from changes.
    """
    from ffcv.pipeline.compiler import Compiler

    warnings.filterwarnings("ignore", message=_UNCACHEABLE, category=NumbaWarning)
    if getattr(Compiler.compile, "caches", False):
        return

    def compile(cls, code, signature=None):  # FFCV's own body (1.0.2), plus cache=True
        if not cls.is_enabled:
            return code
        parallel = bool(getattr(code, "is_parallel", False)) and cls.num_threads > 1
        return njit(signature, fastmath=True, nogil=True, error_model="numpy", parallel=parallel, cache=True)(code)

    compile.caches = True
    Compiler.compile = classmethod(compile)
