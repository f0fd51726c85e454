"""One Triton kernel for all of K-Medoids' iterations on a precomputed distance matrix.

Why our own kernel: no library runs K-Medoids on a batch of small (N <= ~1k) problems on a GPU, and
the torch formulation (one-hot matmuls, gathers and minima per iteration) launches about eight
kernels an iteration and reads (B, N, N) and (B, N, K) tensors each time: on an H200 that made
K-Medoids slower than the transformer block it shrinks (docs/benchmarks.md). Here one program per
image runs every assignment and update; the distances stay in the L2 cache between iterations.

Semantics are those of ``clustering._kmedoids`` (and of the brute-force reference in ``tests/``):

- assignment: each token joins the medoid nearest to it (ties to the lowest cluster index); a
  medoid always joins its own cluster;
- update: the cost of token n as the medoid of its own cluster is ``sum_{j in cluster} w_j d(n, j)``;
  each cluster's cheapest member (lowest token index on ties) replaces the medoid only when cheaper
  by more than the relative margin ``rtol``.

The kernel runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
Phases within a program exchange the assignment and the costs through two small (B, N) buffers,
with a barrier between them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_N = 32  # token rows per tile
_BLOCK_J = 64  # columns of the distance matrix per tile in the cost pass


@triton.jit
def _assign(d_base, a_base, med, mask_k, N, BLOCK_N: tl.constexpr):
    """Nearest medoid of every token: d[n, med_k], -inf where n is med_k, +inf off the K clusters."""
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        vals = tl.load(d_base + offs_n[:, None] * N + med[None, :], mask=mask_n[:, None] & mask_k[None, :],
                       other=float("inf"))
        vals = tl.where(offs_n[:, None] == med[None, :], float("-inf"), vals)
        vals = tl.where(mask_k[None, :], vals, float("inf"))
        tl.store(a_base + offs_n, tl.argmin(vals, axis=1, tie_break_left=True), mask=mask_n)


@triton.jit
def _kmedoids_kernel(D, W, MED, ASSIGN, COST, N, K, ITERS, keep,
                     HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d_base = D + b * N * N
    a_base = ASSIGN + b * N
    c_base = COST + b * N
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    med = tl.load(MED + b * K + offs_k, mask=mask_k, other=0)
    _assign(d_base, a_base, med, mask_k, N, BLOCK_N)
    for _ in range(ITERS - 1):
        tl.debug_barrier()
        # Cost of every token as the medoid of its own cluster.
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            a_n = tl.load(a_base + offs_n, mask=mask_n, other=-1)
            acc = tl.zeros([BLOCK_N], tl.float32)
            for j0 in range(0, N, BLOCK_J):
                offs_j = j0 + tl.arange(0, BLOCK_J)
                mask_j = offs_j < N
                a_j = tl.load(a_base + offs_j, mask=mask_j, other=-2)
                dist = tl.load(d_base + offs_n[:, None] * N + offs_j[None, :],
                               mask=mask_n[:, None] & mask_j[None, :], other=0.0)
                if HAS_W:
                    dist = dist * tl.load(W + b * N + offs_j, mask=mask_j, other=0.0)[None, :]
                acc += tl.sum(tl.where(a_n[:, None] == a_j[None, :], dist, 0.0), axis=1)
            tl.store(c_base + offs_n, acc, mask=mask_n)
        tl.debug_barrier()
        # Each cluster's cheapest member, scanning tokens in order (the first minimum wins ties).
        best_cost = tl.full([BLOCK_K], float("inf"), tl.float32)
        best = med
        current = tl.zeros([BLOCK_K], tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            a_n = tl.load(a_base + offs_n, mask=mask_n, other=-1)
            c_n = tl.load(c_base + offs_n, mask=mask_n, other=float("inf"))
            vals = tl.where(a_n[None, :] == offs_k[:, None], c_n[None, :], float("inf"))  # (BLOCK_K, BLOCK_N)
            tile_cost = tl.min(vals, axis=1)
            tile_best = tl.argmin(vals, axis=1, tie_break_left=True) + n0
            better = tile_cost < best_cost
            best = tl.where(better, tile_best, best)
            best_cost = tl.where(better, tile_cost, best_cost)
            current += tl.sum(tl.where(offs_n[None, :] == med[:, None], c_n[None, :], 0.0), axis=1)
        med = tl.where(best_cost < current * keep, best, med)
        tl.debug_barrier()
        _assign(d_base, a_base, med, mask_k, N, BLOCK_N)
    tl.store(MED + b * K + offs_k, med, mask=mask_k)


def kmedoids_triton(d: Tensor, w: Tensor | None, medoids: Tensor, iters: int, rtol: float) -> tuple[Tensor, Tensor]:
    """K-Medoids iterations: d (B, N, N) float32 distances, w (B, N) float32 or None, medoids (B, K) int64
    starting medoids -> (medoids (B, K) int64, last assignment (B, N) int64)."""
    b, n, _ = d.shape
    k = medoids.shape[1]
    d = d.contiguous()
    med = medoids.to(torch.int64).contiguous().clone()  # updated in place by the kernel
    assign = torch.empty(b, n, device=d.device, dtype=torch.int64)
    cost = torch.empty(b, n, device=d.device, dtype=torch.float32)
    has_w = w is not None
    w_arg = w.contiguous() if has_w else cost  # never read without HAS_W
    block_k = max(16, triton.next_power_of_2(k))
    _kmedoids_kernel[(b,)](d, w_arg, med, assign, cost, n, k, iters, 1.0 - rtol, HAS_W=has_w, BLOCK_N=_BLOCK_N,
                           BLOCK_J=_BLOCK_J, BLOCK_K=block_k, num_warps=4)
    return med, assign
