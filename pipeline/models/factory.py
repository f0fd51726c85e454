"""The one way a model is built: a timm ViT by name, with architecture overrides, weights and downsampling.

``pipeline train`` (``train.build.build_model``), the benchmarks, ``pipeline flops``, the analyses and
the evaluate stage all build through ``create_model``, so a custom width, depth or patch size means the
same thing everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import timm
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from pipeline.errors import InputError
from pipeline.methods import downsamples
from pipeline.models.downsampling import apply_downsampling
from pipeline.models.families import decide_family
from pipeline.models.patch_embed import use_patch_embed
from pipeline.models.weights import load_weights
from pipeline.runtime import KernelChoice

ARCH_OVERRIDES = ("img_size", "patch_size", "embed_dim", "depth", "num_heads")


def create_model(
    name: str,
    *,
    method: str = "none",
    keep: list[int] | None = None,
    num_classes: int | None = None,
    img_size: int | None = None,
    patch_size: int | None = None,
    embed_dim: int | None = None,
    depth: int | None = None,
    num_heads: int | None = None,
    drop_path: float | None = None,
    data_overlay: dict[str, Any] | None = None,
    weights: str | Path | None = None,
    pretrained: bool = False,
    carry: bool = False,
    qk_norm: str | None = None,
    alpha: float = 1.0,
    soft_extract: bool = False,
    options: dict[str, Any] | None = None,
    patch_embed: str = "conv",
    kernels: KernelChoice | None = None,
) -> VisionTransformer:
    """Builds the timm ViT ``name`` (any architecture field overridden), loads weights, adds downsampling.

    ``weights`` is a local state-dict file; ``pretrained=True`` asks timm for the published weights
    (from the Hugging Face hub, so only where a network exists, and only for the published
    architecture). ``data_overlay`` overrides the model's data config (mean, std, crop_pct,
    input_size). The downsampling arguments are ``apply_downsampling``'s; with none of them the
    result is the unmodified timm model. ``patch_embed="matmul"`` computes the patch embedding as one
    matmul (``models.patch_embed``: the same function and parameters, much faster on CUDA). ``kernels``
    (the config's ``kernels`` section) picks the implementation of each fused step.
    """
    if name not in timm.list_models() and name not in timm.list_models(pretrained=True):
        raise InputError(f"unknown timm model {name!r}; for example deit_small_patch16_224")
    arch = {key: value for key, value in dict(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim,
                                               depth=depth, num_heads=num_heads).items() if value is not None}
    if pretrained and arch:
        raise InputError(f"no published weights exist for {name} with {arch}; pass weights=PATH instead")
    kwargs: dict[str, Any] = dict(arch)
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if drop_path is not None:
        kwargs["drop_path_rate"] = drop_path
    if data_overlay:
        kwargs["pretrained_cfg_overlay"] = data_overlay
    try:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except AssertionError as err:  # timm's checks, e.g. a width that the heads do not divide
        heads = f"{num_heads} heads" if num_heads else "the model's heads"
        detail = f"embed_dim {embed_dim} does not split into {heads}; " if embed_dim else ""
        raise InputError(f"timm cannot build {name!r} with {arch}: {detail}{err}") from None
    except (TypeError, RuntimeError) as err:
        raise InputError(f"timm cannot build {name!r} with {arch}: {err}") from None
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", (1, 1))
    if min(grid) < 1:
        raise InputError(f"{name!r}: patches of {model.patch_embed.patch_size} do not fit in images of "
                         f"{model.patch_embed.img_size}; give model.patch_size at most model.img_size")
    if downsamples(method) or keep is not None or carry or qk_norm is not None or soft_extract or options:
        apply_downsampling(model, method, keep, carry=carry, qk_norm=qk_norm, alpha=alpha,
                           soft_extract=soft_extract, kernels=kernels, **(options or {}))
    else:  # the unmodified timm model itself (base and baseline training, the benchmarks' reference), of a family
        decide_family(model)  # the step runs in: a base of any other would fail at its first finetune
    use_patch_embed(model, patch_embed)
    if weights is not None:  # same keys as timm's: a plain timm checkpoint loads as it is
        load_weights(model, weights)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP or ``torch.compile`` (or the module itself)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def data_config(model: nn.Module) -> dict[str, Any]:
    """timm's resolved data config (input size, mean, std, crop_pct) of ``model``."""
    return timm.data.resolve_model_data_config(unwrap(model))
