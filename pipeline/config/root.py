"""The whole config: every section, and the checks that need more than one of them."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from pipeline.config.base import Section
from pipeline.config.bench import BenchLoopConfig, BenchOpsConfig, BenchThroughputConfig
from pipeline.config.data import DataConfig
from pipeline.config.experiment import ExperimentConfig
from pipeline.config.kernels import KernelsConfig
from pipeline.config.model import ModelConfig
from pipeline.config.pooling import PoolingConfig
from pipeline.config.recipe import RecipeConfig
from pipeline.config.train import TrainConfig
from pipeline.errors import InputError


class Config(Section):
    """The whole config: every command reads the sections it needs (``pipeline config show`` prints them)."""

    # Each rank seeds NumPy with seed * 1000 + rank, and NumPy takes 32-bit seeds.
    seed: int = Field(0, ge=0, lt=2**32 // 1000 - 1, description="the run's seed (>= 0)")
    pooling: PoolingConfig = Field(default_factory=PoolingConfig)
    bench: BenchOpsConfig = Field(default_factory=BenchOpsConfig)
    bench_throughput: BenchThroughputConfig = Field(default_factory=BenchThroughputConfig)
    bench_loop: BenchLoopConfig = Field(default_factory=BenchLoopConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    recipe: RecipeConfig = Field(default_factory=RecipeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    experiment: ExperimentConfig | None = None

    @model_validator(mode="after")
    def _keep_fits_the_depth(self) -> Config:
        # The depth is known here when the config sets it; otherwise the model build checks the
        # length before any compute (the config loads without torch, so it cannot ask timm).
        keep, depth = self.pooling.keep, self.model.depth
        if keep is not None and depth is not None and len(keep) != depth:
            raise ValueError(f"pooling.keep has {len(keep)} entries {keep} but model.depth is {depth}; give one K "
                             "per block")
        return self

    @model_validator(mode="after")
    def _sweep_values_fit(self) -> Config:
        sweep = None if self.experiment is None else self.experiment.base.sweep
        if sweep is None:
            return self
        plain = self.model_copy(update={"experiment": None})
        for key, param in sweep.space.items():
            section, _, field = key.partition(".")
            if field not in type(getattr(self, section)).model_fields:
                raise InputError(f"experiment.base.sweep.space.{key}: {section} has no field {field!r}")
            for value in param.values():
                try:
                    with_setting(plain, key, value)
                except (ValidationError, ValueError) as err:
                    why = err.errors()[0]["msg"] if isinstance(err, ValidationError) else str(err)
                    raise InputError(f"experiment.base.sweep.space.{key}: the value {value!r} is not valid there "
                                     f"({why})") from None
        return self


def with_setting(config: Config, key: str, value: Any) -> Config:
    """``config`` with the dotted ``key`` (``SECTION.FIELD``) set to ``value``, validated again."""
    section, field = key.split(".", 1)
    data = config.model_dump(mode="json")
    data[section][field] = value
    return Config.model_validate(data)
