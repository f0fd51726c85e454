"""``recipe:``, DeiT's optimisation recipe."""

from __future__ import annotations

from pydantic import Field

from pipeline.config.base import Section


class RecipeConfig(Section):
    """Optimisation: DeiT's recipe through timm's optimizer, scheduler, Mixup/CutMix, losses and EMA."""

    epochs: int = Field(300, ge=1)
    opt: str = Field("adamw", description="timm.optim name; weight decay skips norms and biases")
    lr: float = Field(5e-4, gt=0, description="at a global batch of lr_batch; scaled linearly")
    lr_batch: int = Field(512, ge=1)
    min_lr: float = Field(1e-5, ge=0)
    warmup_epochs: float = Field(5, ge=0)
    warmup_lr: float = Field(1e-6, ge=0)
    weight_decay: float = Field(0.05, ge=0)
    label_smoothing: float = Field(0.1, ge=0, lt=1)
    mixup: float = Field(0.8, ge=0, description="Mixup alpha (0: off)")
    cutmix: float = Field(1.0, ge=0, description="CutMix alpha (0: off)")
    mixup_prob: float = Field(1.0, ge=0, le=1)
    mixup_switch_prob: float = Field(0.5, ge=0, le=1)
    clip_grad: float | None = Field(None, gt=0, description="clip the gradient norm (None: off)")
    ema: bool = Field(False, description="keep an EMA of the weights (timm ModelEmaV3) and evaluate it too")
    ema_decay: float = Field(0.99996, gt=0, lt=1)
    amp: bool = Field(True, description="bf16 autocast on GPU (ignored on CPU)")
