"""A Triton kernel for the merge of Algorithm 1 (its last line): each cluster's weighted mean.

Why our own kernel: in torch ops the merge is a (B, K, N) one-hot membership written to memory, a
weighted copy of it, its row sums, a batched matmul and a division, five launches a pooled block on
the CUDA path, with the membership written and read back. Here one program sums a (K, BLOCK_M) slab
of one image's means: it builds its membership tile in registers from the assignment and multiplies
it into the tokens with ``tl.dot``, so nothing of size K x N reaches memory. Each program writes its
own outputs (no atomics), so the result is the same on every run.

The kernel runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_M = 64  # features per program
_TILE_N = 32  # tokens per step of the product; tl.dot needs at least 16


@triton.jit
def membership(ASSIGN, W, b, N, offs_n, offs_k, HAS_W: tl.constexpr):
    """The weighted membership of tokens ``offs_n`` of image b, (BLOCK_K, TILE): w_n where token n is in
    cluster k, else 0 (w = 1 without HAS_W; 0 past the end), built in registers from the assignment."""
    mask_n = offs_n < N
    a_n = tl.load(ASSIGN + b * N + offs_n, mask=mask_n, other=-1)
    if HAS_W:
        w_n = tl.load(W + b * N + offs_n, mask=mask_n, other=0.0)
    else:
        w_n = mask_n.to(tl.float32)
    return tl.where(offs_k[:, None] == a_n[None, :], w_n[None, :], 0.0)


@triton.jit
def _means_kernel(X, W, ASSIGN, START, OUT, N, M, K, sxb, sxn, HAS_W: tl.constexpr, HAS_START: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr):
    """out[b, k, m] = sum_{n: assign[b, n] = k} w[b, n] x[b, n, m] / sum_{n: assign[b, n] = k} w[b, n] for
    BLOCK_M features m of image b; an empty cluster k gives x[b, start[b, k], m] with HAS_START, else 0 / 0."""
    b = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    acc = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)
    total = tl.zeros([BLOCK_K], tl.float32)
    for n0 in range(0, N, TILE_N):
        offs_n = n0 + tl.arange(0, TILE_N)
        mask_n = offs_n < N
        member = membership(ASSIGN, W, b, N, offs_n, offs_k, HAS_W)  # (BLOCK_K, TILE_N)
        x = tl.load(X + b * sxb + offs_n[:, None] * sxn + offs_m[None, :], mask=mask_n[:, None] & mask_m[None, :],
                    other=0.0)
        acc += tl.dot(member, x, input_precision=PRECISION)
        total += tl.sum(member, axis=1)
    means = acc / total[:, None]
    mask = mask_k[:, None] & mask_m[None, :]
    if HAS_START:
        start = tl.load(START + b * K + offs_k, mask=mask_k, other=0)
        fallback = tl.load(X + b * sxb + start[:, None] * sxn + offs_m[None, :], mask=mask, other=0.0)
        means = tl.where(total[:, None] > 0, means, fallback)
    tl.store(OUT + b * K * M + offs_k[:, None] * M + offs_m[None, :], means, mask=mask)


def cluster_means_triton(x: Tensor, w: Tensor | None, assign: Tensor, k: int, start: Tensor | None, *,
                         block_m: int = _BLOCK_M, tile_n: int = _TILE_N, num_warps: int = 8) -> Tensor:
    """Weighted cluster means: x (B, N, M) float32 (rows may be strided, features contiguous), w (B, N) or
    None, assign (B, N) int64 in [0, k), start (B, K) int64 or None -> (B, K, M) float32. One launch on a
    (B, M / block_m) grid. The product runs in TF32 where torch's float32 matmuls do
    (``torch.backends.cuda.matmul.allow_tf32``), as the one-hot ``bmm`` it replaces would."""
    b, n, m = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(b, k, m, device=x.device, dtype=torch.float32)
    if b == 0:
        return out
    precision = "tf32" if x.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    has_w, has_start = w is not None, start is not None
    _means_kernel[(b, triton.cdiv(m, block_m))](
        x, w.contiguous() if has_w else x, assign.contiguous(), start.contiguous() if has_start else assign, out,
        n, m, k, x.stride(0), x.stride(1), HAS_W=has_w, HAS_START=has_start,
        BLOCK_K=max(16, triton.next_power_of_2(k)), BLOCK_M=block_m, TILE_N=tile_n, PRECISION=precision,
        num_warps=num_warps)
    return out
