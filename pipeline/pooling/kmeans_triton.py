"""A Triton kernel for K-Means' Gram-form iterations (``clustering.kmeans_gram_iterations``), all of them
in one program per image.

Why our own kernel: in torch ops an iteration is about eleven launches (one-hot membership, weights,
totals, the keep-empty rule, a (K, N) x (N, N) product, the centre norms, the argmin), so five
iterations cost some fifty launches a pooled block and write a (B, K, N) tensor several times each
(docs/benchmarks.md has what that costs a compiled model). Here one launch runs every iteration of an
image:

- the start: centre k is token start_k, so its row of projections is G[start_k] and its squared norm
  G[start_k, start_k];
- an assignment: each token's nearest centre, argmin_k ||c_k||^2 - 2 c_k . x_i (ties to the lowest k);
- ``iters - 1`` updates, each: the cluster totals; then, a tile of columns at a time, the projections
  P = C G with C the weighted, normalised membership built in registers (``tl.dot``), and the centre
  norms sum_j C_kj P_kj; then the assignment again. An empty cluster keeps its centre: its projections
  and norm stay as they are in the scratch rows.

The (K, N) projections pass through global memory (an image's rows stay in L2), with a barrier between
the phases. Each program writes only its own image's rows, so the result is the same on every run.

The kernel runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pipeline.pooling.means_triton import membership


@triton.jit
def _assign(PROJ, CSQ, ASSIGN, b, N, K, offs_k, mask_k, TILE: tl.constexpr):
    """Each token's nearest centre, argmin_k CSQ[k] - 2 PROJ[k, i], ties to the lowest k."""
    csq = tl.load(CSQ + b * K + offs_k, mask=mask_k, other=0.0)
    for i0 in range(0, N, TILE):
        offs_i = i0 + tl.arange(0, TILE)
        mask_i = offs_i < N
        proj = tl.load(PROJ + b * K * N + offs_k[:, None] * N + offs_i[None, :],
                       mask=mask_k[:, None] & mask_i[None, :], other=0.0)
        dist = tl.where(mask_k[:, None], csq[:, None] - 2.0 * proj, float("inf"))
        tl.store(ASSIGN + b * N + offs_i, tl.argmin(dist, axis=0, tie_break_left=True), mask=mask_i)


@triton.jit
def _coef(ASSIGN, W, b, N, offs_n, offs_k, total, HAS_W: tl.constexpr):
    """The weighted, normalised membership C[k, n] = w_n [a_n = k] / T_k of tokens ``offs_n``, (BLOCK_K, TILE)."""
    return membership(ASSIGN, W, b, N, offs_n, offs_k, HAS_W) / total[:, None]


@triton.jit
def _kmeans_kernel(G, W, START, ASSIGN, PROJ, CSQ, N, K, iters, HAS_W: tl.constexpr, BLOCK_K: tl.constexpr,
                   TILE: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    rows = G + b * N * N
    start = tl.load(START + b * K + offs_k, mask=mask_k, other=0)
    for j0 in range(0, N, TILE):  # centre k = token start_k: its projections are the row G[start_k]
        offs_j = j0 + tl.arange(0, TILE)
        mask = mask_k[:, None] & (offs_j < N)[None, :]
        tl.store(PROJ + b * K * N + offs_k[:, None] * N + offs_j[None, :],
                 tl.load(rows + start[:, None] * N + offs_j[None, :], mask=mask, other=0.0), mask=mask)
    tl.store(CSQ + b * K + offs_k, tl.load(rows + start * (N + 1), mask=mask_k, other=0.0), mask=mask_k)
    tl.debug_barrier()
    _assign(PROJ, CSQ, ASSIGN, b, N, K, offs_k, mask_k, TILE)
    tl.debug_barrier()
    for _ in range(1, iters):
        total = tl.zeros([BLOCK_K], tl.float32)
        for n0 in range(0, N, TILE):
            offs_n = n0 + tl.arange(0, TILE)
            total += tl.sum(membership(ASSIGN, W, b, N, offs_n, offs_k, HAS_W), axis=1)
        filled = mask_k & (total > 0)
        total = tl.where(filled, total, 1.0)  # an empty (or absent) cluster's row of C is all zeros
        csq = tl.zeros([BLOCK_K], tl.float32)
        for j0 in range(0, N, TILE):
            offs_j = j0 + tl.arange(0, TILE)
            mask_j = offs_j < N
            proj = tl.zeros([BLOCK_K, TILE], tl.float32)
            for n0 in range(0, N, TILE):
                offs_n = n0 + tl.arange(0, TILE)
                g = tl.load(rows + offs_n[:, None] * N + offs_j[None, :], mask=(offs_n < N)[:, None] & mask_j[None, :],
                            other=0.0)
                proj += tl.dot(_coef(ASSIGN, W, b, N, offs_n, offs_k, total, HAS_W), g, input_precision=PRECISION)
            csq += tl.sum(proj * _coef(ASSIGN, W, b, N, offs_j, offs_k, total, HAS_W), axis=1)
            tl.store(PROJ + b * K * N + offs_k[:, None] * N + offs_j[None, :], proj,
                     mask=filled[:, None] & mask_j[None, :])
        tl.store(CSQ + b * K + offs_k, csq, mask=filled)  # an empty cluster keeps its centre
        tl.debug_barrier()
        _assign(PROJ, CSQ, ASSIGN, b, N, K, offs_k, mask_k, TILE)
        tl.debug_barrier()


def kmeans_fused_triton(g: Tensor, w: Tensor | None, start: Tensor, iters: int, *, tile: int = 32,
                        num_warps: int = 8) -> Tensor:
    """K-Means' Gram-form iterations in one launch: g (B, N, N) float32 Gram matrices, w (B, N) float32 or
    None, start (B, K) int64 token indices -> the last assignment (B, N) int64. The products run in TF32
    where torch's float32 matmuls do (``torch.backends.cuda.matmul.allow_tf32``), as the torch iterations'
    ``bmm`` would."""
    b, n, _ = g.shape
    k = start.shape[1]
    assign = torch.empty(b, n, device=g.device, dtype=torch.int64)
    if b == 0:
        return assign
    proj = torch.empty(b, k, n, device=g.device, dtype=torch.float32)
    csq = torch.empty(b, k, device=g.device, dtype=torch.float32)
    precision = "tf32" if g.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    has_w = w is not None
    _kmeans_kernel[(b,)](g.contiguous(), w.contiguous() if has_w else csq, start.contiguous(), assign, proj, csq, n, k,
                         iters, HAS_W=has_w, BLOCK_K=max(16, triton.next_power_of_2(k)), TILE=tile,
                         PRECISION=precision, num_warps=num_warps)
    return assign
