"""Typed, strictly validated configs: model defaults, then a YAML file, then dotted CLI overrides.

pydantic v2 does the validation (see docs/design.md for why): every section forbids unknown keys
and checks types strictly, and a failure is re-raised as a ConfigError that names the key, where
it came from (the file, or ``--set``) and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.errors import InputError, PipelineError
from pipeline.methods import KEEP_ALL, METHODS, downsampling_methods, keeps_all, method_spec, swept_methods


def _known_method(name: str) -> str:
    method_spec(name)  # ValueError naming the registered methods
    return name


# A registered downsampling method (pipeline.methods.METHODS, read when a config is validated).
MethodName = Annotated[str, AfterValidator(_known_method)]
CompileMode = Literal["none", "default", "reduce-overhead", "max-autotune"]
PatchEmbed = Literal["conv", "matmul"]  # models.patch_embed: timm's convolution, or the same function as a matmul


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Method options of the pooling section that default to None ("the method's own"); one set must apply to
# the method that runs it.
METHOD_OPTION_FIELDS = ("cluster_on", "significance")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as a string (it wants ``1.0e-3``); this loader reads it as a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class ConfigError(PipelineError, ValueError):
    """A config that cannot be used; the message names the key, its source and what is allowed."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PoolingConfig(Section):
    """Options of the downsampling step (see ``pipeline.pooling.build_downsampler``)."""

    method: MethodName = "wkmedoids"
    iters: int = Field(5, ge=1, description="rounds of assignment and centre update")
    init: Literal["topk", "random"] = "topk"
    cluster_on: Literal["tokens", "metric"] | None = Field(
        None, description="match on the tokens, or on the cheaper metric (keys averaged over heads); "
        "default: the method's own (tokens for clustering, keys for ToMe)")
    significance: Literal["eq4", "cls"] | None = Field(
        None, description="the scores of the methods that read them: eq4, the attention each token receives "
        "from every query (the paper's), or cls, the class token's attention alone (EViT; one query row, "
        "cheaper); default eq4")
    keep: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="K_1..K_L for finetuning (one per block, each >= 0); default: keep all")
    level: int | None = Field(None, ge=0, le=7, description="or the paper's sparsity level (configs/sparsity/)")
    carry: bool = Field(False, description="carry cluster sizes, proportional attention (Appendix D)")
    qk_norm: Literal["fixed", "learned"] | None = Field(None, description="normalised queries/keys (Appendix F)")
    alpha: float = Field(1.0, gt=0, description="the (initial) alpha of qk_norm")

    @model_validator(mode="after")
    def _one_keep_source(self) -> PoolingConfig:
        if self.keep is not None and self.level is not None:
            raise InputError("set pooling.keep or pooling.level, not both")
        return self

    def options(self, method: str | None = None) -> dict[str, Any]:
        """The options ``method`` (default ``self.method``) takes, from this section, as
        ``build_downsampler`` takes them; unset ones keep the method's defaults."""
        name = self.method if method is None else method
        spec = method_spec(name)
        given = {key: getattr(self, key) for key in spec.options if getattr(self, key, None) is not None}
        return spec.resolve(name, given)


class BenchOpsConfig(Section):
    """``pipeline bench ops``: each method timed against one transformer block on the same input."""

    model: str = "deit_small_patch16_224"
    batch: int = Field(64, ge=1)
    keep: list[int] = Field(default_factory=lambda: [147, 98, 49], min_length=1)
    methods: list[MethodName] = Field(
        default_factory=downsampling_methods,  # every registered method that downsamples
        min_length=1,
    )
    warmup: int = Field(3, ge=0)
    repeats: int = Field(10, ge=1, description="timed runs per row; the median is reported")
    threads: int | None = Field(None, ge=1, description="torch CPU threads; default: torch's choice")
    device: Literal["cpu", "cuda"] = "cpu"
    tome_reference: str | None = Field(
        None, description="path to a checkout of facebookresearch/ToMe, to time its merge side by side"
    )

    @field_validator("keep")
    @classmethod
    def _keep_positive(cls, keep: list[int]) -> list[int]:
        if any(k < 1 for k in keep):
            raise InputError(f"every K must be >= 1, got {keep}")
        return keep


class _BenchModels(Section):
    """What the model benchmarks share: which models, on which batch, in which dtype and compile mode."""

    model: str = "deit_small_patch16_224"
    methods: list[MethodName] = Field(default_factory=lambda: ["wkmedoids"], min_length=1,
                                      description="timed in one run, each against the same reference")
    keep: list[int] | None = Field(None, description="K_1..K_L; default: the sparsity level below")
    level: int | None = Field(3, ge=0, le=7, description="the paper's sparsity level (configs/sparsity/)")
    batch: int = Field(64, ge=1)
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast dtype of every model")
    compile: CompileMode = Field("none", description="torch.compile mode of every model (fullgraph)")
    patch_embed: PatchEmbed = Field("conv", description="the patch embedding of every model timed")
    threads: int | None = Field(None, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"

    @model_validator(mode="after")
    def _one_keep_source(self) -> _BenchModels:
        section = "bench_loop" if isinstance(self, BenchLoopConfig) else "bench_throughput"
        if self.keep is not None and self.level is not None:
            raise InputError(f"set {section}.keep or {section}.level, not both (set level: null)")
        if self.compile == "reduce-overhead" and self.device != "cuda":
            raise InputError(f"{section}.compile 'reduce-overhead' captures CUDA graphs: it needs device cuda")
        return self


class BenchThroughputConfig(_BenchModels):
    """``pipeline bench throughput``: downsampling models against the unmodified one, side by side."""

    train: bool = Field(False, description="time an optimizer step (forward, backward, AdamW), not inference")
    ceiling: bool = Field(True, description="add a row of plain random token dropping at the same keep list")
    profile: bool = Field(False, description="log a profile of one call of each model: on CUDA the device time "
                         "by kernel group and the longest kernels, then torch.profiler's table")
    warmup: int = Field(2, ge=0)
    repeats: int = Field(10, ge=1, description="timed samples of each model, paired")
    calls: int | None = Field(None, ge=1, description="calls a timed sample queues back to back before one device "
                              "sync (default: 10 on CUDA, which measures throughput; 1 on the CPU)")


class BenchLoopConfig(_BenchModels):
    """``pipeline bench loop``: the training loop (``train_one_epoch``) against the bare step it runs, on the
    same model, batch, dtype and compile mode, fed from batches already on the device."""

    methods: list[MethodName] = Field(default_factory=lambda: [KEEP_ALL, "wkmedoids"], min_length=1,
                                      description=f"{KEEP_ALL}: the unmodified model")
    batch: int = Field(32, ge=2, description="per step (even: Mixup/CutMix pairs images when enabled)")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="bf16: autocast on CUDA (recipe.amp)")
    steps: int = Field(20, ge=1, description="steps of one timed epoch")
    repeats: int = Field(3, ge=1, description="timed (bare steps, loop epoch) pairs; the median is reported")
    log_every: int = Field(50, ge=1, description="train.log_every of the loop")

    @model_validator(mode="after")
    def _bf16_on_cuda(self) -> BenchLoopConfig:
        if self.dtype == "bf16" and self.device != "cuda":
            raise InputError("bench_loop.dtype bf16: training autocasts to bf16 on CUDA only (recipe.amp); use fp32 "
                             "on the CPU")
        return self


class ProgressiveConfig(Section):
    """ffcv-imagenet's progressive resizing: ``start_res`` until ``start_epoch``, then linear to ``end_res``
    at ``end_epoch``."""

    start_res: int = Field(ge=8)
    end_res: int = Field(ge=8)
    start_epoch: int = Field(ge=0)
    end_epoch: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> ProgressiveConfig:
        if self.end_epoch < self.start_epoch:
            raise InputError(f"end_epoch ({self.end_epoch}) must be >= start_epoch ({self.start_epoch})")
        return self


class DataConfig(Section):
    """Datasets and loaders. Paths are ``.beton`` files for ``loader: ffcv``, image folders for ``loader: torch``."""

    train: str | None = Field(None, description="training set (.beton, or a folder for loader: torch)")
    val: str | None = Field(None, description="validation set (.beton, or a folder for loader: torch)")
    loader: Literal["ffcv", "torch"] = "ffcv"
    num_classes: int = Field(1000, ge=2, description="must match the dataset's metadata")
    batch_size: int = Field(128, ge=1, description="per worker")
    num_workers: int = Field(2, ge=0, description="loader threads (ffcv) or processes (torch) per worker")
    os_cache: bool = Field(True, description="FFCV: rely on the page cache (True) or its own process cache")
    flip: bool = Field(True, description="random horizontal flip in training")
    crop_scale: tuple[float, float] = Field((0.08, 1.0), description="random-resized-crop area range")
    progressive: ProgressiveConfig | None = None
    verify_checksum: bool = Field(False, description="SHA-256 the .beton before training (reads the whole file)")
    holdout: float = Field(0.0, ge=0, lt=1, description="fraction of data.train held out (stratified, seeded) to "
                           "validate and rank on; data.val is then the test set, measured once at the end")
    holdout_seed: int = Field(0, description="seed of the held-out split")

    @field_validator("crop_scale", mode="before")
    @classmethod
    def _scale_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _scale_range(self) -> DataConfig:
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise InputError(f"crop_scale must satisfy 0 < low <= high <= 1, got {list(self.crop_scale)}")
        if self.holdout > 0 and self.loader != "ffcv":
            raise InputError("data.holdout splits a .beton: it needs data.loader: ffcv")
        return self


class ModelConfig(Section):
    """The network: a timm model name plus overrides (a small DeiT-style ViT for Fashion-MNIST, or a new width)."""

    name: str = "deit_small_patch16_224"
    img_size: int | None = Field(None, ge=8)
    patch_size: int | None = Field(None, ge=1)
    embed_dim: int | None = Field(None, ge=8, description="a sweep over M sets this")
    depth: int | None = Field(None, ge=1)
    num_heads: int | None = Field(None, ge=1)
    drop_path: float = Field(0.1, ge=0, lt=1, description="stochastic depth rate (DeiT: 0.1)")
    weights: str | None = Field(None, description="a timm state dict to start from (mode base)")
    pretrained: bool = Field(False, description="timm's published weights (needs a network)")
    mean: tuple[float, float, float] | None = Field(None, description="overrides the model's data config")
    std: tuple[float, float, float] | None = Field(None, description="overrides the model's data config")
    crop_pct: float | None = Field(None, gt=0, le=1, description="overrides the model's data config")
    patch_embed: PatchEmbed = Field(
        "conv", description="the patch embedding as timm's convolution, or as the same function in one matmul "
        "(much faster on CUDA; same parameters)")

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _triple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.embed_dim is not None and self.num_heads is not None and self.embed_dim % self.num_heads:
            raise InputError(f"embed_dim {self.embed_dim} does not split into {self.num_heads} heads")
        return self


class RecipeConfig(Section):
    """Optimisation: DeiT's recipe through timm's optimizer, scheduler, Mixup/CutMix, losses and EMA."""

    epochs: int = Field(300, ge=1)
    opt: str = Field("adamw", description="timm.optim name; weight decay skips norms and biases")
    lr: float = Field(5e-4, gt=0, description="at a global batch of lr_batch; scaled linearly")
    lr_batch: int = Field(512, ge=1)
    min_lr: float = Field(1e-5, ge=0)
    warmup_epochs: float = Field(5, ge=0)
    warmup_lr: float = Field(1e-6, ge=0)
    weight_decay: float = Field(0.05, ge=0)
    label_smoothing: float = Field(0.1, ge=0, lt=1)
    mixup: float = Field(0.8, ge=0, description="Mixup alpha (0: off)")
    cutmix: float = Field(1.0, ge=0, description="CutMix alpha (0: off)")
    mixup_prob: float = Field(1.0, ge=0, le=1)
    mixup_switch_prob: float = Field(0.5, ge=0, le=1)
    clip_grad: float | None = Field(None, gt=0, description="clip the gradient norm (None: off)")
    ema: bool = Field(False, description="keep an EMA of the weights (timm ModelEmaV3) and evaluate it too")
    ema_decay: float = Field(0.99996, gt=0, lt=1)
    amp: bool = Field(True, description="bf16 autocast on GPU (ignored on CPU)")


class TrainConfig(Section):
    """One training job on Ray Train: what it does, where it runs and where results go."""

    mode: Literal["base", "ksearch", "finetune", "baseline"] = "base"
    init: str | None = Field(None, description="base checkpoint to start from (ksearch, finetune, baseline)")
    ksearch_lambda: float = Field(1e-4, ge=0, description="strength of the soft-extract mass penalty")
    ksearch_lr_scale: float = Field(20.0, gt=0, description="learning-rate multiple of the retention weights")
    name: str = Field("train", pattern=r"^[A-Za-z0-9_.-]+$", description="run name; same name + storage resumes")
    storage_path: str = Field("runs/ray", description="Ray Train storage (shared FS or s3:// on a cluster)")
    workers: int = Field(2, ge=0, description="DDP workers on Ray Train; 0: the same loop in this process")
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    keep_checkpoints: int = Field(2, ge=1)
    max_failures: int = Field(1, ge=0, description="worker or node failures survived by restarting the workers "
                              "from the last checkpoint")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement of the workers: STRICT_SPREAD puts each rank on its own node")
    address: str | None = Field(None, description="Ray cluster address; default: RAY_ADDRESS or a local Ray")
    tracking_uri: str = Field("sqlite:///runs/mlflow.db", description="MLflow tracking URI")
    artifact_root: str | None = Field("runs/mlartifacts", description="artifact store of new MLflow experiments "
                                      "(null: the tracking server's default)")
    experiment: str = "token-pooling"
    parent_run_id: str | None = Field(None, description="MLflow parent run (set by the stage DAG)")
    tags: dict[str, str] = Field(default_factory=dict, description="extra MLflow tags (the DAG's stage records)")
    checkpoint_artifact_mb: float = Field(200, ge=0, description="log the final checkpoint to MLflow if smaller")
    debug_fail_at_step: int | None = Field(None, ge=1, description="debug: raise once at this global step")
    debug_pause_at_step: int | None = Field(None, ge=1, description="debug: rank 0 pauses once at this global step "
                                            "(for debug_pause_s) so that a fault can be injected mid-epoch")
    debug_pause_s: float = Field(120.0, gt=0, description="debug: how long the pause lasts")
    progress_bar: bool = Field(True, description="a per-step bar when stdout is a terminal")
    log_every: int = Field(50, ge=1, description="steps between the loop's reads of the loss from the device: "
                           "the non-finite check and the progress bar's loss; each read makes the host wait "
                           "for the GPU")
    compile: CompileMode = Field("none", description="torch.compile the model (fullgraph) in this mode")

    @model_validator(mode="after")
    def _compile_fits_the_device(self) -> TrainConfig:
        if self.compile == "reduce-overhead" and not self.use_gpu:
            raise ValueError("train.compile 'reduce-overhead' captures CUDA graphs: it needs train.use_gpu: true")
        return self


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
                                         "pooling.iters, ...) -> their range")
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
    warmup: int = Field(2, ge=0)
    repeats: int = Field(5, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="autocast dtype of the timing")
    compile: Literal["auto", "none", "default", "reduce-overhead", "max-autotune"] = Field(
        "auto", description="torch.compile mode of the timing")
    cpus: float = Field(2.0, gt=0, description="CPUs per evaluation task (all of them: clean timings)")
    analysis_images: int = Field(2, ge=0, description="validation images drawn as cluster maps per model (0: none)")
    analysis_batch: int = Field(16, ge=0, description="validation images for the redundancy and reconstruction "
                                "analyses per model (0: none)")


class SelectConfig(Section):
    """The select stage: which Pareto front (cost against top-1) goes into the Model Registry."""

    cost: Literal["gflops", "images_per_s"] = Field(
        "gflops", description="the cost axis: GFLOPs, or the images/s the evaluate stage measured")


class ExperimentConfig(Section):
    """``pipeline run``: the stage DAG (base -> ksearch -> finetune sweep -> evaluate -> select)."""

    name: str = Field("experiment", pattern=r"^[A-Za-z0-9_.-]+$")
    embed_dims: list[int] | None = Field(None, description="one base per width M (model.* is the template)")
    models: list[str] | None = Field(None, description="or one base per timm model name (the paper's DeiTs)")
    num_heads: dict[int, int] = Field(default_factory=dict, description="heads per width; default model.num_heads")
    base_checkpoints: dict[str, str] = Field(default_factory=dict, description="arch -> checkpoint: skip its training")
    lambdas: list[float] | None = Field(None, description="K-search strengths; each gives one sparsity level")
    levels: list[int] | None = Field(None, description="or pin the paper's levels (configs/sparsity/)")
    methods: list[MethodName] = Field(default_factory=swept_methods,
                                      description="finetuned at every level; default: the registry's swept methods")
    baseline: bool = Field(True, description="also finetune each base without downsampling (DeiT-2x control)")
    base: StageRecipe = Field(default_factory=StageRecipe)
    ksearch: StageRecipe = Field(default_factory=lambda: StageRecipe(epochs=1))
    finetune: StageRecipe = Field(default_factory=StageRecipe)
    search: SearchConfig = Field(default_factory=SearchConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    select: SelectConfig = Field(default_factory=SelectConfig)
    budgets: list[float] | None = Field(None, description="GFLOPs budgets of the best-trade-off table")
    register_models: bool = Field(True, description="register Pareto-optimal models in the MLflow Model Registry")
    prepare: list[PrepareItem] = Field(default_factory=list)
    runs_dir: str = Field("runs/experiments", description="reports and plots go to RUNS_DIR/NAME/")

    @model_validator(mode="after")
    def _sweep_is_not_empty(self) -> ExperimentConfig:
        if (self.embed_dims is None) == (self.models is None):
            raise InputError("give experiment.embed_dims or experiment.models (exactly one)")
        if not (self.embed_dims or self.models):
            raise InputError("experiment.embed_dims/models is empty: the sweep would have zero trials")
        if (self.lambdas is None) == (self.levels is None):
            raise InputError("give experiment.lambdas (K search) or experiment.levels (the paper's), exactly one")
        if not (self.lambdas or self.levels) and self.methods:
            raise InputError("experiment.lambdas/levels is empty: the finetune sweep would have zero trials")
        if not self.methods and not self.baseline:
            raise InputError("experiment.methods is empty and baseline is off: the sweep would have zero trials")
        baseline = [name for name in self.methods if keeps_all(name)]
        if baseline:
            raise InputError(f"experiment.methods: {baseline[0]!r} keeps every token, which is the baseline; set "
                             "experiment.baseline: true instead")
        if self.search.algorithm == "grid" and self.search.num_samples != 1:
            raise InputError("experiment.search.num_samples applies to algorithm: random")
        for stage in ("ksearch", "finetune"):
            if getattr(self, stage).sweep is not None:
                raise InputError(f"experiment.{stage}.sweep: hyperparameter sweeps run on the base stage; the K "
                                 "search and the finetunes are sweeps over lambdas and methods already")
        if self.base.sweep is not None and self.search.trial_workers:
            raise InputError("experiment.base.sweep runs single-process trials: set experiment.search.trial_workers: 0")
        return self


class Config(Section):
    """The whole config: every command reads the sections it needs (``pipeline config show`` prints them)."""

    seed: int = 0
    pooling: PoolingConfig = Field(default_factory=PoolingConfig)
    bench: BenchOpsConfig = Field(default_factory=BenchOpsConfig)
    bench_throughput: BenchThroughputConfig = Field(default_factory=BenchThroughputConfig)
    bench_loop: BenchLoopConfig = Field(default_factory=BenchLoopConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    recipe: RecipeConfig = Field(default_factory=RecipeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
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

    @model_validator(mode="after")
    def _pooling_options_exist(self) -> Config:
        """A method option set in ``pooling`` must apply to the method it runs, or, in an experiment, to at
        least one of its methods (each finetune takes the options its method has; ``dag.plan``)."""
        swept = self.experiment is not None and bool(self.experiment.methods)
        methods = self.experiment.methods if swept else [self.pooling.method]
        for option in METHOD_OPTION_FIELDS:
            if getattr(self.pooling, option) is None or any(option in METHODS[m].options for m in methods):
                continue
            takers = ", ".join(sorted(name for name, s in METHODS.items() if option in s.options))
            where = f"any of experiment.methods {methods}" if swept else repr(self.pooling.method)
            raise InputError(f"pooling.{option} applies to {takers}, not {where}")
        return self


def with_setting(config: Config, key: str, value: Any) -> Config:
    """``config`` with the dotted ``key`` (``SECTION.FIELD``) set to ``value``, validated again."""
    section, field = key.split(".", 1)
    data = config.model_dump(mode="json")
    data[section][field] = value
    return Config.model_validate(data)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is read as YAML, so types come out right."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, for example pooling.iters=3")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: the key {key!r} has an empty part")
    try:
        value = _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({err})") from None
    return parts, value


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        shipped = sorted(str(p.relative_to(CONFIG_DIR.parent)) for p in CONFIG_DIR.rglob("*.yaml"))
        raise ConfigError(f"config file not found: {path}; the shipped configs are: {', '.join(shipped)}")
    try:
        data = _yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _flatten_sources(data: Any, source: str, prefix: tuple[str, ...], out: dict[tuple[str, ...], str]) -> None:
    out[prefix] = source
    if isinstance(data, dict):
        for key, value in data.items():
            _flatten_sources(value, source, prefix + (str(key),), out)


def _set_path(data: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _allowed_keys(loc: tuple[str | int, ...]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def _describe(err: ValidationError, sources: dict[tuple[str, ...], str]) -> str:
    lines = []
    for item in err.errors():
        loc = tuple(str(p) for p in item["loc"])
        key = ".".join(loc) or "(top level)"
        source = next((sources[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in sources), "defaults")
        if item["type"] == "extra_forbidden":
            message = f"unknown key; allowed keys here: {', '.join(_allowed_keys(loc))}"
        else:
            shown = "input" in item and item["type"] != "value_error"
            message = f"{item['msg']} (got {item['input']!r})" if shown else item["msg"]
        lines.append(f"  {source}: {key}: {message}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Merges the model defaults, the YAML file at ``path`` (if any) and ``overrides`` (``"a.b=v"``)."""
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    if path is not None:
        data = _read_yaml(Path(path))
        _flatten_sources(data, str(path), (), sources)
    for item in overrides:
        parts, value = parse_override(item)
        _set_path(data, parts, value, item)
        for depth in range(1, len(parts)):  # sections the override created come from it too
            sources.setdefault(tuple(parts[:depth]), f"--set {item}")
        _flatten_sources(value, f"--set {item}", tuple(parts), sources)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, sources)) from None


def config_hash(config: Config) -> str:
    """A short, stable hash of the resolved config (canonical JSON), for run identities and tags."""
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def git_sha(cwd: str | Path | None = None) -> str:
    """The checkout's commit, with ``-dirty`` for uncommitted changes; ``unknown`` outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def dump_config(config: Config) -> str:
    """The resolved config as YAML, loadable again by ``load_config``."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def write_resolved(config: Config, directory: str | Path) -> Path:
    """Writes ``config.yaml`` (the resolved config, headed by the git SHA and hash) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "config.yaml"
    header = f"# resolved config; git {git_sha(Path(__file__).parent)}; hash {config_hash(config)}\n"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(header + dump_config(config))
    tmp.replace(target)
    return target
