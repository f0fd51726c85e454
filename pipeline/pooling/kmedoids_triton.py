"""Triton kernels for K-Medoids' iterations on a precomputed distance matrix.

Why our own kernel: no library runs K-Medoids on a batch of small (N <= ~1k) problems on a GPU, and
the torch formulation (one-hot matmuls, gathers and minima per iteration) launches about eight
kernels an iteration and reads and writes (B, N, K) tensors each time: on an H200 that made K-Medoids
slower than the transformer block it shrinks (docs/benchmarks.md). Here an iteration is three
kernels that read the distances (which stay in the L2 cache) and write only (B, N) and (B, K).

Semantics are those of ``clustering._kmedoids`` (and of the brute-force reference in ``tests/``):

- assignment: each token joins the medoid nearest to it (ties to the lowest cluster index); a
  medoid always joins its own cluster;
- update: the cost of token n as the medoid of its own cluster is ``sum_{j in cluster} w_j d(n, j)``;
  each cluster's cheapest member (lowest token index on ties) replaces the medoid only when cheaper
  by more than the relative margin ``rtol``.

The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_N = 16  # token rows per program in the assignment and cost kernels
_BLOCK_J = 64  # columns of the distance matrix per step of the cost kernel
_BLOCK_C = 32  # clusters per program in the update kernel
_BLOCK_T = 64  # tokens per step of the update kernel


@triton.jit
def _assign_kernel(D, MED, ASSIGN, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Nearest medoid of BLOCK_N tokens: d[n, med_k], -inf where n is med_k (a medoid joins its own
    cluster), +inf off the K clusters; ties to the lowest cluster index."""
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    med = tl.load(MED + b * K + offs_k, mask=mask_k, other=0)
    vals = tl.load(D + b * N * N + offs_n[:, None] * N + med[None, :], mask=mask_n[:, None] & mask_k[None, :],
                   other=float("inf"))
    vals = tl.where(offs_n[:, None] == med[None, :], float("-inf"), vals)
    vals = tl.where(mask_k[None, :], vals, float("inf"))
    tl.store(ASSIGN + b * N + offs_n, tl.argmin(vals, axis=1, tie_break_left=True), mask=mask_n)


@triton.jit
def _cost_kernel(D, W, ASSIGN, COST, N, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    """Cost of BLOCK_N tokens as the medoid of their own cluster: sum_{j in cluster} w_j d[n, j]."""
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_n = tl.load(ASSIGN + b * N + offs_n, mask=mask_n, other=-1)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j0 in range(0, N, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mask_j = offs_j < N
        a_j = tl.load(ASSIGN + b * N + offs_j, mask=mask_j, other=-2)
        dist = tl.load(D + b * N * N + offs_n[:, None] * N + offs_j[None, :], mask=mask_n[:, None] & mask_j[None, :],
                       other=0.0)
        if HAS_W:
            dist = dist * tl.load(W + b * N + offs_j, mask=mask_j, other=0.0)[None, :]
        acc += tl.sum(tl.where(a_n[:, None] == a_j[None, :], dist, 0.0), axis=1)
    tl.store(COST + b * N + offs_n, acc, mask=mask_n)


@triton.jit
def _update_kernel(ASSIGN, COST, MED, N, K, keep, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """Each of BLOCK_C clusters' cheapest member, scanning tokens in order (the first minimum wins
    ties); it replaces the medoid when its cost is below ``keep`` times the medoid's."""
    b = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_k = offs_k < K
    med = tl.load(MED + b * K + offs_k, mask=mask_k, other=-1)
    best_cost = tl.full([BLOCK_C], float("inf"), tl.float32)
    best = med
    current = tl.zeros([BLOCK_C], tl.float32)
    for n0 in range(0, N, BLOCK_T):
        offs_n = n0 + tl.arange(0, BLOCK_T)
        mask_n = offs_n < N
        a_n = tl.load(ASSIGN + b * N + offs_n, mask=mask_n, other=-1)
        c_n = tl.load(COST + b * N + offs_n, mask=mask_n, other=float("inf"))
        vals = tl.where(a_n[None, :] == offs_k[:, None], c_n[None, :], float("inf"))  # (BLOCK_C, BLOCK_T)
        tile_cost = tl.min(vals, axis=1)
        tile_best = tl.argmin(vals, axis=1, tie_break_left=True) + n0
        better = tile_cost < best_cost
        best = tl.where(better, tile_best, best)
        best_cost = tl.where(better, tile_cost, best_cost)
        current += tl.sum(tl.where(offs_n[None, :] == med[:, None], c_n[None, :], 0.0), axis=1)
    tl.store(MED + b * K + offs_k, tl.where(best_cost < current * keep, best, med), mask=mask_k)


def kmedoids_triton(d: Tensor, w: Tensor | None, medoids: Tensor, iters: int, rtol: float, *,
                    block_n: int = _BLOCK_N, block_j: int = _BLOCK_J) -> tuple[Tensor, Tensor]:
    """K-Medoids iterations: d (B, N, N) float32 distances, w (B, N) float32 or None, medoids (B, K) int64
    starting medoids -> (medoids (B, K) int64, last assignment (B, N) int64). ``block_n`` and ``block_j``
    tile the assignment and cost kernels (``bench kernels`` compares tilings).

    Three kernels an iteration (assignment, costs, update), each on a (B, tiles) grid: one program per
    image for all iterations left the GPU nearly idle (2 programs an SM) and took 0.55-0.65 ms at
    DeiT-S size on an H100, half a transformer block (docs/benchmarks.md).
    """
    b, n, _ = d.shape
    k = medoids.shape[1]
    d = d.contiguous()
    med = medoids.to(torch.int64).contiguous().clone()  # updated in place by the update kernel
    assign = torch.empty(b, n, device=d.device, dtype=torch.int64)
    cost = torch.empty(b, n, device=d.device, dtype=torch.float32)
    has_w = w is not None
    w_arg = w.contiguous() if has_w else cost  # never read without HAS_W
    rows = (b, triton.cdiv(n, block_n))
    block_k = max(16, triton.next_power_of_2(k))
    _assign_kernel[rows](d, med, assign, n, k, BLOCK_N=block_n, BLOCK_K=block_k)
    for _ in range(iters - 1):
        _cost_kernel[rows](d, w_arg, assign, cost, n, HAS_W=has_w, BLOCK_N=block_n, BLOCK_J=block_j)
        _update_kernel[(b, triton.cdiv(k, _BLOCK_C))](assign, cost, med, n, k, 1.0 - rtol, BLOCK_C=_BLOCK_C,
                                                       BLOCK_T=_BLOCK_T)
        _assign_kernel[rows](d, med, assign, n, k, BLOCK_N=block_n, BLOCK_K=block_k)
    return med, assign
