"""The per-worker training loop that Ray Train runs (DDP over gloo on CPU, NCCL on GPU), or this process
runs alone (``train.workers: 0``); ``pipeline.train.session`` says which."""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pipeline.config import Config
from pipeline.console import say
from pipeline.data.loaders import (
    ffcv_loader,
    loader_spec,
    progressive_res,
    read_metadata,
    set_resolution,
    shared_loader,
)
from pipeline.data.split import holdout_split
from pipeline.errors import JobError, LossNotFiniteError
from pipeline.models import data_config, load_weights, project_retention, retention_keep, retention_penalty, unwrap
from pipeline.models.selfcheck import check_model
from pipeline.runtime import autocast, compile_model, cuda_settings, peak_memory_mb, step_marker
from pipeline.train.build import arch_signature, build_model
from pipeline.train.checkpoint import check_architecture, load_init, load_model_weights, save_checkpoint
from pipeline.train.recipe import Recipe, build_recipe
from pipeline.train.session import LocalSession, RaySession, Session
from pipeline.train.state import gather, gather_rng, restore, seed_worker, training_state


@dataclass
class Job:
    """One training job on one rank: what every epoch shares."""

    config: Config
    session: Session
    model: nn.Module  # as the session prepared it (DDP-wrapped with several ranks)
    run: Callable[[torch.Tensor], torch.Tensor]  # the model, or its torch.compile'd form (train.compile)
    recipe: Recipe
    train_loader: Any
    val_loader: Any
    test_loader: Any = None  # data.val when data.holdout > 0: the test set, measured once after the last epoch
    tracker: Any = None  # run_tracking.JobTracker on rank 0
    on_epoch: Callable[[dict[str, float]], None] | None = None  # after each epoch is checkpointed and in MLflow
    run_id: str | None = None  # the MLflow run, kept across resumes
    target: Any = None  # targets.TargetSearch: the K search toward train.ksearch_target

    def __post_init__(self) -> None:
        self.mark = step_marker(self.config.train.compile)  # before each call of ``run`` (CUDA graphs)

    @property
    def lead(self) -> bool:
        return self.session.rank == 0

    @property
    def device(self) -> torch.device:
        return self.session.device

    @property
    def dtype(self) -> str:
        return "bf16" if self.device.type == "cuda" and self.config.recipe.amp else "fp32"


@dataclass
class EpochStats:
    loss: float
    images: int
    seconds: float
    penalty: float = 0.0
    steps: int = 0


def val_loader(config: Config, model: nn.Module, session: Session, *, test: bool = False):
    """The validation loader: the held-out part of ``data.train`` when ``data.holdout`` > 0, else (and for
    ``test``) ``data.val``. Each rank reads every ``world``-th image, so the ranks' counts add up to the set."""
    holdout = config.data.holdout > 0 and not test
    spec = loader_spec(config.data, data_config(model), train=False, seed=config.seed, device=str(session.device),
                       holdout=holdout)
    if config.data.loader == "torch" or session.world == 1:
        return shared_loader(config.data.loader, spec)

    if holdout:
        indices = holdout_split(spec.path, config.data.holdout, config.data.holdout_seed).val
    else:
        indices = np.arange(int(read_metadata(spec.path)["num_images"]))
    return ffcv_loader(spec, indices=indices[session.rank::session.world])


def init_from(config: Config, model: nn.Module) -> None:
    """Loads ``train.init`` (a base checkpoint) or ``model.weights`` (a timm state dict)."""

    if config.train.init is not None:
        state = load_init(config.train.init)
        check_architecture(state, arch_signature(model), config.train.init)
        load_model_weights(model, state, config.train.init)
    elif config.model.weights is not None:
        load_weights(model, config.model.weights)


def debug_hooks(config: Config, step: int, lead: bool) -> None:
    """The documented fault-injection hooks, on rank 0 and once per job (a marker file in the run folder):
    ``train.debug_fail_at_step`` raises; ``train.debug_pause_at_step`` sleeps ``train.debug_pause_s``, writing
    the marker first, so that a test can kill a node or the driver mid-epoch."""
    train = config.train
    if not lead or step not in (train.debug_fail_at_step, train.debug_pause_at_step):
        return
    folder = Path(train.storage_path) / train.name
    if step == train.debug_pause_at_step and not (folder / f".debug_paused_at_{step}").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f".debug_paused_at_{step}").touch()
        say(f"[rank 0] debug_pause_at_step={step}: pausing {train.debug_pause_s:g} s")
        time.sleep(train.debug_pause_s)
    if step == train.debug_fail_at_step and not (folder / f".debug_failed_at_{step}").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f".debug_failed_at_{step}").touch()
        raise JobError(f"debug_fail_at_step={step}: injected failure (the job restarts from its last checkpoint)")


class StepTotals:
    """What an epoch's steps add up, kept on the device.

    Reading a device value makes the host wait for the GPU to finish every step queued so far, so that
    the copy of the next batch and the next step's launches stop overlapping the current step. The loop
    adds each step's loss here without reading it, and reads once every ``train.log_every`` steps and at
    the epoch's end (``read``), as timm's ``train.py`` reads its loss only every ``log_interval`` steps.
    A non-finite loss makes the running sum non-finite, so a read finds it, and says in which steps.
    """

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss x images, K-search penalty)
        self.images, self.steps = 0, 0
        self.read_sums, self.read_images, self.read_steps = (0.0, 0.0), 0, 0  # at the last read

    def add(self, loss: torch.Tensor, images: int, penalty: torch.Tensor | None = None) -> None:
        """Adds one step's mean loss over ``images`` images (and its penalty): no device read."""
        self.sums[0].add_(loss.detach(), alpha=images)
        if penalty is not None:
            self.sums[1].add_(penalty.detach())
        self.images += images
        self.steps += 1

    def due(self, log_every: int) -> bool:
        return self.steps % log_every == 0

    def read(self, epoch: int, step: int) -> float:
        """The mean loss of the steps since the last read, read from the device (one wait for the GPU);
        raises LossNotFiniteError (a FloatingPointError) if the loss was not finite at one of them. ``step``: the
        global step just done, for the message."""
        if self.steps == self.read_steps:
            return math.nan
        sums = self.sums.tolist()
        if not math.isfinite(sums[0]):
            first = step - (self.steps - self.read_steps) + 1
            where = f"step {step}" if first == step else f"one of the steps {first}..{step}"
            raise LossNotFiniteError(f"the training loss is not finite at {where} (epoch {epoch + 1}); lower "
                                     "recipe.lr or enable recipe.clip_grad")
        mean = (sums[0] - self.read_sums[0]) / (self.images - self.read_images)
        self.read_sums, self.read_images, self.read_steps = (sums[0], sums[1]), self.images, self.steps
        return mean

    def stats(self, seconds: float) -> EpochStats:
        """The epoch's stats, from the last read (``read`` the end of the epoch first)."""
        loss, penalty = self.read_sums
        return EpochStats(loss / max(self.images, 1), self.images, seconds, penalty / max(self.steps, 1), self.steps)


def train_step(job: Job, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> tuple[torch.Tensor,
                                                                                           torch.Tensor | None]:
    """One optimizer step on one batch; returns the loss and the K-search penalty (None otherwise), both
    left on the device. Nothing here reads a device value: the LR schedule and the EMA's decay are host
    arithmetic on the step count, and gradient clipping (no ``error_if_nonfinite``) stays on the device."""
    config, recipe = job.config, job.recipe
    if recipe.mixup is not None:
        inputs, targets = recipe.mixup(inputs, targets)
    job.mark()
    with autocast(job.device, job.dtype):
        loss = recipe.loss(job.run(inputs), targets)
    penalty = None
    if config.train.mode == "ksearch":
        if job.target is None:
            penalty = retention_penalty(unwrap(job.model), config.train.ksearch_lambda)
        else:
            penalty = job.target.penalty(unwrap(job.model))
        loss = loss + penalty
    recipe.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.recipe.clip_grad is not None:
        nn.utils.clip_grad_norm_(job.model.parameters(), config.recipe.clip_grad, foreach=True)
    recipe.optimizer.step()
    if config.train.mode == "ksearch":
        project_retention(unwrap(job.model))
        if job.target is not None:
            job.target.update()
    recipe.scheduler.step_update(step + 1)
    if recipe.ema is not None:
        recipe.ema.update(unwrap(job.model), step=step + 1)
    return loss, penalty


def train_one_epoch(job: Job, epoch: int, step: int) -> tuple[EpochStats, int]:
    """One pass over this rank's shard; returns the stats and the new global step.

    The host reads the device every ``train.log_every`` steps and at the end (``StepTotals``), not at
    every step, so that it queues the next steps while the GPU runs this one.
    """
    config = job.config
    job.model.train()
    totals, start = StepTotals(job.device), time.perf_counter()
    bar = _progress_bar(job, len(job.train_loader), epoch)
    for inputs, targets in job.train_loader:
        debug_hooks(config, step + 1, job.lead)
        inputs, targets = inputs.to(job.device, non_blocking=True), targets.to(job.device, non_blocking=True)
        loss, penalty = train_step(job, inputs, targets, step)
        step += 1
        totals.add(loss, inputs.shape[0], penalty)
        if totals.due(config.train.log_every):
            mean = totals.read(epoch, step)
            if bar is not None:
                bar.set_postfix(loss=f"{mean:.3f}")
        if bar is not None:
            bar.update(1)
    totals.read(epoch, step)
    if bar is not None:
        bar.close()
    return totals.stats(time.perf_counter() - start), step


def _progress_bar(job: Job, total: int, epoch: int):
    if not (job.lead and job.config.train.progress_bar and sys.stdout.isatty()):
        return None

    return tqdm(total=total, desc=f"epoch {epoch + 1}", leave=False, unit="batch")


@torch.no_grad()
def evaluate(job: Job, model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], loader=None) -> float:
    """Top-1 (%) of ``run`` (``model``, or its compiled form) over the whole validation set (or ``loader``),
    summed across ranks."""
    model.eval()
    mark = step_marker(job.config.train.compile) if run is not model else (lambda: None)
    counts = torch.zeros(2, dtype=torch.float64, device=job.device)
    for inputs, targets in job.val_loader if loader is None else loader:
        inputs, targets = inputs.to(job.device, non_blocking=True), targets.to(job.device, non_blocking=True)
        mark()
        with autocast(job.device, job.dtype):
            logits = run(inputs)
        counts[0] += (logits.argmax(-1) == targets).sum()
        counts[1] += targets.numel()
    if job.session.world > 1:
        dist.all_reduce(counts)
    return float(100.0 * counts[0] / counts[1].clamp(min=1))


def replica_divergence(job: Job) -> float:
    """The largest difference between ranks of any parameter (0.0 when DDP keeps them in sync)."""
    if job.session.world == 1:
        return 0.0
    flat = torch.cat([p.detach().reshape(-1).double() for p in unwrap(job.model).parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return float((high - low).max())


def global_mean(value: float, job: Job) -> float:
    if job.session.world == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=job.device)
    dist.all_reduce(tensor)
    return float(tensor) / job.session.world


def save_and_report(job: Job, epoch: int, step: int, metrics: dict[str, float], keep: list[int] | None) -> None:
    """Rank 0 writes the checkpoint; every rank reports."""
    rng = gather_rng(job.session.world)
    with tempfile.TemporaryDirectory() as tmp:
        directory = None
        if job.lead:
            directory = job.session.checkpoint_dir(epoch, Path(tmp))
            directory.mkdir(parents=True, exist_ok=True)
            save_checkpoint(directory, training_state(job, epoch, step, rng, keep, metrics),
                            {**metrics, "keep": keep, "mlflow_run_id": job.run_id})
        job.session.report(metrics, directory)


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
    if "target" in metrics:
        keep += (f" cost/unmodified {metrics['target_landed']:.3f} soft, {metrics['target_rounded']:.3f} rounded "
                 f"(target {metrics['target']:.3f})")
    extra += f" test_top1 {metrics['test_top1']:.2f}%" if "test_top1" in metrics else ""
    return (f"epoch {epoch + 1}/{epochs} loss {metrics['train_loss']:.4f} val_top1 {metrics['val_top1']:.2f}%"
            f"{extra}{keep} | {metrics['images_per_s']:.0f} img/s | eta {time.strftime('%H:%M:%S', time.gmtime(eta))}")


def train_worker(config_dict: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: the typed config first, then pipeline/ does the work."""
    config = Config.model_validate(config_dict)
    train(config, RaySession(config))


def train_local(config: Config, on_epoch: Callable[[dict[str, float]], None] | None = None) -> None:
    """The same loop in this process, without Ray Train (``train.workers: 0``); ``on_epoch`` gets each
    epoch's metrics once its checkpoint is written (a sweep trial's report to Ray Tune)."""
    train(config, LocalSession(config), on_epoch)


def build_job(config: Config, session: Session) -> Job:
    """The model (initialised, prepared, compiled as asked), loaders and recipe of this rank."""
    model = build_model(config)
    init_from(config, model)
    model = session.prepare(model)
    train_loader = loader_spec(config.data, data_config(model), train=True, seed=config.seed, world=session.world,
                               device=str(session.device))
    train_loader = shared_loader(config.data.loader, train_loader)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise JobError(f"data.batch_size={config.data.batch_size} x {session.world} workers is larger than the "
                       "training set; lower the batch size")
    recipe = build_recipe(unwrap(model), config.recipe, num_classes=config.data.num_classes,
                          global_batch=config.data.batch_size * session.world, steps_per_epoch=steps_per_epoch,
                          retention_lr_scale=config.train.ksearch_lr_scale)
    amp = session.device.type == "cuda" and config.recipe.amp  # Job.dtype's rule
    check_model(model, session.device, torch.bfloat16 if amp else torch.float32)  # eagerly, before any trace
    run = compile_model(model, config.train.compile, session.device)
    test_loader = val_loader(config, model, session, test=True) if config.data.holdout > 0 else None
    job = Job(config, session, model, run, recipe, train_loader, val_loader(config, model, session), test_loader)
    if config.train.mode == "ksearch" and config.train.ksearch_target is not None:
        from pipeline.targets import TargetSearch

        job.target = TargetSearch.build(config.train.ksearch_target, unwrap(model), config.pooling)
    return job


def train(config: Config, session: Session, on_epoch: Callable[[dict[str, float]], None] | None = None) -> None:
    """Builds everything, resumes from the session's latest checkpoint, and trains to ``recipe.epochs``;
    ``on_epoch`` (rank 0) gets each epoch's metrics once they are checkpointed and in MLflow."""
    from pipeline.train.run_tracking import JobTracker

    seed_worker(config, session.rank)
    job = build_job(config, session)
    job.on_epoch = on_epoch if session.rank == 0 else None
    start_epoch, step = 0, 0
    state = session.latest()
    if state is not None:
        start_epoch, step = restore(state, job)
        job.run_id = state["mlflow_run_id"]
        if job.lead:
            say(f"[rank 0] resuming from the checkpoint of epoch {start_epoch}")
    nodes = gather(session.node_id, session.world)
    if job.lead:
        job.tracker = JobTracker.open(config, job.run_id)
        job.run_id = job.tracker.run_id
        job.tracker.record_placement(nodes)
        if state is not None:
            job.tracker.backfill(state["epoch"] + 1, state.get("metrics"))
        compiled = "" if config.train.compile == "none" else f", torch.compile {config.train.compile}"
        say(f"[rank 0] {config.train.mode}: {session.world} worker(s) on {session.device}{compiled}, "
            f"{len(job.train_loader)} steps/epoch, lr {job.recipe.lr:.2e}, "
            f"epochs {start_epoch + 1}..{config.recipe.epochs}")
    run_epochs(job, start_epoch, step)


def epoch_metrics(job: Job, epoch: int, stats: EpochStats) -> dict[str, float]:
    metrics = {"train_loss": global_mean(stats.loss, job), "val_top1": evaluate(job, job.model, job.run),
               "images_per_s": stats.images * job.session.world / max(stats.seconds, 1e-9),
               "lr": job.recipe.optimizer.param_groups[0]["lr"], "epoch": epoch + 1,
               "replica_divergence": replica_divergence(job),
               # what `pipeline run --rehearse` reports per stage: this rank's step time and its memory high mark
               "step_s": stats.seconds / max(stats.steps, 1), "peak_memory_mb": peak_memory_mb(job.device)}
    if metrics["replica_divergence"] > 0:
        raise JobError(f"DDP replicas diverged by {metrics['replica_divergence']:.3g} after epoch {epoch + 1}")
    if job.recipe.ema is not None:
        metrics["val_top1_ema"] = evaluate(job, job.recipe.ema.module, job.recipe.ema.module)
    if job.test_loader is not None and epoch + 1 == job.config.recipe.epochs:  # the test set, once, at the end
        metrics["test_top1"] = evaluate(job, job.model, job.run, job.test_loader)
    return metrics


def run_epochs(job: Job, start_epoch: int, step: int) -> None:
    with cuda_settings(job.device):  # TF32 and cuDNN autotuning on CUDA; nothing on the CPU
        _run_epochs(job, start_epoch, step)


def _run_epochs(job: Job, start_epoch: int, step: int) -> None:
    config = job.config
    patch = unwrap(job.model).patch_embed.patch_size[0]
    started, keep = time.perf_counter(), None
    for epoch in range(start_epoch, config.recipe.epochs):
        set_epoch(job.train_loader, epoch, config, patch)
        stats, step = train_one_epoch(job, epoch, step)
        metrics = epoch_metrics(job, epoch, stats)
        if config.train.mode == "ksearch":
            if job.target is None:
                keep = retention_keep(unwrap(job.model))
            else:  # the keep list under the target, and how close the search landed before that rounding
                keep, landed = job.target.result(unwrap(job.model))
                metrics.update(landed)
            metrics["penalty"] = global_mean(stats.penalty, job)
            metrics["keep_total"] = float(sum(keep))
        elif config.train.mode == "finetune":
            keep = list(unwrap(job.model).blocks.config.keep)
        # Checkpoint first, then MLflow: a job stopped in between logs the epoch from its checkpoint on resume
        # (``backfill``), so each epoch's metrics land exactly once.
        save_and_report(job, epoch, step, metrics, keep)
        if job.tracker is not None:
            job.tracker.log_epoch(metrics, epoch + 1)
            say(epoch_line(epoch, config.recipe.epochs, metrics, started, epoch + 1 - start_epoch))
        if job.on_epoch is not None:
            job.on_epoch(metrics)
    if job.tracker is not None:
        job.tracker.finish(unwrap(job.model), keep)
