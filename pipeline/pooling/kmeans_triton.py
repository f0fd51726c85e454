"""Triton kernels for K-Means' iterations in the Gram form, on a precomputed Gram matrix.

Why our own kernel: the torch form of these iterations (``clustering._kmeans_gram_iterations``) builds
the (B, K, N) one-hot membership, its weighted and normalised copy, the (B, K, N) projections and their
products on every round, each written to and read back from HBM, for a step whose only product is one
(K, N) x (N, N) matmul; on an H200 K-Medoids' torch iterations of the same shape took 3.7-5.4 times the
GPU time of its Triton kernels (docs/benchmarks.md). No library runs Lloyd iterations on a batch of
small problems on the Gram matrix. Here a round is two kernels that read the Gram matrix (once per
tile of clusters, from programs that run side by side, so that the repeats can come from L2) and the
(B, K, N) projections, and write the projections and (B, K) / (B, N) buffers:

1. ``_update_kernel`` (a tile of clusters and of columns a program): the new projections of the tile,
   ``proj[k, i] = sum_j [a_j = k] w_j G[j, i] / total_k``, as one tensor-core product of the one-hot
   membership (exact in TF32) against the weighted Gram rows, each cluster's total weight, and the
   tile's share of every centre's squared norm, ``sum_{i in tile} [a_i = k] w_i proj[k, i] / total_k``;
   an empty cluster keeps its projections;
2. ``_assign_kernel``: every program adds up the shares of its image (in a fixed order, so the result
   does not depend on scheduling; an empty cluster keeps its norm) and assigns its tokens to the
   nearest centre, ``argmin_k ||c_k||^2 - 2 proj[k, n]``, ties to the lowest cluster index.

Semantics are those of ``clustering._kmeans_gram`` (and of the brute-force reference in ``tests/``): the
first assignment is to the starting tokens; every further round updates the centres to the weighted
means of their clusters (an empty cluster keeps its centre) and assigns again. The products run in
TF32 where ``torch.backends.cuda.matmul.allow_tf32`` is set (as the torch iterations' matmul would), in
full float32 otherwise. The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``
(the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_I = 32  # Gram-matrix columns (tokens) per program of the update kernel
_BLOCK_J = 32  # Gram-matrix rows per step of the update kernel's product
_BLOCK_K = 64  # clusters per program of the update kernel
_BLOCK_N = 32  # tokens per program of the assignment kernel


@triton.jit
def _weights(W, b, N, offs, mask, HAS_W: tl.constexpr):
    """The weights of tokens ``offs`` of image b, 0 off the mask; 1 each without HAS_W."""
    if HAS_W:
        return tl.load(W + b * N + offs, mask=mask, other=0.0)
    return tl.where(mask, 1.0, 0.0)


@triton.jit
def _update_kernel(G, W, ASSIGN, PROJ, TOTAL, PART, N, K, tiles, HAS_W: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    """The projections of BLOCK_K centres on BLOCK_I tokens (the columns of G), the clusters' total weights
    (written by the first column tile) and the column tile's share of the centres' squared norms (PART).
    The grid is (cluster tiles, column tiles, images): the programs that read the same columns of G run
    next to one another."""
    tile = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_i = tile * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < N
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    acc = tl.zeros([BLOCK_K, BLOCK_I], tl.float32)
    total = tl.zeros([BLOCK_K], tl.float32)
    for j0 in range(0, N, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mask_j = offs_j < N
        a_j = tl.load(ASSIGN + b * N + offs_j, mask=mask_j, other=-1)
        w_j = _weights(W, b, N, offs_j, mask_j, HAS_W)
        member = tl.where(offs_k[:, None] == a_j[None, :], 1.0, 0.0)  # (BLOCK_K, BLOCK_J), exact in TF32
        rows = tl.load(G + b * N * N + offs_j[:, None] * N + offs_i[None, :], mask=mask_j[:, None] & mask_i[None, :],
                       other=0.0)
        acc = tl.dot(member, rows * w_j[:, None], acc, input_precision=PRECISION)
        total += tl.sum(member * w_j[None, :], axis=1)
    filled = total > 0
    divisor = tl.where(filled, total, 1.0)
    tile_mask = mask_k[:, None] & mask_i[None, :]
    at = PROJ + (b * K + offs_k[:, None]) * N + offs_i[None, :]
    kept = tl.load(at, mask=tile_mask & ~filled[:, None], other=0.0)  # an empty cluster keeps its centre
    proj = tl.where(filled[:, None], acc / divisor[:, None], kept)
    tl.store(at, proj, mask=tile_mask)
    a_i = tl.load(ASSIGN + b * N + offs_i, mask=mask_i, other=-1)
    w_i = _weights(W, b, N, offs_i, mask_i, HAS_W)
    share = tl.sum(tl.where(offs_k[:, None] == a_i[None, :], proj * w_i[None, :], 0.0), axis=1) / divisor
    tl.store(PART + (b * tiles + tile) * K + offs_k, share, mask=mask_k)
    tl.store(TOTAL + b * K + offs_k, total, mask=mask_k & (tile == 0))


@triton.jit
def _assign_kernel(G, START, PROJ, TOTAL, PART, CSQ_IN, CSQ_OUT, ASSIGN, N, K, tiles, INIT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The nearest centre of BLOCK_N tokens. With INIT the centres are the tokens at START (their
    projections are rows of G, which the program also writes to PROJ for its tokens); otherwise the
    projections are PROJ and the squared norms the sum of the update's shares (CSQ_IN where a cluster is
    empty). The image's first program writes the norms to CSQ_OUT."""
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    tile_mask = mask_k[:, None] & mask_n[None, :]
    at = PROJ + (b * K + offs_k[:, None]) * N + offs_n[None, :]
    if INIT:
        start = tl.load(START + b * K + offs_k, mask=mask_k, other=0)
        proj = tl.load(G + b * N * N + start[:, None] * N + offs_n[None, :], mask=tile_mask, other=0.0)
        tl.store(at, proj, mask=tile_mask)
        csq = tl.load(G + b * N * N + start * (N + 1), mask=mask_k, other=0.0)
    else:
        csq = tl.zeros([BLOCK_K], tl.float32)
        for t in range(0, tiles):
            csq += tl.load(PART + (b * tiles + t) * K + offs_k, mask=mask_k, other=0.0)
        total = tl.load(TOTAL + b * K + offs_k, mask=mask_k, other=0.0)
        csq = tl.where(total > 0, csq, tl.load(CSQ_IN + b * K + offs_k, mask=mask_k, other=0.0))
        proj = tl.load(at, mask=tile_mask, other=0.0)
    tl.store(CSQ_OUT + b * K + offs_k, csq, mask=mask_k & (tl.program_id(1) == 0))
    dist = tl.where(mask_k[:, None], csq[:, None] - 2.0 * proj, float("inf"))  # ||c||^2 - 2 c . x_n
    tl.store(ASSIGN + b * N + offs_n, tl.argmin(dist, axis=0, tie_break_left=True), mask=mask_n)


def kmeans_triton(gram: Tensor, w: Tensor | None, start: Tensor, iters: int, *, block_i: int = _BLOCK_I,
                  block_j: int = _BLOCK_J, block_k: int = _BLOCK_K, block_n: int = _BLOCK_N,
                  warps: int = 4) -> Tensor:
    """K-Means iterations in the Gram form: gram (B, N, N) float32 = X X^T, w (B, N) float32 or None, start
    (B, K) int64 starting tokens -> last assignment (B, N) int64. ``block_i``, ``block_j``, ``block_k``
    (a power of two, at least 16) and ``warps`` tile the update kernel, ``block_n`` the assignment kernel
    (``bench kernels`` compares tilings).

    An assignment, then per further iteration an update and an assignment. The update takes ``block_k``
    clusters a program: with all of them (K = 147 makes 256 rows) one program holds a (256, 32) float32
    product and its (256, 32) one-hot operand, which spill registers at 4 warps when compiled for sm_90
    (ptxas -v), and one program fits on an SM at 8 warps.
    Each iteration's squared norms go to their own buffer (``csq[i]``), so no program reads what another
    program of the same launch writes; the projections are read and written by the program that owns
    their columns.
    """
    b, n, _ = gram.shape
    k = start.shape[1]
    gram, start = gram.contiguous(), start.contiguous()
    dev = gram.device
    tiles = triton.cdiv(n, block_i)
    proj = torch.empty(b, k, n, device=dev, dtype=torch.float32)
    csq = torch.empty(iters, b, k, device=dev, dtype=torch.float32)
    part = torch.empty(b, tiles, k, device=dev, dtype=torch.float32)
    total = torch.empty(b, k, device=dev, dtype=torch.float32)
    assign = torch.empty(b, n, device=dev, dtype=torch.int64)
    has_w = w is not None
    w_arg = w.contiguous() if has_w else total  # never read without HAS_W
    all_k = max(16, triton.next_power_of_2(k))  # the assignment takes every cluster at once
    block_k = min(block_k, all_k)
    precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    update, rows = (triton.cdiv(k, block_k), tiles, b), (b, triton.cdiv(n, block_n))
    _assign_kernel[rows](gram, start, proj, total, part, csq[0], csq[0], assign, n, k, tiles, INIT=True,
                         BLOCK_N=block_n, BLOCK_K=all_k)
    for i in range(1, iters):
        _update_kernel[update](gram, w_arg, assign, proj, total, part, n, k, tiles, HAS_W=has_w, PRECISION=precision,
                               BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_K=block_k, num_warps=warps)
        _assign_kernel[rows](gram, start, proj, total, part, csq[i - 1], csq[i], assign, n, k, tiles, INIT=False,
                             BLOCK_N=block_n, BLOCK_K=all_k)
    return assign
