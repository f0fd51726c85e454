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

from typing import NamedTuple

import torch
from torch import Tensor

from pipeline.pooling.common import (
    Partition,
    PoolResult,
    augmented,
    check_k,
    check_metric,
    check_per_token,
    check_tokens,
    flagged_last,
    identity_result,
    stable_ranks,
    work_dtype,
)


class Matching(NamedTuple):
    """One bipartite soft matching round over N tokens, of which r A tokens merge.

    Attributes:
        assign: (B, N) output index of each token in [0, N - r).
        merged: (B, Na) whether each A token (even position) merges into its partner.
        partner: (B, Na) the B set position (odd token 2 p + 1 is position p) of each A token's most
            similar B token.
    """

    assign: Tensor
    merged: Tensor
    partner: Tensor


def match_round(metric: Tensor, r: int) -> Matching:
    """One bipartite soft matching round on a (B, N, D) metric; see ``Matching``.

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
    assign = torch.stack([a_assign, b_assign], dim=-1).view(b, 2 * n_a)[:, :n]
    return Matching(assign, merged, partner)


class BipartiteMerge:
    """The weighted means of one round's output groups, [unmerged A tokens in order, B tokens], written
    for the round's structure: an unmerged A token is a group of its own (a gather), and each B token's
    group is itself plus the A tokens merged into it, whose sums are a segment sum of the A tokens into
    the Nb B slots (``Partition``: a (B, Nb, Na) one-hot product on CUDA). Where a ``Partition`` of all N
    tokens into the N - r groups multiplies a (B, N - r, N) one-hot matrix, this one is about a quarter of
    that size. Same means as the partition's, summed in another order."""

    def __init__(self, match: Matching, r: int, dtype: torch.dtype) -> None:
        n_a = match.merged.shape[1]
        self.n_b = match.assign.shape[1] // 2
        self.kept = flagged_last(match.merged)[:, : n_a - r]  # (B, Na - r) A positions of the unmerged A tokens
        # merged A tokens go to their partner's slot, the others to a slot Nb that is dropped
        self.into_b = Partition(torch.where(match.merged, match.partner, self.n_b), self.n_b + 1, dtype=dtype)

    def _groups(self, rows: Tensor) -> Tensor:
        """Per group, the sum of ``rows`` (B, N, C) over its members -> (B, K, C)."""
        a = rows[:, ::2]
        into_b = self.into_b.sum(a)[:, : self.n_b] + rows[:, 1::2]  # (B, Nb, C)
        kept = a.gather(1, self.kept.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))  # (B, Na - r, C)
        return torch.cat([kept, into_b], dim=1)

    def mean(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        """Weighted group means of ``values`` (B, N, C) -> ((B, K, C), the (B, K, 1) weight totals)."""
        c = values.shape[-1]
        sums = self._groups(augmented(values, weights))  # [sum w x, sum w, ...], one segment sum
        total = sums[..., c : c + 1]
        return sums[..., :c] / total, total

    def total(self, weights: Tensor | None) -> Tensor:
        """Per group, the sum of ``weights`` (B, N) over its members, or the member count; (B, K, 1)."""
        if weights is None:
            b, n_a = self.into_b.assign.shape
            weights = torch.ones(b, n_a + self.n_b, dtype=self.into_b.dtype, device=self.kept.device)
        return self._groups(weights.unsqueeze(-1))


def _merge(match: Matching, r: int, dtype: torch.dtype) -> BipartiteMerge | Partition:
    """The groups of one round. Traced by ``torch.compile``, ``BipartiteMerge`` (its product is a quarter of
    the partition's; docs/history.md has what that gave a compiled ToMe); eager code
    keeps the ``Partition`` of all N tokens, about half the ops a round (eager GPU forwards are bound by
    the host's launch rate). Both give the same means, summed in another order."""
    if torch.compiler.is_compiling():
        return BipartiteMerge(match, r, dtype)
    return Partition(match.assign, match.assign.shape[1] - r, dtype=dtype)


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
            match = match_round(x if space is None else space, r)
            part = _merge(match, r, dtype)  # every output holds a token: none is empty
        # Size-weighted means; a size-0 token carries no weight unless its whole group has none.
        weights = None if cur_sizes is None else cur_sizes.clamp_min(1e-12)
        x = part.mean(x, weights)[0]
        steps.append(match.assign)  # (B, count)
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
