"""Token downsampling operators: Token Pooling, the paper's baselines and ToMe. The registry that picks
one by name is ``pipeline.methods`` (``build_downsampler``); importing this package never imports it.
"""

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
