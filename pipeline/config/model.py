"""``model:``, the network."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import PatchEmbed, Section
from pipeline.errors import InputError


class ModelConfig(Section):
    """The network: a timm model name plus overrides (a small DeiT-style ViT for Fashion-MNIST, or a new width)."""

    name: str = "deit_small_patch16_224"
    img_size: int | None = Field(None, ge=8)
    patch_size: int | None = Field(None, ge=1)
    embed_dim: int | None = Field(None, ge=8, description="a sweep over M sets this")
    depth: int | None = Field(None, ge=1)
    num_heads: int | None = Field(None, ge=1)
    drop_path: float = Field(0.1, ge=0, lt=1, description="stochastic depth rate (DeiT: 0.1)")
    weights: str | None = Field(None, description="a timm state dict to start from (mode base)")
    pretrained: bool = Field(False, description="timm's published weights (needs a network)")
    mean: tuple[float, float, float] | None = Field(None, description="overrides the model's data config")
    std: tuple[float, float, float] | None = Field(None, description="overrides the model's data config")
    crop_pct: float | None = Field(None, gt=0, le=1, description="overrides the model's data config")
    qk_norm: Literal["fixed", "learned"] | None = Field(
        None, description="L2-normalised queries and keys with logits alpha * q.k (Appendix F), in every stage: fixed "
        "alpha, or one alpha a block learned")
    alpha: float = Field(1.0, gt=0, allow_inf_nan=False, description="qk_norm's alpha (learned: its initial value)")
    patch_embed: PatchEmbed = Field(
        "conv", description="the patch embedding as timm's convolution, or as the same function in one matmul "
        "(much faster on CUDA; same parameters)")

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _triple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.embed_dim is not None and self.num_heads is not None and self.embed_dim % self.num_heads:
            raise InputError(f"embed_dim {self.embed_dim} does not split into {self.num_heads} heads")
        if self.qk_norm is None and self.alpha != 1.0:
            raise InputError(f"model.alpha={self.alpha:g} scales normalised queries and keys: set model.qk_norm "
                             "(fixed or learned) too, or leave model.alpha out")
        return self
