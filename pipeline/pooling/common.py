"""Shared pieces of the downsampling operators: the result type, input checks and segment sums."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from pipeline.errors import InputError


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

    ``sizes`` and ``assign`` may be given as zero-argument callables: they are then computed on
    first access and kept. A model that neither carries sizes nor records assignments never pays
    for them (each is a few kernel launches per block on a GPU).
    """

    __slots__ = ("tokens", "index", "_sizes", "_assign")

    def __init__(self, tokens: Tensor, sizes: Tensor | Callable[[], Tensor], assign: Tensor | Callable[[], Tensor],
                 index: Tensor | None = None) -> None:
        self.tokens = tokens
        self.index = index
        self._sizes = sizes
        self._assign = assign

    @property
    def sizes(self) -> Tensor:
        if callable(self._sizes):
            self._sizes = self._sizes()
        return self._sizes

    @property
    def assign(self) -> Tensor:
        if callable(self._assign):
            self._assign = self._assign()
        return self._assign


def check_k(k: object) -> int:
    """Returns ``k`` as an int, or raises ValueError naming ``k``."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise InputError(f"k must be a positive integer, got {k!r} of type {type(k).__name__}")
    if k < 1:
        raise InputError(f"k must be a positive integer (>= 1), got {k}")
    return int(k)


def check_tokens(tokens: Tensor, *, name: str = "tokens", finite: bool = True) -> None:
    """Checks that ``tokens`` is a (B, N, M) floating tensor, and finite when ``finite``."""
    if not isinstance(tokens, Tensor):
        raise InputError(f"{name} must be a torch.Tensor of shape (B, N, M), got {type(tokens).__name__}")
    if tokens.dim() != 3:
        raise InputError(f"{name} must have shape (B, N, M), got shape {tuple(tokens.shape)}")
    if not tokens.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor, got dtype {tokens.dtype}")
    if tokens.shape[1] < 1:
        raise InputError(f"{name} must hold at least one token, got shape {tuple(tokens.shape)}")
    # One host sync at entry, never inside the iterations; callers on a hot path pass validate=False.
    if finite and not bool(torch.isfinite(tokens).all()):
        raise InputError(f"{name} contains NaN or inf values; check the upstream layer or the input data")
    # Distances and similarities square the tokens in float32 (at least): finite tokens above ~1e19 overflow
    # there, and every token would join one cluster.
    if finite and not bool(torch.isfinite(tokens.float().square().sum(-1)).all()):
        raise InputError(f"{name} are too large: their squared norms overflow float32 (largest |value| "
                         f"{float(tokens.abs().max()):.3g}); scale them down, as a normalisation layer would")


def check_per_token(
    value: Tensor | None, tokens: Tensor, *, name: str, nonnegative: bool = False, values: bool = True
) -> None:
    """Checks an optional per-token tensor of shape (B, N) against ``tokens`` (B, N, M).

    ``values`` also checks the entries (finite, and non-negative where asked), at one host sync.
    """
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise InputError(f"{name} must be a torch.Tensor of shape (B, N), got {type(value).__name__}")
    expected = tuple(tokens.shape[:2])
    if tuple(value.shape) != expected:
        raise InputError(f"{name} must have shape (B, N) = {expected} to match tokens, got {tuple(value.shape)}")
    if not values:
        return
    if not bool(torch.isfinite(value).all()):
        raise InputError(f"{name} contains NaN or inf values")
    if nonnegative and bool((value < 0).any()):
        raise InputError(f"{name} must be non-negative; got a minimum of {float(value.min()):.4g}")


def check_metric(metric: Tensor | None, tokens: Tensor, *, finite: bool = True) -> None:
    """Checks an optional clustering metric of shape (B, N, D) against ``tokens`` (B, N, M)."""
    if metric is None:
        return
    check_tokens(metric, name="metric", finite=finite)
    if tuple(metric.shape[:2]) != tuple(tokens.shape[:2]):
        raise InputError(
            f"metric must have shape (B, N, D) with (B, N) = {tuple(tokens.shape[:2])} to match tokens, "
            f"got {tuple(metric.shape)}"
        )


def identity_result(tokens: Tensor, sizes: Tensor | None) -> PoolResult:
    """The result of a step that keeps every token: (B, N, M) in, the same tensor out."""
    b, n, _ = tokens.shape

    def assign() -> Tensor:
        return torch.arange(n, device=tokens.device).expand(b, n)

    out_sizes = (lambda: torch.ones(b, n, device=tokens.device)) if sizes is None else sizes.float()
    return PoolResult(tokens=tokens, sizes=out_sizes, assign=assign, index=assign())


_DERIVED = [False]  # inside ``derived_noise``


@contextlib.contextmanager
def derived_noise() -> Iterator[None]:
    """Inside, ``uniform_noise`` is a fixed function of each token's index (``hashed_noise``), not a draw: the
    same numbers in torch and in any runtime a model exported inside runs in. ``pipeline.export`` checks a random
    method's export so, since torch's generator and ONNX Runtime's draw different numbers."""
    saved = _DERIVED[0]
    _DERIVED[0] = True
    try:
        yield
    finally:
        _DERIVED[0] = saved


def hashed_noise(like: Tensor) -> Tensor:
    """(B, N) float32 numbers in [0, 1) from each entry's token index by Knuth's multiplicative hash, in int64
    arithmetic, which every runtime computes exactly (a float hash would differ in its last bits). The same for
    every image: an image's numbers do not depend on the batch it came in, which a runtime may cut differently."""
    position = torch.arange(like.shape[-1], device=like.device).expand_as(like)
    return ((position * 2654435761 + 12345) % 16777216).float() / 16777216.0  # 2^24: exact in float32


def uniform_noise(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Uniform [0, 1) float32 noise of the shape (B, N) and device of ``like`` (``hashed_noise`` inside
    ``derived_noise``).

    Without a generator it is ``rand_like``, which ``torch.compile`` traces with a symbolic batch size
    (a model compiled again for a second batch size gets one); ``torch.rand(b, n)`` with symbolic
    sizes fails to trace. Both draw the same numbers from the same generator state.
    """
    if _DERIVED[0]:
        return hashed_noise(like)
    if generator is None:
        return torch.rand_like(like, dtype=torch.float32, memory_format=torch.contiguous_format)
    return torch.rand(like.shape, device=like.device, generator=generator)


def work_dtype(tokens: Tensor) -> torch.dtype:
    """The dtype distances and means are computed in: float32, or float64 for float64 input."""
    return torch.float64 if tokens.dtype == torch.float64 else torch.float32  # no dispatched op


def one_hot(assign: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """(B, N) segment ids in [0, k) -> (B, K, N) membership matrix of 0s and 1s.

    Traced by ``torch.compile``, a comparison with the cluster ids, which inductor fuses into the ops that
    read the membership (a scatter is a kernel of its own after a fill); eager code scatters into zeros,
    two ops where the comparison takes four (eager GPU forwards are bound by the host's launch rate)."""
    b, n = assign.shape
    if torch.compiler.is_compiling():
        return (assign.unsqueeze(1) == torch.arange(k, device=assign.device).view(1, k, 1)).to(dtype)
    return torch.zeros(b, k, n, device=assign.device, dtype=dtype).scatter_(1, assign.unsqueeze(1), 1.0)


_DENSE: bool | None = None  # None: the one-hot path on CUDA, index_add_ on the CPU


@contextlib.contextmanager
def dense_segments(enabled: bool | None) -> Iterator[None]:
    """Forces the segment-sum path of every operator inside the block (None: by device), and with it
    the attention path of the models' blocks (``models.attention.attend``: on the CUDA path the fused
    attention plus separate scores, which reuse its row log-sum-exps where the kernel returns them; on
    the CPU path both from one set of logits).

    ``True`` runs the CUDA path on any device: ``bench throughput`` uses it to count on the CPU the
    ops that a GPU launches.
    """
    global _DENSE
    previous, _DENSE = _DENSE, enabled
    try:
        yield
    finally:
        _DENSE = previous


def use_dense(t: Tensor) -> bool:
    """Whether segment sums over ``t``'s device take the one-hot matmul path."""
    return t.is_cuda if _DENSE is None else _DENSE


# Why compiled graphs never sort: inductor lowers ``sort`` / ``argsort`` to a Triton sorting network
# whose first compilation can take minutes (pytorch/pytorch#182060; on an H100 ToMe's two argsorts a
# round did not compile within 170 s, docs/history.md). At the N of a ViT (<= a few hundred tokens) counting pairwise
# comparisons is (B, N, N) elementwise work that inductor fuses into one reduction. Eager code keeps
# the sort: one kernel launch where the comparisons take five or six, and eager GPU forwards of the
# downsampled models are bound by the host's launch rate.


def stable_ranks(values: Tensor, *, descending: bool) -> Tensor:
    """Each entry's position in a stable sort of ``values`` (B, N) along the last dim -> (B, N) int64.

    Equal values keep their order (the lower index ranks first). Sorts twice when run eagerly;
    counts comparisons when traced by ``torch.compile`` (``compared_ranks``).
    """
    if torch.compiler.is_compiling():
        return compared_ranks(values, descending=descending)
    return values.argsort(dim=-1, descending=descending, stable=True).argsort(dim=-1)


def compared_ranks(values: Tensor, *, descending: bool) -> Tensor:
    """``stable_ranks`` without a sort: the number of entries that sort before each one, (B, N) int64.

    A permutation for values without NaN (a NaN compares false with everything here, while torch's
    sort puts it last; the models' values have none).
    """
    n = values.shape[-1]
    mine, other = values.unsqueeze(-1), values.unsqueeze(-2)  # [.., i, j]: entry i against entry j
    earlier = torch.ones(n, n, dtype=torch.bool, device=values.device).tril_(-1)  # j < i
    ahead = other > mine if descending else other < mine
    return (ahead | (earlier & (other == mine))).sum(-1)  # boolean ops: ONNX Runtime has no Where on booleans


def sorted_indices(index: Tensor) -> Tensor:
    """Distinct indices (B, K) in ascending order, (B, K). Sorts when run eagerly; when traced by
    ``torch.compile``, places each index at the number of smaller ones (``compared_order``)."""
    if torch.compiler.is_compiling():
        return compared_order(index)
    return index.sort(dim=-1).values


def compared_order(index: Tensor) -> Tensor:
    """``sorted_indices`` without a sort, for distinct indices (B, K)."""
    smaller = (index.unsqueeze(-2) < index.unsqueeze(-1)).sum(-1)  # (B, K)
    return torch.empty_like(index).scatter_(1, smaller, index)


def flagged_last(flags: Tensor) -> Tensor:
    """A permutation (B, N) of the positions of ``flags`` (B, N) bool: the unflagged positions first, then
    the flagged ones, each group in ascending order. One scatter to distinct slots: no sort, which
    compiled graphs avoid (see ``stable_ranks``), and no repeated index, so the result is the same on
    every run."""
    b, n = flags.shape
    seen = flags.long().cumsum(-1)  # flagged positions up to and including each one
    positions = torch.arange(n, device=flags.device)
    slot = torch.where(flags, n - seen[:, -1:] + seen - 1, positions - seen)
    return torch.empty_like(slot).scatter_(1, slot, positions.expand(b, n))


def batch_offset(b: int, k: int, device: torch.device) -> Tensor:
    """(B, 1) offsets s * k that turn per-sample segment ids into rows of a flattened (B*K) output (zeros at k = 0)."""
    if k == 0:  # arange's step cannot be 0; a multiply instead would dispatch one op more every call, every block
        return torch.zeros(b, 1, dtype=torch.long, device=device)
    return torch.arange(0, b * k, k, device=device).unsqueeze(1)


class Partition:
    """N tokens split into K segments by ``assign`` (B, N), and the segment sums over it.

    On CUDA the sums multiply by a (B, K, N) one-hot matrix: a dense batched matmul is fast there
    and, unlike ``index_add_``'s atomics, gives the same bits on every run. On the CPU ``index_add_``
    over the flattened batch is several times cheaper than the matmul. ``dense`` picks the path
    (default: by device); both give the same sums.
    """

    def __init__(self, assign: Tensor, k: int, *, dtype: torch.dtype, dense: bool | None = None,
                 offset: Tensor | None = None) -> None:
        self.assign, self.k, self.dtype = assign, k, dtype
        self.dense = use_dense(assign) if dense is None else dense
        if self.dense:
            self.matrix = one_hot(assign, k, dtype)  # (B, K, N)
        else:
            if offset is None:
                offset = batch_offset(assign.shape[0], k, assign.device)
            self.flat = (assign + offset).view(-1)  # (B*N,) row of each token in the flattened (B*K) output

    def sum(self, values: Tensor) -> Tensor:
        """Segment sums of the rows of ``values`` (B, N, C) -> (B, K, C)."""
        if self.dense:
            return torch.bmm(self.matrix, values)
        b, n, c = values.shape
        out = values.new_zeros(b * self.k, c).index_add_(0, self.flat, values.reshape(b * n, c))
        return out.view(b, self.k, c)

    def total(self, weights: Tensor | None) -> Tensor:
        """Per segment, the sum of ``weights`` (B, N) over its members, or the member count; (B, K, 1)."""
        if self.dense:
            return (self.matrix if weights is None else self.matrix * weights.unsqueeze(1)).sum(-1, keepdim=True)
        b = self.assign.shape[0]
        source = torch.ones_like(self.flat, dtype=self.dtype) if weights is None else weights.reshape(-1)
        return source.new_zeros(b * self.k).index_add_(0, self.flat, source).view(b, self.k, 1)

    def mean(self, values: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        """Weighted segment means of ``values`` (B, N, C) -> ((B, K, C), the (B, K, 1) weight totals).

        An empty segment gives 0 / 0 (NaN), for the caller to replace.
        """
        if self.dense:  # weight the (B, K, N) matrix, not the (B, N, C) values: K < C here
            mw = self.matrix if weights is None else self.matrix * weights.unsqueeze(1)
            total = mw.sum(-1, keepdim=True)
            return torch.bmm(mw, values) / total, total
        total = self.total(weights)
        return self.sum(values if weights is None else values * weights.unsqueeze(-1)) / total, total


def augmented(x: Tensor, w: Tensor | None) -> Tensor:
    """(B, N, D) rows and (B, N) weights -> (B, N, D + P) rows ``[w_i x_i, w_i, ...]`` (w = 1 when None).

    A segment sum of these gives each segment's weighted sum and its total weight in one pass. The
    weight is repeated to a width that is a multiple of 8 (P >= 1), which keeps the rows 32-byte
    aligned for the GPU's matmul kernels.
    """
    b, n, d = x.shape
    pad = 8 - d % 8
    if w is None:
        return torch.cat([x, x.new_ones(b, n, pad)], dim=-1)
    w = w.unsqueeze(-1)
    return torch.cat([x * w, w.expand(b, n, pad)], dim=-1)


def segment_means(part: Partition, rows: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """Weighted means from ``augmented`` rows of D features -> ((B, K, D), the (B, K, 1) total weights).

    An empty segment gives 0 / 0 (NaN), for the caller to replace.
    """
    sums = part.sum(rows)
    total = sums[..., d : d + 1]
    return sums[..., :d] / total, total


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows of x (B, N, D) at index (B, K) -> (B, K, D)."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
