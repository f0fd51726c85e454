"""A method's declared options against its operator, on a tiny model: where a ``MethodSpec`` declares an option its
operator does not take (``build(**options)`` forwards every option), or a value it cannot run, the first forward
fails, possibly inside a Ray worker hours into a run. ``probe_method`` finds that before any work, in one line, for
``pipeline methods`` (every option at two values) and ``run --plan`` (the config's options)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipeline.errors import InputError
from pipeline.methods import method_spec
from pipeline.models.factory import create_model

# A 2-block ViT of 4 x 4 patches on 8 px: 4 tokens, pooled to 2, then to 1 (a 2 x 2 grid halves once for conv).
_TINY = {"img_size": 8, "patch_size": 4, "embed_dim": 8, "depth": 2, "num_heads": 2, "num_classes": 2}
_KEEP = [2, 1]
_LEARNABLE_KEEP = [1, 1]


def probe_method(name: str, options: Mapping[str, Any] | None = None) -> None:
    """Runs method ``name``'s operator in a tiny model's forward: with ``options`` (resolved by its spec) where given,
    else once at its defaults and once more for each option's second value (``Option.samples``). InputError naming
    the method, the options and what the operator said, where a forward fails."""
    spec = method_spec(name)
    if options is not None:
        settings = [spec.resolve(name, options)]
    else:
        defaults = spec.defaults()
        settings = [defaults, *({**defaults, key: value} for key, option in spec.options.items()
                                for value in option.samples()[1:])]
    for resolved in settings:
        _forward(name, resolved)


def _forward(name: str, options: dict[str, Any]) -> None:
    spec = method_spec(name)
    torch.manual_seed(0)
    try:
        model = create_model("deit_tiny_patch16_224", method=name, keep=_LEARNABLE_KEEP if spec.learnable else _KEEP,
                             options=options, **_TINY)
        with torch.no_grad():
            model(torch.randn(2, 3, _TINY["img_size"], _TINY["img_size"]))
    except Exception as err:  # whatever the operator raises: a spec that disagrees with it, in one line
        shown = ", ".join(f"{key}={value!r}" for key, value in options.items()) or "no options"
        what = " ".join(str(err).split()) or type(err).__name__
        raise InputError(f"method {name!r}: its operator fails with {shown} ({type(err).__name__}: {what}); its "
                         "MethodSpec declares an option the operator does not take, or a value it cannot run: make "
                         "the two agree") from None
