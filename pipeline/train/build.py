"""Models for training: the config's timm ViT, with the downsampling each mode asks for."""

from __future__ import annotations

from typing import Any

from torch import nn

from pipeline.config import Config, ConfigError
from pipeline.errors import InputError
from pipeline.methods import downsamples
from pipeline.models.factory import ARCH_OVERRIDES, create_model
from pipeline.sparsity import level_keep


def model_args(config: Config) -> dict[str, Any]:
    """``create_model`` keyword arguments from the model and data sections (architecture, classes, data)."""
    cfg = config.model
    args: dict[str, Any] = {key: getattr(cfg, key) for key in ARCH_OVERRIDES}
    overlay = {key: getattr(cfg, key) for key in ("mean", "std", "crop_pct") if getattr(cfg, key) is not None}
    if cfg.img_size is not None:
        overlay["input_size"] = (3, cfg.img_size, cfg.img_size)
    return args | {"num_classes": config.data.num_classes, "drop_path": cfg.drop_path,
                   "data_overlay": overlay or None, "pretrained": cfg.pretrained, "patch_embed": cfg.patch_embed}


def finetune_keep(config: Config) -> list[int]:
    """The keep list of a finetune: ``pooling.keep``, or the paper's ``pooling.level`` for the model."""

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
    ``pooling.method`` with its keep list; in every mode ``model.qk_norm`` (one ``qk_alpha`` a block). Invalid names,
    widths and keep lists raise here, before any training starts.
    """
    mode, pool = config.train.mode, config.pooling
    # the model's normalised queries and keys, in every mode (absent: the unmodified timm attention)
    downsampling: dict[str, Any] = {"qk_norm": config.model.qk_norm, "alpha": config.model.alpha}
    if mode == "ksearch":
        downsampling["soft_extract"] = True
    elif mode == "finetune":
        if not downsamples(pool.method):
            raise ConfigError("train.mode=finetune with pooling.method=none is the baseline; use train.mode=baseline")
        downsampling |= {"method": pool.method, "keep": finetune_keep(config), "carry": pool.carry,
                         "options": pool.method_options()}
    try:
        return create_model(config.model.name, **model_args(config), **downsampling,
                            kernels=config.kernels.choice())
    except InputError as err:
        raise ConfigError(f"model: {err}") from None


def arch_signature(model: nn.Module) -> dict[str, Any]:
    """What must agree for a checkpoint to load: normalised queries and keys (``model.qk_norm``), widths, depth,
    heads, patches, classes."""
    alpha = getattr(model.blocks[0], "qk_alpha", None)
    return {
        "qk_norm": None if alpha is None else "learned" if alpha.requires_grad else "fixed",
        "embed_dim": int(model.embed_dim),
        "depth": len(model.blocks),
        "num_heads": int(model.blocks[0].attn.num_heads),
        "num_patches": int(model.patch_embed.num_patches),
        "num_prefix_tokens": int(model.num_prefix_tokens),
        "num_classes": int(model.num_classes),
    }
