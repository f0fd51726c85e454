"""Where a training loop runs: a Ray Train worker, or this process alone (``train.workers: 0``).

Both sessions honour one contract (``Session``): rank 0 writes each epoch's checkpoint into
``checkpoint_dir(epoch, scratch)``, every rank then calls ``report``, and the session keeps the
newest ``train.keep_checkpoints`` of them; ``latest`` returns the newest one's state for a resume.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from pipeline.config import Config
from pipeline.console import say
from pipeline.train.checkpoint import SUMMARY_FILE, CheckpointError, load_checkpoint

EPOCH_DIR = "epoch_{:05d}"  # named by the epoch it ends, from 1


class Session(Protocol):
    rank: int
    world: int
    device: torch.device
    node_id: str  # the Ray node this rank runs on ("local" outside Ray)

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model on this session's device, wrapped for DDP when there are several ranks."""

    def latest(self) -> dict[str, Any] | None:
        """The state of this job's newest checkpoint, or None for a fresh start."""

    def checkpoint_dir(self, epoch: int, scratch: Path) -> Path:
        """Where rank 0 writes the checkpoint of ``epoch`` (``scratch``: a temporary folder of this call)."""

    def report(self, metrics: dict[str, float], directory: Path | None) -> None:
        """Hands over the epoch's metrics and checkpoint (rank 0; None elsewhere) and keeps the newest
        ``train.keep_checkpoints`` checkpoints."""


class RaySession:
    """A Ray Train worker: rank and device from Ray; ``ray.train.report`` persists the checkpoint to the
    run's storage and keeps ``train.keep_checkpoints`` of them (``CheckpointConfig.num_to_keep``)."""

    def __init__(self, config: Config) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.node_id = ray_node_id()
        storage = config.train.storage_path
        self.folder = None if "://" in storage else Path(storage) / config.train.name

    def prepare(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model, parallel_strategy="ddp" if self.world > 1 else None)

    def latest(self) -> dict[str, Any] | None:
        """The newest readable checkpoint of the run: on a filesystem ``storage_path`` read from the run's
        folder, which holds Ray's registered checkpoints and any it has not registered yet; on ``s3://``,
        Ray's registered one.

        Ray Train's controller registers a reported checkpoint when it next polls the workers (every
        ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default); a worker killed in that window would
        otherwise restart the job from the checkpoint before (seen in tests/test_multinode.py).
        """
        import ray.train

        if self.folder is not None:
            found = newest_stored_state(self.folder, after_epoch=-1, announce=self.rank == 0)
            if found is not None:
                return found
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            return load_checkpoint(directory)

    def checkpoint_dir(self, epoch: int, scratch: Path) -> Path:
        return scratch / EPOCH_DIR.format(epoch + 1)  # Ray copies it into the run's storage

    def report(self, metrics: dict[str, float], directory: Path | None) -> None:
        import ray.train

        checkpoint = None if directory is None else ray.train.Checkpoint.from_directory(str(directory))
        ray.train.report(metrics, checkpoint=checkpoint)


class LocalSession:
    """This process alone: what Tune trials and quick runs use. Checkpoints live in
    ``STORAGE/NAME/local_checkpoints/epoch_*``."""

    rank, world = 0, 1

    def __init__(self, config: Config) -> None:
        self.device = torch.device("cuda" if config.train.use_gpu else "cpu")
        self.node_id = ray_node_id()
        self.folder = local_checkpoints(config)
        self.keep_last = config.train.keep_checkpoints

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def latest(self) -> dict[str, Any] | None:
        complete = sorted(d for d in self.folder.glob("epoch_*") if (d / SUMMARY_FILE).is_file())
        return newest_readable(reversed(complete), announce=True)

    def checkpoint_dir(self, epoch: int, scratch: Path) -> Path:
        return self.folder / EPOCH_DIR.format(epoch + 1)  # written in place: it is the kept copy

    def report(self, metrics: dict[str, float], directory: Path | None) -> None:
        for old in sorted(self.folder.glob("epoch_*"))[:-self.keep_last]:
            shutil.rmtree(old)


def ray_node_id() -> str:
    """The Ray node this process runs on (a Tune trial or a Train worker), or "local" outside Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "local"
    return ray.get_runtime_context().get_node_id()


def newest_readable(directories, *, announce: bool) -> dict[str, Any] | None:
    """The state of the first readable checkpoint of ``directories`` (newest first), or None. Passing over an
    unreadable one (deleted, truncated, half-copied) is said in one line when ``announce`` (rank 0)."""
    passed = []
    for directory in directories:
        try:
            state = load_checkpoint(directory)
        except CheckpointError as err:
            passed.append(f"{directory.name} ({err})")
            continue
        if passed and announce:
            say(f"[rank 0] resuming from {directory.name}: the newer {'; '.join(passed)} could not be read")
        return state
    if passed and announce:
        say(f"[rank 0] no checkpoint could be read ({'; '.join(passed)}); starting over")
    return None


def newest_stored_state(folder: Path, after_epoch: int, announce: bool = False) -> dict[str, Any] | None:
    """The newest readable checkpoint in ``folder``'s ``checkpoint_*`` directories (Ray's names) past
    ``after_epoch`` (0-based, as checkpoints record it), or None; a half-copied one is passed over."""
    found = []
    for directory in folder.glob("checkpoint_*"):
        try:
            epoch = int(json.loads((directory / SUMMARY_FILE).read_text())["epoch"]) - 1
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if epoch > after_epoch:
            found.append((epoch, directory))
    return newest_readable((directory for _, directory in sorted(found, reverse=True)), announce=announce)


def local_checkpoints(config: Config) -> Path:
    return Path(config.train.storage_path) / config.train.name / "local_checkpoints"


def latest_local_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint directory (one with its summary written last)."""
    found = sorted(d for d in folder.glob("epoch_*") if (d / SUMMARY_FILE).is_file())
    return found[-1] if found else None
