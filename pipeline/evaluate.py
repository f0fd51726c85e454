"""Evaluating a trained checkpoint: top-1 on the validation set, GFLOPs (fvcore) and measured images/s."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from pipeline.config import Config
from pipeline.train.checkpoint import load_checkpoint, load_model_weights


@dataclass(frozen=True)
class Evaluation:
    top1: float
    gflops: float
    images_per_s: float
    images_per_s_spread: float
    num_images: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_from_checkpoint(path: str) -> tuple[nn.Module, Config]:
    """Rebuilds the network a checkpoint was trained as (its own config) and loads its weights."""
    from pipeline.train.build import build_model

    state = load_checkpoint(path)
    config = Config.model_validate(state["config"])
    model = build_model(config)
    load_model_weights(model, state, path)
    return model.eval(), config


@torch.no_grad()
def top1(model: nn.Module, config: Config, device: torch.device) -> tuple[float, int]:
    """Top-1 (%) over the whole validation set with the validation loader of ``config``."""
    from pipeline.data.loaders import shared_loader
    from pipeline.train.loop import Worker, loader_spec

    worker = Worker(0, 1, device, config)
    loader = shared_loader(config.data.loader, loader_spec(config, model, worker, train=False))
    correct = total = 0
    for images, labels in loader:
        correct += int((model(images.to(device)).argmax(-1) == labels.to(device)).sum())
        total += labels.numel()
    return 100.0 * correct / max(total, 1), total


@torch.no_grad()
def throughput(model: nn.Module, *, batch: int, warmup: int, repeats: int, device: torch.device
               ) -> tuple[float, float]:
    """Inference images/s at ``batch``: median over ``repeats`` timed passes, and the spread (max - min)."""
    from pipeline.benchmark import _timed

    images = torch.randn(batch, 3, *model.patch_embed.img_size, device=device)
    for _ in range(warmup):
        _timed(lambda: model(images), device)
    rates = [batch / _timed(lambda: model(images), device) for _ in range(repeats)]
    return statistics.median(rates), max(rates) - min(rates)


def evaluate_checkpoint(path: str, *, batch: int, warmup: int, repeats: int, device: str = "cpu") -> Evaluation:
    """Everything the select stage needs about one trained model."""
    from pipeline.flops import count_flops

    model, config = model_from_checkpoint(path)
    flops = count_flops(model).total
    target = torch.device(device)
    model = model.to(target)
    accuracy, count = top1(model, config, target)
    rate, spread = throughput(model, batch=batch, warmup=warmup, repeats=repeats, device=target)
    return Evaluation(top1=accuracy, gflops=flops, images_per_s=rate, images_per_s_spread=spread, num_images=count)
