"""What crosses the DAG's process boundaries (Ray tasks, Tune trials, MLflow records), typed.

Ray pickles these dataclasses; MLflow stores a result as the JSON of ``as_record()``. A method name
travels from the experiment config to the worker inside ``StageSpec.config`` (``pooling.method``)
and ``StageMeta.method``, never through a string-keyed dict.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import asdict, dataclass
from typing import Any

import pydantic

from pipeline.config import Config, EvalConfig
from pipeline.pareto import relative_half_width
from pipeline.stored import Record, read_record


@dataclass(frozen=True)
class StageMeta:
    """What identifies a stage beyond its config (part of its id), and what the report shows."""

    method: str | None = None  # finetunes: the method, "none" for the baseline
    level: str | None = None  # finetunes: the sparsity level (lam1e-3, L3, full)
    lam: float | None = None  # K searches: the penalty strength
    target: str | None = None  # K searches toward a cost target: its level name (lat0.8, gf0.5)
    rounding: str | None = None  # K searches toward a cost target: the rounding's rule (``targets.ROUNDING``)
    given: str | None = None  # bases: a checkpoint from the config instead of training
    eval: EvalConfig | None = None  # evaluations: how the model is measured
    sweep: dict[str, Any] | None = None  # bases: the hyperparameter search (SweepConfig as JSON)
    kernels: dict[str, str] | None = None  # evaluations: the config's kernel choices
    carry: bool | None = None  # evaluations without finetuning: pooling.carry of the inserted method

    @property
    def finetuned(self) -> bool:
        """False for an evaluation of a base with a method inserted and no training (``experiment.no_finetune``)."""
        return self.carry is None

    def identity(self) -> dict[str, Any]:
        """The JSON-able content that enters the stage id (unset fields left out)."""
        out: dict[str, Any] = {}
        for key, value in (("method", self.method), ("level", self.level), ("lambda", self.lam),
                           ("target", self.target), ("rounding", self.rounding), ("given", self.given)):
            if value is not None:
                out[key] = value
        if self.eval is not None:  # the default runtime leaves the id as it was before the setting existed
            out["eval"] = self.eval.model_dump(exclude={"runtime"} if self.eval.runtime == "torch" else None)
        if self.sweep is not None:
            out["sweep"] = self.sweep
        if self.kernels is not None:
            out["kernels"] = self.kernels
        if self.carry is not None:
            out["carry"] = self.carry
        return out


@dataclass(frozen=True)
class StageSpec:
    """What a Ray task or Tune trial needs to run one stage."""

    id: str
    kind: str
    label: str
    meta: StageMeta
    config: Config | None = None  # training stages: the job's resolved config


def _record(result) -> dict[str, Any]:
    """What MLflow stores of a result: everything but the run it is stored on and whether it was found."""
    return {k: v for k, v in asdict(result).items() if k not in ("run_id", "skipped")}


@dataclass(frozen=True)
class TrainedResult:
    """A finished training stage (base, K search, finetune): its MLflow run and checkpoint."""

    run_id: str
    checkpoint: str
    keep: list[int] | None = None
    val_top1: float | None = None  # on the validation split (data.holdout), else on data.val
    seconds: float | None = None
    test_top1: float | None = None  # with data.holdout: data.val, measured once after the last epoch
    settings: dict[str, Any] | None = None  # a swept base: the chosen trial's settings ({"recipe.lr": ...})
    skipped: bool = False  # found done in MLflow; nothing ran

    as_record = _record


@dataclass(frozen=True)
class EvalResult:
    """A finished evaluation: top-1, cost and speed of one model, and the setting the speed was measured in."""

    run_id: str
    checkpoint: str
    top1: float
    gflops: float
    images_per_s: float
    images_per_s_spread: float
    num_images: int
    device: str = "cpu"
    dtype: str = "fp32"
    compile: str = "none"
    kernels: dict[str, str] | None = None  # what ran (``models.selfcheck.kernels_ran``)
    analysis: str | None = None
    skipped: bool = False
    # The paired speed (``bench.paired``): the model's time over its unmodified reference's, its 95% interval,
    # the blocks and why they stopped, and the load average around it.
    speed_ratio: float | None = None
    speed_ratio_low: float | None = None
    speed_ratio_high: float | None = None
    speed_blocks: int = 0
    speed_stop: str | None = None
    speed_seconds: float | None = None
    load_before: float | None = None
    load_after: float | None = None
    device_name: str | None = None  # the timed device's name (``bench.blocks.device_name``): its spread record
    clock: str | None = None  # the clock the speed was timed on (``evaluate.speed_clock``)

    as_record = _record

    @property
    def speed_half_width(self) -> float:
        """The paired speed ratio's 95% interval's half-width, relative to the ratio."""
        return relative_half_width(self.speed_ratio, self.speed_ratio_low, self.speed_ratio_high)


# Where a result read back from MLflow fails its schema: what to run again. A record is read as it was written, never
# completed with today's defaults: a field this release added would otherwise read as "not recorded" and pass the
# checks that compare it (an evaluation before ``clock`` existed passed the one-clock check).
_RERUN = {"TrainedResult": "run its stage again (`pipeline run CONFIG --force KIND`, KIND the stage's kind: base, "
                           "ksearch or finetune)",
          "EvalResult": "run the evaluations again (`pipeline run CONFIG --force evaluate`)"}
_NOT_STORED = ("run_id", "skipped")  # where the record is, and whether it was found done: not part of it


@functools.cache
def record_schema(cls: type) -> type[Record]:
    """The schema of ``cls``'s MLflow record (``as_record``): each of its fields, typed and required."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: (hints[f.name], ...) for f in dataclasses.fields(cls) if f.name not in _NOT_STORED}
    return pydantic.create_model(f"{cls.__name__}Record", __base__=Record, **fields)


def from_record(cls: type, record: Any, run_id: str, **extra: Any) -> Any:
    """A result dataclass from an MLflow record (``as_record``'s JSON) and its run; one InputError naming the run and
    each field that is missing, unknown to this release or of another type (``stored.read_record``)."""
    read = read_record(record_schema(cls), record, f"the stored result of MLflow run {run_id} ({cls.__name__})",
                       f"it was written by another release: {_RERUN[cls.__name__]}")
    return cls(run_id=run_id, **{name: getattr(read, name) for name in type(read).model_fields}, **extra)


@dataclass(frozen=True)
class Tracking:
    """Where evaluation tasks record their runs."""

    uri: str
    experiment: str
    artifact_root: str | None
    parent: str
    dag: str
