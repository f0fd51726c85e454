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
from pipeline.pooling.clustering import INITS, token_pool
from pipeline.pooling.common import PoolResult, check_k, check_per_token, check_tokens, identity_result
from pipeline.pooling.selection import select_importance, select_random, select_topk
from pipeline.pooling.tome import tome_merge
from pipeline.runtime import KernelChoice

CLUSTER_ON = ("tokens", "metric")
# Which attention the scores measure: "eq4", the paper's (the attention each token receives from every
# query), or "cls", the class token's row of it alone (EViT's token attentiveness; one query row a head,
# so it costs B*H*T*D multiply-adds where eq. 4 costs B*H*T^2*D). The operators take the scores as they
# come; the models compute the kind the method's options name.
SIGNIFICANCE = ("eq4", "cls")


def check_significance(significance: object) -> None:
    """InputError unless ``significance`` names a kind of scores (``SIGNIFICANCE``)."""
    if significance not in SIGNIFICANCE:
        raise InputError(f"significance must be one of {SIGNIFICANCE}, got {significance!r}")


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


def _check_cluster_on(cluster_on: str) -> None:
    if cluster_on not in CLUSTER_ON:
        raise InputError(f"cluster_on must be one of {CLUSTER_ON}, got {cluster_on!r}")


def _clustering(method: str, weighted: bool, *, iters: int, init: str, cluster_on: str, significance: str
                ) -> Downsampler:
    if init not in INITS:
        raise InputError(f"init must be one of {INITS}, got {init!r}")
    _check_cluster_on(cluster_on)
    check_significance(significance)  # the operators take scores as given; the models read it

    def step(tokens: Tensor, k: int, *, scores: Tensor | None = None, sizes: Tensor | None = None,
             metric: Tensor | None = None, generator: torch.Generator | None = None,
             validate: bool = True, kernels: KernelChoice | None = None) -> PoolResult:
        if weighted and scores is None:
            raise InputError(f"w{method} needs scores (B, N), the significance of eq. 4, as its weights")
        if cluster_on == "metric" and metric is None:
            raise InputError("cluster_on='metric' needs metric (B, N, D), for example the keys averaged over heads")
        return token_pool(
            tokens, k, method=method, weights=scores if weighted else None, init=init, init_scores=scores,
            iters=iters, sizes=sizes, generator=generator, metric=metric if cluster_on == "metric" else None,
            validate=validate, kernels=kernels,
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


def powerbert(*, significance: str) -> Downsampler:
    check_significance(significance)
    return _selection(select_topk, ("scores", "sizes"))


def random() -> Downsampler:
    return _selection(select_random, ("sizes", "generator"))


def importance(*, significance: str) -> Downsampler:
    check_significance(significance)
    return _selection(select_importance, ("scores", "sizes", "generator"))


def tome(*, cluster_on: str) -> Downsampler:
    _check_cluster_on(cluster_on)

    def step(tokens: Tensor, k: int, *, sizes: Tensor | None = None, metric: Tensor | None = None,
             validate: bool = True, **_: Any) -> PoolResult:
        check_k(k)
        if cluster_on == "metric" and metric is None:
            raise InputError("tome with cluster_on='metric' needs metric (B, N, D), the keys averaged over heads")
        return tome_merge(tokens, k, metric=metric if cluster_on == "metric" else None, sizes=sizes,
                          validate=validate)

    return step
