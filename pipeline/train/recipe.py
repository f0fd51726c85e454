"""DeiT's training recipe, assembled from timm's own parts."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, get_optimizer_info, param_groups_weight_decay
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3
from torch import nn

from pipeline.config import RecipeConfig


@dataclass
class Recipe:
    """The optimiser and everything that steps with it."""

    optimizer: torch.optim.Optimizer
    scheduler: CosineLRScheduler
    mixup: Mixup | None
    loss: nn.Module
    ema: ModelEmaV3 | None
    lr: float


def scaled_lr(cfg: RecipeConfig, global_batch: int) -> float:
    """DeiT's linear scaling: ``lr * global_batch / lr_batch``."""
    return cfg.lr * global_batch / cfg.lr_batch


def param_groups(model: nn.Module, weight_decay: float, retention_lr_scale: float) -> list[dict]:
    """timm's groups (no decay on 1-D parameters: norms, biases), with the K search's retention
    weights apart at ``retention_lr_scale`` times the learning rate, as PoWER-BERT trains them."""
    retention = [p for name, p in model.named_parameters() if name.endswith(".retention") and p.requires_grad]
    skip = {id(p) for p in retention}
    groups = []
    for group in param_groups_weight_decay(model, weight_decay):
        params = [p for p in group["params"] if id(p) not in skip]
        if params:
            groups.append({**group, "params": params})
    if retention:
        groups.append({"params": retention, "weight_decay": 0.0, "lr_scale": retention_lr_scale})
    return groups


def fused(opt: str) -> dict[str, bool]:
    """``fused=True`` where the optimizer class takes it (torch's Adam, AdamW, SGD): the whole update in
    one kernel, on CUDA and on the CPU. The ``foreach`` form reads each parameter's step count back with
    ``.item()`` at every step. An unknown name gets nothing here; timm's factory then names the known ones."""

    try:
        takes = "fused" in inspect.signature(get_optimizer_info(opt).opt_class).parameters
    except (ValueError, KeyError, TypeError):
        return {}
    return {"fused": True} if takes else {}


def build_recipe(model: nn.Module, cfg: RecipeConfig, *, num_classes: int, global_batch: int,
                 steps_per_epoch: int, retention_lr_scale: float = 1.0) -> Recipe:
    """AdamW (no decay on norms, biases and other 1-D parameters), cosine with warm-up per step,
    Mixup/CutMix with label smoothing folded into the soft targets, and an optional EMA."""
    lr = scaled_lr(cfg, global_batch)
    optimizer = create_optimizer_v2(param_groups(model, cfg.weight_decay, retention_lr_scale), opt=cfg.opt, lr=lr,
                                    weight_decay=cfg.weight_decay, **fused(cfg.opt))
    scheduler = CosineLRScheduler(optimizer, t_initial=cfg.epochs * steps_per_epoch, lr_min=cfg.min_lr,
                                  warmup_t=int(cfg.warmup_epochs * steps_per_epoch), warmup_lr_init=cfg.warmup_lr,
                                  t_in_epochs=False)
    mixup = None
    if cfg.mixup > 0 or cfg.cutmix > 0:
        mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                      switch_prob=cfg.mixup_switch_prob, label_smoothing=cfg.label_smoothing, num_classes=num_classes)
        loss: nn.Module = SoftTargetCrossEntropy()
    elif cfg.label_smoothing > 0:
        loss = LabelSmoothingCrossEntropy(smoothing=cfg.label_smoothing)
    else:
        loss = nn.CrossEntropyLoss()
    ema = ModelEmaV3(model, decay=cfg.ema_decay) if cfg.ema else None
    return Recipe(optimizer, scheduler, mixup, loss, ema, lr)
