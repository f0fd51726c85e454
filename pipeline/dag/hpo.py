"""The base stage's hyperparameter sweep (``experiment.base.sweep``) on Ray Tune.

Each trial trains the base with its sampled settings in one process and reports every epoch to
Tune, so that ASHA can stop the worse trials at its rungs. A trial's run name comes from its
settings: a trial that runs again (the driver was killed, the sweep restored) resumes from its own
checkpoints and MLflow run instead of training again. The Tune experiment has a stable name, so a
rerun restores it (``Tuner.restore``) and runs only the trials that had not finished.

The best trial on the validation split (``metric``; use ``data.holdout``) among those that ran all
their epochs becomes the base; its test top-1 was measured once, after its last epoch. Its settings
are recorded with it, and the stages downstream of the base train with them (``chosen_config``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import signals
from pipeline.config import Config, SweepConfig, with_setting
from pipeline.console import worker_failure
from pipeline.dag.records import mark_done
from pipeline.dag.types import StageSpec, TrainedResult
from pipeline.errors import JobError
from pipeline.tracking import log_batch
from pipeline.train import run_training

TRIAL_TAG = "pipeline.trial"


@dataclass(frozen=True)
class TrialRecord:
    """One trial as the sweep left it (what the trials table shows)."""

    name: str
    settings: dict[str, Any]
    epochs: int  # epochs it ran
    val: float | None  # its last reported metric
    seconds: float
    stopped_early: bool
    run_id: str | None


def trial_name(stage_name: str, settings: dict[str, Any]) -> str:
    """The run name of the trial with these settings (the same settings: the same trial, resumed)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{stage_name}-t{digest}"


def search_space(sweep: SweepConfig) -> dict[str, Any]:
    from ray import tune

    def domain(param):
        low_high = getattr(param, param.kind)
        if param.kind == "choice":
            return tune.grid_search(low_high) if sweep.search == "grid" else tune.choice(low_high)
        return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[param.kind](*low_high)

    return {key: domain(param) for key, param in sweep.space.items()}


def _trial(settings: dict[str, Any], spec: StageSpec) -> None:
    """The Tune trainable: the base trained with ``settings``, each epoch reported to Tune."""
    from ray import tune

    config = chosen_config(spec.config, settings)
    name = trial_name(config.train.name, settings)
    train = config.train.model_copy(update={"name": name, "tags": {**config.train.tags, TRIAL_TAG: name}})

    def report(metrics: dict[str, float]) -> None:
        # The last epoch is reported after the run is closed: ASHA stops a trial that reaches max_t at once.
        if metrics["epoch"] < config.recipe.epochs:
            tune.report(metrics)

    result = run_training(config.model_copy(update={"train": train}), on_epoch=report)
    # Also when it had finished in an earlier attempt (a killed driver): Tune gets its final metrics.
    tune.report({k: v for k, v in result.summary.items() if isinstance(v, int | float)})


def chosen_config(config: Config, settings: dict[str, Any] | None) -> Config:
    """``config`` with a sweep's chosen settings applied (``recipe.lr``, ``model.drop_path``, ...): what the
    K search and the finetunes of that base start from. Each stage's own recipe (``experiment.ksearch``,
    ``experiment.finetune``) still overrides the fields it sets."""
    for key, value in (settings or {}).items():
        config = with_setting(config, key, value)
    return config


def trial_resources(spec: StageSpec) -> dict[str, float]:
    """What one trial holds: ``experiment.search.trial_cpus``, and a GPU when ``trial_gpus`` > 0."""
    train = spec.config.train
    return {"CPU": train.cpus_per_worker, "GPU": 1.0 if train.use_gpu else 0.0}


def make_tuner(spec: StageSpec, sweep: SweepConfig, path: Path, slots: int):
    """A new Tune experiment at ``path``, or the one a killed driver left there (restored)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    trainable = tune.with_resources(tune.with_parameters(_trial, spec=spec), trial_resources(spec))
    if tune.Tuner.can_restore(str(path)):
        return tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True), True
    epochs = spec.config.recipe.epochs
    scheduler = FIFOScheduler() if sweep.scheduler == "none" else ASHAScheduler(
        time_attr="epoch", max_t=epochs, grace_period=min(sweep.grace_period, epochs),
        reduction_factor=sweep.reduction_factor)
    search = None
    if sweep.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(seed=spec.config.seed)
    # Reused actors: a new trial starts in a finished trial's process, where torch, timm and MLflow are
    # imported and the FFCV loader is compiled (``shared_loader``); a fresh actor paid ~15 s for them here.
    config = tune.TuneConfig(metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples,
                             max_concurrent_trials=slots, search_alg=search, scheduler=scheduler, reuse_actors=True)
    run = tune.RunConfig(name=path.name, storage_path=str(path.parent), verbose=1)
    return tune.Tuner(trainable, param_space=search_space(sweep), tune_config=config, run_config=run), False


def trial_records(results, spec: StageSpec, sweep: SweepConfig, client, exp_id: str) -> list[TrialRecord]:
    """The finished sweep's trials with their MLflow runs; a run ASHA stopped is closed as KILLED and tagged."""
    epochs = spec.config.recipe.epochs
    out = []
    for result in results:
        settings, metrics = dict(result.config), result.metrics or {}
        reached = int(metrics.get("epoch", 0))
        name = trial_name(spec.config.train.name, settings)  # from Tune's values, as the trial named itself
        settings = json.loads(json.dumps(settings, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
        runs = client.search_runs([exp_id], filter_string=f"tags.`{TRIAL_TAG}` = '{name}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        run_id = runs[0].info.run_id if runs else None
        stopped = reached < epochs
        if stopped and runs and runs[0].info.status == "RUNNING":
            log_batch(client, run_id, tags={"pipeline.stopped_early": "1", "pipeline.epochs_reached": str(reached)})
            client.set_terminated(run_id, "KILLED")
        out.append(TrialRecord(name, settings, reached, metrics.get(sweep.metric),
                               float(metrics.get("time_total_s", 0.0)), stopped, run_id))
    return out


def asha_saving_s(records: list[TrialRecord], epochs: int) -> float:
    """Seconds the stopped trials would have trained on, at each one's own measured seconds per epoch."""
    return sum((epochs - r.epochs) * r.seconds / r.epochs for r in records if r.stopped_early and r.epochs)


def write_table(records: list[TrialRecord], best: TrialRecord, path: Path) -> Path:
    keys = sorted({k for r in records for k in r.settings})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trial", *keys, "epochs", "val", "seconds", "stopped_early", "chosen", "mlflow_run"])
        for r in sorted(records, key=lambda r: r.name):
            writer.writerow([r.name, *(r.settings.get(k) for k in keys), r.epochs,
                             "" if r.val is None else f"{r.val:.2f}", f"{r.seconds:.1f}", int(r.stopped_early),
                             int(r is best), r.run_id or ""])
    return path


def choose(records: list[TrialRecord], sweep: SweepConfig) -> TrialRecord:
    """The best trial on the validation metric among those that ran every epoch."""
    complete = [r for r in records if not r.stopped_early and r.val is not None and r.run_id is not None]
    if not complete:
        raise JobError("no trial of the sweep ran all its epochs; raise sweep.num_samples or the grace period")
    sign = 1 if sweep.mode == "max" else -1
    return max(complete, key=lambda r: sign * r.val)


def run_base_sweep(spec: StageSpec, sweep: SweepConfig, *, client, exp_id: str, slots: int, out_dir: Path,
                   parent: str, log) -> TrainedResult:
    """Runs (or restores) the sweep, records the chosen trial as the base stage, and returns it."""
    from pipeline.train.session import latest_local_checkpoint, local_checkpoints

    config = spec.config
    path = Path(config.train.storage_path) / f"{config.train.name}-sweep"
    tuner, restored = make_tuner(spec, sweep, path, slots)
    log(f"[sweep] {spec.label}: {'restoring' if restored else 'starting'} {sweep.num_samples} trial(s) "
        f"({sweep.search}, scheduler {sweep.scheduler}), up to {slots} at a time")
    started = time.perf_counter()
    results = signals.fit(tuner)  # Ray's fit leaves its SIGINT handler; this does not
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise JobError(worker_failure(f"the first of {len(errors)} failed trial(s) of the {spec.label} sweep",
                                      errors[0], "the trial's error.txt under " + str(path)))
    records = trial_records(results, spec, sweep, client, exp_id)
    best = choose(records, sweep)
    epochs = config.recipe.epochs
    table = write_table(records, best, out_dir / f"sweep-{spec.label}.csv")
    client.log_artifact(parent, str(table), artifact_path="sweep")
    saving = asha_saving_s(records, epochs)
    ran = sum(r.seconds for r in records)
    stopped = sum(r.stopped_early for r in records)
    log(f"[sweep] {spec.label}: {len(records)} trials in {time.perf_counter() - started:.0f} s, {stopped} stopped "
        f"early; ASHA saved about {saving:.0f} s of {ran + saving:.0f} s of trial time; table {table}")
    chosen = config.model_copy(update={"train": config.train.model_copy(update={"name": best.name})})
    checkpoint = latest_local_checkpoint(local_checkpoints(chosen))
    summary = json.loads((checkpoint / "summary.json").read_text())
    result = TrainedResult(run_id=best.run_id, checkpoint=str(checkpoint), keep=None,
                           val_top1=summary.get("val_top1"), seconds=round(ran, 1), test_top1=summary.get("test_top1"),
                           settings=best.settings)
    mark_done(client, best.run_id, stage_id=spec.id, kind=spec.kind, result=result.as_record())
    test = "" if result.test_top1 is None else f", test top-1 {result.test_top1:.2f}% (measured once)"
    log(f"[sweep] {spec.label}: chose {best.name} {best.settings}: {sweep.metric} {best.val:.2f}{test}")
    return result
