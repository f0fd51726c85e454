"""Training on Ray Train (2 CPU workers, gloo) and in Ray Train's local mode, on tiny synthetic data."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from pipeline.config import ConfigError, load_config
from pipeline.data import WriteSettings, open_source, write_beton, write_folder
from pipeline.data.loaders import DatasetMismatchError
from pipeline.errors import JobError
from pipeline.methods import METHODS
from pipeline.tracking import TrackingError
from pipeline.train import loop, run_training
from pipeline.train.checkpoint import CheckpointError, load_checkpoint
from pipeline.train.launch import quiet_local_cleaner

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_synthetic.yaml"
QUIET = lambda _: None  # noqa: E731


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    raw = WriteSettings(mode="raw", max_res=None)
    paths = {}
    for split, spec in (("train", "synthetic:classes=4,count=256,size=16"),
                        ("val", "synthetic:classes=4,count=64,size=16,seed=1")):
        write_beton(open_source(spec), root / f"{split}.beton", raw, log=QUIET)
        write_folder(open_source(spec), root / split, size=None, quality=95, log=QUIET)
        paths[split] = root / f"{split}.beton"
        paths[f"{split}_folder"] = root / split
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def tiny(data: dict[str, Path], runs: Path, *overrides: str, folders: bool = False):
    if folders:
        paths = [f"data.train={data['train_folder']}", f"data.val={data['val_folder']}", "data.loader=torch",
                 "data.num_workers=0"]
    else:
        paths = [f"data.train={data['train']}", f"data.val={data['val']}"]
    where = [f"train.storage_path={runs / 'ray'}", f"train.tracking_uri=sqlite:///{runs / 'mlflow.db'}",
             f"train.artifact_root={runs / 'artifacts'}"]
    return load_config(TINY, [*paths, *where, *overrides])


HANDLERS_AFTER_BASE: dict[int, object] = {}


def _callers_handler(*_) -> None:
    pass


@pytest.fixture(scope="module")
def base(data, runs):
    """A base model trained by 2 Ray Train workers (DDP over gloo) on FFCV loaders; the SIGINT and SIGUSR1
    handlers found after it are kept in HANDLERS_AFTER_BASE."""
    previous = {signum: signal.signal(signum, _callers_handler) for signum in (signal.SIGINT, signal.SIGUSR1)}
    try:
        result = run_training(tiny(data, runs, "train.name=base"))
        HANDLERS_AFTER_BASE.update({signum: signal.getsignal(signum) for signum in previous})
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return result


def mlflow_run(runs: Path, run_id: str):
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    return client, client.get_run(run_id)


@pytest.mark.ray
@pytest.mark.beton
def test_two_workers_learn_and_stay_in_sync(base, runs):
    client, run = mlflow_run(runs, base.run_id)
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train_loss"), key=lambda m: m.step)]
    assert len(losses) == 2 and losses[1] < losses[0]
    divergence = client.get_metric_history(run.info.run_id, "replica_divergence")
    assert [m.value for m in divergence] == [0.0, 0.0]  # DDP: both ranks hold the same parameters
    state = load_checkpoint(base.checkpoint)
    assert state["world_size"] == 2 and len(state["rng"]) == 2 and state["epoch"] == 1
    assert {"model", "optimizer", "scheduler", "ema", "scaler", "data_seed"} <= set(state)


@pytest.mark.ray
@pytest.mark.beton
def test_a_fit_leaves_the_callers_signal_handlers_in_place(base):
    """Ray Train's fit installs a SIGINT handler and leaves it (a later Ctrl-C would exit 0, and a data write
    would wait on a dead writer forever); run_training puts the caller's back."""
    assert HANDLERS_AFTER_BASE == {signal.SIGINT: _callers_handler, signal.SIGUSR1: _callers_handler}


def local_ray_logs(pattern: str) -> list[str]:
    """The texts of this process's local Ray log files that match ``pattern`` (after the ``base`` training)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return [p.read_text(errors="replace") for p in logs.glob(pattern) if p.is_file()]


@pytest.mark.ray
@pytest.mark.beton
def test_a_local_ray_drops_the_cleaners_state_api_warning(base):
    """Ray Train's placement-group cleaner asks the dashboard's State API once a second whether the
    controller lives; a local Ray has no dashboard, so each ask warned (26 times in this training). The
    worker setup hook drops that warning; the cleaner still ran (its actor wrote a log)."""
    texts = local_ray_logs("worker-*")
    assert any(":actor_name:PlacementGroupCleaner" in text for text in texts)
    assert not [text for text in texts if "Failed to query Ray Train Controller actor state" in text]


@pytest.mark.ray
@pytest.mark.beton
def test_a_local_ray_starts_no_preemption_watcher(base):
    """A local Ray is one node that nothing drains: Ray Train's preemption watcher, whose start logged a
    core-worker error line ("Actor with class name: 'PreemptionWatcher' ... has constructor arguments in
    the object store") in every training, is off (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1`` turns it on)."""
    texts = local_ray_logs("*")
    assert any(":actor_name:TrainController" in text for text in texts)
    assert not [text for text in texts if "PreemptionWatcher" in text]


def test_the_cleaner_filter_drops_that_warning_only(caplog):
    from pipeline.train.launch import quiet_local_cleaner

    logger = logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner")
    saved = list(logger.filters)
    try:
        quiet_local_cleaner()
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("Failed to query Ray Train Controller actor state. State API may be temporarily "
                           "unavailable. Continuing to monitor.")
            logger.warning("Detected that the Ray Train controller actor (x) is dead. Cleaning up placement group")
    finally:
        logger.filters[:] = saved
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["Detected that the Ray Train controller actor"]


@pytest.mark.ray
@pytest.mark.beton
def test_mlflow_holds_params_metrics_tags_and_artifacts(base, runs):
    client, run = mlflow_run(runs, base.run_id)
    assert run.data.params["model.embed_dim"] == "24" and run.data.params["train.mode"] == "base"
    # What ran, not what auto resolves to: a base model runs no fused step (native-c would be the CPU's K-Medoids).
    assert run.data.params["kernels.kmedoids"] == "auto" and run.data.params["kernels_run.kmedoids"] == "none noted"
    assert run.data.params["kernels_run.attention"] == "none noted"
    assert run.data.tags["mode"] == "base" and len(run.data.tags["config_hash"]) == 16
    assert run.data.tags["git_sha"] != "unknown"
    assert {"val_top1", "train_loss", "images_per_s", "lr"} <= set(run.data.metrics)
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "checkpoint"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")] == ["checkpoint/model.pt"]


@pytest.mark.ray
@pytest.mark.beton
def test_failure_at_a_step_resumes_to_the_same_weights(data, runs):
    # Mixup on, so that the restored RNG states matter; crops and flips are drawn per image from the seed.
    common = ["recipe.epochs=3", "recipe.mixup=0.8"]
    clean = run_training(tiny(data, runs, "train.name=clean", *common))
    failed = run_training(tiny(data, runs, "train.name=failed", "train.debug_fail_at_step=12",
                               "train.max_failures=1", *common))
    assert (runs / "ray" / "failed" / ".debug_failed_at_12").exists()  # it did fail once, in epoch 2
    a, b = load_checkpoint(clean.checkpoint)["model"], load_checkpoint(failed.checkpoint)["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    client, run = mlflow_run(runs, failed.run_id)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_top1")]
    assert sorted(steps) == [1, 2, 3]  # one MLflow run, each epoch once


@pytest.mark.ray
@pytest.mark.beton
def test_rerun_of_a_finished_job_resumes_instead_of_starting_over(base, data, runs):
    again = run_training(tiny(data, runs, "train.name=base", "recipe.epochs=3"))
    assert load_checkpoint(again.checkpoint)["epoch"] == 2  # only the third epoch ran
    assert again.run_id == base.run_id


@pytest.mark.ray
@pytest.mark.beton
def test_ksearch_gives_non_increasing_keep_lists_and_lambda_prunes(base, data, runs):
    keeps = {}
    for lam in (0.0, 0.05):
        result = run_training(tiny(data, runs, "train.mode=ksearch", f"train.init={base.checkpoint}",
                                   f"train.ksearch_lambda={lam}", f"train.name=ks{lam}", "train.workers=0",
                                   "recipe.epochs=3", folders=True))
        keep = result.keep
        assert len(keep) == 3 and all(0 <= k <= 16 for k in keep)
        assert all(a >= b for a, b in zip(keep, keep[1:]))
        keeps[lam] = keep
    # The task loss alone may move a few weights (straight-through clamp); the penalty must prune more.
    assert sum(keeps[0.05]) < sum(keeps[0.0])


@pytest.mark.ray
@pytest.mark.beton
@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_finetune_every_method_from_the_base(method, base, data, runs):
    keep = "[4, 1, 1]" if method == "conv" else "[12, 8, 4]"
    result = run_training(tiny(data, runs, "train.mode=finetune", f"train.init={base.checkpoint}",
                               f"pooling.method={method}", f"pooling.keep={keep}", f"train.name=ft_{method}",
                               "train.workers=0", "recipe.epochs=1", folders=True))
    assert result.keep == eval(keep)
    before, after = load_checkpoint(base.checkpoint)["model"], load_checkpoint(result.checkpoint)["model"]
    assert not torch.equal(before["head.weight"], after["head.weight"])  # it trained
    assert 0.0 <= result.summary["val_top1"] <= 100.0


@pytest.mark.ray
@pytest.mark.beton
def test_baseline_finetunes_without_downsampling(base, data, runs):
    result = run_training(tiny(data, runs, "train.mode=baseline", f"train.init={base.checkpoint}",
                               "train.name=baseline", "train.workers=0", "recipe.epochs=1", folders=True))
    assert result.keep is None and load_checkpoint(result.checkpoint)["mode"] == "baseline"


@pytest.mark.ray
@pytest.mark.beton
def test_a_base_with_learned_alpha_learns_one_a_block_and_its_finetunes_start_from_them(base, data, runs):
    """model.qk_norm in the base stage (Appendix F): the base trains one alpha a block, which moves; a finetune that
    asks for the same normalisation starts from those alphas; a checkpoint and a stage that disagree are refused
    before any compute, both ways round."""
    from pipeline.models import DownsamplingBlocks
    from pipeline.train.build import build_model

    normed = run_training(tiny(data, runs, "train.name=base_qk", "model.qk_norm=learned", "model.alpha=4.0",
                               "train.workers=0", "recipe.epochs=1", folders=True))
    alphas = {k: float(v) for k, v in load_checkpoint(normed.checkpoint)["model"].items() if k.endswith("qk_alpha")}
    assert sorted(alphas) == [f"blocks.{i}.qk_alpha" for i in range(3)]
    assert all(abs(a - 4.0) > 1e-6 for a in alphas.values()), alphas  # learned: the optimiser moved each
    finetune = tiny(data, runs, "train.mode=finetune", f"train.init={normed.checkpoint}", "model.qk_norm=learned",
                    "model.alpha=4.0", "pooling.method=kmedoids", "pooling.keep=[12, 8, 4]")
    model = build_model(finetune)
    loop.init_from(finetune, model)
    assert {f"blocks.{i}.qk_alpha": float(b.qk_alpha) for i, b in enumerate(model.blocks)} == alphas
    assert not isinstance(build_model(tiny(data, runs)).blocks, DownsamplingBlocks)  # unset: timm's own attention
    with pytest.raises(CheckpointError, match="different architecture.*qk_norm: checkpoint None vs config learned"):
        run_training(tiny(data, runs, "train.mode=finetune", f"train.init={base.checkpoint}", "model.qk_norm=learned",
                          "pooling.keep=[12, 8, 4]"))
    with pytest.raises(CheckpointError, match="different architecture.*qk_norm: checkpoint learned vs config None"):
        run_training(tiny(data, runs, "train.mode=ksearch", f"train.init={normed.checkpoint}"))
    # `run --plan`'s check of a given base: the tiny DAG's 24-wide base, asked for with normalised queries and keys
    from pipeline.dag.checks import check_given_bases

    dag = ROOT / "configs" / "experiments" / "tiny.yaml"
    given = [f"experiment.base_checkpoints={{M24: {base.checkpoint}}}", "experiment.embed_dims=[24]"]
    check_given_bases(load_config(dag, given))
    with pytest.raises(ConfigError, match=r"^experiment.base_checkpoints.M24: .* was trained for a different "
                                          "architecture \\(qk_norm: checkpoint None vs config fixed\\)"):
        check_given_bases(load_config(dag, [*given, "model.qk_norm=fixed"]))


@pytest.mark.ray
@pytest.mark.beton
def test_bad_inputs_fail_before_any_compute(base, data, runs, tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset not found"):
        run_training(tiny(data, runs, f"data.train={tmp_path / 'nope.beton'}"))
    with pytest.raises(DatasetMismatchError, match="holds 4 classes"):
        run_training(tiny(data, runs, "data.num_classes=10"))
    with pytest.raises(CheckpointError, match="different architecture.*embed_dim: checkpoint 24 vs config 32"):
        run_training(tiny(data, runs, "train.mode=finetune", f"train.init={base.checkpoint}", "model.embed_dim=32",
                          "pooling.keep=[12, 8, 4]"))
    with pytest.raises(ConfigError, match="needs 16 CPUs but the Ray cluster has 2"):
        run_training(tiny(data, runs, "train.workers=8", "train.cpus_per_worker=2"))
    with pytest.raises(ConfigError, match="use_gpu is true but the Ray cluster has no GPU"):
        run_training(tiny(data, runs, "train.use_gpu=true"))
    with pytest.raises(ConfigError, match="pooling.method"):
        tiny(data, runs, "pooling.method=kmedians")
    with pytest.raises(ValueError, match=r"pooling.keep has 2 entries \[8, 4\] but model.depth is 3"):
        run_training(tiny(data, runs, "train.mode=finetune", f"train.init={base.checkpoint}", "pooling.keep=[8, 4]"))
    with pytest.raises(ConfigError, match="set train.init"):
        run_training(tiny(data, runs, "train.mode=finetune", "pooling.keep=[12, 8, 4]"))
    with pytest.raises(TrackingError, match="not reachable"):
        run_training(tiny(data, runs, "train.tracking_uri=http://127.0.0.1:9"))


def test_a_resumed_job_logs_each_epoch_once_even_when_it_stopped_before_mlflow(tmp_path):
    """Checkpoint first, MLflow second: a stop in between is made good from the checkpoint, never twice."""
    from pipeline.train.run_tracking import JobTracker

    config = tiny({"train": tmp_path / "t", "val": tmp_path / "v"}, tmp_path, "train.name=backfill")
    tracker = JobTracker.open(config)
    tracker.log_epoch({"epoch": 1, "val_top1": 40.0}, 1)
    # The job stopped after writing epoch 2's checkpoint, before logging it; the resumed job reopens the run.
    resumed = JobTracker.open(config, tracker.run_id)
    resumed.backfill(2, {"epoch": 2, "val_top1": 55.0})
    resumed.backfill(2, {"epoch": 2, "val_top1": 55.0})  # a second resume changes nothing
    resumed.backfill(1, {"epoch": 1, "val_top1": 40.0})
    history = resumed.client.get_metric_history(tracker.run_id, "val_top1")
    assert sorted((m.step, m.value) for m in history) == [(1, 40.0), (2, 55.0)]


def test_a_checkpoint_cut_short_is_never_resumed_from(tmp_path):
    from pipeline.train.session import latest_local_checkpoint

    for epoch in (1, 2):
        (tmp_path / f"epoch_{epoch:05d}").mkdir()
        (tmp_path / f"epoch_{epoch:05d}" / "checkpoint.pt").write_bytes(b"x")
    (tmp_path / "epoch_00001" / "summary.json").write_text("{}")  # epoch 2 died (disk full, kill) before its summary
    assert latest_local_checkpoint(tmp_path) == tmp_path / "epoch_00001"


def test_a_reported_checkpoint_ray_never_registered_is_found_and_a_torn_one_skipped(tmp_path):
    from pipeline.train.session import newest_stored_state

    for name, epoch, payload in (("checkpoint_a", 1, {"epoch": 0}), ("checkpoint_b", 2, {"epoch": 1}),
                                 ("checkpoint_c", 3, None)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "summary.json").write_text(f'{{"epoch": {epoch}}}')
        if payload is None:
            (folder / "checkpoint.pt").write_bytes(b"PK\x03\x04 half copied")  # a copy cut short
        else:
            torch.save(payload, folder / "checkpoint.pt")
    assert newest_stored_state(tmp_path, after_epoch=-1) == {"epoch": 1}
    assert newest_stored_state(tmp_path, after_epoch=1) is None  # Ray's own is as new: use it


@pytest.mark.ray
@pytest.mark.beton
def test_a_bug_in_the_workers_keeps_its_traceback(data, runs, monkeypatch):
    """A RuntimeError planted in the workers' training function is a bug, not the project's error: the job's error
    keeps Ray's text with the traceback (a project error's one line is the CLI test's below)."""
    def planted(config_dict):  # a closure: Ray pickles it by value into the workers
        raise RuntimeError("planted bug")

    monkeypatch.setattr(loop, "train_worker", planted)
    with pytest.raises(JobError, match=r"(?s)training job 'planted' failed after 0 restart\(s\): .*Traceback .*"
                                       r"RuntimeError: planted bug"):
        run_training(tiny(data, runs, "train.name=planted", "train.max_failures=0"))


@pytest.mark.ray
@pytest.mark.beton
@pytest.mark.slow
def test_the_cli_ends_a_diverging_training_in_one_error_line_and_verbose_shows_the_tracebacks(data, tmp_path):
    """Through the CLI, in a subprocess: recipe.lr=1e30 on two Ray Train workers ends in one ``error:`` line and no
    traceback (exit 2); with --verbose the workers' tracebacks are shown. A batch larger than the training set is
    refused before Ray starts."""
    where = [f"data.train={data['train']}", f"data.val={data['val']}", f"train.storage_path={tmp_path / 'ray'}",
             f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"train.artifact_root={tmp_path / 'art'}",
             "train.max_failures=0", "recipe.lr=1e30"]

    def train(*extra: str) -> subprocess.CompletedProcess:
        sets = [arg for item in [*where, *extra] for arg in ("--set", item)]
        return subprocess.run([sys.executable, "-m", "pipeline", "train", str(TINY), *sets], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    quiet = train("train.name=quiet")
    output = quiet.stdout + quiet.stderr
    assert quiet.returncode == 2, output
    errors = [line for line in quiet.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: the training loss is not finite"), output
    assert "Traceback" not in output, output
    loud = subprocess.run([sys.executable, "-m", "pipeline", "train", str(TINY), "--verbose",
                           *[arg for item in [*where, "train.name=loud"] for arg in ("--set", item)]],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert loud.returncode == 2 and "Traceback (most recent call last)" in loud.stdout + loud.stderr
    big = train("train.name=big", "data.batch_size=1000000")
    assert big.returncode == 2 and "Traceback" not in big.stderr, big.stderr
    assert big.stderr.strip().splitlines()[-1].startswith("error: data.batch_size=1000000 x 2 worker(s) "
                                                          "(train.workers) is larger than the training set")


def test_the_cleaner_hook_drops_its_monitors_lost_connection_only(monkeypatch):
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append((args.thread.name, args.exc_type)))
    quiet_local_cleaner()

    def fail(error: Exception) -> None:
        raise error

    for name, error in (("PlacementGroupCleanerMonitor", ConnectionError("gone")),
                        ("PlacementGroupCleanerMonitor", RuntimeError("bug")), ("other", ConnectionError("x"))):
        thread = threading.Thread(target=fail, args=(error,), name=name)
        thread.start()
        thread.join()
    assert seen == [("PlacementGroupCleanerMonitor", RuntimeError), ("other", ConnectionError)]
