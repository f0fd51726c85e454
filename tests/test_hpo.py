"""The base stage's hyperparameter sweep (``experiment.base.sweep``): Optuna + ASHA on Ray Tune inside
`pipeline run`, its driver killed mid-sweep and the sweep restored; plus the sweep config's refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.config import ConfigError, load_config
from pipeline.dag.hpo import TRIAL_TAG
from tests.conftest import write_synthetic_pair
from tests.processes import ROOT, stop, wait_for

TINY = ROOT / "configs" / "experiments" / "tiny.yaml"
TRIALS, EPOCHS = 6, 4
# Train loss as the metric: on this separable synthetic data every trial's validation top-1 is 100%, and ASHA
# cannot rank ties; the loss still orders the learning rates. Optuna draws them (seeded); ASHA stops the worse
# ones. One trial at a time, so that ASHA sees the same order of results in every run (with two at a time, which
# trial reaches a rung first varies, and in one CI run no trial fell below the cutoff).
SWEEP = (f"{{epochs: {EPOCHS}, sweep: {{space: {{recipe.lr: {{loguniform: [1.0e-4, 1.0e-2]}}, recipe.weight_decay: "
         "{uniform: [0.0, 0.1]}}, search: optuna, scheduler: asha, grace_period: 1, reduction_factor: 2, "
         f"num_samples: {TRIALS}, max_concurrent: 1, metric: train_loss, mode: min}}}}")


def overrides(root: Path, data: Path) -> list[str]:
    """The sweep's DAG on the betons in ``data``, its runs, stores and reports in ``root``."""
    return [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}", "data.holdout=0.25",
            f"train.storage_path={root / 'ray'}", f"train.tracking_uri=sqlite:///{root / 'mlflow.db'}",
            f"train.artifact_root={root / 'artifacts'}", f"experiment.runs_dir={root / 'experiments'}",
            "train.workers=0", "train.progress_bar=false", "experiment.embed_dims=[16]", "experiment.lambdas=[0.05]",
            "experiment.methods=[powerbert]", "experiment.baseline=false", f"experiment.base={SWEEP}",
            "experiment.eval.analysis_images=0", "experiment.eval.analysis_batch=0",
            # Each trial pauses 2 s at its first step: trials in a reused actor take ~0.3 s, too short a
            # window for the test to see one trial finished and others not started before it kills the driver.
            "train.debug_pause_at_step=1", "train.debug_pause_s=2"]


def trial_runs(client: MlflowClient) -> list:
    exp = client.get_experiment_by_name("token-pooling")
    if exp is None:
        return []
    return [r for r in client.search_runs([exp.experiment_id], max_results=1000) if TRIAL_TAG in r.data.tags]


def epochs_of(client: MlflowClient, run_id: str, key: str = "train_loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.ray
@pytest.mark.beton
def test_optuna_asha_sweep_stops_trials_early_and_a_killed_driver_does_not_rerun_finished_ones(tmp_path):
    # Its own betons, not the shared synthetic_data: data.holdout writes the drawn split beside the training beton.
    root = data = write_synthetic_pair(tmp_path, 192, 48)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    client.search_experiments()  # the schema first: the driver and this test must not race on creating it
    command = [sys.executable, "-m", "pipeline", "run", str(TINY)]
    command += [part for item in overrides(root, data) for part in ("--set", item)]
    log = open(root / "first.log", "w")
    driver = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def a_trial_done_and_some_not_started():
            assert driver.poll() is None, (root / "first.log").read_text()[-3000:]
            runs = trial_runs(client)
            return any(r.info.status == "FINISHED" for r in runs) and len(runs) < TRIALS

        wait_for(a_trial_done_and_some_not_started, "a finished trial while others wait", 600, every=0.5)
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its local Ray, mid-sweep
        driver.wait()
    finally:
        stop(driver)
        log.close()
    finished = {r.data.tags[TRIAL_TAG]: (r.info.run_id, epochs_of(client, r.info.run_id))
                for r in trial_runs(client) if r.info.status == "FINISHED"}
    assert 1 <= len(finished) < TRIALS

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-3000:]
    assert "[sweep] tiny-base-M16: restoring" in again.stdout

    live = [r for r in trial_runs(client) if r.info.status != "FAILED"]  # FAILED: retired, killed before a checkpoint
    names = [r.data.tags[TRIAL_TAG] for r in live]
    assert len(names) == len(set(names)) == TRIALS  # every trial once
    for run in live:
        name = run.data.tags[TRIAL_TAG]
        if name in finished:  # finished before the kill: the same run, not trained again
            assert (run.info.run_id, epochs_of(client, run.info.run_id)) == finished[name]
        steps = epochs_of(client, run.info.run_id)
        assert steps == list(range(1, len(steps) + 1))  # each epoch once
    stopped = [r for r in live if r.data.tags.get("pipeline.stopped_early") == "1"]
    assert stopped and all(r.info.status == "KILLED" and len(epochs_of(client, r.info.run_id)) < EPOCHS
                           for r in stopped)

    (chosen,) = [r for r in live if r.data.tags.get("pipeline.done") == "1"]
    assert epochs_of(client, chosen.info.run_id) == list(range(1, EPOCHS + 1))
    assert [m.step for m in client.get_metric_history(chosen.info.run_id, "test_top1")] == [EPOCHS]  # once
    record = json.loads(chosen.data.tags["pipeline.result"])
    assert record["test_top1"] is not None and record["val_top1"] is not None
    final_loss = {r.info.run_id: client.get_metric_history(r.info.run_id, "train_loss") for r in live}
    complete = {run: max(h, key=lambda m: m.step).value for run, h in final_loss.items() if len(h) == EPOCHS}
    assert chosen.info.run_id == min(complete, key=complete.get)  # the lowest final loss among complete trials
    # the K search and the finetune train at the chosen trial's recipe, not the YAML's
    swept, params = ("recipe.lr", "recipe.weight_decay"), chosen.data.params
    assert record["settings"] == {key: pytest.approx(float(params[key])) for key in swept}
    exp_id = client.get_experiment_by_name("token-pooling").experiment_id
    downstream = [r for r in client.search_runs([exp_id]) if r.data.tags.get("mode") in ("ksearch", "finetune")]
    assert {r.data.tags["mode"] for r in downstream} == {"ksearch", "finetune"}
    for run in downstream:
        for key in ("recipe.lr", "recipe.weight_decay"):
            assert run.data.params[key] == chosen.data.params[key], (run.data.tags["mode"], key)
    assert "the K search and finetunes use the chosen settings" in again.stdout
    table = (root / "experiments" / "tiny" / "sweep-tiny-base-M16.csv").read_text().splitlines()
    assert len(table) == TRIALS + 1 and "stopped_early" in table[0]
    assert "ASHA saved about" in again.stdout
    report = (root / "experiments" / "tiny" / "report.md").read_text()
    base_rows = report.split("## Base models", 1)[1]
    assert f"| M16 | {record['val_top1']:.2f} | {record['test_top1']:.2f} | {chosen.info.run_id} |" in base_rows


@pytest.mark.parametrize(("sweep", "says"), [
    ("{space: {recipe.bogus: {choice: [1]}}}", "recipe has no field 'bogus'"),
    ("{space: {train.lr: {choice: [1]}}}", "SECTION one of recipe, model, pooling, data"),
    ("{space: {recipe.lr: {uniform: [1.0, 0.1]}}}", "low < high"),
    ("{space: {recipe.lr: {loguniform: [0.0, 0.1]}}}", "the low end must be positive"),
    ("{space: {recipe.lr: {uniform: [0.1, 1.0], choice: [1]}}}", "exactly one of"),
    ("{space: {recipe.epochs: {choice: [1, 2]}}}", "the epochs are the ASHA budget"),
    ("{space: {recipe.lr: {uniform: [0.1, 1.0]}}, search: grid}", "search grid takes choice lists only"),
    ("{space: {recipe.lr: {choice: [-1.0]}}}", "the value -1.0 is not valid there"),
    ("{space: {}}", "sweep.space is empty"),
])
def test_bad_sweeps_are_refused_when_the_config_loads(sweep, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        load_config(TINY, [f"experiment.base.sweep={sweep}"])


def test_sweeps_are_for_the_base_stage_with_single_process_trials():
    good = "{space: {recipe.lr: {choice: [0.001]}}}"
    with pytest.raises(ConfigError, match="experiment.finetune.sweep: hyperparameter sweeps run on the base stage"):
        load_config(TINY, [f"experiment.finetune.sweep={good}"])
    with pytest.raises(ConfigError, match="set experiment.search.trial_workers: 0"):
        load_config(TINY, [f"experiment.base.sweep={good}", "experiment.search.trial_workers=2"])


def test_trials_hold_the_search_resources():
    from pipeline.dag.hpo import trial_resources
    from pipeline.dag.plan import archs, base_stage
    from pipeline.dag.stages import stage_spec

    def resources(*extra: str) -> dict[str, float]:
        config = load_config(ROOT / "configs" / "experiments" / "fmnist_hpo.yaml", list(extra))
        return trial_resources(stage_spec(base_stage(config, archs(config)[0]), init=None, parent_id="p", dag="d"))

    assert resources() == {"CPU": 1.0, "GPU": 0.0}
    assert resources("experiment.search.trial_cpus=4", "experiment.search.trial_gpus=1") == {"CPU": 4.0, "GPU": 1.0}


@pytest.mark.parametrize("trials,concurrency,wall,train,per_trial", [
    (1, 2, 211.0, 208.0, 3.0),      # one trial, two slots: the idle slot is not overhead
    (4, 2, 100.0, 180.0, 5.0),      # 200 slot-seconds, 180 of them in the trials
    (3, 2, 10.0, 30.0, 0.0),        # never negative
])
def test_sweep_overhead_counts_only_the_slots_the_trials_can_fill(trials, concurrency, wall, train, per_trial):
    from pipeline.dag.sweep import SweepTiming

    assert SweepTiming(trials, wall, train, concurrency).overhead_per_trial_s == pytest.approx(per_trial)


def test_the_chosen_settings_change_only_the_swept_keys():
    """The chosen trial's settings (typed, as a swept base records them) make the config its K search and finetunes
    plan from: the swept keys change, nothing else."""
    from pipeline.dag.hpo import chosen_config

    config = load_config(ROOT / "configs" / "experiments" / "fmnist_hpo.yaml")
    settings = {"recipe.lr": 0.00128, "recipe.weight_decay": 5e-05, "recipe.warmup_epochs": 0.5,
                "recipe.label_smoothing": 0.1, "model.drop_path": 0.05}
    chosen = chosen_config(config, settings)
    assert (chosen.recipe.lr, chosen.recipe.warmup_epochs, chosen.model.drop_path) == (0.00128, 0.5, 0.05)
    assert chosen.recipe.epochs == config.recipe.epochs  # only the swept keys change
