"""A real two-node Ray cluster on loopback (a head and a second node, one CPU each, separate raylets):
DDP ranks on different nodes, a node killed mid-epoch, a Tune sweep spread over both nodes, and the
DAG driver killed while trials run. Every process is started here and ended by pid."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.processes import ROOT, RayCluster, get_json, ray_env, stop, wait_for

# Every test here starts Ray and writes its data as betons: `make test` only.
pytestmark = [pytest.mark.ray, pytest.mark.beton]

TINY = ROOT / "configs" / "train" / "tiny_synthetic.yaml"
EPOCHS = 3
STEPS_PER_EPOCH = 8  # 256 images / (batch 16 x 2 ranks)


@pytest.fixture(scope="module")
def cluster():
    nodes = RayCluster(ray_env())
    try:
        nodes.start_head(cpus=1)
        nodes.add_worker(cpus=1)
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def data(synthetic_data) -> Path:
    return synthetic_data(256, 64)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("twonode-runs")


def tracking_uri(out: Path) -> str:
    return f"sqlite:///{out / 'mlflow.db'}"


def train_command(cluster: RayCluster, data: Path, out: Path, name: str, *extra: str) -> list[str]:
    settings = [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
                f"train.storage_path={out / 'ray'}", f"train.tracking_uri={tracking_uri(out)}",
                f"train.artifact_root={out / 'artifacts'}", f"train.name={name}", "train.workers=2",
                "train.placement=STRICT_SPREAD", f"recipe.epochs={EPOCHS}", "train.progress_bar=false",
                # deterministic data, so that an interrupted run can be compared with an uninterrupted one
                "data.flip=false", "data.crop_scale=[1.0, 1.0]", *extra]
    return [sys.executable, "-m", "pipeline", "train", str(TINY), "--address", cluster.address,
            *[part for item in settings for part in ("--set", item)]]


def the_run(out: Path, name: str):
    client = MlflowClient(tracking_uri=tracking_uri(out))
    exp = client.get_experiment_by_name("token-pooling")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    assert len(runs) == 1, f"{name}: {len(runs)} MLflow runs, expected one"
    return client, runs[0]


def epochs_logged(client: MlflowClient, run_id: str, key: str = "val_top1") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def final_weights(client: MlflowClient, run_id: str, where: Path) -> dict[str, torch.Tensor]:
    path = client.download_artifacts(run_id, "checkpoint/model.pt", str(where))
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(cluster, data, out):
    proc = subprocess.run(train_command(cluster, data, out, "spread"), cwd=ROOT, env=cluster.env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out / "spread.out").write_text(proc.stdout + proc.stderr)
    return the_run(out, "spread")


def test_ddp_puts_one_rank_on_each_node_and_keeps_them_identical(uninterrupted, cluster):
    client, run = uninterrupted
    ranks = run.data.tags["ray.node_ids"].split(",")
    assert len(ranks) == 2 and len(set(ranks)) == 2  # two ranks, two nodes
    assert set(ranks) == {n["node_id"] for n in cluster.alive_nodes()}
    divergence = client.get_metric_history(run.info.run_id, "replica_divergence")
    assert [m.value for m in divergence] == [0.0] * EPOCHS  # the ranks' parameters are bit-identical each epoch
    assert epochs_logged(client, run.info.run_id) == list(range(1, EPOCHS + 1))


def test_rank_zero_progress_reaches_the_driver_once(uninterrupted, out):
    """Ray Train 2.60 patches a worker's print to log the line and print it too: each line came twice."""
    lines = re.findall(r"epoch \d+/\d+ loss .*", (out / "spread.out").read_text())
    assert lines and len(lines) == len(set(lines)) <= EPOCHS, lines  # Ray may forward the last ones too late


PAUSE = STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2  # rank 0 waits in the middle of epoch 2


def train_through_a_fault(cluster, data, out, tmp_path, name: str, inject) -> tuple[str, float]:
    """Trains ``name`` with rank 0 paused mid-epoch 2, calls ``inject()`` there, waits for the job to end.
    Returns its output and the seconds from the fault to the job's end (1.5 epochs of training included)."""
    command = train_command(cluster, data, out, name, "train.max_failures=2", f"train.debug_pause_at_step={PAUSE}",
                            "train.debug_pause_s=300")
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(command, cwd=ROOT, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_for((out / "ray" / name / f".debug_paused_at_{PAUSE}").exists, "rank 0 pausing in epoch 2", 300)
        started = time.monotonic()
        inject()
        proc.wait(timeout=600)
        seconds = time.monotonic() - started
    finally:
        stop(proc)
        log.close()
    text = (tmp_path / f"{name}.log").read_text()
    assert proc.returncode == 0, text[-5000:]
    assert "epochs 2..3" in text  # the restarted workers resumed from epoch 1's checkpoint, not from scratch
    return text, seconds


def assert_same_as_uninterrupted(uninterrupted, out: Path, name: str, tmp_path: Path):
    """One MLflow run holding each epoch once, and final weights equal to the uninterrupted run's."""
    client, run = the_run(out, name)
    assert epochs_logged(client, run.info.run_id) == list(range(1, EPOCHS + 1))  # each epoch exactly once
    assert epochs_logged(client, run.info.run_id, "train_loss") == list(range(1, EPOCHS + 1))
    reference, reference_run = uninterrupted
    a = final_weights(reference, reference_run.info.run_id, tmp_path / "a")
    b = final_weights(client, run.info.run_id, tmp_path / "b")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    return run


def train_worker_pid(cluster: RayCluster, node_id: str) -> int:
    actors = get_json(f"{cluster.dashboard}/api/v0/actors?limit=1000&detail=1")["data"]["result"]["result"]
    (pid,) = [a["pid"] for a in actors if a["class_name"] == "RayTrainWorker" and a["state"] == "ALIVE"
              and a["node_id"] == node_id]
    return pid


def test_a_worker_killed_mid_epoch_resumes_to_the_uninterrupted_weights(uninterrupted, cluster, data, out, tmp_path):
    second = next(n["node_id"] for n in cluster.alive_nodes() if not n["is_head_node"])
    killed = []

    def kill_rank_on_the_second_node():
        killed.append(train_worker_pid(cluster, second))
        os.kill(killed[0], signal.SIGKILL)  # one training process, by pid; its node stays up

    _, seconds = train_through_a_fault(cluster, data, out, tmp_path, "workerkill", kill_rank_on_the_second_node)
    run = assert_same_as_uninterrupted(uninterrupted, out, "workerkill", tmp_path)
    assert second in run.data.tags["ray.node_ids"].split(",")
    print(f"worker {killed[0]} killed mid-epoch 2: job finished {seconds:.0f} s later")


def test_a_node_killed_mid_epoch_resumes_to_the_uninterrupted_weights(uninterrupted, cluster, data, out, tmp_path):
    replacement = []

    def kill_the_second_node_and_start_another():
        old = cluster.workers[-1]
        cluster.kill_worker()  # the second node's raylet, its rank and every other process of it, by process group
        assert old.poll() is not None
        replacement.append(cluster.add_worker(cpus=1))

    _, seconds = train_through_a_fault(cluster, data, out, tmp_path, "nodekill", kill_the_second_node_and_start_another)
    run = assert_same_as_uninterrupted(uninterrupted, out, "nodekill", tmp_path)
    assert replacement[0] in run.data.tags["ray.node_ids"].split(",")  # the last attempt ran on the new node
    print(f"node killed mid-epoch 2: job finished {seconds:.0f} s after the kill")


# ---------------------------------------------------------------- the DAG: a sweep over both nodes, driver killed

FINETUNE_EPOCHS = 3
METHODS = ["powerbert", "random"]
# Each training stage's rank 0 pauses once in its epoch 2 (16 steps an epoch), so that the two finetune trials
# are seen running at once, each past its first checkpoint; the base (one epoch) never gets there.
DAG_PAUSE = ["train.debug_pause_at_step=20", "train.debug_pause_s=20"]


def dag_command(cluster: RayCluster, data: Path, out: Path) -> list[str]:
    settings = [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
                f"train.storage_path={out / 'dag-ray'}", f"train.tracking_uri={tracking_uri(out)}",
                f"train.artifact_root={out / 'artifacts'}", "train.workers=0", "train.progress_bar=false",
                f"experiment.runs_dir={out / 'experiments'}", "experiment.embed_dims=[16]",
                "experiment.lambdas=[0.05]", f"experiment.methods=[{', '.join(METHODS)}]", "experiment.baseline=false",
                f"experiment.finetune.epochs={FINETUNE_EPOCHS}", "experiment.search.trial_cpus=1",
                "experiment.search.max_concurrent=2",  # tiny.yaml's is 1: two trials at once, one on each node
                "experiment.eval.cpus=1", *DAG_PAUSE]
    return [sys.executable, "-m", "pipeline", "run", str(ROOT / "configs" / "experiments" / "tiny.yaml"),
            "--address", cluster.address, *[part for item in settings for part in ("--set", item)]]


def finetune_runs(client: MlflowClient) -> list:
    exp = client.get_experiment_by_name("token-pooling")
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string="tags.`pipeline.stage` = 'finetune'")


def trials_running_on_both_nodes(client: MlflowClient, driver: subprocess.Popen) -> list | None:
    """The finetune runs when two of them run at once on different nodes, each past its first checkpoint."""
    assert driver.poll() is None, "the DAG ended before two of its trials were seen running at once"
    running = [r for r in finetune_runs(client) if r.info.status == "RUNNING" and "ray.node_ids" in r.data.tags
               and epochs_logged(client, r.info.run_id)]
    return running if len({r.data.tags["ray.node_ids"] for r in running}) == 2 else None


def test_dag_sweep_spreads_over_nodes_and_a_killed_driver_resumes_without_duplicates(cluster, data, out, tmp_path):
    client = MlflowClient(tracking_uri=tracking_uri(out))
    command = dag_command(cluster, data, out)
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(command, cwd=ROOT, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        running = wait_for(lambda: trials_running_on_both_nodes(client, driver), "two finetune trials on two nodes",
                           600, every=0.2)
        killed_at = time.monotonic()
        os.killpg(driver.pid, signal.SIGKILL)  # the driver only: the Ray nodes are in other process groups
        driver.wait()
    finally:
        stop(driver)
        log.close()
    assert {r.data.tags["ray.node_ids"] for r in running} == {n["node_id"] for n in cluster.alive_nodes()}
    interrupted = {r.info.run_id for r in running}
    done_before = {r.data.tags["pipeline.stage_id"]: r.info.run_id for r in finetune_runs(client)
                   if r.data.tags.get("pipeline.done") == "1"}
    assert len(done_before) < len(METHODS), "both trials finished before the kill; the test proved nothing"

    again = subprocess.run(command, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-3000:]
    resume_s = time.monotonic() - killed_at

    finals = [r for r in finetune_runs(client) if r.data.tags.get("pipeline.done") == "1"]
    stage_ids = [r.data.tags["pipeline.stage_id"] for r in finals]
    assert len(stage_ids) == len(set(stage_ids)) == len(METHODS)  # no duplicate trial, none lost
    assert {r.info.run_id for r in finals} == interrupted  # each interrupted trial continued its own run
    for stage, run_id in done_before.items():
        assert stage in stage_ids and run_id in {r.info.run_id for r in finals}  # finished ones were not rerun
    for run in finals:
        assert epochs_logged(client, run.info.run_id) == list(range(1, FINETUNE_EPOCHS + 1))  # each epoch once
    report = (out / "experiments" / "tiny" / "report.md").read_text()
    assert all(method in report for method in METHODS)
    print(f"DAG driver killed during the finetune sweep: the rerun finished {resume_s:.0f} s after the kill")
