"""The factories of the downsampling methods: one interface for every method, each picked by name
through the registry (``pipeline.methods``, which names these by ``"module:attribute"``; this module
never imports it), as timm picks attention layers.

Every built method is called as::

    step(tokens, k, *, scores=None, sizes=None, metric=None, generator=None, validate=True, kernels=None) -> PoolResult

with tokens (B, N, M), significance ``scores`` (B, N), carried ``sizes`` (B, N), a cheap
similarity ``metric`` (B, N, D) such as the attention keys averaged over heads, and ``kernels``, the
``runtime.KernelChoice`` of the model (the config's ``kernels`` section). A method ignores what it does
not use (a plugin's step takes ``**_``) and raises a ValueError when it lacks what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.pooling.clustering import token_pool
from pipeline.pooling.common import PoolResult, check_k, check_per_token, check_tokens, identity_result
from pipeline.pooling.selection import select_importance, select_random, select_topk
from pipeline.pooling.tome import tome_merge
from pipeline.runtime import KernelChoice


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
        kernels: KernelChoice | None = None,
    ) -> PoolResult: ...


def _none(tokens: Tensor, k: int, *, sizes: Tensor | None = None, validate: bool = True, **_: Any) -> PoolResult:
    check_tokens(tokens, finite=validate)
    check_k(k)
    check_per_token(sizes, tokens, name="sizes", nonnegative=True, values=validate)
    return identity_result(tokens, sizes)


def _clustering(method: str, weighted: bool, *, cluster_on: str, significance: str, **operator: Any
                ) -> Downsampler:
    """``token_pool`` with the method's options (checked by its ``MethodSpec``): ``cluster_on`` picks what it
    matches, ``significance`` is the models' (which scores they compute), and every other option goes to
    ``token_pool`` as it is (``iters``, ``init``, ...)."""

    def step(tokens: Tensor, k: int, *, scores: Tensor | None = None, sizes: Tensor | None = None,
             metric: Tensor | None = None, generator: torch.Generator | None = None,
             validate: bool = True, kernels: KernelChoice | None = None) -> PoolResult:
        if weighted and scores is None:
            raise InputError(f"w{method} needs scores (B, N), the significance of eq. 4, as its weights")
        if cluster_on == "metric" and metric is None:
            raise InputError("cluster_on='metric' needs metric (B, N, D), for example the keys averaged over heads")
        return token_pool(
            tokens, k, method=method, weights=scores if weighted else None, init_scores=scores, sizes=sizes,
            generator=generator, metric=metric if cluster_on == "metric" else None, validate=validate,
            kernels=kernels, **operator,
        )

    return step


def _selection(fn: Callable[..., PoolResult], uses: tuple[str, ...]) -> Downsampler:
    def step(tokens: Tensor, k: int, *, validate: bool = True, **inputs: Any) -> PoolResult:
        return fn(tokens, k, validate=validate, **{name: inputs.get(name) for name in uses})

    return step


# The factories the registry (pipeline.methods) names, each called with the method's resolved options.
def keep_all() -> Downsampler:
    return _none


def kmeans(**options: Any) -> Downsampler:
    return _clustering("kmeans", False, **options)


def kmedoids(**options: Any) -> Downsampler:
    return _clustering("kmedoids", False, **options)


def wkmeans(**options: Any) -> Downsampler:
    return _clustering("kmeans", True, **options)


def wkmedoids(**options: Any) -> Downsampler:
    return _clustering("kmedoids", True, **options)


def powerbert(*, significance: str) -> Downsampler:  # the scores are the models' to compute
    return _selection(select_topk, ("scores", "sizes"))


def random() -> Downsampler:
    return _selection(select_random, ("sizes", "generator"))


def importance(*, significance: str) -> Downsampler:
    return _selection(select_importance, ("scores", "sizes", "generator"))


def tome(*, cluster_on: str) -> Downsampler:
    def step(tokens: Tensor, k: int, *, sizes: Tensor | None = None, metric: Tensor | None = None,
             validate: bool = True, **_: Any) -> PoolResult:
        check_k(k)
        if cluster_on == "metric" and metric is None:
            raise InputError("tome with cluster_on='metric' needs metric (B, N, D), the keys averaged over heads")
        return tome_merge(tokens, k, metric=metric if cluster_on == "metric" else None, sizes=sizes,
                          validate=validate)

    return step
