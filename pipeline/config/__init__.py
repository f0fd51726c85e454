"""Typed, strictly validated configs: model defaults, then a YAML file, then dotted CLI overrides.

pydantic v2 does the validation (see docs/design.md for why): every section forbids unknown keys
and checks types strictly, and a failure is re-raised as a ConfigError that names the key, where
it came from (the file, or ``--set``) and what is allowed. One module per section (``pooling``,
``bench``, ``data``, ``model``, ``recipe``, ``train``, ``kernels``, ``experiment``); ``root`` joins them and checks
what spans sections; ``loading`` reads, merges, hashes and writes configs.
"""

from pipeline.config.base import CONFIG_DIR, ConfigError, PatchEmbed, Section, error_message
from pipeline.config.bench import BenchLoopConfig, BenchOpsConfig, BenchThroughputConfig
from pipeline.config.data import DataConfig, ProgressiveConfig
from pipeline.config.experiment import (
    SWEEPABLE_SECTIONS,
    EvalConfig,
    ExperimentConfig,
    ParamRange,
    PrepareItem,
    SearchConfig,
    SelectConfig,
    StageRecipe,
    SweepConfig,
)
from pipeline.config.kernels import KernelsConfig
from pipeline.config.loading import config_hash, dump_config, git_sha, load_config, parse_override, write_resolved
from pipeline.config.model import ModelConfig
from pipeline.config.pooling import PoolingConfig
from pipeline.config.recipe import RecipeConfig
from pipeline.config.root import Config, with_setting
from pipeline.config.train import CostTarget, TrainConfig

__all__ = [
    "CONFIG_DIR", "SWEEPABLE_SECTIONS", "BenchLoopConfig", "BenchOpsConfig",
    "BenchThroughputConfig", "Config", "ConfigError", "CostTarget", "DataConfig", "EvalConfig",
    "ExperimentConfig", "KernelsConfig", "ModelConfig", "ParamRange", "PatchEmbed", "PoolingConfig", "PrepareItem",
    "ProgressiveConfig", "RecipeConfig", "SearchConfig", "Section", "SelectConfig", "StageRecipe", "SweepConfig",
    "TrainConfig", "config_hash",
    "dump_config", "error_message", "git_sha", "load_config", "parse_override", "with_setting", "write_resolved",
]
