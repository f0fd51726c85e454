"""Models for training: the config's timm ViT, with the downsampling each mode asks for."""

from __future__ import annotations

from typing import Any

import timm
from torch import nn

from pipeline.config import Config, ConfigError
from pipeline.models import apply_downsampling


def model_kwargs(config: Config) -> dict[str, Any]:
    """``timm.create_model`` keyword arguments from the model and data sections."""
    cfg = config.model
    kwargs: dict[str, Any] = {"num_classes": config.data.num_classes, "drop_path_rate": cfg.drop_path}
    for key in ("img_size", "patch_size", "embed_dim", "depth", "num_heads"):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    overlay = {key: getattr(cfg, key) for key in ("mean", "std", "crop_pct") if getattr(cfg, key) is not None}
    if cfg.img_size is not None:
        overlay["input_size"] = (3, cfg.img_size, cfg.img_size)
    if overlay:
        kwargs["pretrained_cfg_overlay"] = overlay
    return kwargs


def finetune_keep(config: Config) -> list[int]:
    """The keep list of a finetune: ``pooling.keep``, or the paper's ``pooling.level`` for the model."""
    from pipeline.sparsity import level_keep

    if config.pooling.keep is not None:
        return list(config.pooling.keep)
    if config.pooling.level is not None:
        if any(getattr(config.model, key) is not None for key in ("embed_dim", "depth", "patch_size", "img_size")):
            raise ConfigError("pooling.level holds the paper's keep lists for its unmodified DeiTs; with model "
                              "overrides give pooling.keep instead")
        return level_keep(config.model.name, config.pooling.level)
    raise ConfigError("train.mode=finetune needs a keep list: set pooling.keep (K_1..K_L) or pooling.level")


def build_model(config: Config) -> nn.Module:
    """The network of ``config.train.mode``.

    base and baseline: no downsampling; ksearch: PoWER-BERT soft-extract layers; finetune:
    ``pooling.method`` with its keep list. Invalid names, widths and keep lists raise here, before
    any training starts.
    """
    cfg, mode = config.model, config.train.mode
    if cfg.name not in timm.list_models() and cfg.name not in timm.list_models(pretrained=True):
        raise ConfigError(f"model.name: unknown timm model {cfg.name!r}; for example deit_small_patch16_224")
    try:
        model = timm.create_model(cfg.name, pretrained=cfg.pretrained, **model_kwargs(config))
    except (TypeError, AssertionError, RuntimeError) as err:
        raise ConfigError(f"model: timm cannot build {cfg.name!r} with these overrides: {err}") from None
    if mode == "ksearch":
        apply_downsampling(model, "none", soft_extract=True)
    elif mode == "finetune":
        pool = config.pooling
        if pool.method == "none":
            raise ConfigError("train.mode=finetune with pooling.method=none is the baseline; use train.mode=baseline")
        apply_downsampling(model, pool.method, finetune_keep(config), carry=pool.carry, qk_norm=pool.qk_norm,
                           alpha=pool.alpha, **pool.options())
    return model


def arch_signature(model: nn.Module) -> dict[str, Any]:
    """What must agree for a checkpoint to load: widths, depth, heads, patches, classes."""
    return {
        "embed_dim": int(model.embed_dim),
        "depth": len(model.blocks),
        "num_heads": int(model.blocks[0].attn.num_heads),
        "num_patches": int(model.patch_embed.num_patches),
        "num_prefix_tokens": int(model.num_prefix_tokens),
        "num_classes": int(model.num_classes),
    }


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP (or the module itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def data_config(model: nn.Module) -> dict[str, Any]:
    """timm's resolved data config (input size, mean, std, crop_pct) of ``model``."""
    return timm.data.resolve_model_data_config(unwrap(model))
