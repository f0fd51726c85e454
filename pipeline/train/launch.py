"""The driver side of ``pipeline train``: checks everything first, then runs a Ray Train ``TorchTrainer``."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import signals
from pipeline.config import Config, ConfigError
from pipeline.config.identity import identity_differences, run_identity
from pipeline.config.train import AUTO_TABLE
from pipeline.console import quiet_train_reports, quiet_worker_errors, say, verbose, worker_failure
from pipeline.errors import JobError, MissingFileError
from pipeline.methods import registered_in_code


@dataclass(frozen=True)
class TrainResult:
    """What a finished job hands to the next stage."""

    checkpoint: str  # directory holding checkpoint.pt
    summary: dict[str, Any]

    @property
    def keep(self) -> list[int] | None:
        return self.summary.get("keep")

    @property
    def run_id(self) -> str | None:
        return self.summary.get("mlflow_run_id")


def _absolute(path: str | None) -> str | None:
    if path is None or "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def resolve_paths(config: Config) -> Config:
    """Absolute local paths, so that Ray workers (whatever their working directory) see the same files."""
    uri = config.train.tracking_uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + _absolute(uri[len("sqlite:///"):])
    data = config.data.model_copy(update={"train": _absolute(config.data.train), "val": _absolute(config.data.val)})
    model = config.model.model_copy(update={"weights": _absolute(config.model.weights)})
    target = config.train.ksearch_target
    if target is not None and target.table != AUTO_TABLE:
        target = target.model_copy(update={"table": _absolute(target.table)})
    train = config.train.model_copy(update={
        "init": _absolute(config.train.init), "storage_path": _absolute(config.train.storage_path),
        "artifact_root": _absolute(config.train.artifact_root), "tracking_uri": uri, "ksearch_target": target})
    experiment = config.experiment
    if experiment is not None and experiment.ksearch_targets:
        experiment = experiment.model_copy(update={"ksearch_targets": [
            t if t.table == AUTO_TABLE else t.model_copy(update={"table": _absolute(t.table)})
            for t in experiment.ksearch_targets]})
    return config.model_copy(update={"data": data, "model": model, "train": train, "experiment": experiment})


def check_data(config: Config) -> None:
    """Both datasets exist and their metadata matches the config."""
    from pipeline.data.loaders import check_dataset

    for split in ("train", "val"):
        path = getattr(config.data, split)
        if path is None:
            raise ConfigError(f"data.{split} is not set; write a dataset with `python -m pipeline data write`")
        if config.data.loader == "ffcv":
            check_dataset(path, config.data.num_classes, full_checksum=config.data.verify_checksum)
        elif not Path(path).is_dir():
            raise MissingFileError(f"data.{split}: {path} is not an image folder (loader: torch)")
    if config.data.batch_size % 2 and (config.recipe.mixup > 0 or config.recipe.cutmix > 0):
        raise ConfigError(f"data.batch_size={config.data.batch_size}: Mixup/CutMix pair images, use an even batch")
    if config.data.loader == "ffcv":
        from pipeline.data.loaders import read_metadata

        images = int(read_metadata(config.data.train)["num_images"])
        check_batch_fits(config, images, config.data.train, workers_key="train.workers")


def check_batch_fits(config: Config, images: int, source: str, *, workers_key: str, world: int | None = None,
                     batch: int | None = None, batch_key: str = "data.batch_size") -> None:
    """Refuses a global batch (``batch``, default ``data.batch_size``, x ``world`` workers, default
    ``train.workers``) larger than the images it trains on (``images`` in ``source``, less the ``data.holdout``
    share): every rank's epoch would have no step."""
    world = max(config.train.workers if world is None else world, 1)
    batch = config.data.batch_size if batch is None else batch
    training = math.ceil(images * (1 - config.data.holdout))
    if batch * world > training:
        held = f" less data.holdout={config.data.holdout:g}" if config.data.holdout else ""
        raise ConfigError(f"{batch_key}={batch} x {world} worker(s) ({workers_key}) is larger than the training "
                          f"set: {source} has {training} training image(s){held}; lower {batch_key}")


def check_model(config: Config) -> None:
    """The model builds (names, widths, method, keep list), and ``train.init`` fits it."""
    from pipeline.train.build import arch_signature, build_model
    from pipeline.train.checkpoint import check_architecture, load_init

    model = build_model(config)
    mode = config.train.mode
    if mode in ("ksearch", "finetune", "baseline") and config.train.init is None:
        raise ConfigError(f"train.mode={mode} starts from a base model: set train.init to its checkpoint")
    if config.train.init is not None:
        check_architecture(load_init(config.train.init), arch_signature(model), config.train.init)


def check_resources(config: Config) -> None:
    """Enough CPUs (and GPUs) in the Ray cluster for the workers asked for."""
    import ray

    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    check_fits(config.train, ray.cluster_resources(), nodes, "the Ray cluster")


def check_fits(train, resources: dict[str, float], nodes: int, cluster: str) -> None:
    """Refuses a job (``train``: a ``TrainConfig``) whose workers need more CPUs, GPUs or nodes than ``resources``
    and ``nodes`` give; ``cluster`` names where they were counted."""
    if train.use_gpu and resources.get("GPU", 0) < 1:
        raise ConfigError(f"train.use_gpu is true but {cluster} has no GPU; set train.use_gpu=false "
                          "or connect to a GPU cluster (--address)")
    cpus = train.workers * train.cpus_per_worker
    if resources.get("CPU", 0) < cpus:
        raise ConfigError(f"train.workers={train.workers} x train.cpus_per_worker={train.cpus_per_worker} needs "
                          f"{cpus:g} CPUs but {cluster} has {resources.get('CPU', 0):g}; lower them")
    if train.use_gpu and resources.get("GPU", 0) < train.workers:
        raise ConfigError(f"train.workers={train.workers} GPU workers but {cluster} has "
                          f"{resources.get('GPU', 0):g} GPUs")
    if train.placement == "STRICT_SPREAD" and nodes < train.workers:
        raise ConfigError(f"train.placement=STRICT_SPREAD puts each of the {train.workers} workers on its own node "
                          f"but {cluster} has {nodes} node(s); add nodes or use train.placement=SPREAD")


def preflight(config: Config) -> None:
    """Every check that can fail before compute starts, then the tracking store: a refused dataset or
    model leaves no new SQLite store behind."""
    from pipeline.tracking import check_tracking_uri, create_store

    check_data(config)
    check_model(config)
    check_tracking_uri(config.train.tracking_uri)
    create_store(config.train.tracking_uri)


_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
_NO_STATE_API = "Failed to query Ray Train Controller actor state"
_CLEANER_THREAD = "PlacementGroupCleanerMonitor"


def _not_the_state_api_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_NO_STATE_API)


def quiet_local_cleaner() -> None:
    """Ray worker setup hook of a local Ray: drops one warning of Ray Train's placement-group cleaner.

    The cleaner asks the State API, which the dashboard serves, once a second whether the training's
    controller lives; a local Ray starts without a dashboard (starting one here made the test cluster's
    own head miss its 180 s start in CI, docs/design.md), so every ask failed and warned: 28 of the 60
    lines of a tiny training. Its other warnings stay.

    Also its monitor thread's ``ConnectionError`` when the local cluster goes away under it (the driver ended,
    which ends a local Ray): a race, whose thread traceback reached the console after a failed training's one
    line now and then. Any other exception of any thread still reaches the previous hook."""
    logging.getLogger(_CLEANER_LOGGER).addFilter(_not_the_state_api_warning)
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (args.thread is not None and args.thread.name == _CLEANER_THREAD
                and issubclass(args.exc_type, ConnectionError)):
            previous(args)

    threading.excepthook = hook


def setup_local_worker() -> None:
    """Ray worker setup hook of a local Ray: the cleaner's warning off, and Ray Train's report lines and a project
    error's worker tracebacks off the console (``pipeline.console.quiet_train_reports``, ``quiet_worker_errors``)."""

    quiet_local_cleaner()
    quiet_train_reports()
    quiet_worker_errors()


def check_reaches_workers(config: Config) -> None:
    """Refuses a config that names a method registered in this process only (``register_method``): Ray
    workers validate the config again from their own registry, which has the built-in methods and the
    entry points of the packages installed where they run, not this process's registrations."""

    names = {config.pooling.method, *config.pooling.options, *(config.experiment.methods if config.experiment else [])}
    local = sorted(name for name in names if registered_in_code(name))
    if local:
        raise ConfigError(f"method(s) {', '.join(map(repr, local))} were registered in this process "
                          "(register_method), which Ray workers do not see; make each an entry point in the group "
                          "pipeline.methods of a package installed where the workers run (the image, or Ray's "
                          "runtime_env; docs/architecture.md), or train in this process (train.workers: 0)")


TIMING = "timing"  # a Ray resource of 1 per node: a speed measurement holds it, so no other one runs beside it


def connect_ray(address: str | None) -> None:
    """A local Ray by default (one node, with the ``timing`` resource), or the cluster at ``address`` (or
    ``RAY_ADDRESS``), whose nodes are started with ``--resources='{"timing": 1}'``."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    address = address or os.environ.get("RAY_ADDRESS")
    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    # Ray Train's preemption watcher polls for drained nodes (spot preemption) from an actor made with
    # max_restarts=-1 and actor handles as constructor arguments, so Ray's core worker logs an error line
    # at every training's start (ray-project/ray#53727). A local Ray is one node that nothing drains; its
    # processes inherit this environment, and Ray Train passes the variable on to its controller.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(logging_level=logging.WARNING, include_dashboard=False, resources={TIMING: 1},
             runtime_env={"worker_process_setup_hook": f"{__name__}.{setup_local_worker.__name__}"})


def make_trainer(config: Config):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipeline.train.loop import train_worker

    train = config.train
    resources = {"CPU": train.cpus_per_worker} | ({"GPU": 1} if train.use_gpu else {})
    return TorchTrainer(
        train_worker,
        train_loop_config=config.model_dump(mode="json"),
        scaling_config=ScalingConfig(num_workers=train.workers, use_gpu=train.use_gpu,
                                     resources_per_worker=resources, placement_strategy=train.placement),
        torch_config=TorchConfig(backend="nccl" if train.use_gpu else "gloo"),
        run_config=RunConfig(name=train.name, storage_path=train.storage_path,
                             failure_config=FailureConfig(max_failures=train.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=train.keep_checkpoints),
                             # Ray Train's INFO lines (each report, each checkpoint, the worker group's start)
                             # stay in Ray's logs/train/ray-train-sys-*.log; the console gets its warnings.
                             logging_config=LoggingConfig(log_level="INFO" if verbose() else "WARNING")),
    )


def run_local(config: Config, on_epoch: Callable[[dict[str, float]], None] | None = None, *,
              restart: bool = False) -> TrainResult:
    """``train.workers: 0``: the loop in this process (Tune trials, quick runs)."""
    from pipeline.train.loop import train_local
    from pipeline.train.session import latest_local_checkpoint, local_checkpoints

    if config.train.use_gpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.use_gpu is true but this machine has no CUDA device")
    check_rerun(config, restart)
    train_local(config, on_epoch)
    directory = latest_local_checkpoint(local_checkpoints(config))
    if directory is None:
        raise JobError(f"training job {config.train.name!r} finished without a checkpoint")
    return TrainResult(checkpoint=str(directory), summary=json.loads((directory / "summary.json").read_text()))


RUN_RECORD = "run_config.json"  # in STORAGE/NAME: the identity of the config that made the run


def run_folder(config: Config) -> Path | None:
    """``train.storage_path/train.name``, where the run's checkpoints live (None on object storage)."""
    storage = config.train.storage_path
    return None if "://" in storage else Path(storage) / config.train.name


def epochs_done(folder: Path) -> int:
    """The newest epoch a checkpoint of the run in ``folder`` holds (Ray's or the local session's), 0 if none."""
    done = 0
    for summary in [*folder.glob("checkpoint_*/summary.json"), *folder.glob("local_checkpoints/epoch_*/summary.json")]:
        try:
            done = max(done, int(json.loads(summary.read_text())["epoch"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return done


def check_rerun(config: Config, restart: bool = False) -> None:
    """A run folder resumes only under the config that made it, with at least as many epochs as it has done.

    ``restart`` sets the folder aside (renamed, not deleted) and starts over. The record is written once this
    passes, before the run's first checkpoint.
    """

    folder = run_folder(config)
    if folder is None:
        return
    name = config.train.name
    if restart and folder.exists():
        aside = folder.with_name(f"{folder.name}.restarted-{time.strftime('%Y%m%d-%H%M%S')}")
        folder.rename(aside)
        say(f"[restart] {name}: the earlier run is now {aside}")
    record, identity = folder / RUN_RECORD, run_identity(config)
    if record.is_file():
        differs = identity_differences(json.loads(record.read_text()), identity)
        way_out = ("give a new train.name, or pass --restart to set the earlier run aside (it is kept) and start "
                   "over")
        if differs:
            raise ConfigError(f"train.name {name!r} names a run of another config in {folder.parent}: "
                              f"{'; '.join(differs[:6])}{' ...' if len(differs) > 6 else ''}; only more epochs of "
                              f"the same config resume a run: {way_out}")
        done = epochs_done(folder)
        if config.recipe.epochs < done:
            raise ConfigError(f"recipe.epochs={config.recipe.epochs}, but the run {name!r} has done {done} epochs; "
                              f"give recipe.epochs >= {done} to continue it, or {way_out}")
        return
    folder.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n")


def run_training(config: Config, address: str | None = None,
                 on_epoch: Callable[[dict[str, float]], None] | None = None, *, restart: bool = False) -> TrainResult:
    """Runs (or resumes: same ``train.name`` and ``train.storage_path``, same config) one training job.

    ``on_epoch`` (single-process jobs only) gets each epoch's metrics once its checkpoint is written;
    ``restart`` sets an earlier run of the same name aside first (``check_rerun``).
    """
    config = resolve_paths(config)
    if config.train.workers > 0:
        check_reaches_workers(config)
    preflight(config)
    if config.train.workers == 0:
        return run_local(config, on_epoch, restart=restart)
    if on_epoch is not None:
        raise ConfigError("per-epoch reports (a sweep trial) need a single-process job: train.workers: 0")
    connect_ray(address or config.train.address)
    check_resources(config)
    check_rerun(config, restart)
    try:
        result = signals.fit(make_trainer(config))  # Ray's fit leaves its SIGINT handler; this does not
    except Exception as err:  # Ray wraps the worker's exception; keep its message, drop Ray's frames
        raise JobError(worker_failure(f"training job {config.train.name!r} failed after "
                                      f"{config.train.max_failures} restart(s)", err)) from err
    if result.checkpoint is None:
        raise JobError(f"training job {config.train.name!r} finished without a checkpoint")
    with result.checkpoint.as_directory() as directory:
        summary = json.loads((Path(directory) / "summary.json").read_text())
    return TrainResult(checkpoint=result.checkpoint.path, summary=summary)
