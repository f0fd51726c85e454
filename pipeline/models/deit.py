"""The paper's in-between DeiT widths, registered the timm way, and loading timm state dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, _create_vision_transformer
from torch import nn

from pipeline.errors import InputError, MissingFileError

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


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Loads a timm state dict (a bare dict, or under 'model' / 'state_dict') with no key renaming."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"weights file not found: {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    load_state(model, state, path)


def load_state(model: nn.Module, state: dict[str, Any], source: str | Path) -> None:
    """``load_state_dict`` that tolerates only the parameters downsampling adds or drops.

    A new variant's per-block alpha, conv layers and retention weights may be absent; a K-search
    state dict's retention weights may be extra. Anything else raises ValueError naming ``source``.
    """
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(("qk_alpha", "retention")) and ".downsample." not in k]
    unexpected = [k for k in unexpected if not k.endswith("retention")]
    if missing or unexpected:
        raise InputError(f"{source}: state dict does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
