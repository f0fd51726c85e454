"""Triton kernels for eq. 4 without the (B, H, T, T) probability matrix.

Why our own kernels: the fused attention kernels (flash, memory-efficient) never expose the column
sums of the softmax, and materialising the probabilities next to them costs more than the whole
downsampling saves on a GPU (the ceiling measurements in docs/benchmarks.md). FlagAttention's
``total.py`` takes the same two-pass route.

Pass 1 (``_row_lse``), one program per (query block, batch x head): the log-sum-exp of every logit
row, with the online-softmax recurrence over key blocks. Pass 2 (``_column_sums``), one program per
(key block, batch x head): ``sum_i exp(logit_ij - lse_i)`` over every query block. Neither pass
writes anything of size T x T; both recompute the logits with ``tl.dot``. Each program writes its own
outputs, so the result is deterministic (no atomics).

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
def _logits(q, k_ptrs, bias_ptrs, mask_n, mask_d, scale, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled logits of a (BLOCK, D) query tile against the key tile at k_ptrs, -inf off the end."""
    k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return tl.where(mask_n[None, :], s, float("-inf"))


@triton.jit
def _row_lse(Q, K, BIAS, LSE, T, H, scale,
             sqb, sqh, sqt, sqd, skb, skh, skt, skd, sbb, sbt,
             HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < T
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    bias_ptr = BIAS + b * sbb
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, T, BLOCK):
        offs_n = start + tl.arange(0, BLOCK)
        mask_n = offs_n < T
        k_ptrs = K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd
        s = _logits(q, k_ptrs, bias_ptr + offs_n * sbt, mask_n, mask_d, scale, HAS_BIAS, PRECISION)
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
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < T
    mask_d = offs_d < HEAD_DIM
    k_ptrs = K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd
    bias_ptr = BIAS + b * sbb
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, T, BLOCK):
        offs_m = start + tl.arange(0, BLOCK)
        mask_m = offs_m < T
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        s = _logits(q, k_ptrs, bias_ptr + offs_n * sbt, mask_n, mask_d, scale, HAS_BIAS, PRECISION)
        lse = tl.load(LSE + bh * T + offs_m, mask=mask_m, other=0.0)
        p = tl.exp(s - lse[:, None])
        acc += tl.sum(tl.where(mask_m[:, None], p, 0.0), axis=0)
    tl.store(OUT + bh * T + offs_n, acc, mask=mask_n)


def significance_triton(q: Tensor, k: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """Eq. 4 from queries and keys: q, k (B, H, T, D), bias (B, T) added to every logit row -> (B, T) float32."""
    b, h, t, d = q.shape
    block_d = max(16, 1 << math.ceil(math.log2(d)))
    lse = torch.empty(b * h, t, device=q.device, dtype=torch.float32)
    per_head = torch.empty(b * h, t, device=q.device, dtype=torch.float32)
    has_bias = bias is not None
    bias_arg = bias if has_bias else lse  # never read without HAS_BIAS
    bias_strides = (bias.stride(0), bias.stride(1)) if has_bias else (0, 0)
    precision = None  # half-precision inputs: the default (fp32 accumulation)
    if q.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    args = (t, h, float(scale), *q.stride(), *k.stride(), *bias_strides)
    meta = dict(HAS_BIAS=has_bias, PRECISION=precision, BLOCK=_BLOCK, BLOCK_D=block_d, HEAD_DIM=d)
    grid = (triton.cdiv(t, _BLOCK), b * h)
    _row_lse[grid](q, k, bias_arg, lse, *args, **meta)
    _column_sums[grid](q, k, bias_arg, lse, per_head, *args, **meta)
    return per_head.view(b, h, t).sum(1)
