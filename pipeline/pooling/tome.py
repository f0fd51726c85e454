"""Token Merging's bipartite soft matching (Bolya et al., ICLR 2023), written from the paper's description.

One round: split the tokens alternately into sets A (even positions) and B (odd positions); join each
A token to its most similar B token by cosine similarity of the metric; keep the r most similar
joins; merge each joined A token into its B partner by a size-weighted mean (sizes add up). The
output is the unmerged A tokens (in original order) followed by the B tokens.

One round removes at most |A| = ceil(N/2) tokens. To reach any K for a like-for-like comparison
with Token Pooling, further rounds run on the merged set until K tokens remain; a K >= N/2 takes
exactly one round, as in ToMe.
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
    work_dtype,
)


def match_round(metric: Tensor, r: int) -> Tensor:
    """One bipartite soft matching round: (B, N, D) metric -> (B, N) output index of each token in [0, N - r).

    Args:
        metric: (B, N, D) features compared by cosine similarity.
        r: number of A tokens to merge, 0 < r <= ceil(N/2).
    """
    b, n, _ = metric.shape
    unit = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    a, bb = unit[:, ::2], unit[:, 1::2]  # (B, Na, D), (B, Nb, D)
    n_a = a.shape[1]
    sim = torch.bmm(a, bb.transpose(1, 2))  # (B, Na, Nb)
    best_sim, partner = sim.max(dim=-1)  # (B, Na)
    order = best_sim.argsort(dim=-1, descending=True, stable=True)  # (B, Na)
    merged = torch.zeros(b, n_a, dtype=torch.bool, device=metric.device)
    chosen = order[:, :r]
    merged.scatter_(1, chosen, torch.ones_like(chosen, dtype=torch.bool))
    unmerged_pos = (~merged).long().cumsum(-1) - 1  # position among the kept A tokens
    first_b = n_a - r  # B tokens follow the n_a - r unmerged A tokens
    assign = torch.empty(b, n, dtype=torch.long, device=metric.device)
    assign[:, ::2] = torch.where(merged, first_b + partner, unmerged_pos)
    assign[:, 1::2] = first_b + torch.arange(n - n_a, device=metric.device)
    return assign


def tome_merge(
    tokens: Tensor,
    k: int,
    *,
    metric: Tensor | None = None,
    sizes: Tensor | None = None,
    validate: bool = True,
) -> PoolResult:
    """Merges (B, N, M) tokens down to (B, K, M) by bipartite soft matching with size-weighted means.

    Args:
        tokens: (B, N, M) non-prefix tokens.
        k: number of tokens to keep.
        metric: (B, N, D) similarity features, for example the attention keys averaged over heads,
            as ToMe uses; default the tokens themselves.
        sizes: (B, N) carried sizes; the merge is weighted by them and they add up.
        validate: check values at a cost of one host sync.
    """
    check_tokens(tokens, finite=validate)
    k = check_k(k)
    check_metric(metric, tokens, finite=validate)
    check_per_token(sizes, tokens, name="sizes", nonnegative=True, values=validate)
    b, n, _ = tokens.shape
    if k >= n:
        return identity_result(tokens, sizes)

    dtype = work_dtype(tokens)
    x = tokens.to(dtype)
    space = x if metric is None else metric.to(dtype)
    cur_sizes = None if sizes is None else sizes.to(dtype)  # None: every token has size 1
    assign = torch.arange(n, device=tokens.device).expand(b, n)
    count = n
    while count > k:
        r = min(count - k, (count + 1) // 2)
        with torch.no_grad():
            step = match_round(space, r)  # (B, count)
        # Size-weighted means; a size-0 token carries no weight unless its whole group has none.
        weights = None if cur_sizes is None else cur_sizes.clamp_min(1e-12)
        # Every output holds at least its B token, so no segment is empty.
        x, new_sizes = pool_segments(x, weights, cur_sizes, step, count - r, fallback=None)
        if metric is None:
            space = x
        else:
            space, _ = pool_segments(space, weights, cur_sizes, step, count - r, fallback=None)
        assign = step.gather(1, assign)
        cur_sizes = new_sizes
        count -= r
    return PoolResult(tokens=x.to(tokens.dtype), sizes=cur_sizes.float(), assign=assign)
