"""The downsampling methods: everything the rest of the project knows about each one, in one place.

This module imports no torch, so the config (and ``jobs/submit.py`` on a laptop that only submits
jobs) can validate method names and options with pydantic and PyYAML alone. The operators themselves
are named by ``"module:attribute"`` and imported on first use.

Adding a method is one module with its operator plus one ``register_method`` call::

    from pipeline.methods import MethodSpec, register_method

    register_method("firstk", MethodSpec(
        build="mypackage.firstk:build",   # build(**options) -> step(tokens, k, *, scores, sizes, metric, ...)
        summary="keep the first K tokens",
        options={"offset": 0},            # accepted options and their defaults
    ))

The config, ``pipeline flops``, ``bench ops`` / ``bench throughput``, training and the analyses then
accept ``method: firstk`` (docs/design.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pipeline.errors import InputError

# Which attention the scores measure: "eq4", the paper's (the attention each token receives from every
# query), or "cls", the class token's row of it alone (EViT's token attentiveness; one query row a head,
# so it costs B*H*T*D multiply-adds where eq. 4 costs B*H*T^2*D). The operators take the scores as they
# come; the models compute the kind the method's options name.
SIGNIFICANCE = ("eq4", "cls")


def check_significance(significance: object) -> None:
    """InputError unless ``significance`` names a kind of scores (``SIGNIFICANCE``)."""
    if significance not in SIGNIFICANCE:
        raise InputError(f"significance must be one of {SIGNIFICANCE}, got {significance!r}")


SCORE_OPTIONS = MappingProxyType({"significance": "eq4"})
CLUSTER_OPTIONS = MappingProxyType({"iters": 5, "init": "topk", "cluster_on": "tokens", **SCORE_OPTIONS})


@dataclass(frozen=True)
class MethodSpec:
    """One registered method.

    Attributes:
        build: the operator's factory, or ``"module:attribute"`` naming it. Called as
            ``build(**options)``, or ``build(dim, **options)`` for a learnable method (one instance
            per downsampling block, ``build(dim, grid=(h, w), k=K)``).
        summary: one line for ``pipeline methods``.
        needs_scores: reads significance scores (eq. 4 by default; the models compute them only then).
        options: the options it accepts, with their defaults. ``cluster_on: metric`` makes the models
            hand it the attention keys averaged over heads as ``metric``; ``significance: cls`` makes
            them compute its scores from the class token's attention instead of eq. 4.
        learnable: has parameters of its own, one set per block.
        reconstructs: takes part in ``analyze reconstruction`` (parameter-free methods that downsample).
    """

    build: Callable[..., Any] | str
    summary: str
    needs_scores: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    learnable: bool = False
    reconstructs: bool = True

    def factory(self) -> Callable[..., Any]:
        if callable(self.build):
            return self.build
        module, _, attribute = self.build.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def resolve(self, name: str, given: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults updated by ``given``; ValueError for an option this method does not take."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            accepted = ", ".join(sorted(self.options)) or "none"
            raise InputError(f"method {name!r} got options it does not take: {unknown}; it takes: {accepted}")
        return {**self.options, **given}

    def needs_metric(self, options: Mapping[str, Any]) -> bool:
        """Whether, with these (resolved) options, the method clusters on the mean keys."""
        return options.get("cluster_on") == "metric"

    @staticmethod
    def significance(options: Mapping[str, Any]) -> str:
        """Which scores the models compute for it, with these (resolved) options: ``"eq4"`` or ``"cls"``."""
        return options.get("significance", "eq4")


METHODS: dict[str, MethodSpec] = {
    "none": MethodSpec("pipeline.pooling.registry:keep_all", "keep every token", reconstructs=False),
    "kmeans": MethodSpec("pipeline.pooling.registry:kmeans", "K-Means (eq. 6-7)", True, CLUSTER_OPTIONS),
    "kmedoids": MethodSpec("pipeline.pooling.registry:kmedoids", "K-Medoids (eq. 8)", True, CLUSTER_OPTIONS),
    "wkmeans": MethodSpec("pipeline.pooling.registry:wkmeans", "weighted K-Means", True, CLUSTER_OPTIONS),
    "wkmedoids": MethodSpec("pipeline.pooling.registry:wkmedoids", "weighted K-Medoids", True, CLUSTER_OPTIONS),
    "powerbert": MethodSpec("pipeline.pooling.registry:powerbert", "top-K significance", True, SCORE_OPTIONS),
    "random": MethodSpec("pipeline.pooling.registry:random", "uniform selection"),
    "importance": MethodSpec("pipeline.pooling.registry:importance", "significance sampling", True, SCORE_OPTIONS),
    # ToMe matches on the keys averaged over heads, as ToMe itself does, unless told otherwise.
    "tome": MethodSpec("pipeline.pooling.registry:tome", "ToMe bipartite soft matching",
                       options={"cluster_on": "metric"}),
    "conv": MethodSpec("pipeline.pooling.conv:GridConvDownsample", "2x2 stride-2 convolution", learnable=True,
                       reconstructs=False),
}


def register_method(name: str, spec: MethodSpec) -> None:
    """Adds (or replaces) a method; every consumer reads ``METHODS`` when it needs it."""
    if not name.replace("_", "").isalnum():
        raise InputError(f"method name must be letters, digits and underscores, got {name!r}")
    METHODS[name] = spec


def method_spec(name: str) -> MethodSpec:
    """The spec of ``name``; ValueError listing the methods when there is none."""
    spec = METHODS.get(name)
    if spec is None:
        raise InputError(f"unknown downsampling method {name!r}; choose one of {sorted(METHODS)}")
    return spec
