"""timm ViTs with a token-downsampling step in every block."""

from pipeline.models.attention import AttentionStats, attend
from pipeline.models.deit import deit_e252_patch16_224, deit_e318_patch16_224
from pipeline.models.downsampling import (
    DownsamplingBlocks,
    DownsamplingConfig,
    apply_downsampling,
    project_retention,
    retention_keep,
    retention_penalty,
    set_kernels,
    soft_extract,
)
from pipeline.models.factory import create_model, data_config, unwrap
from pipeline.models.keep import effective_keep, parse_keep
from pipeline.models.weights import load_state, load_weights

__all__ = [
    "AttentionStats",
    "DownsamplingBlocks",
    "DownsamplingConfig",
    "apply_downsampling",
    "attend",
    "create_model",
    "deit_e252_patch16_224",
    "deit_e318_patch16_224",
    "data_config",
    "effective_keep",
    "load_state",
    "load_weights",
    "parse_keep",
    "project_retention",
    "retention_keep",
    "retention_penalty",
    "set_kernels",
    "soft_extract",
    "unwrap",
]
