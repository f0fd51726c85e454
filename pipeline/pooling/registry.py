"""One interface for every downsampling method, picked by name (as timm picks attention layers).

Every built method is called as::

    step(tokens, k, *, scores=None, sizes=None, metric=None, generator=None, validate=True) -> PoolResult

with tokens (B, N, M), significance ``scores`` (B, N), carried ``sizes`` (B, N) and a cheap
similarity ``metric`` (B, N, D) such as the attention keys averaged over heads. A method ignores
what it does not use and raises a ValueError when it lacks what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from pipeline.pooling.clustering import INITS, token_pool
from pipeline.pooling.common import PoolResult, check_k, check_per_token, check_tokens, identity_result
from pipeline.pooling.conv import GridConvDownsample
from pipeline.pooling.selection import select_importance, select_random, select_topk
from pipeline.pooling.tome import tome_merge

CLUSTER_ON = ("tokens", "metric")


class Downsampler(Protocol):
    def __call__(
        self,
        tokens: Tensor,
        k: int,
        *,
        scores: Tensor | None = None,
        sizes: Tensor | None = None,
        metric: Tensor | None = None,
        generator: torch.Generator | None = None,
        validate: bool = True,
    ) -> PoolResult: ...


def _none(tokens: Tensor, k: int, *, sizes: Tensor | None = None, validate: bool = True, **_: Any) -> PoolResult:
    check_tokens(tokens, finite=validate)
    check_k(k)
    check_per_token(sizes, tokens, name="sizes", nonnegative=True, values=validate)
    return identity_result(tokens, sizes)


def _clustering(method: str, weighted: bool, *, iters: int = 5, init: str = "topk", cluster_on: str = "tokens"):
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if cluster_on not in CLUSTER_ON:
        raise ValueError(f"cluster_on must be one of {CLUSTER_ON}, got {cluster_on!r}")

    def step(tokens: Tensor, k: int, *, scores: Tensor | None = None, sizes: Tensor | None = None,
             metric: Tensor | None = None, generator: torch.Generator | None = None,
             validate: bool = True) -> PoolResult:
        if weighted and scores is None:
            raise ValueError(f"w{method} needs scores (B, N), the significance of eq. 4, as its weights")
        if cluster_on == "metric" and metric is None:
            raise ValueError("cluster_on='metric' needs metric (B, N, D), for example the keys averaged over heads")
        return token_pool(
            tokens, k, method=method, weights=scores if weighted else None, init=init, init_scores=scores,
            iters=iters, sizes=sizes, generator=generator, metric=metric if cluster_on == "metric" else None,
            validate=validate,
        )

    return step


def _selection(fn: Callable[..., PoolResult], uses: tuple[str, ...]):
    def step(tokens: Tensor, k: int, *, validate: bool = True, **inputs: Any) -> PoolResult:
        return fn(tokens, k, validate=validate, **{name: inputs.get(name) for name in uses})

    return step


def _tome(*, cluster_on: str = "metric"):
    if cluster_on not in CLUSTER_ON:
        raise ValueError(f"cluster_on must be one of {CLUSTER_ON}, got {cluster_on!r}")

    def step(tokens: Tensor, k: int, *, sizes: Tensor | None = None, metric: Tensor | None = None,
             validate: bool = True, **_: Any) -> PoolResult:
        return tome_merge(tokens, k, metric=metric if cluster_on == "metric" else None, sizes=sizes,
                          validate=validate)

    return step


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: how to build it and what it needs from the model."""

    build: Callable[..., Downsampler]
    needs_scores: bool
    learnable: bool = False
    summary: str = ""


METHODS: dict[str, MethodSpec] = {
    "none": MethodSpec(lambda: _none, False, summary="keep every token"),
    "kmeans": MethodSpec(lambda **o: _clustering("kmeans", False, **o), True, summary="K-Means (eq. 6-7)"),
    "kmedoids": MethodSpec(lambda **o: _clustering("kmedoids", False, **o), True, summary="K-Medoids (eq. 8)"),
    "wkmeans": MethodSpec(lambda **o: _clustering("kmeans", True, **o), True, summary="weighted K-Means"),
    "wkmedoids": MethodSpec(lambda **o: _clustering("kmedoids", True, **o), True, summary="weighted K-Medoids"),
    "powerbert": MethodSpec(lambda: _selection(select_topk, ("scores", "sizes")), True, summary="top-K significance"),
    "random": MethodSpec(lambda: _selection(select_random, ("sizes", "generator")), False, summary="uniform selection"),
    "importance": MethodSpec(lambda: _selection(select_importance, ("scores", "sizes", "generator")), True, summary="significance sampling"),
    "tome": MethodSpec(_tome, False, summary="ToMe bipartite soft matching"),
    "conv": MethodSpec(GridConvDownsample, False, learnable=True, summary="2x2 stride-2 convolution"),
}


def build_downsampler(name: str, *, dim: int | None = None, **options: Any) -> Downsampler:
    """Builds the method ``name`` with its ``options``; ``conv`` also needs ``dim``.

    Options: clustering methods take ``iters``, ``init`` and ``cluster_on`` ("tokens" or
    "metric"); ``tome`` takes ``cluster_on`` (default "metric", ToMe's keys). The others take none.
    """
    spec = METHODS.get(name)
    if spec is None:
        raise ValueError(f"unknown downsampling method {name!r}; choose one of {sorted(METHODS)}")
    try:
        if spec.learnable:
            if dim is None:
                raise ValueError(f"method {name!r} has learnable weights and needs dim (the token width M)")
            return spec.build(dim, **options)
        return spec.build(**options)
    except TypeError as err:
        raise ValueError(f"method {name!r} got options it does not take: {sorted(options)} ({err})") from None
