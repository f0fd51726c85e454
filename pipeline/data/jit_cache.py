"""numba's on-disk cache for FFCV's compiled pipelines, and for the typed dict FFCV builds when it is imported.

FFCV 1.0.2 compiles every operation of a loader's pipeline with ``numba.njit`` in each process that builds a
loader, and offers no option to cache the result: every DAG trial, Ray Train worker, evaluation and CLI process
paid for it again. With ``cache=True`` numba keeps the machine code under ``__pycache__`` beside the source (or its
user-wide cache folder, or ``NUMBA_CACHE_DIR``), and a later process loads it: a fresh process building a 16 px
training and validation loader took about 6 s less (docs/data/cpu/2026-12-02_ffcv-jit-cache/).

What numba's cache does not do, and this module does around it:

- Its key is the function's bytecode, the values its closure captured, the signature and the CPU; not numba's
  options. So only serial builds are kept: a loader with more than one thread (``data.num_workers`` > 1) compiles
  its parallel ops as before, as FFCV would.
- Its save reads the index, picks a free data file and writes both, with no lock: two processes saving two keys of
  one function at once can leave one key pointing at the other's code. Every load and save here holds an
  exclusive ``flock`` on the cache folder.
- It raises where no folder is writable, or when a closure value cannot be pickled: those ops compile uncached.
- Functions that reach "dynamic globals" (FFCV's ctypes memcpy, the JPEG decoder) cannot be cached: numba compiles
  them as before and warns once per function; that warning is dropped here, and no other.

FFCV's ``Compiler.compile`` body is copied below (it has no hook), so the patch applies to FFCV 1.0.2 only; with
another version, FFCV's own compile runs.

FFCV's ``fields.rgb_image`` also builds a ``numba.typed.Dict`` when it is imported (``IMAGE_MODES``), which compiles
the dict's methods: 3.4-3.8 s of CPU in every process that imports FFCV, which loading them from the disk cache
saves (docs/data/cpu/2026-12-02_numba-typed-dict-cache/). ``cache_typed_dicts`` keeps those methods in numba's disk
cache too (under the same lock); ``pipeline.data`` calls it when it is imported, before any of its modules imports
FFCV.

``PIPELINE_NUMBA_CACHE=0`` turns both off: every process compiles, as numba and FFCV do, and nothing is written.
"""

from __future__ import annotations

import fcntl
import os
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from importlib.metadata import version
from typing import Any

import numba.typed.typeddict as typeddict
from numba import njit
from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher
from numba.core.errors import NumbaWarning
from numba.core.serialize import dumps

from pipeline.errors import InputError

FFCV_VERSION = "1.0.2"  # the version whose Compiler.compile is copied below
CACHE_ENV = "PIPELINE_NUMBA_CACHE"  # "0": no disk cache (numba's and FFCV's own compilation)
LOCK_NAME = "pipeline-numba-cache.lock"
# Where colorama is importable (Ray's workers), numba wraps the message in terminal escapes: match anywhere.
_UNCACHEABLE = r".*Cannot cache compiled function"


def cache_ffcv_compilation() -> bool:
    """Make ``ffcv.pipeline.compiler.Compiler.compile`` keep serial builds in numba's disk cache, in this process
    (idempotent). Returns whether it does: False with an FFCV other than 1.0.2."""
    from ffcv.pipeline.compiler import Compiler

    # Each call, first in the list (Python drops the older copy): a caller's catch_warnings may have reset it.
    warnings.filterwarnings("ignore", message=_UNCACHEABLE, category=NumbaWarning)
    if getattr(Compiler.compile, "caches", False):
        return True
    if version("ffcv") != FFCV_VERSION or not enabled():
        return False

    def compile_cached(cls, code, signature=None):
        if not cls.is_enabled:
            return code
        parallel = bool(getattr(code, "is_parallel", False)) and cls.num_threads > 1
        options = {"fastmath": True, "nogil": True, "error_model": "numpy", "parallel": parallel}
        if parallel or not _picklable_closure(code):
            return njit(signature, **options)(code)
        try:
            built = njit(signature, cache=True, **options)(code)
        except RuntimeError:  # "cannot cache function ...: no locator available": no writable folder
            return njit(signature, **options)(code)
        _lock(built._cache)
        return built

    compile_cached.caches = True
    Compiler.compile = classmethod(compile_cached)
    return True


def enabled() -> bool:
    """Whether the disk caches are on: ``PIPELINE_NUMBA_CACHE`` unset or ``1``; ``0`` turns them off. InputError
    for any other value (``off`` must not read as on)."""
    value = os.environ.get(CACHE_ENV, "1")
    if value not in ("0", "1"):
        raise InputError(f"{CACHE_ENV}={value!r} in the environment: set it to 0 (compile in every process, keep "
                         "nothing on disk) or 1 (numba's disk cache, the default), or unset it")
    return value == "1"


def cache_typed_dicts() -> bool:
    """Make the methods of ``numba.typed.Dict`` (``numba.typed.typeddict``'s jitted functions) load from and save to
    numba's disk cache, each load and save under the folder's lock, in this process (idempotent). Call it before FFCV
    is imported: its ``fields.rgb_image`` builds a typed dict then. Returns whether they are cached: False where
    ``PIPELINE_NUMBA_CACHE=0`` or no folder is writable."""
    if not enabled():
        return False

    for dispatcher in vars(typeddict).values():
        if isinstance(dispatcher, Dispatcher) and isinstance(dispatcher._cache, NullCache):
            try:
                dispatcher.enable_caching()
            except RuntimeError:  # "cannot cache function ...: no locator available": no writable folder
                return False
            _lock(dispatcher._cache)
    return True


def _picklable_closure(code: Callable) -> bool:
    """Whether numba can key ``code`` (it pickles the closure's values)."""
    try:
        dumps(tuple(cell.cell_contents for cell in code.__closure__ or ()))
    except Exception:  # noqa: BLE001 - any pickling failure: leave the function uncached
        return False
    return True


def _lock(cache: Any) -> None:
    """Every load and save of ``cache`` (a numba ``FunctionCache``) under an exclusive lock on its folder."""
    for name in ("load_overload", "save_overload"):
        setattr(cache, name, _locked(getattr(cache, name), cache.cache_path))


def _locked(method: Callable, folder: str) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        with _folder_lock(folder):
            return method(*args, **kwargs)
    return call


@contextmanager
def _folder_lock(folder: str):
    try:
        os.makedirs(folder, exist_ok=True)
        handle = open(os.path.join(folder, LOCK_NAME), "a")
    except OSError:  # numba found the folder writable; if that changed, it reports its own error
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
