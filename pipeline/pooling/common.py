"""Shared pieces of the downsampling operators: the result type, input checks and segment sums."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PoolResult:
    """What every downsampling method returns.

    Attributes:
        tokens: (B, K, M) downsampled tokens, in the dtype of the input.
        sizes: (B, K) float32, how many original tokens each output stands for. With carried
            ``sizes`` these add up the incoming sizes; a slot whose cluster ended empty has size 0.
        assign: (B, N) int64, the output index of each input token, or -1 for a token that a
            selection method dropped.
        index: (B, K) int64 input token behind each output where there is one: the medoid of each
            cluster (K-Medoids, medoids of the last assignment) or the kept token (selection and
            ``k >= N``); None for K-Means, ToMe and conv, whose outputs are new vectors.
    """

    tokens: Tensor
    sizes: Tensor
    assign: Tensor
    index: Tensor | None = None


def check_k(k: object) -> int:
    """Returns ``k`` as an int, or raises ValueError naming ``k``."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"k must be a positive integer, got {k!r} of type {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be a positive integer (>= 1), got {k}")
    return int(k)


def check_tokens(tokens: Tensor, *, name: str = "tokens", finite: bool = True) -> None:
    """Checks that ``tokens`` is a (B, N, M) floating tensor, and finite when ``finite``."""
    if not isinstance(tokens, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, N, M), got {type(tokens).__name__}")
    if tokens.dim() != 3:
        raise ValueError(f"{name} must have shape (B, N, M), got shape {tuple(tokens.shape)}")
    if not tokens.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tokens.dtype}")
    if tokens.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one token, got shape {tuple(tokens.shape)}")
    # One host sync at entry, never inside the iterations; callers on a hot path pass validate=False.
    if finite and not bool(torch.isfinite(tokens).all()):
        raise ValueError(f"{name} contains NaN or inf values; check the upstream layer or the input data")


def check_per_token(
    value: Tensor | None, tokens: Tensor, *, name: str, nonnegative: bool = False, values: bool = True
) -> None:
    """Checks an optional per-token tensor of shape (B, N) against ``tokens`` (B, N, M).

    ``values`` also checks the entries (finite, and non-negative where asked), at one host sync.
    """
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, N), got {type(value).__name__}")
    expected = tuple(tokens.shape[:2])
    if tuple(value.shape) != expected:
        raise ValueError(f"{name} must have shape (B, N) = {expected} to match tokens, got {tuple(value.shape)}")
    if not values:
        return
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} contains NaN or inf values")
    if nonnegative and bool((value < 0).any()):
        raise ValueError(f"{name} must be non-negative; got a minimum of {float(value.min()):.4g}")


def check_metric(metric: Tensor | None, tokens: Tensor, *, finite: bool = True) -> None:
    """Checks an optional clustering metric of shape (B, N, D) against ``tokens`` (B, N, M)."""
    if metric is None:
        return
    check_tokens(metric, name="metric", finite=finite)
    if tuple(metric.shape[:2]) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"metric must have shape (B, N, D) with (B, N) = {tuple(tokens.shape[:2])} to match tokens, "
            f"got {tuple(metric.shape)}"
        )


def identity_result(tokens: Tensor, sizes: Tensor | None) -> PoolResult:
    """The result of a step that keeps every token: (B, N, M) in, the same tensor out."""
    b, n, _ = tokens.shape
    out_sizes = torch.ones(b, n, device=tokens.device) if sizes is None else sizes.float()
    assign = torch.arange(n, device=tokens.device).expand(b, n)
    return PoolResult(tokens=tokens, sizes=out_sizes, assign=assign, index=assign)


def work_dtype(tokens: Tensor) -> torch.dtype:
    """The dtype distances and means are computed in: float32, or float64 for float64 input."""
    return torch.promote_types(tokens.dtype, torch.float32)


def segment_sum(values: Tensor, assign: Tensor, k: int, *, dense: bool | None = None) -> Tensor:
    """Sums rows of ``values`` (B, N, C) into ``k`` segments given by ``assign`` (B, N) -> (B, K, C).

    On CUDA it multiplies by a one-hot matrix: a dense batched matmul is fast there and, unlike
    ``index_add_``'s atomics, gives the same bits on every run. On the CPU ``index_add_`` over the
    flattened batch is several times cheaper than the matmul. ``dense`` forces either path (tests).
    """
    b, n, c = values.shape
    if dense is None:
        dense = values.is_cuda
    if dense:
        onehot = torch.zeros(b, k, n, device=values.device, dtype=values.dtype)
        onehot.scatter_(1, assign.unsqueeze(1), 1.0)  # (B, K, N)
        return torch.bmm(onehot, values)
    offset = torch.arange(b, device=assign.device).unsqueeze(1) * k  # (B, 1)
    flat = (assign + offset).reshape(-1)  # (B*N,)
    out = values.new_zeros(b * k, c)
    return out.index_add_(0, flat, values.reshape(b * n, c)).reshape(b, k, c)


def pool_segments(
    tokens: Tensor, weights: Tensor | None, sizes: Tensor | None, assign: Tensor, k: int, fallback: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Weighted mean of the tokens in each segment, and the summed sizes of each segment.

    Args:
        tokens: (B, N, M).
        weights: (B, N) strictly positive, or None for a plain mean (no (B, N, M) product).
        sizes: (B, N) the number of original tokens each input stands for, or None for ones.
        assign: (B, N) int64 segment of each token, in [0, k).
        k: number of segments.
        fallback: (B, K, M), returned for a segment with no members (its size is 0); None when
            the caller guarantees that no segment is empty.

    Returns:
        ((B, K, M) weighted means, (B, K) summed sizes).
    """
    b, n, _ = tokens.shape
    sums = segment_sum(tokens if weights is None else tokens * weights.unsqueeze(-1), assign, k)  # (B, K, M)
    ones = torch.ones(b, n, dtype=tokens.dtype, device=tokens.device)
    # Weights and sizes go through segment_sum too (not scatter_add_), so that CUDA stays deterministic.
    per_token = torch.stack([ones if weights is None else weights, ones if sizes is None else sizes], dim=-1)
    total, out_sizes = segment_sum(per_token, assign, k).unbind(-1)  # (B, K) each
    if fallback is None:
        return sums.div_(total.unsqueeze(-1)), out_sizes
    # An empty segment (total 0, sums 0) becomes fallback / 1; the others divide by their weight.
    empty = (total == 0).to(sums.dtype)
    sums.addcmul_(fallback, empty.unsqueeze(-1))
    return sums.div_((total + empty).unsqueeze(-1)), out_sizes
