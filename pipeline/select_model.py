"""``pipeline select``: the best model of an experiment under a cost budget, read from MLflow alone.

An experiment's models are the finished evaluate runs under its newest DAG parent run (tags
``pipeline.stage = dag``, run name = ``experiment.name``): top-1, GFLOPs and measured images/s
(with the device they were measured on, and the interval of at least 90% the select stage put on one scale: a
model's 95% interval chained with its reference's), and the
finetune run that trained each model. A speed budget holds only where the measurement's doubt does: images/s
at least X by the interval's lower end, latency under X ms by its upper end. The model
URI is its Model Registry version when it is registered (``models:/token-pooling-NAME/V``), else
the finetune run's checkpoint artifact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from mlflow.tracking import MlflowClient
from pydantic import ConfigDict, Field

from pipeline.dag.records import (
    DONE,
    FINETUNED,
    LATENCY_HIGH,
    LATENCY_METRIC,
    LATENCY_TABLE_TAG,
    RATE_HIGH,
    RATE_LOW,
    SCALED_RATE,
    STAGE_KIND,
    TRAINED_RUN,
    check_identity_version,
)
from pipeline.errors import InputError, MissingFileError
from pipeline.spread import timing_setting
from pipeline.stored import Record, read_record
from pipeline.tracking import store_missing

EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # experiment.name's pattern: safe inside a quoted filter


# What the images/s interval of a candidate is: a model's 95% interval chained with its width's reference's on the
# select stage's scale (``bench.paired.chain``, Bonferroni), measured in one run's processes: another run moves it by
# the device's spread between processes (``pipeline doctor --speed``).
RATE_INTERVAL_SCOPE = "at least 90%, within this run"


@dataclass(frozen=True)
class Candidate:
    """One evaluated model of the experiment."""

    uri: str
    method: str
    level: str
    top1: float
    gflops: float
    images_per_s: float
    device: str
    latency_ms: float | None = None  # measured against a latency table (a K-search target's models)
    latency_table: str | None = None  # that table's sha256
    images_per_s_low: float | None = None  # the select stage's interval (>= 90%) of images/s, on its one scale
    images_per_s_high: float | None = None
    latency_ms_high: float | None = None  # the measured latency's interval's upper end
    threads: int = 1  # the CPU threads it was timed with (``experiment.eval.threads``)
    device_name: str | None = None  # the timed device's name (``bench.blocks.device_name``): its spread record
    timing: str | None = None  # the setting it was timed in (``spread.timing_setting``): its spread record too

    @property
    def slowest_rate(self) -> float:
        """The lower end of the images/s interval (the rate itself where there is none)."""
        return self.images_per_s if self.images_per_s_low is None else self.images_per_s_low

    @property
    def longest_latency(self) -> float | None:
        """The upper end of the measured latency's interval (the latency itself where there is none)."""
        return self.latency_ms if self.latency_ms_high is None else self.latency_ms_high

    def line(self) -> str:
        latency = "" if self.latency_ms is None else f"  {self.latency_ms:.3f} ms measured"
        if self.latency_ms is not None and self.latency_ms_high is not None:
            latency += f" (upper end {self.latency_ms_high:.3f}: the ratio's 95% interval times the measured reference)"
        interval = ("" if self.images_per_s_low is None else
                    f" [{self.images_per_s_low:.0f}, {self.images_per_s_high:.0f}] ({RATE_INTERVAL_SCOPE})")
        return (f"{self.uri}  top1 {self.top1:.2f}%  {self.gflops:.4f} GFLOPs  {self.images_per_s:.0f}{interval} img/s "
                f"({self.device}){latency}  [{self.method}, {self.level}]")


class EvalRunParams(Record):
    """What ``pipeline select`` reads of an evaluate run's params (MLflow keeps them as text). The run logs more (its
    dtype, compile mode, clock, kernels), which are kept as given."""

    model_config = ConfigDict(extra="allow")

    checkpoint: str
    method: str
    level: str
    eval_device: str
    eval_threads: Annotated[str, Field(pattern=r"^[1-9][0-9]*$")]  # a whole number of threads
    eval_device_name: str  # the timed device's name: its spread record
    eval_dtype: str  # and the setting it was timed in, which the spread record is kept under too
    eval_compile: str
    eval_batch: Annotated[str, Field(pattern=r"^[1-9][0-9]*$")]


class EvalRunMetrics(Record):
    """What ``pipeline select`` reads of an evaluate run's metrics: top-1, GFLOPs, and the select stage's images/s on
    its one scale with the interval a budget holds by; the latency against a table only a K-search target's models
    have."""

    model_config = ConfigDict(extra="allow")

    top1: float
    gflops: float
    images_per_s_scaled: float = Field(alias=SCALED_RATE)
    images_per_s_low: float = Field(alias=RATE_LOW)
    images_per_s_high: float = Field(alias=RATE_HIGH)
    latency_ms: float | None = Field(None, alias=LATENCY_METRIC)
    latency_ms_high: float | None = Field(None, alias=LATENCY_HIGH)


def _read_run(run, experiment: str) -> tuple[EvalRunParams, EvalRunMetrics]:
    """An evaluate run's params and metrics through their schemas: one InputError naming the run and each field
    missing or of another type."""
    where = f"experiment {experiment!r}: evaluation run {run.info.run_id}"
    advice = ("it was recorded by another release, or its DAG stopped before the select stage: run `pipeline run` "
              "with its config to the end (its evaluate and select stages record them), then select")
    return (read_record(EvalRunParams, dict(run.data.params), f"{where}'s params", advice),
            read_record(EvalRunMetrics, dict(run.data.metrics), f"{where}'s metrics", advice))


def open_store(tracking_uri: str) -> MlflowClient:
    """A client of an existing store; reading never creates one."""
    if store_missing(tracking_uri):
        raise MissingFileError(f"there is no MLflow store at {tracking_uri}; pass --tracking-uri, or run "
                               "`python -m pipeline run` first")
    return MlflowClient(tracking_uri=tracking_uri)


def registered_versions(client: MlflowClient, experiment: str) -> dict[str, str]:
    """{finetune run id: models:/NAME/VERSION} of the experiment's registered models (image classifiers)."""
    name = f"token-pooling-{experiment}"
    return {v.run_id: f"models:/{name}/{v.version}" for v in client.search_model_versions(f"name = '{name}'")}


def candidates(client: MlflowClient, experiment: str) -> list[Candidate]:
    """Every evaluated model of the newest DAG run named ``experiment``, in whichever MLflow experiment
    (``train.experiment``) it was recorded."""
    if not EXPERIMENT_NAME.fullmatch(experiment):
        raise InputError(f"--experiment {experiment!r}: an experiment.name holds only letters, digits, '_', '.' and "
                         "'-'; no experiment can have this name")
    ids = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(
        ids, filter_string=f"tags.`{STAGE_KIND}` = 'dag' and attributes.run_name = '{experiment}'",
        order_by=["attributes.start_time DESC"], max_results=1) if ids else []
    if not parents:
        raise InputError(f"no experiment {experiment!r} in this MLflow store; `pipeline run` records one under its "
                         "experiment.name (pass --tracking-uri for another store)")
    parent = parents[0]
    store = client.get_experiment(parent.info.experiment_id)
    check_identity_version(client, store.experiment_id, client.tracking_uri, store.name)  # as `pipeline run` does
    evaluations = client.search_runs(
        [parent.info.experiment_id], max_results=10000,
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and tags.`{STAGE_KIND}` = 'evaluate' "
                      f"and tags.`{DONE}` = '1'")
    registered = registered_versions(client, experiment)
    out = []
    for run in evaluations:
        if run.data.tags.get(FINETUNED) == "false":  # experiment.no_finetune's: a measurement, never a pick
            continue
        if SCALED_RATE not in run.data.metrics:
            raise InputError(f"experiment {experiment!r}: evaluation run {run.info.run_id} has no images/s on the "
                             f"select stage's scale ({SCALED_RATE}): the DAG's select stage has not finished; run "
                             "`pipeline run` with its config to the end, then select")
        params, metrics = _read_run(run, experiment)
        trained = run.data.tags.get(TRAINED_RUN)
        uri = registered.get(trained) or (f"runs:/{trained}/checkpoint" if trained else params.checkpoint)
        out.append(Candidate(uri, params.method, params.level, metrics.top1, metrics.gflops,
                             metrics.images_per_s_scaled, params.eval_device, metrics.latency_ms,
                             run.data.tags.get(LATENCY_TABLE_TAG), metrics.images_per_s_low,
                             metrics.images_per_s_high, metrics.latency_ms_high, int(params.eval_threads),
                             params.eval_device_name, timing_setting(params.eval_device, params.eval_dtype,
                                                                     params.eval_compile, int(params.eval_batch))))
    if not out:
        raise InputError(f"experiment {experiment!r} has no finished evaluations yet")
    return out


def best_under_latency(models: list[Candidate], max_latency_ms: float, table: str) -> Candidate:
    """The highest top-1 among the models that measured within ``max_latency_ms`` against the cost table at
    ``table`` (the same file: its sha256), as the select stage measured a K-search target's models."""
    from pipeline.cost import file_sha256

    if not Path(table).is_file():
        raise InputError(f"--table {table}: no such file; give the cost table the experiment's target used")
    measured = [m for m in models if m.latency_ms is not None and m.latency_table == file_sha256(table)]
    if not measured:
        raise InputError(f"no model of this experiment was measured against {table}; latency is measured for the "
                         "models of a K-search target with that table, on a machine that is the table's key")
    fits = [m for m in measured if m.longest_latency <= max_latency_ms]  # the interval's upper end under it
    if not fits:
        cheapest = min(measured, key=lambda m: m.latency_ms)
        raise InputError(f"no model measured within {max_latency_ms:g} ms; the fastest is {cheapest.line()}")
    return max(fits, key=lambda m: (m.top1, -m.latency_ms))


def best_under_budget(models: list[Candidate], *, max_gflops: float | None = None,
                      min_images_per_s: float | None = None, device: str | None = None,
                      max_latency_ms: float | None = None, table: str | None = None) -> Candidate:
    """The highest top-1 among the models within the budget (ties: the cheaper one).

    Raises InputError naming the cheapest model when none fits.
    """
    if (max_latency_ms is None) != (table is None):
        raise InputError("--max-latency-ms X goes with --table PATH (the cost table the latency was measured on)")
    if max_latency_ms is not None:
        if max_gflops is not None or min_images_per_s is not None:
            raise InputError("give exactly one budget: --max-gflops, --min-images-per-s or --max-latency-ms")
        return best_under_latency(models, max_latency_ms, table)
    if (max_gflops is None) == (min_images_per_s is None):
        raise InputError("give exactly one budget: --max-gflops X, --min-images-per-s Y or --max-latency-ms Z")
    if device is not None:
        measured = [m for m in models if m.device == device]
        if not measured:
            devices = sorted({m.device for m in models})
            raise InputError(f"no model of this experiment was timed on {device!r}; measured on: {', '.join(devices)}")
        models = measured
    if max_gflops is not None:
        fits = [m for m in models if m.gflops <= max_gflops]
        cheapest, budget = min(models, key=lambda m: m.gflops), f"{max_gflops:g} GFLOPs"
    else:
        fits = [m for m in models if m.slowest_rate >= min_images_per_s]  # the interval's lower end over it
        cheapest, budget = max(models, key=lambda m: m.images_per_s), f"{min_images_per_s:g} images/s"
    if not fits:
        raise InputError(f"no model fits the budget of {budget}; the cheapest is {cheapest.line()}")
    return max(fits, key=lambda m: (m.top1, -m.gflops))
