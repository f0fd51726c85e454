"""The paper's in-between DeiT widths (e252, e318), registered the timm way."""

from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, _create_vision_transformer

from pipeline.errors import InputError

DEIT_BASE_ARGS = dict(patch_size=16, depth=12, mlp_ratio=4.0, qkv_bias=True)

# DeiT's data config (timm's deit_*_patch16_224): register_model reads this module's default_cfgs.
_DEIT_CFG = dict(url="", num_classes=1000, input_size=(3, 224, 224), pool_size=None, crop_pct=0.875,
                 interpolation="bicubic", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                 first_conv="patch_embed.proj", classifier="head")
default_cfgs = generate_default_cfgs({
    "deit_e252_patch16_224.untrained": dict(_DEIT_CFG),
    "deit_e318_patch16_224.untrained": dict(_DEIT_CFG),
})


def _paper_width(variant: str, embed_dim: int, pretrained: bool, **kwargs: Any) -> VisionTransformer:
    if pretrained:
        raise InputError(f"no published weights exist for {variant}; load a local file instead (weights=PATH)")
    return _create_vision_transformer(variant, **(DEIT_BASE_ARGS | dict(embed_dim=embed_dim, num_heads=6) | kwargs))


@register_model
def deit_e252_patch16_224(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """DeiT-e252 of the paper: embed dim 252, 6 heads."""
    return _paper_width("deit_e252_patch16_224", 252, pretrained, **kwargs)


@register_model
def deit_e318_patch16_224(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """DeiT-e318 of the paper: embed dim 318, 6 heads."""
    return _paper_width("deit_e318_patch16_224", 318, pretrained, **kwargs)
