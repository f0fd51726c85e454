"""Datasets: FFCV ``.beton`` writing from folders, Fashion-MNIST and synthetic data, and the loaders."""

from pipeline.data.jit_cache import cache_typed_dicts
from pipeline.data.sources import Source, SourceError, open_source
from pipeline.data.write import DataWriteError, WriteSettings, metadata_path, write_beton, write_folder

# Before the package's other modules import FFCV (those above do so only when called; augment at its top, after
# this): FFCV's rgb_image module compiles a numba typed dict when imported, which numba's disk cache saves 3.4-3.8 s
# of CPU a process (pipeline/data/jit_cache.py).
cache_typed_dicts()

__all__ = ["DataWriteError", "Source", "SourceError", "WriteSettings", "metadata_path", "open_source",
           "write_beton", "write_folder"]
