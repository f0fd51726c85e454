"""numba's disk cache for FFCV's compiled pipelines (pipeline/data/jit_cache.py), in fresh processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_synthetic_pair

ROOT = Path(__file__).resolve().parents[1]

# One epoch of a training loader (seeded crops and flips) and of a validation loader; prints a digest of every
# batch, the cache hits and misses (compilations) of every numba dispatcher in the process, and whether FFCV's
# compile was the cached one.
EPOCHS = """
import gc, hashlib, json, sys
from numba.core.dispatcher import Dispatcher
import pipeline.data.jit_cache as jit_cache
from pipeline.data.loaders import LoaderSpec, ffcv_loader
if sys.argv[2] == "uncached":
    jit_cache.cache_ffcv_compilation = lambda: None  # FFCV's own compile: the reference
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
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-c", EPOCHS, str(beton), mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Cannot cache compiled function" not in proc.stderr  # numba's note on uncacheable functions is dropped
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.beton
@pytest.mark.slow
def test_a_second_process_loads_the_compiled_pipeline_and_reads_the_same_batches(tmp_path):
    beton = write_synthetic_pair(tmp_path, 64, 16) / "train.beton"
    cache = tmp_path / "numba"
    first = epochs(beton, cache, "cached")
    assert first["cached"] and first["misses"] > 0  # an empty cache: compiled (the validation loader can load
    # what the training loader's build saved: the label pipeline is the same)
    entries = sorted(p.name for p in cache.rglob("*.nbi"))
    assert entries  # and kept
    second = epochs(beton, cache, "cached")
    assert second["hits"] > first["hits"] and second["misses"] < first["misses"]  # loaded, not compiled again
    assert sorted(p.name for p in cache.rglob("*.nbi")) == entries  # same pipelines, no new entries
    reference = epochs(beton, tmp_path / "unused", "uncached")
    assert not reference["cached"] and reference["hits"] == 0  # no cache asked for
    assert not (tmp_path / "unused").exists()
    # FFCV's own compilation reads the same pixels and labels as the cached code, compiled or loaded
    assert first["digest"] == second["digest"] == reference["digest"]
