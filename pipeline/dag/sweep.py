"""Ray Tune sweeps of training stages (K search over lambda, finetunes over method x level x width)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline import signals
from pipeline.config import ExperimentConfig
from pipeline.console import worker_failure
from pipeline.dag.types import StageSpec
from pipeline.errors import JobError


@dataclass(frozen=True)
class SweepTiming:
    trials: int
    wall_s: float
    train_s: float
    concurrency: int
    failed: dict[str, str] = field(default_factory=dict)  # keep-going: stage label -> its trial's error

    @property
    def overhead_per_trial_s(self) -> float:
        """Slot-seconds not spent inside the trials' own work, per trial (Ray/Tune scheduling and start-up).

        Only the slots the trials can fill count: one trial with two slots leaves one idle, which is not
        overhead (it was counted as such, and a single 211 s trial showed 214 s of overhead)."""
        slots = min(self.concurrency, max(self.trials, 1))
        return max(self.wall_s * slots - self.train_s, 0.0) / max(self.trials, 1)


def _trial(params: dict[str, Any]) -> None:
    """The Tune function trainable: one training stage (skipped if MLflow records it done)."""
    from ray import tune

    from pipeline.dag.stages import run_training_spec

    result = run_training_spec(params["spec"])
    tune.report({"val_top1": float(result.val_top1 or 0.0), "skipped": int(result.skipped),
                 "stage_seconds": 0.0 if result.skipped else float(result.seconds or 0.0)})


def progress_callback(name: str, total: int, log: Callable[[str], None]):
    """A Tune callback that logs one line per finished or failed trial of the sweep ``name``.

    The sweeps run Tune silent (``verbose=0``): each trial logs its own ``[run]``, epoch and ``[done]``
    lines, and Tune's default output added a configuration table and a result table per trial (about
    650 of the demo's 1,040 lines) that said less. What they did say, how far the sweep is and where
    a failed trial's error is, is this callback's.
    """
    from ray import tune

    class Progress(tune.Callback):
        def __init__(self) -> None:
            self.finished = 0

        def on_trial_complete(self, iteration, trials, trial, **info) -> None:
            self.finished += 1
            log(f"[sweep] {name}: {self.finished} of {total} trial(s) finished")

        def on_trial_error(self, iteration, trials, trial, **info) -> None:
            log(f"[sweep] {name}: trial {trial.trial_id} failed (error file: {trial.error_file})")

    return Progress()


def concurrency(exp: ExperimentConfig) -> int:
    """Trials that fit at once: the config's bound, else the cluster's CPUs over a trial's CPUs."""
    import ray

    search = exp.search
    per_trial = search.trial_cpus * max(search.trial_workers, 1)
    fit = max(int(ray.cluster_resources().get("CPU", 1) // per_trial), 1)
    return min(fit, search.max_concurrent) if search.max_concurrent else fit


TRIAL_DRIVER_CPU = 0.01  # what a trial that only drives a TorchTrainer reserves


def run_sweep(specs: list[StageSpec], exp: ExperimentConfig, *, storage: str, name: str,
              log: Callable[[str], None], keep_going: bool = False) -> SweepTiming:
    """Runs ``specs`` as Tune trials; results are read back from MLflow, not from Tune. A failed trial
    raises JobError, or with ``keep_going`` is returned in ``SweepTiming.failed`` by its stage's label."""
    from ray import tune

    if not specs:
        return SweepTiming(0, 0.0, 0.0, 1)
    search = exp.search
    slots = concurrency(exp)
    if search.algorithm == "grid":
        space, samples = {"spec": tune.grid_search(specs)}, 1
    else:
        space, samples = {"spec": tune.choice(specs)}, search.num_samples
    total = len(specs) if samples == 1 else samples
    # A trial with its own TorchTrainer holds almost no CPU itself; the trainer's workers reserve them. Not 0:
    # Ray 2.60 refuses a trial whose only bundle is empty ("Cannot initialize a ResourceRequest with an empty
    # head and zero worker bundles").
    resources = ({"CPU": search.trial_cpus, "GPU": search.trial_gpus} if search.trial_workers == 0
                 else {"CPU": TRIAL_DRIVER_CPU})
    tuner = tune.Tuner(
        tune.with_resources(_trial, resources),
        param_space=space,
        tune_config=tune.TuneConfig(num_samples=samples, max_concurrent_trials=slots, reuse_actors=True),
        run_config=tune.RunConfig(name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}", storage_path=storage, verbose=0,
                                  callbacks=[progress_callback(name, total, log)]),
    )
    log(f"[sweep] {name}: {total} trial(s), up to {slots} at a time")
    started = time.perf_counter()
    results = signals.fit(tuner)  # Ray's fit leaves its SIGINT handler; this does not
    wall = time.perf_counter() - started
    errors = [r.error for r in results if r.error is not None]
    if errors and not keep_going:
        raise JobError(worker_failure(f"the first of {len(errors)} failed trial(s) of {name}", errors[0],
                                      "the error file the [sweep] line names"))
    failed = {r.config["spec"].label: one_line(r.error) for r in results if r.error is not None}
    train_s = sum(float(r.metrics.get("stage_seconds", 0.0)) for r in results if r.metrics)
    timing = SweepTiming(len(results), wall, train_s, slots, failed)
    log(f"[sweep] {name}: {timing.trials} trials in {wall:.0f} s; Ray/Tune overhead about "
        f"{timing.overhead_per_trial_s:.1f} s per trial")
    return timing


def one_line(error: BaseException) -> str:
    """A failed stage's error in one line, ``Type: message``: the innermost cause, and of an error that Ray or
    Tune wrapped, the last line of its text (the original error's)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    head, _, message = last.partition(": ")
    if message and head.replace(".", "").replace("_", "").isalnum() and head[-1:].isalnum():
        return f"{head.rsplit('.', 1)[-1]}: {message}"  # "pipeline.errors.JobError: ..." as Ray prints it
    return f"{type(error).__name__}: {last}"
