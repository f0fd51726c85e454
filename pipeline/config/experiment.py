"""``experiment:``, the stage DAG of ``pipeline run``, and the base stage's hyperparameter sweep."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import MethodName, Section, Seed
from pipeline.config.train import CostTarget
from pipeline.errors import InputError
from pipeline.methods import GRID_CONV, keeps_all, method_spec, swept_methods


class ParamRange(Section):
    """One swept setting: exactly one of ``uniform: [lo, hi]``, ``loguniform: [lo, hi]``, ``randint: [lo, hi]``
    (hi excluded) or ``choice: [a, b, ...]``."""

    uniform: list[float] | None = None
    loguniform: list[float] | None = None
    randint: list[int] | None = None
    choice: list[Any] | None = None

    @model_validator(mode="after")
    def _one_range(self) -> ParamRange:
        given = {k: v for k, v in self.model_dump().items() if v is not None}
        if len(given) != 1:
            raise InputError("give exactly one of uniform, loguniform, randint, choice "
                             f"(got {sorted(given) or 'none'})")
        kind, values = next(iter(given.items()))
        if kind == "choice":
            if not values:
                raise InputError("choice: give at least one value")
        elif len(values) != 2 or not values[0] < values[1]:
            raise InputError(f"{kind}: give [low, high] with low < high, got {values}")
        elif kind == "loguniform" and values[0] <= 0:
            raise InputError(f"loguniform: the low end must be positive, got {values[0]}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k, v in self.model_dump().items() if v is not None)

    def values(self) -> list[Any]:
        """The settings a config must accept: both ends of a range, every choice."""
        return list(getattr(self, self.kind))


# What a sweep may set: the recipe, the model's regularisation and the pooling options (sections of Config).
SWEEPABLE_SECTIONS = ("recipe", "model", "pooling", "data")


class SweepConfig(Section):
    """A hyperparameter search over one training stage (Ray Tune): every trial trains the stage with the
    sampled settings and reports each epoch; the best trial on ``metric`` becomes the stage's result."""

    space: dict[str, ParamRange] = Field(description="dotted config keys (recipe.lr, model.drop_path, "
                                         "data.batch_size, ...) -> their range")
    search: Literal["grid", "random", "optuna"] = Field("optuna", description="grid: every combination of "
                                                        "choices; random; optuna: Ray Tune's OptunaSearch (TPE)")
    scheduler: Literal["none", "asha"] = Field("asha", description="asha: stop the worse trials early")
    grace_period: int = Field(1, ge=1, description="ASHA: epochs every trial runs before it may be stopped")
    reduction_factor: float = Field(2.0, gt=1, description="ASHA: 1/reduction_factor of trials go on at each rung")
    num_samples: int = Field(8, ge=1, description="trials (grid: repeats of the whole grid)")
    max_concurrent: int | None = Field(None, ge=1, description="default: as many as the cluster's CPUs allow")
    metric: Literal["val_top1", "train_loss"] = Field("val_top1", description="ranked on the validation split "
                                                      "(data.holdout), never on the test set")
    mode: Literal["max", "min"] = "max"

    @model_validator(mode="after")
    def _space_fits_the_search(self) -> SweepConfig:
        if not self.space:
            raise InputError("sweep.space is empty: give at least one setting to search over")
        for key, param in self.space.items():
            section, _, field = key.partition(".")
            if section not in SWEEPABLE_SECTIONS or not field or "." in field:
                raise InputError(f"sweep.space.{key}: give SECTION.FIELD with SECTION one of "
                                 f"{', '.join(SWEEPABLE_SECTIONS)}")
            if key == "recipe.epochs":
                raise InputError("sweep.space.recipe.epochs: the epochs are the ASHA budget; set the stage's epochs")
            if self.search == "grid" and param.kind != "choice":
                raise InputError(f"sweep.space.{key}: search grid takes choice lists only (got {param.kind})")
        return self


class StageRecipe(Section):
    """Per-stage overrides of the recipe (the rest comes from the ``recipe`` section)."""

    epochs: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0)
    warmup_epochs: float | None = Field(None, ge=0)
    sweep: SweepConfig | None = Field(None, description="base stage only: a hyperparameter search (Ray Tune)")
    seed: Seed | None = Field(None, description="the stage's seed (default the config's "
                             "`seed`): finetunes again from the same bases and keep lists with another seed, to see "
                             "the run-to-run noise")


class PrepareItem(Section):
    """A dataset the DAG writes before anything else, if it is missing (``pipeline data write``)."""

    source: str
    out: str
    limit: int | None = Field(None, ge=1)
    mode: Literal["raw", "jpg", "smart"] = "raw"
    max_res: int | None = 256


class SearchConfig(Section):
    """How Ray Tune walks the finetune grid."""

    algorithm: Literal["grid", "random"] = Field("grid", description="grid: every trial; random: num_samples of them")
    num_samples: int = Field(1, ge=1, description="random: how many trials to draw")
    max_concurrent: int | None = Field(None, ge=1, description="default: as many as the cluster's resources allow")
    trial_workers: int = Field(0, ge=0,
                               description="0: single-process trials (cheap); N: a TorchTrainer of N per trial")
    trial_cpus: float = Field(1.0, gt=0, description="CPUs per trial (per worker with trial_workers > 0)")
    trial_gpus: float = Field(0.0, ge=0, description="GPUs per trial (per worker with trial_workers > 0)")


class EvalConfig(Section):
    """How the evaluate stage measures each model: top-1 on the validation set, and images/s in the
    setting the models would be deployed in (``auto``: the GPU with bf16 and torch.compile where the
    cluster has one, else the CPU in fp32 eager)."""

    batch: int = Field(64, ge=1, description="throughput batch")
    warmup: int = Field(2, ge=0, description="calls of the model and its reference before they are timed")
    speed_tolerance: float = Field(0.02, gt=0, lt=1, description="the speed ratio's 95% interval aimed at, as a "
                                   "half-width relative to the ratio: an 8-block pilot's spread sets the blocks")
    speed_cap_s: float = Field(20.0, gt=0, allow_inf_nan=False, description="the most wall-clock seconds a "
                               "model's measurement (its pilot and blocks) may take, to within one block; a result "
                               "that hit it says so (speed_stop: cap)")
    threads: int = Field(1, ge=1, description="CPU timing threads: 1 times the timing thread's CPU clock, as the "
                         "latency tables do; more time wall clock")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="autocast dtype of the timing")
    compile: Literal["auto", "none", "default", "reduce-overhead", "max-autotune"] = Field(
        "auto", description="torch.compile mode of the timing")
    runtime: Literal["torch", "onnxruntime"] = Field(
        "torch", description="what runs the timed models: torch, or onnxruntime (each model and its reference exported "
        "to ONNX, `pipeline export`, and timed in ONNX Runtime on the CPU in float32; top-1 stays torch's, which the "
        "export's check holds to the runtime's logits)")
    cpus: float = Field(2.0, gt=0, description="CPUs per evaluation task (all of them: clean timings)")
    analysis_images: int = Field(2, ge=0, description="validation images drawn as cluster maps per model (0: none)")
    analysis_batch: int = Field(16, ge=0, description="validation images for the redundancy and reconstruction "
                                "analyses per model (0: none)")

    @model_validator(mode="after")
    def _onnxruntime_on_the_cpu(self) -> EvalConfig:
        given = {key: value for key, value in (("device", self.device), ("dtype", self.dtype),
                                               ("compile", self.compile))
                 if value not in ("auto", {"device": "cpu", "dtype": "fp32", "compile": "none"}[key])}
        if self.runtime == "onnxruntime" and given:
            settings = ", ".join(f"experiment.eval.{key}: {value}" for key, value in given.items())
            raise ValueError(f"experiment.eval.runtime: onnxruntime times the exported models on the CPU in float32, "
                             f"not with {settings}: leave those at auto (or cpu, fp32, none)")
        return self


class SelectConfig(Section):
    """The select stage: which Pareto front (cost against top-1) goes into the Model Registry."""

    cost: Literal["gflops", "images_per_s"] = Field(
        "gflops", description="the cost axis: GFLOPs, or the images/s the evaluate stage measured")
    tie_margin: Literal["none", "machine"] | Annotated[float, Field(ge=0, lt=1)] = Field(
        "none", description="the front by measured speed: models whose times differ by less than this relative "
        "margin are ties, and none leaves the front for another; none: the intervals alone; machine: this "
        "machine's recorded run-to-run spread (`pipeline doctor --speed`); or a number (0.02: 2%)")
    check_cap_s: float = Field(60.0, gt=0, allow_inf_nan=False, description="the most wall-clock seconds one keep "
                               "list's paired measurement against its latency table may take (to a 2% interval): the "
                               "K-search check before the finetunes, and the select stage's target rows")


class ConvConfig(Section):
    """``experiment.conv``: grid downsampling by 2x2 stride-2 convolutions, as in Swin and PiT (the paper's Figure 3a
    baseline and Appendix D): every placement of ``layers`` such layers after blocks 1 ... L-1 that each model's token
    grid allows (``dag.plan.conv_placements``), each a fixed keep list finetuned like any other method."""

    layers: list[Annotated[int, Field(ge=1, le=3)]] = Field(
        default_factory=lambda: [1, 2, 3], min_length=1,
        description="how many layers a placement has (1 to 3; three are equally spaced, as in the paper)")
    archs: list[str] | None = Field(None, min_length=1, description="the widths (M32) or models with conv placements; "
                                    "default all")


class NoFinetuneConfig(Section):
    """``experiment.no_finetune``: each base with a method inserted at each of the experiment's keep lists (its levels
    or K-search lists) and no training, evaluated like the finetuned models (the paper's Appendix E), with and without
    ``carry``. A measurement beside the fronts, never a pick: kept out of the fronts, the registry and ``@best``."""

    methods: list[MethodName] = Field(min_length=1, description="methods inserted without training (not learnable)")
    carry: list[bool] = Field(default_factory=lambda: [False], min_length=1,
                              description="pooling.carry settings, each evaluated (cluster sizes carried, Appendix E)")

    @model_validator(mode="after")
    def _untrained_methods(self) -> NoFinetuneConfig:
        for name in self.methods:
            if method_spec(name).learnable:
                raise InputError(f"methods: {name!r} learns its own layers, which are random "
                                 "without training; finetune it (experiment.conv or experiment.methods) instead")
            if keeps_all(name):
                raise InputError(f"methods: {name!r} keeps every token; each base's unmodified "
                                 "model is evaluated anyway, as the table's reference")
        for key, values in (("methods", self.methods), ("carry", self.carry)):
            if len(set(values)) != len(values):
                raise InputError(f"{key}: {values} lists a value twice")
        return self


class ExperimentConfig(Section):
    """``pipeline run``: the stage DAG (base -> ksearch -> finetune sweep -> evaluate -> select)."""

    name: str = Field("experiment", pattern=r"^[A-Za-z0-9_.-]+$")
    embed_dims: list[int] | None = Field(None, description="one base per width M (model.* is the template)")
    models: list[str] | None = Field(None, description="or one base per timm model name (the paper's DeiTs)")
    num_heads: dict[int, Annotated[int, Field(ge=1)]] = Field(default_factory=dict,
                                                              description="heads per width; default model.num_heads")
    base_checkpoints: dict[str, str] = Field(default_factory=dict, description="arch -> checkpoint: skip its training")
    lambdas: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = Field(
        None, description="K-search strengths (>= 0); each gives one sparsity level")
    ksearch_targets: list[CostTarget] | None = Field(None, description="K searches toward cost targets (latency "
                                                     "or GFLOPs); with or instead of lambdas")
    levels: list[int] | None = Field(None, description="or pin the paper's levels (configs/sparsity/)")
    methods: list[MethodName] = Field(default_factory=swept_methods,
                                      description="finetuned at every level; default: the registry's swept methods")
    baseline: bool = Field(True, description="also finetune each base without downsampling (DeiT-2x control)")
    conv: ConvConfig | None = Field(None, description="also finetune conv downsampling at every placement the grid "
                                    "allows (Appendix D)")
    no_finetune: NoFinetuneConfig | None = Field(None, description="also evaluate methods inserted into each base "
                                                 "at every level, without training (Appendix E)")
    base: StageRecipe = Field(default_factory=StageRecipe)
    ksearch: StageRecipe = Field(default_factory=lambda: StageRecipe(epochs=1, warmup_epochs=0))
    finetune: StageRecipe = Field(default_factory=StageRecipe)
    search: SearchConfig = Field(default_factory=SearchConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    select: SelectConfig = Field(default_factory=SelectConfig)
    budgets: list[float] | None = Field(None, description="GFLOPs budgets of the best-trade-off table")
    register_models: bool = Field(True, description="register Pareto-optimal models in the MLflow Model Registry")
    register_onnx: bool = Field(True, description="with register_models, also register each pick exported to ONNX "
                                "(`pipeline export`, checked in onnxruntime) as NAME-onnx under the same aliases: "
                                "`pipeline serve NAME@ALIAS --runtime onnxruntime` serves it")
    prepare: list[PrepareItem] = Field(default_factory=list)
    runs_dir: str = Field("runs/experiments", description="reports and plots go to RUNS_DIR/NAME/")

    @field_validator("name")
    @classmethod
    def _not_a_twins_name(cls, name: str) -> str:
        if name.endswith("-onnx"):  # token-pooling-NAME-onnx holds the ONNX twins of token-pooling-NAME
            raise ValueError(f"{name!r} ends in -onnx, which names the registry's ONNX twins (experiment."
                             f"register_onnx); call the experiment {name.removesuffix('-onnx')}_onnx, say")
        return name

    @model_validator(mode="after")
    def _sweep_is_not_empty(self) -> ExperimentConfig:
        if (self.embed_dims is None) == (self.models is None):
            raise InputError("give experiment.embed_dims or experiment.models (exactly one)")
        if not (self.embed_dims or self.models):
            raise InputError("experiment.embed_dims/models is empty: the sweep would have zero trials")
        searched = self.lambdas is not None or self.ksearch_targets is not None
        if searched == (self.levels is not None):
            raise InputError("give experiment.lambdas and/or experiment.ksearch_targets (K search), or "
                             "experiment.levels (the paper's), not both")
        if not (self.lambdas or self.ksearch_targets or self.levels) and self.methods:
            raise InputError("experiment.lambdas/levels is empty: the finetune sweep would have zero trials")
        labels = [target.label for target in self.ksearch_targets or []]
        if len(set(labels)) != len(labels):
            raise InputError(f"experiment.ksearch_targets: two targets give the same level name ({labels})")
        aliases = [label.replace(".", "_") for label in labels]  # the registry's target-<level> aliases
        if len(set(aliases)) != len(aliases):
            raise InputError(f"experiment.ksearch_targets: level names {labels} give the same registry alias once "
                             "'.' becomes '_' (target-<level>); rename one")
        taken = [t.name for t in self.ksearch_targets or [] if t.name is not None
                 and (t.name == "full" or re.fullmatch(r"lam.*|L\d+|conv[\d-]+", t.name))]
        if taken:
            raise InputError(f"experiment.ksearch_targets: name {taken[0]!r} looks like another kind of level ('full' "
                             "is the baseline, lam<strength> a lambda level, L<n> a paper level, conv<blocks> a conv "
                             "placement); pick another")
        if not self.methods and not self.baseline:
            raise InputError("experiment.methods is empty and baseline is off: the sweep would have zero trials")
        labels = [f"M{dim}" for dim in self.embed_dims or []] + list(self.models or [])
        unknown = sorted(set(self.conv.archs or []) - set(labels)) if self.conv is not None else []
        if unknown:
            raise InputError(f"experiment.conv.archs: {unknown} are not among the experiment's {labels}")
        if GRID_CONV in self.methods or any(GRID_CONV in (t.methods or []) for t in self.ksearch_targets or []):
            raise InputError(f"experiment.methods: {GRID_CONV!r} downsamples on fixed grid placements, not on the "
                             "keep lists a K search or a paper level gives; set experiment.conv: {layers: [1, 2, 3]} "
                             "to finetune it at every placement the grid allows")
        baseline = [name for name in self.methods if keeps_all(name)]
        if baseline:
            raise InputError(f"experiment.methods: {baseline[0]!r} keeps every token, which is the baseline; set "
                             "experiment.baseline: true instead")
        if self.search.algorithm == "grid" and self.search.num_samples != 1:
            raise InputError("experiment.search.num_samples applies to algorithm: random")
        if self.base.seed is not None or self.ksearch.seed is not None:
            raise InputError("experiment.base.seed / experiment.ksearch.seed: set the config's `seed` for the bases "
                             "and K searches; experiment.finetune.seed reruns the finetunes alone with another")
        for stage in ("ksearch", "finetune"):
            if getattr(self, stage).sweep is not None:
                raise InputError(f"experiment.{stage}.sweep: hyperparameter sweeps run on the base stage; the K "
                                 "search and the finetunes are sweeps over lambdas and methods already")
        if self.base.sweep is not None and self.search.trial_workers:
            raise InputError("experiment.base.sweep runs single-process trials: set experiment.search.trial_workers: 0")
        return self
