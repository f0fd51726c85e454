"""Token downsampling operators: Token Pooling, the paper's baselines and ToMe, behind one registry."""

from pipeline.methods import METHODS
from pipeline.pooling.clustering import token_pool
from pipeline.pooling.common import PoolResult
from pipeline.pooling.conv import GridConvDownsample, pooled_count
from pipeline.pooling.registry import Downsampler, build_downsampler
from pipeline.pooling.selection import select_importance, select_random, select_topk, significance
from pipeline.pooling.tome import tome_merge

__all__ = [
    "METHODS",
    "Downsampler",
    "GridConvDownsample",
    "PoolResult",
    "build_downsampler",
    "pooled_count",
    "select_importance",
    "select_random",
    "select_topk",
    "significance",
    "token_pool",
    "tome_merge",
]
