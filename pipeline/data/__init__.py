"""Datasets: FFCV ``.beton`` writing from folders, Fashion-MNIST and synthetic data, and the loaders."""

from pipeline.data.sources import Source, SourceError, open_source
from pipeline.data.write import DataWriteError, WriteSettings, metadata_path, write_beton, write_folder

__all__ = ["DataWriteError", "Source", "SourceError", "WriteSettings", "metadata_path", "open_source",
           "write_beton", "write_folder"]
