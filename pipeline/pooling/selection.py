"""Score-based baselines of Section 5: significance (eq. 4), PoWER-BERT top-K, random and importance selection.

Selection keeps K of the N tokens as they are and drops the rest: a dropped token's ``assign`` is -1.
Kept tokens stay in their original order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.pooling.common import (
    PoolResult,
    check_k,
    check_per_token,
    check_tokens,
    identity_result,
    sorted_indices,
    uniform_noise,
)


def significance(attn: Tensor) -> Tensor:
    """Significance scores of eq. 4, s = sum_h A_h^T 1: the attention each token receives.

    Args:
        attn: (B, H, N, N) attention probabilities, rows (queries) summing to 1.

    Returns:
        (B, N) float32 scores; token j gets sum_h sum_i A_h[i, j].
    """
    if not isinstance(attn, Tensor) or attn.dim() != 4 or attn.shape[-1] != attn.shape[-2]:
        shape = tuple(attn.shape) if isinstance(attn, Tensor) else type(attn).__name__
        raise InputError(f"attn must have shape (B, H, N, N), got {shape}")
    return attn.float().sum(dim=(1, 2))


def keep_highest(tokens: Tensor, keys: Tensor, k: int, sizes: Tensor | None) -> PoolResult:
    """Keeps the K tokens (B, N, M) with the highest ``keys`` (B, N), in their original order, and drops the others.

    The winners come from ``topk(sorted=False)``: ordering them by key is a sort kernel of its own on
    CUDA, and that order would be thrown away here (the kept set is the same).
    """
    b, n, m = tokens.shape
    index = sorted_indices(keys.topk(k, dim=-1, sorted=False).indices)  # (B, K)
    kept = tokens.gather(1, index.unsqueeze(-1).expand(b, k, m))  # (B, K, M)

    def out_sizes() -> Tensor:
        return torch.ones(b, k, device=tokens.device) if sizes is None else sizes.float().gather(1, index)

    def assign() -> Tensor:
        out = torch.full((b, n), -1, dtype=torch.long, device=tokens.device)
        return out.scatter_(1, index, torch.arange(k, device=tokens.device).expand(b, k))

    return PoolResult(tokens=kept, sizes=out_sizes, assign=assign, index=index)


def _prepare(tokens: Tensor, k: int, scores: Tensor | None, sizes: Tensor | None, *, validate: bool,
             need_scores: str | None) -> int:
    check_tokens(tokens, finite=validate)
    k = check_k(k)
    if need_scores is not None and scores is None:
        raise InputError(f"{need_scores} needs scores: pass the significance scores (B, N) of eq. 4")
    check_per_token(scores, tokens, name="scores", nonnegative=need_scores == "importance", values=validate)
    check_per_token(sizes, tokens, name="sizes", nonnegative=True, values=validate)
    return k


def select_topk(
    tokens: Tensor, k: int, *, scores: Tensor | None = None, sizes: Tensor | None = None, validate: bool = True
) -> PoolResult:
    """PoWER-BERT: keeps the K tokens (B, N, M) -> (B, K, M) with the highest significance ``scores`` (B, N)."""
    k = _prepare(tokens, k, scores, sizes, validate=validate, need_scores="powerbert")
    if k >= tokens.shape[1]:
        return identity_result(tokens, sizes)
    return keep_highest(tokens, scores, k, sizes)


def select_random(
    tokens: Tensor, k: int, *, sizes: Tensor | None = None, generator: torch.Generator | None = None,
    validate: bool = True,
) -> PoolResult:
    """Keeps K tokens (B, N, M) -> (B, K, M) drawn uniformly without replacement."""
    k = _prepare(tokens, k, None, sizes, validate=validate, need_scores=None)
    b, n, _ = tokens.shape
    if k >= n:
        return identity_result(tokens, sizes)
    noise = uniform_noise(tokens[..., 0], generator)  # (B, N)
    return keep_highest(tokens, noise, k, sizes)


def select_importance(
    tokens: Tensor, k: int, *, scores: Tensor | None = None, sizes: Tensor | None = None,
    generator: torch.Generator | None = None, validate: bool = True,
) -> PoolResult:
    """Keeps K tokens (B, N, M) -> (B, K, M) drawn without replacement with probability proportional to ``scores``.

    Sequential draws without replacement equal the top-K of log(score) plus Gumbel noise
    (the Gumbel-top-k trick), which needs one sort instead of K dependent draws.
    """
    k = _prepare(tokens, k, scores, sizes, validate=validate, need_scores="importance")
    b, n, _ = tokens.shape
    if k >= n:
        return identity_result(tokens, sizes)
    uniform = uniform_noise(scores, generator)  # (B, N)
    gumbel = -torch.log(-torch.log(uniform.clamp(torch.finfo(torch.float32).tiny, 1.0 - 1e-7)))
    # A zero score can only be drawn after every positive one: log(0) = -inf keeps that order.
    keys = torch.log(scores.float()) + gumbel  # (B, N)
    return keep_highest(tokens, keys, k, sizes)
