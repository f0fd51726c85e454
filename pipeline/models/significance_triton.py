"""Triton kernels for eq. 4 without the (B, H, T, T) probability matrix.

Why our own kernels: the fused attention kernels (flash, memory-efficient) never expose the column
sums of the softmax, and materialising the probabilities next to them costs more than the whole
downsampling saves on a GPU (the ceiling measurements in docs/benchmarks.md). FlagAttention's
``total.py`` takes the same two-pass route.

Pass 1 (``_row_lse``), one program per (query block, batch x head): the log-sum-exp of every logit
row, with the online-softmax recurrence over key blocks. Pass 2 (``_column_sums``), one program per
(key block, batch x head): ``sum_i exp(logit_ij - lse_i)`` over every query block. Neither pass
writes anything of size T x T; both recompute the logits with ``tl.dot``. Each program writes its own
outputs, so the result is deterministic (no atomics). Next to a fused attention kernel that returns
the row log-sum-exps with its output (cuDNN's, flash), pass 1 is skipped (``lse=``).

The backward (``significance_backward_triton``) follows the same route from the forward's row
log-sum-exps (pass 1 runs again only when it is not given them). With g the (B, T) gradient of the
scores and P_ij = exp(logit_ij - lse_i), d s / d logit_ij = P_ij (g_j - c_i), c_i = sum_j P_ij g_j:
``_row_grad`` per query block (c_i in one sweep over the keys, dq in a second), then
``_column_grad`` per key block (dk and the bias gradient in one sweep over the queries). The torch
backward it replaces on CUDA forms four (B, H, T, T) float32 tensors a block.

The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 64  # query and key tile; tl.dot needs at least 16


@triton.jit
def _program(T, H, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's batch, head and batch x head index, its BLOCK positions (axis 0 of the grid)
    and the head dims, with their masks."""
    bh = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    return bh // H, bh % H, bh, offs, offs < T, offs_d, offs_d < HEAD_DIM


@triton.jit
def _ptrs(X, b, h, offs, offs_d, sb, sh, st, sd):
    """Pointers to the (BLOCK, BLOCK_D) tile of positions ``offs`` of x[b, h]."""
    return X + b * sb + h * sh + offs[:, None] * st + offs_d[None, :] * sd


@triton.jit
def _logits(q, k_ptrs, bias_ptrs, mask_n, mask_d, scale, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled logits of a (BLOCK, D) query tile against the key tile at k_ptrs, -inf off the end."""
    k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return tl.where(mask_n[None, :], s, float("-inf"))


@triton.jit
def _column_probs(Q, k_ptrs, bias_ptrs, LSE_ROW, start, b, h, mask_n, offs_d, mask_d, T, scale, sqb, sqh, sqt, sqd,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr):
    """For the key tile at k_ptrs and the query tile from ``start``: (the queries, P = exp(logit - lse),
    0 on rows past the end, the query positions)."""
    offs_m = start + tl.arange(0, BLOCK)
    mask_m = offs_m < T
    q = tl.load(_ptrs(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, sqd), mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    s = _logits(q, k_ptrs, bias_ptrs, mask_n, mask_d, scale, HAS_BIAS, PRECISION)
    lse = tl.load(LSE_ROW + offs_m, mask=mask_m, other=0.0)
    return q, tl.where(mask_m[:, None], tl.exp(s - lse[:, None]), 0.0), offs_m


@triton.jit
def _row_lse(Q, K, BIAS, LSE, T, H, scale,
             sqb, sqh, sqt, sqd, skb, skh, skt, skd, sbb, sbt,
             HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    b, h, bh, offs_m, mask_m, offs_d, mask_d = _program(T, H, BLOCK, BLOCK_D, HEAD_DIM)
    q = tl.load(_ptrs(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, sqd), mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, T, BLOCK):
        offs_n = start + tl.arange(0, BLOCK)
        mask_n = offs_n < T
        s = _logits(q, _ptrs(K, b, h, offs_n, offs_d, skb, skh, skt, skd), BIAS + b * sbb + offs_n * sbt, mask_n,
                    mask_d, scale, HAS_BIAS, PRECISION)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row whose logits so far are all -inf (size-0 keys) keeps total = 0 instead of exp(nan).
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
        m = m_new
    tl.store(LSE + bh * T + offs_m, m + tl.log(total), mask=mask_m)


@triton.jit
def _column_sums(Q, K, BIAS, LSE, OUT, T, H, scale,
                 sqb, sqh, sqt, sqd, skb, skh, skt, skd, sbb, sbt,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    b, h, bh, offs_n, mask_n, offs_d, mask_d = _program(T, H, BLOCK, BLOCK_D, HEAD_DIM)
    k_ptrs = _ptrs(K, b, h, offs_n, offs_d, skb, skh, skt, skd)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, T, BLOCK):
        _, p, _ = _column_probs(Q, k_ptrs, BIAS + b * sbb + offs_n * sbt, LSE + bh * T, start, b, h, mask_n, offs_d,
                                mask_d, T, scale, sqb, sqh, sqt, sqd, HAS_BIAS, PRECISION, BLOCK)
        acc += tl.sum(p, axis=0)
    tl.store(OUT + bh * T + offs_n, acc, mask=mask_n)


@triton.jit
def _row_grad(Q, K, BIAS, G, LSE, C, DQ, T, H, scale,
              sqb, sqh, sqt, sqd, skb, skh, skt, skd, sbb, sbt,
              HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, GRAD_PRECISION: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Per query block: c_i = sum_j P_ij g_j in a first sweep over the keys, then in a second
    dq_i = scale sum_j P_ij (g_j - c_i) k_j (float32)."""
    b, h, bh, offs_m, mask_m, offs_d, mask_d = _program(T, H, BLOCK, BLOCK_D, HEAD_DIM)
    q = tl.load(_ptrs(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, sqd), mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    lse = tl.load(LSE + bh * T + offs_m, mask=mask_m, other=0.0)
    c = tl.zeros([BLOCK], tl.float32)
    dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    for sweep in tl.static_range(2):
        for start in range(0, T, BLOCK):
            offs_n = start + tl.arange(0, BLOCK)
            mask_n = offs_n < T
            k_ptrs = _ptrs(K, b, h, offs_n, offs_d, skb, skh, skt, skd)
            p = tl.exp(_logits(q, k_ptrs, BIAS + b * sbb + offs_n * sbt, mask_n, mask_d, scale, HAS_BIAS, PRECISION)
                       - lse[:, None])
            g = tl.load(G + b * T + offs_n, mask=mask_n, other=0.0)
            if sweep == 0:
                c += tl.sum(p * g[None, :], axis=1)
            else:
                k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
                dq += tl.dot(p * (g[None, :] - c[:, None]), k, input_precision=GRAD_PRECISION)
    tl.store(C + bh * T + offs_m, c, mask=mask_m)
    tl.store(DQ + bh * T * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq * scale,
             mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _column_grad(Q, K, BIAS, G, LSE, C, DK, DBIAS, T, H, scale,
                 sqb, sqh, sqt, sqd, skb, skh, skt, skd, sbb, sbt,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, GRAD_PRECISION: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Per key block: dk_j = scale sum_i P_ij (g_j - c_i) q_i and the bias gradient sum_i P_ij (g_j - c_i)."""
    b, h, bh, offs_n, mask_n, offs_d, mask_d = _program(T, H, BLOCK, BLOCK_D, HEAD_DIM)
    k_ptrs = _ptrs(K, b, h, offs_n, offs_d, skb, skh, skt, skd)
    g = tl.load(G + b * T + offs_n, mask=mask_n, other=0.0)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dbias = tl.zeros([BLOCK], tl.float32)
    for start in range(0, T, BLOCK):
        q, p, offs_m = _column_probs(Q, k_ptrs, BIAS + b * sbb + offs_n * sbt, LSE + bh * T, start, b, h, mask_n,
                                     offs_d, mask_d, T, scale, sqb, sqh, sqt, sqd, HAS_BIAS, PRECISION, BLOCK)
        c = tl.load(C + bh * T + offs_m, mask=offs_m < T, other=0.0)
        ds = p * (g[None, :] - c[:, None])
        dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision=GRAD_PRECISION)
        dbias += tl.sum(ds, axis=0)
    tl.store(DK + bh * T * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :], dk * scale,
             mask=mask_n[:, None] & mask_d[None, :])
    tl.store(DBIAS + bh * T + offs_n, dbias, mask=mask_n)


def _launch_setup(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None
                  ) -> tuple[Tensor, tuple, dict, tuple, Tensor]:
    """The kernels' shared arguments: (the bias argument, scalar and stride args, meta-parameters,
    grid, the row log-sum-exps as (B*H, T) float32: ``lse`` when given, else an empty buffer)."""
    b, h, t, d = q.shape
    block_d = max(16, 1 << math.ceil(math.log2(d)))
    if lse is None:
        lse = torch.empty(b * h, t, device=q.device, dtype=torch.float32)
    else:
        lse = lse.float().reshape(b * h, t).contiguous()
    has_bias = bias is not None
    bias_arg = bias if has_bias else lse  # never read without HAS_BIAS
    bias_strides = (bias.stride(0), bias.stride(1)) if has_bias else (0, 0)
    precision = None  # half-precision inputs: the default (fp32 accumulation)
    if q.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    args = (t, h, float(scale), *q.stride(), *k.stride(), *bias_strides)
    meta = dict(HAS_BIAS=has_bias, PRECISION=precision, BLOCK=_BLOCK, BLOCK_D=block_d, HEAD_DIM=d)
    return bias_arg, args, meta, (triton.cdiv(t, _BLOCK), b * h), lse


def significance_backward_triton(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, grad: Tensor,
                                 lse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradients of ``significance_triton`` for the score gradient ``grad`` (B, T): (dq, dk) in q's
    and k's dtypes, (B, H, T, D), and the bias gradient (B, T) float32 (None without a bias).
    ``lse`` (B, H, T), the row log-sum-exps of the forward (the models always pass them), saves the
    first pass."""
    b, h, t, d = q.shape
    bias_arg, args, meta, grid, row_lse = _launch_setup(q, k, bias, scale, lse)
    grad = grad.float().contiguous()
    c = torch.empty_like(row_lse)
    dq = torch.empty(b, h, t, d, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dbias = torch.empty_like(row_lse)
    grad_precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 or q.dtype != torch.float32 else "ieee"
    if lse is None:
        _row_lse[grid](q, k, bias_arg, row_lse, *args, **meta)
    _row_grad[grid](q, k, bias_arg, grad, row_lse, c, dq, *args, GRAD_PRECISION=grad_precision, **meta)
    _column_grad[grid](q, k, bias_arg, grad, row_lse, c, dk, dbias, *args, GRAD_PRECISION=grad_precision, **meta)
    return dq.to(q.dtype), dk.to(k.dtype), None if bias is None else dbias.view(b, h, t).sum(1)


def significance_triton(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None = None
                        ) -> Tensor:
    """Eq. 4 from queries and keys: q, k (B, H, T, D), bias (B, T) added to every logit row -> (B, T) float32.

    ``lse`` (B, H, T): the row log-sum-exps of those logits where a fused attention kernel already
    computed them (cuDNN's and flash attention return them); then only the column pass runs.
    """
    return significance_and_lse_triton(q, k, bias, scale, lse)[0]


def significance_and_lse_triton(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None = None
                                ) -> tuple[Tensor, Tensor]:
    """``significance_triton`` and the row log-sum-exps (B, H, T) float32 of pass 1, for the backward;
    an empty tensor when it was given ``lse`` (no pass 1)."""
    b, h, t, _ = q.shape
    bias_arg, args, meta, grid, row_lse = _launch_setup(q, k, bias, scale, lse)
    per_head = torch.empty(b * h, t, device=q.device, dtype=torch.float32)
    if lse is None:
        _row_lse[grid](q, k, bias_arg, row_lse, *args, **meta)
    _column_sums[grid](q, k, bias_arg, row_lse, per_head, *args, **meta)
    return per_head.view(b, h, t).sum(1), row_lse.view(b, h, t) if lse is None else row_lse.new_empty(0)


@triton.jit
def _attention_with_columns(Q, K, V, BIAS, OUT, COLS, T, H, scale,
                            sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod, sbb, sbt,
                            HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (batch x head): every key of the head in one tile (T <= BLOCK_N), the queries BLOCK_M at
    a time: logits, each row normalised exactly (its maximum and sum are at hand), P V, and the column sums of
    P in registers; then the head's column sums to COLS (B*H, T). Nothing of size T x T reaches memory."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < T
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_nd = mask_n[:, None] & mask_d[None, :]
    k = tl.load(_ptrs(K, b, h, offs_n, offs_d, skb, skh, skt, skd), mask=mask_nd, other=0.0)
    v = tl.load(_ptrs(V, b, h, offs_n, offs_d, svb, svh, svt, svd), mask=mask_nd, other=0.0)
    if HAS_BIAS:
        bias = tl.load(BIAS + b * sbb + offs_n * sbt, mask=mask_n, other=0.0).to(tl.float32)
    cols = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, T, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < T
        q = tl.load(_ptrs(Q, b, h, offs_m, offs_d, sqb, sqh, sqt, sqd), mask=mask_m[:, None] & mask_d[None, :],
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if HAS_BIAS:
            s += bias[None, :]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        top = tl.max(s, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)  # a row of size-0 keys only: all zeros, not NaN
        p = tl.exp(s - top[:, None])
        total = tl.sum(p, axis=1)
        p = p / tl.where(total > 0, total, 1.0)[:, None]
        cols += tl.sum(tl.where(mask_m[:, None], p, 0.0), axis=0)
        out = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        tl.store(_ptrs(OUT, b, h, offs_m, offs_d, sob, soh, sot, sod), out.to(OUT.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d[None, :])
    tl.store(COLS + bh * T + offs_n, cols, mask=mask_n)


FUSED_MAX_TOKENS = 256  # the joint kernel holds every key of a head in one tile


def attention_with_columns_triton(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float,
                                  *, block_m: int = 32, num_warps: int = 8) -> tuple[Tensor, Tensor]:
    """Softmax attention (no dropout) and eq. 4 in one pass over the logits: q, k, v (B, H, T, D) with
    T <= ``FUSED_MAX_TOKENS``, bias (B, T) added to every logit row -> (the (B, H, T, D) output in v's dtype,
    laid out as (B, T, H, D) so that merging the heads is a view, as with the fused attention kernels;
    the (B, T) float32 scores). Two launches: the pass (``_attention_with_columns``) and the sum over heads."""
    b, h, t, d = q.shape
    if t > FUSED_MAX_TOKENS:
        raise ValueError(f"attention_with_columns_triton holds at most {FUSED_MAX_TOKENS} tokens, got {t}")
    out = torch.empty(b, t, h, d, device=q.device, dtype=v.dtype).permute(0, 2, 1, 3)
    cols = torch.empty(b * h, t, device=q.device, dtype=torch.float32)
    has_bias = bias is not None
    precision = None  # half-precision inputs: the default (fp32 accumulation)
    if q.dtype == torch.float32:
        precision = "tf32" if q.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    if b * h:
        _attention_with_columns[(b * h,)](
            q, k, v, bias if has_bias else cols, out, cols, t, h, float(scale), *q.stride(), *k.stride(), *v.stride(),
            *out.stride(), *((bias.stride(0), bias.stride(1)) if has_bias else (0, 0)), HAS_BIAS=has_bias,
            PRECISION=precision, BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(t)),
            BLOCK_D=max(16, triton.next_power_of_2(d)), HEAD_DIM=d, num_warps=num_warps)
    return out, cols.view(b, h, t).sum(1)
