"""The per-worker training loop that Ray Train runs (DDP over gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import math
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import Config, config_hash
from pipeline.data.loaders import LoaderSpec, progressive_res, set_resolution, shared_loader
from pipeline.errors import InputError, JobError
from pipeline.models import project_retention, retention_keep, retention_penalty
from pipeline.train.build import arch_signature, build_model, data_config, unwrap
from pipeline.train.checkpoint import (
    check_architecture,
    load_checkpoint,
    load_model_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from pipeline.train.recipe import Recipe, build_recipe


@dataclass
class Worker:
    """This rank's view of the job."""

    rank: int
    world: int
    device: torch.device
    config: Config

    @property
    def lead(self) -> bool:
        return self.rank == 0


@dataclass
class EpochStats:
    loss: float
    images: int
    seconds: float
    penalty: float = 0.0


def loader_spec(config: Config, model: nn.Module, worker: Worker, *, train: bool) -> LoaderSpec:
    """Train: a distributed, per-epoch reshuffled shard; validation: a disjoint strided slice per rank."""
    cfg = data_config(model)
    data = config.data
    return LoaderSpec(path=data.train if train else data.val, train=train, batch_size=data.batch_size,
                      res=cfg["input_size"][-1], mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                      crop_pct=cfg["crop_pct"], crop_scale=data.crop_scale, workers=data.num_workers,
                      distributed=train and worker.world > 1, seed=config.seed, os_cache=data.os_cache,
                      device=str(worker.device), flip=data.flip)


def val_loader(config: Config, model: nn.Module, worker: Worker):
    """Each rank reads every ``world``-th validation image, so the ranks' counts add up to the set exactly."""
    spec = loader_spec(config, model, worker, train=False)
    if config.data.loader == "torch" or worker.world == 1:
        return shared_loader(config.data.loader, spec)
    from pipeline.data.loaders import ffcv_loader

    return ffcv_loader(spec, indices=np.arange(worker.rank, _num_samples(spec.path), worker.world))


def _num_samples(path: str) -> int:
    from pipeline.data.loaders import read_metadata

    return int(read_metadata(path)["num_images"])


def init_from(config: Config, model: nn.Module) -> None:
    """Loads ``train.init`` (a base checkpoint) or ``model.weights`` (a timm state dict)."""
    from pipeline.models import load_weights

    if config.train.init is not None:
        state = load_checkpoint(config.train.init)
        check_architecture(state, arch_signature(model), config.train.init)
        load_model_weights(model, state, config.train.init)
    elif config.model.weights is not None:
        load_weights(model, config.model.weights)


def gather_rng(worker: Worker) -> list[dict[str, Any]]:
    """Every rank's RNG state, on every rank (rank r restores entry r on resume)."""
    states: list[Any] = [None] * worker.world
    if worker.world == 1:
        return [rng_state()]
    dist.all_gather_object(states, rng_state())
    return states


def autocast(worker: Worker):
    if worker.device.type == "cuda" and worker.config.recipe.amp:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def maybe_fail(config: Config, step: int, worker: Worker) -> None:
    """The documented debug hook: raise once at ``train.debug_fail_at_step`` (marker file in the run folder)."""
    target = config.train.debug_fail_at_step
    if target is None or step != target or not worker.lead:
        return
    marker = Path(config.train.storage_path) / config.train.name / f".debug_failed_at_{target}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    raise JobError(f"debug_fail_at_step={target}: injected failure (the job restarts from its last checkpoint)")


def train_one_epoch(model: nn.Module, loader, recipe: Recipe, worker: Worker, epoch: int, step: int,
                    steps_per_epoch: int) -> tuple[EpochStats, int]:
    """One pass over this rank's shard; returns the stats and the new global step."""
    config = worker.config
    model.train()
    total, images, penalty_sum, start = 0.0, 0, 0.0, time.perf_counter()
    bar = _progress_bar(worker, steps_per_epoch, epoch)
    for inputs, targets in loader:
        maybe_fail(config, step + 1, worker)
        inputs, targets = inputs.to(worker.device, non_blocking=True), targets.to(worker.device, non_blocking=True)
        if recipe.mixup is not None:
            inputs, targets = recipe.mixup(inputs, targets)
        with autocast(worker):
            loss = recipe.loss(model(inputs), targets)
        if config.train.mode == "ksearch":
            penalty = retention_penalty(unwrap(model), config.train.ksearch_lambda)
            loss = loss + penalty
            penalty_sum += float(penalty.detach())
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at epoch {epoch + 1}, step {step + 1}; "
                                     "lower recipe.lr or enable recipe.clip_grad")
        recipe.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.recipe.clip_grad is not None:
            nn.utils.clip_grad_norm_(model.parameters(), config.recipe.clip_grad)
        recipe.optimizer.step()
        if config.train.mode == "ksearch":
            project_retention(unwrap(model))
        step += 1
        recipe.scheduler.step_update(step)
        if recipe.ema is not None:
            recipe.ema.update(unwrap(model), step=step)
        total += value * inputs.shape[0]
        images += inputs.shape[0]
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    batches = max(images // max(config.data.batch_size, 1), 1)
    return EpochStats(total / max(images, 1), images, seconds, penalty_sum / batches), step


def _progress_bar(worker: Worker, total: int, epoch: int):
    if not (worker.lead and worker.config.train.progress_bar and sys.stdout.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch + 1}", leave=False, unit="batch")


@torch.no_grad()
def evaluate(model: nn.Module, loader, worker: Worker) -> float:
    """Top-1 (%) over the whole validation set, summed across ranks."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=worker.device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(worker.device, non_blocking=True), targets.to(worker.device, non_blocking=True)
        with autocast(worker):
            logits = model(inputs)
        counts[0] += (logits.argmax(-1) == targets).sum()
        counts[1] += targets.numel()
    if worker.world > 1:
        dist.all_reduce(counts)
    return float(100.0 * counts[0] / counts[1].clamp(min=1))


def replica_divergence(model: nn.Module, worker: Worker) -> float:
    """The largest difference between ranks of any parameter (0.0 when DDP keeps them in sync)."""
    if worker.world == 1:
        return 0.0
    flat = torch.cat([p.detach().reshape(-1).double() for p in unwrap(model).parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return float((high - low).max())


def global_mean(value: float, worker: Worker) -> float:
    if worker.world == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=worker.device)
    dist.all_reduce(tensor)
    return float(tensor) / worker.world


def training_state(model: nn.Module, recipe: Recipe, epoch: int, step: int, rng: list, worker: Worker,
                   keep: list[int] | None, mlflow_run_id: str | None) -> dict[str, Any]:
    """Everything a resumed job needs to continue exactly where this one stands."""
    config = worker.config
    return {
        "model": unwrap(model).state_dict(),
        "optimizer": recipe.optimizer.state_dict(),
        "scheduler": recipe.scheduler.state_dict(),
        "scaler": None,  # bf16 autocast needs no loss scaling; kept for the format's readers
        "ema": None if recipe.ema is None else recipe.ema.state_dict(),
        "epoch": epoch,
        "step": step,
        "rng": rng,
        "data_seed": config.seed,
        "world_size": worker.world,
        "arch": arch_signature(unwrap(model)),
        "mode": config.train.mode,
        "keep": keep,
        "config_hash": config_hash(config),
        "config": config.model_dump(mode="json"),
        "mlflow_run_id": mlflow_run_id,
    }


def restore(state: dict[str, Any], model: nn.Module, recipe: Recipe, worker: Worker) -> tuple[int, int]:
    """Loads a Ray checkpoint of this job; returns (next epoch, global step)."""
    unwrap(model).load_state_dict(state["model"])
    recipe.optimizer.load_state_dict(state["optimizer"])
    recipe.scheduler.load_state_dict(state["scheduler"])
    if recipe.ema is not None and state["ema"] is not None:
        recipe.ema.load_state_dict(state["ema"])
    if len(state["rng"]) == worker.world:
        set_rng_state(state["rng"][worker.rank])
    else:  # a different worker count: the sample order stays seeded, per-rank RNG streams restart
        torch.manual_seed(worker.config.seed * 1000 + worker.rank + 7919 * state["epoch"])
    return state["epoch"] + 1, state["step"]


class RaySession:
    """A Ray Train worker: rank and device from Ray, checkpoints kept by ``ray.train.report``."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()

    def prepare(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model, parallel_strategy="ddp" if self.world > 1 else None)

    def latest(self) -> dict[str, Any] | None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            return load_checkpoint(directory)

    def report(self, metrics: dict[str, float], directory: Path | None) -> None:
        """Every rank reports (Ray requires it); rank 0 hands over the checkpoint directory."""
        import ray.train

        checkpoint = None if directory is None else ray.train.Checkpoint.from_directory(str(directory))
        ray.train.report(metrics, checkpoint=checkpoint)

    def checkpoint_dir(self, config: Config, epoch: int, tmp: str) -> Path:
        return Path(tmp)


class LocalSession:
    """One process, no Ray Train (``train.workers: 0``): what Tune trials and quick runs use.

    Checkpoints go to ``STORAGE/NAME/local_checkpoints/epoch_*`` (the newest ``keep_checkpoints``).
    """

    rank, world = 0, 1

    def __init__(self, config: Config) -> None:
        self.device = torch.device("cuda" if config.train.use_gpu else "cpu")
        self.folder = local_checkpoints(config)
        self.keep = config.train.keep_checkpoints

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def latest(self) -> dict[str, Any] | None:
        found = latest_local_checkpoint(self.folder)
        return None if found is None else load_checkpoint(found)

    def report(self, metrics: dict[str, float], directory: Path | None) -> None:
        import shutil

        for old in sorted(self.folder.glob("epoch_*"))[:-self.keep]:
            shutil.rmtree(old)

    def checkpoint_dir(self, config: Config, epoch: int, tmp: str) -> Path:
        return self.folder / f"epoch_{epoch + 1:05d}"


def local_checkpoints(config: Config) -> Path:
    return Path(config.train.storage_path) / config.train.name / "local_checkpoints"


def latest_local_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint directory (one with its summary written last)."""
    found = sorted(d for d in folder.glob("epoch_*") if (d / "summary.json").is_file())
    return found[-1] if found else None


def save_and_report(session, model, recipe, worker, epoch, step, metrics, keep, run_id) -> None:
    """Rank 0 writes the checkpoint; every rank reports."""
    rng = gather_rng(worker)
    with tempfile.TemporaryDirectory() as tmp:
        directory = None
        if worker.lead:
            directory = session.checkpoint_dir(worker.config, epoch, tmp)
            directory.mkdir(parents=True, exist_ok=True)
            save_checkpoint(directory, training_state(model, recipe, epoch, step, rng, worker, keep, run_id),
                            {**metrics, "keep": keep, "mlflow_run_id": run_id})
        session.report(metrics, directory)


def seed_worker(config: Config, rank: int) -> None:
    import random

    seed = config.seed * 1000 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_epoch(loader, epoch: int, config: Config, patch: int) -> None:
    """Positions the loader's order (and resolution) at ``epoch``, also after a resume."""
    loader.next_epoch = epoch
    prog = config.data.progressive
    if prog is not None:
        set_resolution(loader, progressive_res(epoch, prog.start_res, prog.end_res, prog.start_epoch,
                                               prog.end_epoch, multiple=patch))


def epoch_line(epoch: int, epochs: int, metrics: dict[str, float], started: float, done: int) -> str:
    elapsed = time.perf_counter() - started
    eta = elapsed / max(done, 1) * (epochs - epoch - 1)
    extra = f" val_top1_ema {metrics['val_top1_ema']:.2f}%" if "val_top1_ema" in metrics else ""
    keep = f" keep {metrics['keep_total']:.0f}" if "keep_total" in metrics else ""
    return (f"epoch {epoch + 1}/{epochs} loss {metrics['train_loss']:.4f} val_top1 {metrics['val_top1']:.2f}%"
            f"{extra}{keep} | {metrics['images_per_s']:.0f} img/s | eta {time.strftime('%H:%M:%S', time.gmtime(eta))}")


def train_worker(config_dict: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: the typed config first, then pipeline/ does the work."""
    config = Config.model_validate(config_dict)
    train(config, RaySession())


def train_local(config: Config) -> None:
    """The same loop in this process, without Ray Train (``train.workers: 0``)."""
    train(config, LocalSession(config))


def train(config: Config, session) -> None:
    """Builds everything, resumes from the session's latest checkpoint, and trains to ``recipe.epochs``."""
    from pipeline.train.run_tracking import JobTracker

    worker = Worker(session.rank, session.world, session.device, config)
    seed_worker(config, worker.rank)
    model = build_model(config)
    init_from(config, model)
    model = session.prepare(model)
    train_loader = shared_loader(config.data.loader, loader_spec(config, unwrap(model), worker, train=True))
    evaluation = val_loader(config, unwrap(model), worker)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise InputError(f"data.batch_size={config.data.batch_size} x {worker.world} workers is larger than the "
                         "training set; lower the batch size")
    recipe = build_recipe(unwrap(model), config.recipe, num_classes=config.data.num_classes,
                          global_batch=config.data.batch_size * worker.world, steps_per_epoch=steps_per_epoch,
                          retention_lr_scale=config.train.ksearch_lr_scale)
    start_epoch, step, run_id = 0, 0, None
    state = session.latest()
    if state is not None:
        start_epoch, step = restore(state, model, recipe, worker)
        run_id = state["mlflow_run_id"]
    tracker = JobTracker.open(config, run_id) if worker.lead else None
    if worker.lead:
        print(f"[rank 0] {config.train.mode}: {worker.world} worker(s) on {worker.device}, "
              f"{steps_per_epoch} steps/epoch, lr {recipe.lr:.2e}, epochs {start_epoch + 1}..{config.recipe.epochs}",
              flush=True)
    run_epochs(config, session, worker, model, recipe, train_loader, evaluation, tracker, start_epoch, step)


def run_epochs(config, session, worker, model, recipe, train_loader, evaluation, tracker, start_epoch, step) -> None:
    patch = unwrap(model).patch_embed.patch_size[0]
    steps_per_epoch = len(train_loader)
    started, keep = time.perf_counter(), None
    for epoch in range(start_epoch, config.recipe.epochs):
        set_epoch(train_loader, epoch, config, patch)
        stats, step = train_one_epoch(model, train_loader, recipe, worker, epoch, step, steps_per_epoch)
        metrics = {"train_loss": global_mean(stats.loss, worker), "val_top1": evaluate(model, evaluation, worker),
                   "images_per_s": stats.images * worker.world / max(stats.seconds, 1e-9),
                   "lr": recipe.optimizer.param_groups[0]["lr"], "epoch": epoch + 1,
                   "replica_divergence": replica_divergence(model, worker)}
        if metrics["replica_divergence"] > 0:
            raise JobError(f"DDP replicas diverged by {metrics['replica_divergence']:.3g} after epoch {epoch + 1}")
        if recipe.ema is not None:
            metrics["val_top1_ema"] = evaluate(recipe.ema.module, evaluation, worker)
        if config.train.mode == "ksearch":
            keep = retention_keep(unwrap(model))
            metrics["penalty"] = global_mean(stats.penalty, worker)
            metrics["keep_total"] = float(sum(keep))
        elif config.train.mode == "finetune":
            keep = list(unwrap(model).blocks.config.keep)
        if tracker is not None:
            tracker.log_epoch(metrics, epoch + 1)
            print(epoch_line(epoch, config.recipe.epochs, metrics, started, epoch + 1 - start_epoch), flush=True)
        save_and_report(session, model, recipe, worker, epoch, step, metrics, keep,
                        None if tracker is None else tracker.run_id)
    if tracker is not None:
        tracker.finish(unwrap(model), keep)
