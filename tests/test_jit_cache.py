"""numba's disk cache for FFCV's compiled pipelines (pipeline/data/jit_cache.py), in fresh processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One epoch of a training loader (seeded crops and flips) and of a validation loader; prints a digest of every
# batch, the cache hits and misses (compilations) of every numba dispatcher in the process, and whether FFCV's
# compile was the cached one.
EPOCHS = """
import gc, hashlib, json, sys
from numba.core.dispatcher import Dispatcher
from pipeline.data.loaders import LoaderSpec, ffcv_loader
digest = hashlib.sha256()
for train in (True, False):
    spec = LoaderSpec(path=sys.argv[1], train=train, batch_size=16, res=16, mean=(0.5,) * 3, std=(0.25,) * 3,
                      workers=1, seed=3)
    for images, labels in ffcv_loader(spec):
        digest.update(images.numpy().tobytes()); digest.update(labels.numpy().tobytes())
from ffcv.pipeline.compiler import Compiler
dispatchers = [d for d in gc.get_objects() if issubclass(type(d), Dispatcher)]
hits = sum(sum(d.stats.cache_hits.values()) for d in dispatchers)
misses = sum(sum(d.stats.cache_misses.values()) for d in dispatchers)
print(json.dumps({"digest": digest.hexdigest(), "hits": hits, "misses": misses,  # a miss: a compilation
                  "cached": bool(getattr(Compiler.compile, "caches", False))}))
"""


def epochs(beton: Path, cache: Path, mode: str) -> dict:
    """``EPOCHS`` in a fresh process with numba's cache in ``cache``; ``mode`` ``uncached``: FFCV's own compile, the
    reference (``PIPELINE_NUMBA_CACHE=0``)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PIPELINE_NUMBA_CACHE": "0" if mode == "uncached" else "1"}
    proc = subprocess.run([sys.executable, "-c", EPOCHS, str(beton)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Cannot cache compiled function" not in proc.stderr  # numba's note on uncacheable functions is dropped
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.beton
@pytest.mark.slow
def test_a_second_process_loads_the_compiled_pipeline_and_reads_the_same_batches(synthetic_data, tmp_path):
    beton = synthetic_data(64, 32) / "train.beton"
    cache = tmp_path / "numba"
    first = epochs(beton, cache, "cached")
    assert first["cached"] and first["misses"] > 0  # an empty cache: compiled (the validation loader can load
    # what the training loader's build saved: the label pipeline is the same)
    entries = {p.name: p.stat().st_mtime_ns for p in cache.rglob("*.nb*")}
    assert any(name.endswith(".nbc") for name in entries)  # and kept
    second = epochs(beton, cache, "cached")
    assert second["hits"] > first["hits"] and second["misses"] < first["misses"]  # loaded, not compiled again
    # same pipelines, same keys: no entry added or written again (a key that changed every process would add one)
    assert {p.name: p.stat().st_mtime_ns for p in cache.rglob("*.nb*")} == entries
    reference = epochs(beton, tmp_path / "unused", "uncached")
    assert not reference["cached"] and reference["hits"] == 0  # no cache asked for
    assert not (tmp_path / "unused").exists()
    # FFCV's own compilation reads the same pixels and labels as the cached code, compiled or loaded
    assert first["digest"] == second["digest"] == reference["digest"]


@pytest.mark.parametrize("threads,kept", [(1, True), (2, False)])
def test_serial_builds_are_kept_and_parallel_ones_compiled(threads, kept):
    """numba's cache key leaves ``parallel`` out, so a parallel build (a loader with 2 or more threads) must not be
    kept: a later serial build of the same function would load it, or the other way round."""
    from ffcv.pipeline.compiler import Compiler
    from numba.core.caching import FunctionCache

    from pipeline.data.jit_cache import cache_ffcv_compilation

    def op(x):
        return x

    op.is_parallel = True
    cache_ffcv_compilation()
    before = Compiler.num_threads
    Compiler.num_threads = threads  # the attribute alone: set_num_threads would change torch's threads too
    try:
        built = Compiler.compile(op)
    finally:
        Compiler.num_threads = before
    assert built.targetoptions.get("parallel", False) == (threads > 1)
    assert isinstance(built._cache, FunctionCache) == kept


def test_numbas_note_on_an_uncacheable_function_is_dropped_and_no_other_warning():
    """The note comes wrapped in terminal escapes where colorama is importable (Ray's workers): the demo printed it
    in each Ray Train worker until the filter matched anywhere in the message."""
    import warnings

    from numba.core.errors import NumbaWarning

    from pipeline.data.jit_cache import cache_ffcv_compilation

    note = '\x1b[1m\x1b[1mCannot cache compiled function "decode" as it uses dynamic globals\x1b[0m\x1b[0m'
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache_ffcv_compilation()
        for message in (note, note.replace("\x1b[1m", "").replace("\x1b[0m", ""), "Cannot determine Numba type"):
            warnings.warn_explicit(NumbaWarning(message), NumbaWarning, "augment.py", 73)
    assert [str(w.message) for w in seen] == ["Cannot determine Numba type"]


def test_an_op_with_no_file_or_an_unpicklable_closure_compiles_uncached():
    """numba raises when asked to cache a function it cannot place (code from ``exec``) or key (a closure value
    that does not pickle); FFCV's compile then builds it as FFCV would."""
    import threading

    from ffcv.pipeline.compiler import Compiler
    from numba.core.caching import NullCache

    from pipeline.data.jit_cache import cache_ffcv_compilation

    assert cache_ffcv_compilation()
    namespace: dict = {}
    exec("def op(x):\n    return x + 1", namespace)  # no source file: no locator
    lock = threading.Lock()

    def holds_a_lock(x):
        return x if lock is None else x + 2

    for code, answer in ((namespace["op"], 4), (holds_a_lock, None)):
        built = Compiler.compile(code)
        assert isinstance(built._cache, NullCache)
        if answer is not None:
            assert built(3) == answer


def test_a_load_waits_for_another_processs_save_to_the_same_folder(tmp_path, monkeypatch):
    """numba's index save is a read-modify-write with no lock: every load and save here holds ``flock`` on the
    cache folder, so a first call (a load, then a compile and a save) waits while another holder has it."""
    import fcntl
    import threading

    import numba
    from ffcv.pipeline.compiler import Compiler

    from pipeline.data.jit_cache import LOCK_NAME, cache_ffcv_compilation

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))  # numba's user-wide folder: here
    assert cache_ffcv_compilation()

    def op(x):
        return x * 3

    built = Compiler.compile(op)
    folder = Path(built._cache.cache_path)
    folder.mkdir(parents=True, exist_ok=True)
    answers: list[int] = []
    with open(folder / LOCK_NAME, "a") as held:  # another holder, as another process would be
        fcntl.flock(held, fcntl.LOCK_EX)
        caller = threading.Thread(target=lambda: answers.append(built(5)))
        caller.start()
        caller.join(timeout=3)
        blocked = caller.is_alive()
        fcntl.flock(held, fcntl.LOCK_UN)
    caller.join(timeout=120)
    assert blocked and answers == [15]


# FFCV's rgb_image module, imported after pipeline.data: the typed dict it builds, and whether its setitem (one of the
# dict's jitted methods) was compiled or loaded.
TYPED_DICT = """
import json
import pipeline.data
from ffcv.fields.rgb_image import IMAGE_MODES
from numba.typed import typeddict
stats = typeddict._setitem.stats
print(json.dumps({"modes": dict(IMAGE_MODES), "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


def typed_dict(cache: Path, enabled: str = "1") -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PIPELINE_NUMBA_CACHE": enabled}
    proc = subprocess.run([sys.executable, "-c", TYPED_DICT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_typed_dict_ffcv_builds_on_import_is_compiled_once_then_loaded(tmp_path):
    cache = tmp_path / "numba"
    first = typed_dict(cache)
    assert first == {"modes": {"jpg": 0, "raw": 1}, "hits": 0, "misses": 1}, first  # an empty cache: compiled
    assert [p.name for p in cache.rglob("typeddict._setitem-*.nbi")], sorted(p.name for p in cache.rglob("*"))
    entries = {p.name: p.stat().st_mtime_ns for p in cache.rglob("*.nb*")}
    second = typed_dict(cache)
    assert second == {"modes": {"jpg": 0, "raw": 1}, "hits": 1, "misses": 0}, second  # loaded, the same dict
    assert {p.name: p.stat().st_mtime_ns for p in cache.rglob("*.nb*")} == entries  # nothing written again
    off = typed_dict(tmp_path / "unused", enabled="0")
    assert off["modes"] == {"jpg": 0, "raw": 1} and off["hits"] == 0 and not (tmp_path / "unused").exists()


@pytest.mark.parametrize("value", ["off", "false", "", "2"])
def test_a_switch_value_other_than_0_or_1_is_refused_naming_the_variable(monkeypatch, value):
    from pipeline.data.jit_cache import enabled
    from pipeline.errors import InputError

    monkeypatch.setenv("PIPELINE_NUMBA_CACHE", value)
    with pytest.raises(InputError, match=f"PIPELINE_NUMBA_CACHE={value!r} in the environment: set it to 0"):
        enabled()
    for good, on in (("0", False), ("1", True)):
        monkeypatch.setenv("PIPELINE_NUMBA_CACHE", good)
        assert enabled() is on
    monkeypatch.delenv("PIPELINE_NUMBA_CACHE")
    assert enabled()

