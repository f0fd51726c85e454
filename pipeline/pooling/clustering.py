"""Token Pooling (Marin et al., Algorithm 1 and Appendix A): K-Means and K-Medoids, optionally weighted.

Exact semantics, which the brute-force references in ``tests/`` follow step by step:

1. Initial centres: the K tokens with the highest ``init_scores`` (``init="topk"``), or K distinct
   tokens drawn uniformly (``init="random"``).
2. ``iters`` rounds of Algorithm 1's loop body: assign every token to its nearest centre (eq. 6,
   ties to the lowest index; a K-Medoids medoid always joins its own cluster), then update the
   centres. K-Means: the weighted mean of each cluster (eq. 7 and 13); an empty cluster keeps its
   centre. K-Medoids: the member ``i`` minimising ``sum_{i' in cluster} w_i' ||f_i - f_i'||^2``
   (eq. 8 and 14, with the weights that make it minimise the weighted objective; lowest index on
   ties), taken only when its cost is lower than the current medoid's by more than a relative
   1e-4, so that the objective never increases and rounding never swaps tied medoids.
3. The output is the weighted mean of each cluster of the last assignment (Algorithm 1, last
   line), so the last round's centre update never reaches the output and is skipped. No K-Medoids
   cluster is ever empty; an empty K-Means cluster outputs the token its centre started from, with
   size 0.

A converged iteration changes nothing, so the loop runs a fixed number of times and never asks the
device whether it has converged (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.pooling.common import (
    PoolResult,
    check_k,
    check_metric,
    check_per_token,
    check_tokens,
    identity_result,
    pool_segments,
    segment_sum,
    work_dtype,
)

CLUSTER_METHODS = ("kmeans", "kmedoids")
INITS = ("topk", "random")
# Floor for normalised weights: keeps every weighted mean defined (an all-zero-weight cluster
# averages its members uniformly) without moving results for weights within 1e12 of the largest.
_WEIGHT_FLOOR = 1e-12
# A medoid is replaced only by a member cheaper by more than this relative margin. Two-member
# clusters tie exactly (unweighted), and float32 rounding must not flip a tie into a swap.
_SWAP_RTOL = 1e-4


def sq_norms(x: Tensor) -> Tensor:
    """Squared row norms, (B, N, D) -> (B, N)."""
    return torch.linalg.vector_norm(x, dim=-1).square()


def shifted_sq_dists(x: Tensor, y: Tensor) -> Tensor:
    """||x_i - y_j||^2 - ||x_i||^2 for (B, N, D) x (B, K, D) -> (B, N, K), one batched matmul.

    Dropping ||x_i||^2 leaves every argmin over j unchanged and saves a pass over the result.
    """
    return torch.baddbmm(sq_norms(y).unsqueeze(1), x, y.transpose(1, 2), alpha=-2.0)


def effective_weights(tokens: Tensor, weights: Tensor | None, sizes: Tensor | None) -> Tensor | None:
    """Per-token weights w_i * size_i, scaled to a maximum of 1 per sample and floored, (B, N).

    None when neither is given: every token weighs the same, and the callers skip the products.
    """
    if weights is None and sizes is None:
        return None
    dtype = work_dtype(tokens)
    if weights is None:
        w = sizes.to(dtype)
    elif sizes is None:
        w = weights.to(dtype)
    else:
        w = weights.to(dtype) * sizes.to(dtype)
    # Weighted means and medoids are scale-invariant, so the scaling changes no result.
    w = w / w.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return w.clamp_min(_WEIGHT_FLOOR)


def initial_indices(
    n: int, k: int, *, init: str, init_scores: Tensor | None, batch: int, device: torch.device,
    generator: torch.Generator | None,
) -> Tensor:
    """Indices (B, K) of the tokens that start as cluster centres."""
    if init == "topk":
        return init_scores.float().topk(k, dim=-1).indices
    noise = torch.rand(batch, n, device=device, generator=generator)
    return noise.topk(k, dim=-1).indices


def _kmeans(x: Tensor, w: Tensor | None, centres: Tensor, iters: int) -> Tensor:
    """Lloyd iterations. x (B, N, D), w (B, N) or None, centres (B, K, D) -> last assignment (B, N)."""
    k = centres.shape[1]
    assign = shifted_sq_dists(x, centres).argmin(-1)  # (B, N)
    for _ in range(iters - 1):
        centres, _ = pool_segments(x, w, None, assign, k, fallback=centres)
        assign = shifted_sq_dists(x, centres).argmin(-1)
    return assign


def _first_argmin_rows(rows: Tensor) -> Tensor:
    """Index of the smallest entry along dim 1 of (B, K, N), ties to the lowest index, -> (B, N).

    Overwrites ``rows``. After subtracting the minimum, an entry is 0 exactly where it is minimal;
    an in-place ``<= 0`` turns that into 1.0 (else 0.0), and the max over reversed indices picks the
    first. These in-place float passes run several times faster on the CPU than argmin over a
    non-last dim, or than a comparison into a new bool tensor, which is not vectorised.
    """
    k = rows.shape[1]
    reverse = torch.arange(k, 0, -1, device=rows.device, dtype=rows.dtype).view(1, k, 1)
    rows.sub_(rows.amin(1, keepdim=True)).le_(0.0).mul_(reverse)
    return k - rows.amax(1).long()


def _segment_argmin(values: Tensor, assign: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per segment, the minimum of ``values`` (B, N) and the lowest index reaching it, -> ((B, K), (B, K)).

    An empty segment gets value inf and index N.
    """
    b, n = values.shape
    best = values.new_full((b, k), torch.inf).scatter_reduce(1, assign, values, "amin")
    positions = torch.arange(n, device=values.device).expand(b, n)
    candidates = torch.where(values == best.gather(1, assign), positions, n)
    return best, torch.full_like(best, n, dtype=torch.long).scatter_reduce(1, assign, candidates, "amin")


def _kmedoids(
    x: Tensor, w: Tensor | None, medoids: Tensor, iters: int, dense: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Voronoi iterations on the token distance matrix, computed once.

    x (B, N, D), w (B, N) or None (uniform), medoids (B, K) token indices
    -> (medoids (B, K), last assignment (B, N)). ``dense`` forces the CUDA or the CPU path (tests).

    With ``g[m, i] = ||x_m||^2 - 2 x_m . x_i = d(m, i) - ||x_i||^2`` (one matmul), the nearest medoid
    of token i is the argmin of g over the medoid rows, and the cost of i as the medoid of its
    cluster C, ``sum_{i' in C} w_i' d(i', i)``, is a segment sum of the rows ``w_i' g[i', :]`` plus
    ``||x_i||^2 sum_{i' in C} w_i'``. No (B, N, N) element-wise pass runs inside the loop, and its
    buffers are allocated once.
    """
    b, n, _ = x.shape
    k = medoids.shape[1]
    norms = sq_norms(x)  # (B, N)
    g = torch.bmm(x, x.transpose(1, 2))  # (B, N, N) Gram matrix
    if w is None:
        g.mul_(-2.0).add_(norms.unsqueeze(2))  # g[m, i] = d(m, i) - ||x_i||^2
    else:
        # Store the weighted rows w_m g[m, :] in place (no second N x N matrix); the few medoid
        # rows are divided back by their weight before each assignment.
        g.mul_(-2.0 * w.unsqueeze(2)).add_((w * norms).unsqueeze(2))
    g_rows = g.reshape(b * n, n)
    member_weights = torch.ones(b, n, dtype=x.dtype, device=x.device) if w is None else w
    if dense is None:  # one-hot matmuls on CUDA: fast there, and deterministic unlike atomics
        dense = x.is_cuda
    batch_offset = torch.arange(b, device=x.device).unsqueeze(1)  # (B, 1)
    clusters = torch.arange(k, device=x.device).expand(b, k)
    scratch = g.new_empty(b * k, n)  # medoid rows in the assignment, segment sums in the update

    def nearest(med: Tensor) -> Tensor:
        rows = torch.index_select(g_rows, 0, (med + batch_offset * n).reshape(-1), out=scratch).view(b, k, n)
        if w is not None:
            rows.div_(w.gather(1, med).unsqueeze(-1))
        assign = _first_argmin_rows(rows)  # (B, N)
        # A medoid belongs to its own cluster even when rounding (or a duplicate token) ties it
        # with another: no cluster is ever empty.
        return assign.scatter_(1, med, clusters)

    assign = nearest(medoids)  # (B, N)
    for _ in range(iters - 1):
        if dense:
            sums = segment_sum(g, assign, k, dense=True)
        else:
            sums = scratch.zero_().index_add_(0, (assign + batch_offset * k).reshape(-1), g_rows).view(b, k, n)
        mass = segment_sum(member_weights.unsqueeze(-1), assign, k).squeeze(-1)  # (B, K) sum_{i' in C} w_i'
        cost = sums.gather(1, assign.unsqueeze(1)).squeeze(1) + norms * mass.gather(1, assign)
        best_cost, best = _segment_argmin(cost, assign, k)  # (B, K)
        current = cost.gather(1, medoids)  # the current medoid's cost (it is a member)
        medoids = torch.where(best_cost < current * (1.0 - _SWAP_RTOL), best, medoids)
        assign = nearest(medoids)
    return medoids, assign


def _check_options(method: str, init: str, iters: object, init_scores: Tensor | None) -> None:
    if method not in CLUSTER_METHODS:
        raise ValueError(f"method must be one of {CLUSTER_METHODS}, got {method!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive integer, got {iters!r}")
    if init == "topk" and init_scores is None:
        raise ValueError(
            "init='topk' needs init_scores or weights (for example the significance scores of eq. 4); "
            "pass one of them, or use init='random'"
        )


def token_pool(
    tokens: Tensor,
    k: int,
    *,
    method: str = "kmedoids",
    weights: Tensor | None = None,
    init: str = "topk",
    init_scores: Tensor | None = None,
    iters: int = 5,
    sizes: Tensor | None = None,
    generator: torch.Generator | None = None,
    metric: Tensor | None = None,
    validate: bool = True,
) -> PoolResult:
    """Downsamples (B, N, M) tokens to (B, K, M) cluster means (Token Pooling, Algorithm 1).

    Args:
        tokens: (B, N, M) non-prefix tokens; prefix tokens (CLS, ...) are the caller's to keep.
        k: target number of tokens K. ``k >= N`` returns the input unchanged.
        method: ``"kmeans"`` or ``"kmedoids"``.
        weights: (B, N) non-negative token weights; makes the method WK-Means / WK-Medoids.
        init: ``"topk"`` (the K highest ``init_scores``) or ``"random"`` (uses ``generator``).
        init_scores: (B, N) scores for ``"topk"``; default ``weights``.
        iters: rounds of assignment and centre update (Algorithm 1's loop), at least 1.
        sizes: (B, N) carried cluster sizes (Appendix D); they weight the means and add up.
        generator: random source for ``init="random"``.
        metric: (B, N, D) features to cluster on instead of ``tokens`` (for example the attention
            keys averaged over heads); the output still averages ``tokens``.
        validate: check values (NaN, inf, negative weights) at a cost of one host sync.

    Returns:
        PoolResult with tokens (B, K, M), sizes (B, K), assign (B, N).
    """
    check_tokens(tokens, finite=validate)
    k = check_k(k)
    if init_scores is None:
        init_scores = weights
    _check_options(method, init, iters, init_scores)
    check_per_token(weights, tokens, name="weights", nonnegative=True, values=validate)
    check_per_token(init_scores, tokens, name="init_scores", values=validate)
    check_per_token(sizes, tokens, name="sizes", nonnegative=True, values=validate)
    check_metric(metric, tokens, finite=validate)
    b, n, _ = tokens.shape
    if k >= n:
        return identity_result(tokens, sizes)

    dtype = work_dtype(tokens)  # distances in float32 even for bf16 / fp16 tokens
    x = tokens.to(dtype)
    space = x if metric is None else metric.to(dtype)
    w = effective_weights(tokens, weights, sizes)
    start = initial_indices(
        n, k, init=init, init_scores=init_scores, batch=b, device=tokens.device, generator=generator
    )
    with torch.no_grad():  # the assignments are constants; gradients flow through the means below
        if method == "kmeans":
            assign = _kmeans(space, w, _gather_rows(space, start), iters)
        else:
            medoids, assign = _kmedoids(space, w, start, iters)
    # No K-Medoids cluster is empty; an empty K-Means cluster outputs the token its centre started from.
    fallback = _gather_rows(x, start) if method == "kmeans" else None
    in_sizes = None if sizes is None else sizes.to(dtype)
    pooled, out_sizes = pool_segments(x, w, in_sizes, assign, k, fallback=fallback)
    index = medoids if method == "kmedoids" else None
    return PoolResult(tokens=pooled.to(tokens.dtype), sizes=out_sizes.float(), assign=assign, index=index)


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows of x (B, N, D) at index (B, K) -> (B, K, D); whole-row copies, far cheaper than gather."""
    b, n, d = x.shape
    flat = (index + torch.arange(b, device=x.device).unsqueeze(1) * n).reshape(-1)
    return x.reshape(b * n, d).index_select(0, flat).reshape(b, -1, d)
