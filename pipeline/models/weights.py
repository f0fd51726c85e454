"""Loading weights into a model: a timm state-dict file, or a state dict (a checkpoint's), tolerating only
the parameters that downsampling adds or drops. Every path that loads weights into a network comes here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.errors import InputError, MissingFileError


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
    state dict's retention weights may be extra, and so may a conv placement's layers where the model has no
    layers of its own (the same weights without downsampling: an evaluation's reference, an analysis applying
    another method). Anything else raises ValueError naming ``source``.
    """
    own_layers = any(".downsample." in k for k in model.state_dict())
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a parameter of another shape: weights of another architecture
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise InputError(f"{source}: weights of another architecture ({first}); give weights of this model") \
            from None
    missing = [k for k in missing if not k.endswith(("qk_alpha", "retention")) and ".downsample." not in k]
    unexpected = [k for k in unexpected if not k.endswith("retention") and (own_layers or ".downsample." not in k)]
    if missing or unexpected:
        raise InputError(f"{source}: state dict does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
