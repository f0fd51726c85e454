"""A method's declared options against its operator, on a tiny model: where a ``MethodSpec`` declares an option its
operator does not take (``build(**options)`` forwards every option), or a value it cannot run, the first forward
fails, possibly inside a Ray worker hours into a run. ``probe_method`` finds that before any work, in one line, for
``pipeline methods`` (every option at two values) and ``run --plan`` (the config's options).

It checks the spec against the operator, not the operator itself: an operator that fails at its own defaults has a
fault of its own, which its stages report as they run (a rehearsal names it per stage); the probe says nothing then.
"""

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
    """Builds method ``name``'s operator and runs it in a tiny model's forward: with ``options`` (resolved by its
    spec) where given, else at its defaults and with each option's second value (``Option.samples``). InputError
    naming the method, the options and what the operator said where building fails, or where a forward fails with
    options while it passes at the defaults."""
    spec = method_spec(name)
    defaults = spec.defaults()
    settings = [spec.resolve(name, options)] if options is not None else [
        defaults, *({**defaults, key: value} for key, option in spec.options.items() for value in option.samples()[1:])]
    for resolved in settings:
        _refuse(name, resolved, _build_error(name, resolved))
    if _forward_error(name, defaults) is not None:
        return  # the operator's own fault at its defaults: not a disagreement with its spec
    for resolved in settings:
        _refuse(name, resolved, _forward_error(name, resolved))


def _refuse(name: str, options: dict[str, Any], err: Exception | None) -> None:
    if err is None:
        return
    shown = ", ".join(f"{key}={value!r}" for key, value in options.items()) or "no options"
    what = " ".join(str(err).split()) or type(err).__name__
    raise InputError(f"method {name!r}: its operator fails with {shown} ({type(err).__name__}: {what}); its "
                     "MethodSpec declares an option the operator does not take, or a value it cannot run: make the "
                     "two agree")


def _build_error(name: str, options: dict[str, Any]) -> Exception | None:
    """What building the operator with ``options`` raised (a learnable method is built per block, in the forward)."""
    spec = method_spec(name)
    if spec.learnable:
        return None
    try:
        spec.factory()(**options)
    except Exception as err:  # whatever the factory raises: the spec's options are not the operator's
        return err
    return None


def _forward_error(name: str, options: dict[str, Any]) -> Exception | None:
    """What a tiny model's forward with the method at ``options`` raised, or None."""
    spec = method_spec(name)
    # Seeded for a probe that says the same each time, in a random state of its own: the `run` driver's (and any
    # caller's) global generator goes on as if no probe had drawn from it. The CPU's only: the model is built there.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            model = create_model("deit_tiny_patch16_224", method=name,
                                 keep=_LEARNABLE_KEEP if spec.learnable else _KEEP, options=options, **_TINY)
            with torch.no_grad():
                model(torch.randn(2, 3, _TINY["img_size"], _TINY["img_size"]))
        except Exception as err:  # whatever the operator raises, in one line
            return err
    return None
