"""The whole config: every section, and the checks that need more than one of them."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from pipeline.config.base import ConfigError, Section, Seed, error_message
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

    seed: Seed = Field(0, description="the run's seed (>= 0)")
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
    def _heads_divide_every_width(self) -> Config:
        """Each width of ``experiment.embed_dims`` splits into its heads (``experiment.num_heads``, else
        ``model.num_heads``): refused here, naming those keys, not when the stage configs are made from it."""
        exp = self.experiment
        for dim in [] if exp is None else exp.embed_dims or []:
            heads, key = ((exp.num_heads[dim], f"experiment.num_heads[{dim}]") if dim in exp.num_heads
                          else (self.model.num_heads, "model.num_heads"))
            if heads is not None and dim % heads:
                raise InputError(f"{key} {heads} does not divide the width {dim} of experiment.embed_dims (M{dim}): "
                                 "give heads that divide every width, or experiment.num_heads per width")
        return self

    @model_validator(mode="after")
    def _warmup_ends_before_training(self) -> Config:
        """Refuses a recipe that warms up for all its epochs or more (it would train at warm-up rates, near 0, and
        end at chance): ``recipe`` itself for a single training, and each stage's recipe (``experiment.base``,
        ``.ksearch``, ``.finetune`` over ``recipe``) in an experiment."""
        recipe = self.recipe
        stages = [None] if self.experiment is None else ["base", "ksearch", "finetune"]
        for stage in stages:
            own = None if stage is None else getattr(self.experiment, stage)
            epochs, epochs_key = recipe.epochs, "recipe.epochs"
            warmup, warmup_key = recipe.warmup_epochs, "recipe.warmup_epochs"
            if own is not None and own.epochs is not None:
                epochs, epochs_key = own.epochs, f"experiment.{stage}.epochs"
            if own is not None and own.warmup_epochs is not None:
                warmup, warmup_key = own.warmup_epochs, f"experiment.{stage}.warmup_epochs"
            if warmup > 0 and warmup >= epochs:
                where = "" if stage is None else f"the {stage} stage: "
                raise InputError(f"{where}{warmup_key} {warmup:g} is not below {epochs_key} {epochs}: the whole run "
                                 "would warm up, at a learning rate near 0; give fewer warm-up epochs"
                                 + ("" if stage is None else f" (experiment.{stage}.warmup_epochs)"))
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
                except ValueError as err:
                    why = str(err)
                    raise InputError(f"experiment.base.sweep.space.{key}: the value {value!r} is not valid there "
                                     f"({why})") from None
        return self


def with_setting(config: Config, key: str, value: Any) -> Config:
    """``config`` with the dotted ``key`` (``SECTION.FIELD``) set to ``value``, validated again."""
    section, field = key.split(".", 1)
    data = config.model_dump(mode="json")
    data[section][field] = value
    try:
        return Config.model_validate(data)
    except ValidationError as err:  # a trial's setting: the key that set it, not pydantic's traceback
        raise ConfigError(f"{key}={value!r}: {'; '.join(error_message(e) for e in err.errors())}") from None
