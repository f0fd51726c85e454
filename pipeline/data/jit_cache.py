"""numba's on-disk cache for FFCV's compiled pipelines.

FFCV 1.0.2 compiles every operation of a loader's pipeline with ``numba.njit`` in each process that builds a
loader, and offers no option to cache the result: about 6 s of the first epoch here (a 16 px beton, 2 cores), paid
again by every DAG trial, Ray Train worker, evaluation and CLI process. With ``cache=True`` numba keeps the
machine code under ``__pycache__`` beside the source (or its user-wide cache dir, or ``NUMBA_CACHE_DIR``), and a
later process loads it in about 1.5 s. numba keys each entry on the function's bytecode, the values its closure
captured, the signature and the CPU, and drops it when the source file changes, so a pipeline with another
resolution or crop compiles its own entry. It does not key on numba's options, so only serial builds are kept: a
loader with more than one worker thread (``data.num_workers`` > 1) compiles its parallel ops as before.

Functions that reach "dynamic globals" (FFCV's ctypes memcpy, ``NormalizeImage``'s lookup table) cannot be
cached: numba compiles them as before and warns once per function; that warning is dropped here, and no other.
"""

import warnings

from numba import njit
from numba.core.errors import NumbaWarning

# Where colorama is importable (Ray's workers), numba wraps the message in terminal escapes: match anywhere.
_UNCACHEABLE = r".*Cannot cache compiled function"


def cache_ffcv_compilation() -> None:
    """Make ``ffcv.pipeline.compiler.Compiler.compile`` ask numba for its disk cache, in this process (idempotent).

    The compiled code is the same as without the cache (same ``njit`` options); only where it comes from changes.
    Parallel builds are compiled, not cached (numba's cache key leaves ``parallel`` out).
    """
    from ffcv.pipeline.compiler import Compiler

    warnings.filterwarnings("ignore", message=_UNCACHEABLE, category=NumbaWarning)
    if getattr(Compiler.compile, "caches", False):
        return

    def compile(cls, code, signature=None):  # FFCV's own body (1.0.2), plus the cache for serial builds
        if not cls.is_enabled:
            return code
        parallel = bool(getattr(code, "is_parallel", False)) and cls.num_threads > 1
        # numba's key leaves the target options out: a parallel build and a serial one of the same function would
        # share an entry. Parallel builds (a loader with more than one worker thread) are not kept.
        return njit(signature, fastmath=True, nogil=True, error_model="numpy", parallel=parallel,
                    cache=not parallel)(code)

    compile.caches = True
    Compiler.compile = classmethod(compile)
