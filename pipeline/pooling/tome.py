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
    Partition,
    PoolResult,
    check_k,
    check_metric,
    check_per_token,
    check_tokens,
    identity_result,
    stable_ranks,
    work_dtype,
)


def match_round(metric: Tensor, r: int) -> Tensor:
    """One bipartite soft matching round: (B, N, D) metric -> (B, N) output index of each token in [0, N - r).

    Args:
        metric: (B, N, D) features compared by cosine similarity.
        r: number of A tokens to merge, 0 < r <= ceil(N/2).
    """
    b, n, _ = metric.shape
    n_a = (n + 1) // 2
    unit = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    sim = torch.bmm(unit[:, ::2], unit[:, 1::2].transpose(1, 2))  # (B, Na, Nb)
    best_sim, partner = sim.max(dim=-1)  # (B, Na)
    merged = stable_ranks(best_sim, descending=True) < r  # equal similarities keep A's order, (B, Na)
    first_b = n_a - r  # B tokens follow the n_a - r unmerged A tokens
    kept_pos = torch.arange(n_a, device=metric.device) - merged.cumsum(-1)  # position among the kept A tokens
    a_assign = torch.where(merged, partner + first_b, kept_pos)  # (B, Na)
    # Interleave A (even) and B (odd) positions; for odd N the last B slot is a pad cut off below.
    b_assign = torch.arange(first_b, first_b + n_a, device=metric.device).expand(b, n_a)
    return torch.stack([a_assign, b_assign], dim=-1).view(b, 2 * n_a)[:, :n]


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
    space = None if metric is None else metric.to(dtype)
    cur_sizes = None if sizes is None else sizes.to(dtype)  # None: every token has size 1
    steps = []
    count = n
    while count > k:
        r = min(count - k, (count + 1) // 2)
        with torch.no_grad():
            step = match_round(x if space is None else space, r)  # (B, count)
        part = Partition(step, count - r, dtype=dtype)  # every output holds its B token: none is empty
        # Size-weighted means; a size-0 token carries no weight unless its whole group has none.
        weights = None if cur_sizes is None else cur_sizes.clamp_min(1e-12)
        x = part.mean(x, weights)[0]
        steps.append(step)
        count -= r
        if count > k:  # the next round is weighted by the sizes and matches on the merged metric
            cur_sizes = part.total(cur_sizes).squeeze(-1)
            if space is not None:
                space = part.mean(space, weights)[0]
    last_sizes = cur_sizes  # what entered the last round

    def assign() -> Tensor:
        out = steps[0]
        for step in steps[1:]:
            out = step.gather(1, out)
        return out

    def out_sizes() -> Tensor:
        return part.total(last_sizes).squeeze(-1).float()

    return PoolResult(tokens=x.to(tokens.dtype), sizes=out_sizes, assign=assign)
