"""Token downsampling operators: Token Pooling, the paper's baselines and ToMe. The registry that picks
one by name is ``pipeline.methods`` (``build_downsampler``); importing this package never imports it.

``pipeline.pooling.build_downsampler``, where the function was before it moved to ``pipeline.methods``,
still works for this release with a ``DeprecationWarning``: the module ``__getattr__`` below imports the
registry only when that name is read.
"""

import warnings
from typing import Any

from pipeline.pooling.clustering import token_pool
from pipeline.pooling.common import PoolResult
from pipeline.pooling.conv import GridConvDownsample, pooled_count
from pipeline.pooling.factories import Downsampler
from pipeline.pooling.selection import select_importance, select_random, select_topk, significance
from pipeline.pooling.tome import tome_merge

__all__ = [
    "Downsampler",
    "GridConvDownsample",
    "PoolResult",
    "pooled_count",
    "select_importance",
    "select_random",
    "select_topk",
    "significance",
    "token_pool",
    "tome_merge",
]


def __getattr__(name: str) -> Any:
    """The names that moved out of this package: each works for one release, with a DeprecationWarning."""
    if name != "build_downsampler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn("pipeline.pooling.build_downsampler moved to pipeline.methods.build_downsampler; import it from "
                  "pipeline.methods (the old place goes in the next release)", DeprecationWarning, stacklevel=2)
    from pipeline import methods  # on first access only: importing pipeline.pooling does not load the registry

    return methods.build_downsampler
