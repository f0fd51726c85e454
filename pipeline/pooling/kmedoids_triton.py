"""Triton kernels for K-Medoids' iterations on a precomputed distance matrix.

Why our own kernel: no library runs K-Medoids on a batch of small (N <= ~1k) problems on a GPU, and
the torch formulation (one-hot matmuls, gathers and minima per iteration) launches about eight
kernels an iteration and reads and writes (B, N, K) tensors each time: on an H200 that made K-Medoids
slower than the transformer block it shrinks (docs/benchmarks.md). Here an iteration is two
kernels that read the distances and write only (B, N) and (B, K) buffers:

1. ``_cost_kernel``: each token's cost as the medoid of its own cluster, and each cluster's cheapest
   member by an atomic minimum of ``(cost, token)`` packed in one int64 (``_pack``), so that the
   minimum is the lowest cost and, on ties, the lowest token index, in any order of arrival;
2. ``_assign_kernel``: every program first applies the swap rule to all K clusters of its image
   (from the packed minima and the current medoids' costs), then assigns its tokens.

A third kernel that scans every token for every cluster took about half the GPU time of the
iterations in a profile (docs/history.md); the packed minimum folds it into the cost kernel.

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
# an unwritten packed minimum: decodes to a NaN cost, which never replaces a medoid. A kernel may read a
# module global only when it is a tl.constexpr (the interpreter does not enforce it; the compiler does)
_EMPTY = tl.constexpr(2**63 - 1)


@triton.jit
def _pack(cost, index):
    """(float32 cost, int token index) -> int64 ordered as (cost, index): the float's bits, made monotone
    for negative values (rounding can give -1e-7), above the index."""
    bits = (cost + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into 0.0, as min() treats them alike
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (bits.to(tl.int64) << 32) + index.to(tl.int64)


@triton.jit
def _unpack(key):
    """The inverse of ``_pack``: int64 -> (float32 cost, int64 index)."""
    high = (key >> 32).to(tl.int32)
    bits = high ^ ((high >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), key - (high.to(tl.int64) << 32)


@triton.jit
def _dist(ROWS, N, offs_r, mask_r, offs_c, mask_c, other, GRAM: tl.constexpr):
    """d[r, c] of an image's ``ROWS``, ``other`` off the rows ``mask_r`` and columns ``mask_c``.

    With GRAM the rows hold the Gram matrix G = X X^T and d[r, c] = (G[r, r] + G[c, c]) - 2 G[r, c], in the
    order of ``clustering.dists_from_gram`` (2 G is exact, so one rounding each way, fused or not): the
    distances are never written."""
    mask = mask_r[:, None] & mask_c[None, :]
    vals = tl.load(ROWS + offs_r[:, None] * N + offs_c[None, :], mask=mask, other=0.0)
    if GRAM:
        diag_r = tl.load(ROWS + offs_r * (N + 1), mask=mask_r, other=0.0)
        diag_c = tl.load(ROWS + offs_c * (N + 1), mask=mask_c, other=0.0)
        vals = (diag_r[:, None] + diag_c[None, :]) - 2.0 * vals
    return tl.where(mask, vals, other)


@triton.jit
def _nearest(ROWS, N, offs_n, mask_n, med, mask_k, GRAM: tl.constexpr):
    """The nearest medoid of tokens ``offs_n`` (an image's distance ``ROWS``): d[n, med_k], -inf where n is
    med_k (a medoid joins its own cluster), +inf off the K clusters; ties to the lowest cluster index."""
    vals = _dist(ROWS, N, offs_n, mask_n, med, mask_k, float("inf"), GRAM)
    vals = tl.where(offs_n[:, None] == med[None, :], float("-inf"), vals)
    vals = tl.where(mask_k[None, :], vals, float("inf"))
    return tl.argmin(vals, axis=1, tie_break_left=True)


@triton.jit
def _own_cluster_costs(ROWS, W_ROW, ASSIGN_ROW, N, offs_n, mask_n, a_n, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_J: tl.constexpr, GRAM: tl.constexpr):
    """Each token's cost as the medoid of its own cluster: sum_{j in cluster} w_j d[n, j] (an image's rows)."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j0 in range(0, N, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mask_j = offs_j < N
        a_j = tl.load(ASSIGN_ROW + offs_j, mask=mask_j, other=-2)
        dist = _dist(ROWS, N, offs_n, mask_n, offs_j, mask_j, 0.0, GRAM)
        if HAS_W:
            dist = dist * tl.load(W_ROW + offs_j, mask=mask_j, other=0.0)[None, :]
        acc += tl.sum(tl.where(a_n[:, None] == a_j[None, :], dist, 0.0), axis=1)
    return acc


@triton.jit
def _assign_kernel(D, MED_IN, MED_OUT, BEST, COST, ASSIGN, N, K, keep, SWAP: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """With SWAP, first the update: each cluster's cheapest member (BEST, packed) replaces its medoid when
    its cost is below ``keep`` times the medoid's (every program of an image computes the same K medoids
    and writes them to MED_OUT). Then the nearest medoid of BLOCK_N tokens: d[n, med_k], -inf where n is
    med_k (a medoid joins its own cluster), +inf off the K clusters; ties to the lowest cluster index."""
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    med = tl.load(MED_IN + b * K + offs_k, mask=mask_k, other=0)
    if SWAP:
        best_cost, best = _unpack(tl.load(BEST + b * K + offs_k, mask=mask_k, other=_EMPTY))
        current = tl.load(COST + b * N + med, mask=mask_k, other=0.0)
        med = tl.where(best_cost < current * keep, best, med)
        tl.store(MED_OUT + b * K + offs_k, med, mask=mask_k)
    tl.store(ASSIGN + b * N + offs_n, _nearest(D + b * N * N, N, offs_n, mask_n, med, mask_k, False), mask=mask_n)


@triton.jit
def _cost_kernel(D, W, ASSIGN, COST, BEST, N, K, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_J: tl.constexpr):
    """Cost of BLOCK_N tokens as the medoid of their own cluster, sum_{j in cluster} w_j d[n, j], and
    each one's bid for its cluster's cheapest member: an atomic minimum of the packed (cost, n)."""
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_n = tl.load(ASSIGN + b * N + offs_n, mask=mask_n, other=-1)
    acc = _own_cluster_costs(D + b * N * N, W + b * N, ASSIGN + b * N, N, offs_n, mask_n, a_n, HAS_W, BLOCK_N, BLOCK_J,
                             False)
    tl.store(COST + b * N + offs_n, acc, mask=mask_n)
    tl.atomic_min(BEST + b * K + a_n, _pack(acc, offs_n), mask=mask_n)


def kmedoids_triton(d: Tensor, w: Tensor | None, medoids: Tensor, iters: int, rtol: float, *,
                    block_n: int = _BLOCK_N, block_j: int = _BLOCK_J) -> tuple[Tensor, Tensor]:
    """K-Medoids iterations: d (B, N, N) float32 distances, w (B, N) float32 or None, medoids (B, K) int64
    starting medoids -> (medoids (B, K) int64, last assignment (B, N) int64). ``block_n`` and ``block_j``
    tile both kernels (``bench kernels`` compares tilings).

    An assignment, then per further iteration a cost kernel and an assignment that first swaps the
    medoids; each on a (B, tiles) grid, which keeps more of the GPU busy than one program per image
    (2 programs an SM at DeiT-S size; ``kmedoids_fused_triton`` is that form, ``bench kernels`` times both).
    Each iteration writes its own medoids and packed minima (``meds[i]``, ``best[i]``), so no program
    reads what another program of the same launch writes.
    """
    b, n, _ = d.shape
    k = medoids.shape[1]
    d = d.contiguous()
    meds = torch.empty(iters, b, k, device=d.device, dtype=torch.int64)
    meds[0] = medoids
    best = torch.full((iters - 1, b, k), _EMPTY.value, device=d.device, dtype=torch.int64)
    assign = torch.empty(b, n, device=d.device, dtype=torch.int64)
    cost = torch.empty(b, n, device=d.device, dtype=torch.float32)
    has_w = w is not None
    w_arg = w.contiguous() if has_w else cost  # never read without HAS_W
    rows = (b, triton.cdiv(n, block_n))
    block_k = max(16, triton.next_power_of_2(k))
    keep = 1.0 - rtol
    # without SWAP the kernel reads neither medoids out, minima nor costs: meds[0] and cost stand in
    _assign_kernel[rows](d, meds[0], meds[0], meds[0], cost, assign, n, k, keep, SWAP=False, BLOCK_N=block_n,
                         BLOCK_K=block_k)
    for i in range(1, iters):
        _cost_kernel[rows](d, w_arg, assign, cost, best[i - 1], n, k, HAS_W=has_w, BLOCK_N=block_n, BLOCK_J=block_j)
        _assign_kernel[rows](d, meds[i - 1], meds[i], best[i - 1], cost, assign, n, k, keep, SWAP=True,
                             BLOCK_N=block_n, BLOCK_K=block_k)
    return meds[iters - 1], assign


@triton.jit
def _fused_kernel(D, W, MED_IN, MED_OUT, ASSIGN, COST, N, K, iters, keep, HAS_W: tl.constexpr,
                  BLOCK_K: tl.constexpr, TILE: tl.constexpr, GRAM: tl.constexpr):
    """Every iteration of one image's K-Medoids in one program: the assignment, then ``iters - 1`` times
    the costs, each cluster's cheapest member (a running minimum of the packed ``(cost, token)``, lowest
    cost then lowest token), the swap rule and the assignment again. The medoids stay in registers; the
    (N,) assignment and costs pass through global memory (an image's rows stay in L2), with a barrier
    between the phases, since the program's threads read what the others wrote."""
    b = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    med = tl.load(MED_IN + b * K + offs_k, mask=mask_k, other=0)
    rows = D + b * N * N
    for it in range(iters):
        if it > 0:
            for n0 in range(0, N, TILE):
                offs_n = n0 + tl.arange(0, TILE)
                mask_n = offs_n < N
                a_n = tl.load(ASSIGN + b * N + offs_n, mask=mask_n, other=-1)
                acc = _own_cluster_costs(rows, W + b * N, ASSIGN + b * N, N, offs_n, mask_n, a_n, HAS_W, TILE, TILE,
                                         GRAM)
                tl.store(COST + b * N + offs_n, acc, mask=mask_n)
            tl.debug_barrier()
            best = tl.full([BLOCK_K], _EMPTY, tl.int64)
            for n0 in range(0, N, TILE):
                offs_n = n0 + tl.arange(0, TILE)
                mask_n = offs_n < N
                a_n = tl.load(ASSIGN + b * N + offs_n, mask=mask_n, other=-1)
                packed = _pack(tl.load(COST + b * N + offs_n, mask=mask_n, other=0.0), offs_n)
                bids = tl.where(a_n[None, :] == offs_k[:, None], packed[None, :], _EMPTY)
                best = tl.minimum(best, tl.min(bids, axis=1))
            best_cost, best_token = _unpack(best)
            current = tl.load(COST + b * N + med, mask=mask_k, other=0.0)
            med = tl.where(mask_k & (best_cost < current * keep), best_token, med)
            tl.debug_barrier()
        for n0 in range(0, N, TILE):
            offs_n = n0 + tl.arange(0, TILE)
            mask_n = offs_n < N
            tl.store(ASSIGN + b * N + offs_n, _nearest(rows, N, offs_n, mask_n, med, mask_k, GRAM), mask=mask_n)
        tl.debug_barrier()
    tl.store(MED_OUT + b * K + offs_k, med, mask=mask_k)


def kmedoids_fused_triton(d: Tensor, w: Tensor | None, medoids: Tensor, iters: int, rtol: float, *,
                          gram: bool = False, tile: int = 32, num_warps: int = 8) -> tuple[Tensor, Tensor]:
    """The same iterations as ``kmedoids_triton`` in one launch: one program per image runs all of them
    (``_fused_kernel``), where ``kmedoids_triton`` launches two kernels an iteration on a (B, tiles) grid.
    With ``gram`` ``d`` is the Gram matrix X X^T and the kernel derives each distance it reads
    (``_dist``), so the distances cost no kernel of their own. Which kernel is faster on a GPU is
    ``bench kernels``' question (one program per image can leave a large GPU nearly idle);
    ``tile`` and ``num_warps`` are its knobs."""
    b, n, _ = d.shape
    k = medoids.shape[1]
    d = d.contiguous()
    med_out = torch.empty_like(medoids)
    assign = torch.empty(b, n, device=d.device, dtype=torch.int64)
    cost = torch.empty(b, n, device=d.device, dtype=torch.float32)
    has_w = w is not None
    w_arg = w.contiguous() if has_w else cost  # never read without HAS_W
    if b:
        _fused_kernel[(b,)](d, w_arg, medoids.contiguous(), med_out, assign, cost, n, k, iters, 1.0 - rtol,
                            HAS_W=has_w, BLOCK_K=max(16, triton.next_power_of_2(k)), TILE=tile, GRAM=gram,
                            num_warps=num_warps)
    return med_out, assign
