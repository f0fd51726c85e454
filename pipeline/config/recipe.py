"""``recipe:``, DeiT's optimisation recipe."""

from __future__ import annotations

from pydantic import Field, field_validator

from pipeline.config.base import Section
from pipeline.errors import InputError

# The optimizers DeiT's and timm's own recipes use, accepted without asking timm (importing it costs seconds of
# torch at every config load); any other name is looked up in timm's registry (``timm.optim.list_optimizers``), and
# tests/test_config_refusals.py holds these to it.
COMMON_OPTIMIZERS = ("adamw", "sgd", "momentum", "lamb", "adam", "lion", "nadam", "rmsproptf")
# The learning rates of timm's and DeiT's recipes (at their own batch) lie within about 1e-4 to 0.5; one two orders
# of magnitude outside gets a warning at plan time (docs/usage.md).
TYPICAL_LR = (1e-6, 50.0)


def timm_optimizer(name: str) -> str:
    """``name`` where timm's ``create_optimizer_v2`` takes it (its last ``_`` part names the optimizer, as in
    ``lookahead_adamw``), else an InputError with some valid names."""
    base = name.lower().split("_")[-1]
    if base in COMMON_OPTIMIZERS:
        return name
    from timm.optim import list_optimizers  # only for a name off the common list

    known = list_optimizers()
    if base not in known:
        raise InputError(f"{name!r} is not an optimizer of timm; for example {', '.join(COMMON_OPTIMIZERS)} "
                         f"(timm.optim.list_optimizers() lists all {len(known)})")
    return name


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

    @field_validator("opt")
    @classmethod
    def _timm_has_it(cls, name: str) -> str:
        return timm_optimizer(name)
