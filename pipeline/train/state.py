"""A training job's state: what a checkpoint holds so that a resumed job continues exactly, and how
each rank's random streams are seeded and restored."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.config import Config, config_hash
from pipeline.models import unwrap
from pipeline.train.build import arch_signature
from pipeline.train.checkpoint import rng_state, set_rng_state


def seed_worker(config: Config, rank: int) -> None:
    seed = config.seed * 1000 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def gather(value: Any, world: int) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if world == 1:
        return [value]
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    return values


def gather_rng(world: int) -> list[dict[str, Any]]:
    """Every rank's RNG state, on every rank (rank r restores entry r on resume)."""
    return gather(rng_state(), world)


def training_state(job, epoch: int, step: int, rng: list, keep: list[int] | None,
                   metrics: dict[str, float]) -> dict[str, Any]:
    """Everything a resumed job needs to continue exactly where this one stands (``job``: a ``Job``)."""
    config, recipe, model = job.config, job.recipe, unwrap(job.model)
    return {
        "model": model.state_dict(),
        "optimizer": recipe.optimizer.state_dict(),
        "scheduler": recipe.scheduler.state_dict(),
        "scaler": None,  # bf16 autocast needs no loss scaling; kept for the format's readers
        "ema": None if recipe.ema is None else recipe.ema.state_dict(),
        "epoch": epoch,
        "step": step,
        "rng": rng,
        "data_seed": config.seed,
        "world_size": job.session.world,
        "arch": arch_signature(model),
        "mode": config.train.mode,
        "keep": keep,
        "config_hash": config_hash(config),
        "config": config.model_dump(mode="json"),
        "mlflow_run_id": job.run_id,
        "metrics": metrics,  # the epoch's, for MLflow if the job stopped before logging them
        "ksearch_dual": None if job.target is None else job.target.dual_value(),  # the target search's strength
    }


def restore(state: dict[str, Any], job) -> tuple[int, int]:
    """Loads a checkpoint of this job into it; returns (next epoch, global step)."""
    unwrap(job.model).load_state_dict(state["model"])
    job.recipe.optimizer.load_state_dict(state["optimizer"])
    job.recipe.scheduler.load_state_dict(state["scheduler"])
    if job.recipe.ema is not None and state["ema"] is not None:
        job.recipe.ema.load_state_dict(state["ema"])
    if job.target is not None and state.get("ksearch_dual") is not None:
        job.target.dual = state["ksearch_dual"]
    rank, world = job.session.rank, job.session.world
    if len(state["rng"]) == world:
        set_rng_state(state["rng"][rank])
    else:  # a different worker count: the sample order stays seeded, per-rank RNG streams restart
        torch.manual_seed(job.config.seed * 1000 + rank + 7919 * state["epoch"])
    return state["epoch"] + 1, state["step"]
