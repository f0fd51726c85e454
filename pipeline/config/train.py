"""``train:``, one training job: what it does, where it runs, where results go."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import MethodName, Section
from pipeline.console import redact
from pipeline.errors import InputError
from pipeline.kernel_choices import CompileMode

AUTO_TABLE = "auto"  # a latency target's table: this machine's, measured by `pipeline run` before the K search


class CostTarget(Section):
    """A K-search target: the cost of the searched keep list, in measured latency (a cost table of
    ``pipeline bench blocks``) or in GFLOPs (counted for ``method``), as a fraction of the unmodified
    model's cost or as an absolute figure (ms or GFLOPs). ``pipeline.targets`` holds the search."""

    cost: Literal["latency", "gflops"] = Field(description="latency: a cost table's ms; gflops: the count")
    fraction: float | None = Field(None, gt=0, le=1, description="of the unmodified model's cost, in (0, 1]")
    value: float | None = Field(None, gt=0, description="or an absolute figure: ms (latency) or GFLOPs")
    table: str | None = Field(None, description="latency: the cost table (JSON of `pipeline bench blocks`); "
                              "{arch} in it stands for the width's label (M32) or the model's name, {embed_dim} "
                              "for the width; auto: this machine's table of the target's one method in the evaluate "
                              "stage's setting, measured by `pipeline run` before the K search and kept under "
                              "experiment.runs_dir by its key")
    table_sha256: str | None = Field(None, description="the table's content hash (the DAG sets it; a table that "
                                     "changed afterwards is refused)")
    method: MethodName = Field("powerbert", description="gflops: the method whose pooling step is counted")
    methods: list[MethodName] | None = Field(None, min_length=1, description="experiment: the methods finetuned at "
                                             "this target's level; default experiment.methods")
    archs: list[str] | None = Field(None, min_length=1, description="experiment: the widths (M32) or models searched "
                                    "toward it; default all")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="the level's name in stage ids, "
                             "reports and aliases; default from the figure (lat0.8, gf1.2g); two targets at one "
                             "figure with each method's own table need one each")
    dual_rate: float = Field(1.0, gt=0, description="step of the penalty's self-adjusting strength per step")
    quadratic: float = Field(1.0e4, ge=0, description="weight of (cost ratio - target)^2")

    @model_validator(mode="after")
    def _one_figure(self) -> CostTarget:
        if (self.fraction is None) == (self.value is None):
            raise InputError("a K-search target takes fraction (of the unmodified model) or value (ms or GFLOPs), "
                             "exactly one")
        if (self.cost == "latency") != (self.table is not None):
            raise InputError("a latency target needs table: PATH (a cost table of `pipeline bench blocks`); a "
                             "gflops target takes none")
        return self

    @property
    def label(self) -> str:
        """``name``, else ``lat0.8``, ``lat12ms``, ``gf0.5``, ``gf1.2g``: the sparsity level it gives."""
        if self.name is not None:
            return self.name
        head = "lat" if self.cost == "latency" else "gf"
        if self.fraction is not None:
            return f"{head}{self.fraction:g}"
        return f"{head}{self.value:g}{'ms' if self.cost == 'latency' else 'g'}"


class TrainConfig(Section):
    """One training job on Ray Train: what it does, where it runs and where results go."""

    mode: Literal["base", "ksearch", "finetune", "baseline"] = "base"
    init: str | None = Field(None, description="base checkpoint to start from (ksearch, finetune, baseline)")
    ksearch_lambda: float = Field(1e-4, ge=0, description="strength of the soft-extract mass penalty")
    ksearch_target: CostTarget | None = Field(None, description="K search toward a cost target instead of "
                                              "the fixed-strength mass penalty (ksearch_lambda)")
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
    def _no_credentials_in_the_uri(self) -> TrainConfig:
        if redact(self.tracking_uri) != self.tracking_uri:
            raise ValueError(f"train.tracking_uri {redact(self.tracking_uri)} holds a user and password; give it "
                             "without them and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
        return self

    @model_validator(mode="after")
    def _compile_fits_the_device(self) -> TrainConfig:
        if self.compile == "reduce-overhead" and not self.use_gpu:
            raise ValueError("train.compile 'reduce-overhead' captures CUDA graphs: it needs train.use_gpu: true")
        return self
