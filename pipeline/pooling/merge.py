"""The merge of Algorithm 1 (its last line): each cluster's weighted mean of the tokens, and the sizes.

The means are one custom op, ``tokenpool::cluster_means``: one Triton kernel on CUDA (``means_triton``, no (B, K, N)
membership in memory), native C code on the CPU (``native.cluster_means``: one pass over the tokens, the bits of
``Partition``'s ``index_add_`` sums, which run where the library is not at hand or with ``kernels.merge: torch`` or
``kernels.native: torch``), the one-hot torch ops on other devices (the reference the kernels are tested against; on
CUDA too with ``kernels.merge: torch``). Its backward is the closed form below, in torch ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.pooling import native
from pipeline.pooling.common import Partition, gather_rows, one_hot
from pipeline.runtime import exporting, note_dispatch

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch path
    from pipeline.pooling.means_triton import cluster_means_triton
except ImportError:  # pragma: no cover - depends on the install
    cluster_means_triton = None


def pool_segments(
    tokens: Tensor, weights: Tensor | None, sizes: Tensor | None, assign: Tensor, k: int, start: Tensor | None,
    kernel: str = "auto", use_native: bool = True,
) -> tuple[Tensor, Callable[[], Tensor]]:
    """Weighted mean of the tokens in each segment, and the summed sizes of each segment.

    Args:
        tokens: (B, N, M).
        weights: (B, N) strictly positive, or None for a plain mean.
        sizes: (B, N) the number of original tokens each input stands for, or None for ones.
        assign: (B, N) int64 segment of each token, in [0, k).
        k: number of segments.
        start: (B, K) token indices: a segment with no members outputs the token at its index (its size
            is 0); None when the caller guarantees that no segment is empty.
        kernel: the config's ``kernels.merge``: ``auto`` (the Triton means on CUDA, native code on the CPU) or
            ``torch``.
        use_native: the config's ``kernels.native`` is not ``torch``.

    Returns:
        ((B, K, M) weighted means, a call that returns the (B, K) float32 summed sizes).
    """
    if exporting():
        means = means_dense(tokens, weights, assign, k, start)
    else:
        means = cluster_means(tokens, weights, assign, k, start, kernel, use_native)

    def summed_sizes() -> Tensor:
        part = Partition(assign, k, dtype=tokens.dtype)
        return part.total(None if sizes is None else sizes.to(tokens.dtype)).squeeze(-1).float()

    return means, summed_sizes


@torch.library.custom_op("tokenpool::cluster_means", mutates_args=())
def cluster_means(x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None, kernel: str = "auto",
                  use_native: bool = True) -> Tensor:
    """Weighted cluster means, x (B, N, M), w (B, N) or None, assign (B, N) in [0, k), start (B, K) or None
    -> (B, K, M); an empty cluster gives x at its ``start`` index (0 / 0 without ``start``). ``kernel``:
    ``auto`` or ``torch`` (the config's ``kernels.merge``), ``use_native``: the config's ``kernels.native`` is not
    ``torch``. Each device's kernel notes the path it took (``runtime.note_dispatch``)."""
    note_dispatch("merge", "torch", x.shape[1])
    return means_dense(x, w, assign, k, start)


def means_dense(x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None) -> Tensor:
    """The means in torch ops: a one-hot (B, K, N) membership, weighted, times the tokens."""
    member = one_hot(assign, k, x.dtype)
    if w is not None:
        member = member * w.unsqueeze(1)
    total = member.sum(-1, keepdim=True)  # (B, K, 1)
    return _empty_to_start(torch.bmm(member, x) / total, total, x, start)


def means_partition(x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None) -> Tensor:
    """The means in ``Partition``'s ``index_add_`` sums (the CPU's torch path)."""
    means, total = Partition(assign, k, dtype=x.dtype).mean(x, w)
    return _empty_to_start(means, total, x, start)


def _empty_to_start(means: Tensor, total: Tensor, x: Tensor, start: Tensor | None) -> Tensor:
    """means (B, K, M) with each empty cluster's (total (B, K, 1) weight 0: 0 / 0) the token of x at its start."""
    return means if start is None else torch.where(total > 0, means, gather_rows(x, start))


@cluster_means.register_kernel("cpu")
def _cluster_means_cpu(x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None,
                       kernel: str = "auto", use_native: bool = True) -> Tensor:
    lib = native.for_tensor(x, use_native and kernel != "torch")
    note_dispatch("merge", "torch" if lib is None else "native-c", x.shape[1])
    if lib is None:
        return means_partition(x, w, assign, k, start)
    return native.cluster_means(lib, x, w, assign, k, start)


@cluster_means.register_kernel("cuda")
def _cluster_means_cuda(x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None,
                        kernel: str = "auto", use_native: bool = True) -> Tensor:
    if (kernel == "torch" or cluster_means_triton is None or x.dtype != torch.float32
            or (w is not None and w.dtype != torch.float32)):
        note_dispatch("merge", "torch", x.shape[1])
        return means_dense(x, w, assign, k, start)
    note_dispatch("merge", "triton", x.shape[1])
    return cluster_means_triton(x, w, assign, k, start)


@cluster_means.register_fake
def _cluster_means_fake(x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None,
                        kernel: str = "auto", use_native: bool = True) -> Tensor:
    return x.new_empty(x.shape[0], k, x.shape[2])


def _setup_context(ctx, inputs, output) -> None:
    x, w, assign, k, start, _, _ = inputs
    ctx.save_for_backward(x, w, assign, start, output)
    ctx.k = k


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None, None]:
    """With T_k = sum_{n in k} w_n and the mean mu_k of a member cluster k = a(n):
    d mu_k / d x_n = w_n / T_k, and d mu_k / d w_n = (x_n - mu_k) / T_k; an empty cluster's output is the
    token at its ``start``, whose gradient it passes on."""
    x, w, assign, start, means = ctx.saved_tensors
    b, n, m = x.shape
    member = one_hot(assign, ctx.k, grad.dtype)  # (B, K, N): sums without atomics, the same bits every run
    total = (member if w is None else member * w.to(grad.dtype).unsqueeze(1)).sum(-1)  # (B, K)
    rows = assign.unsqueeze(-1).expand(b, n, m)
    per_member = (grad / total.clamp_min(torch.finfo(grad.dtype).tiny).unsqueeze(-1)).gather(1, rows)  # (B, N, M)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = per_member if w is None else per_member * w.unsqueeze(-1)
        if start is not None:
            empty = (total == 0).unsqueeze(-1)
            # an image's start tokens are distinct: no two adds meet, so the order cannot change the sum
            grad_x = grad_x.scatter_add(1, start.unsqueeze(-1).expand(b, ctx.k, m), torch.where(empty, grad, 0.0))
    if w is not None and ctx.needs_input_grad[1]:
        grad_w = ((x - means.gather(1, rows)) * per_member).sum(-1)
    return grad_x, grad_w, None, None, None, None, None


cluster_means.register_autograd(_backward, setup_context=_setup_context)
