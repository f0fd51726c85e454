"""Eq. 4 significance from queries and keys, next to a fused attention kernel.

``attention_significance(q, k, scale, bias)`` returns ``s_j = sum_h sum_i softmax_j(scale q_i . k_j + bias_j)``
without ever holding the normalised (B, H, T, T) probabilities:

- on CUDA, two Triton passes (``significance_triton``): row log-sum-exps, then column sums of
  ``exp(logit - lse)``, both recomputing the logits tile by tile; only the second when the caller
  passes the row log-sum-exps that its fused attention kernel returned (``lse=``);
- on the CPU (and on CUDA without Triton), the same math in torch: the row-normalised column sum
  is one matmul of the reciprocal row sums against the unnormalised ``exp(logit - rowmax)``, so the
  (B, H, T, T) matrix is never normalised.

It is a ``torch.library`` custom op, so ``torch.compile(fullgraph=True)`` keeps it as one opaque call
and autograd uses the backward below (the weighted methods differentiate through their weights), an
op too (``tokenpool::attention_significance_backward``): Triton kernels on CUDA
(``significance_backward_triton``), torch elsewhere.

On the CPU a block that needs the scores gets its attention output from the same exponentials
(``attention_and_significance``, custom op ``tokenpool::attention_with_significance``): there the
fused kernel is no faster than the explicit product, and one set of logits, worked in chunks of
images, makes a DeiT-S attention with scores about twice as fast (benchmarks/attention_with_scores_cpu.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.runtime import exporting, note_dispatch

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch path
    from pipeline.models.significance_triton import (
        FUSED_MAX_TOKENS,
        attention_with_columns_triton,
        significance_and_lse_triton,
        significance_backward_triton,
    )
except ImportError:  # pragma: no cover - depends on the install
    significance_and_lse_triton = significance_backward_triton = attention_with_columns_triton = None
    FUSED_MAX_TOKENS = 0


def _logits(q: Tensor, k: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """(B, H, T, D) x (B, H, T, D) -> (B, H, T, T) float32 logits, bias (B, T) added to every row."""
    logits = torch.matmul(q.float() * scale, k.float().transpose(-2, -1))
    if bias is not None:
        logits = logits + bias.float()[:, None, None, :]
    return logits


def significance_torch(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None = None
                       ) -> Tensor:
    """The fast eq. 4 in plain torch: (B, H, T, D) queries and keys -> (B, T) float32.

    With ``lse`` (B, H, T), the row log-sum-exps of the same logits, the probabilities are
    ``exp(logit - lse)`` and their column sums are the scores.
    """
    return significance_and_lse_torch(q, k, bias, scale, lse)[0]


def significance_and_lse_torch(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None = None
                               ) -> tuple[Tensor, Tensor]:
    """``significance_torch`` and the row log-sum-exps (B, H, T) float32 it computed, for the backward;
    an empty tensor when it was given ``lse``."""
    e = _logits(q, k, bias, scale)
    if lse is not None:
        return e.sub_(lse.float().unsqueeze(-1)).exp_().sum((1, 2)), e.new_empty(0)
    rowmax = e.amax(-1, keepdim=True)
    e = e.sub_(rowmax).exp_()  # unnormalised, (B, H, T, T)
    total = e.sum(-1, keepdim=True)  # (B, H, T, 1) row sums
    scores = torch.matmul(total.reciprocal().transpose(-2, -1), e).sum(1).squeeze(1)  # (B, 1, T) a head, summed
    return scores, (rowmax + total.log()).squeeze(-1)


# Images per chunk of the joint CPU op: their (H, T, T) float32 exponentials stay in cache across the
# five passes over them (max, exp, row sums, the two products). At DeiT-S size (T = 197, 6 heads, 4
# images) chunking halves the time of one attention with scores at batch 64 on 2 CPU cores
# (benchmarks/attention_with_scores_cpu.py).
_CHUNK_BYTES = 4 << 20


def attention_and_significance_torch(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float
                                     ) -> tuple[Tensor, Tensor]:
    """Softmax attention and eq. 4 from one unnormalised exponential: (B, H, T, D) q, k, v
    -> ((B, H, T, D) output in v's dtype, laid out as (B, T, H, D) like the fused attention kernels' and the
    Triton kernel's, (B, T) float32 scores). The rows are normalised on the (T, D) output and in the column
    sum, never on the (T, T) matrix; the batch goes in chunks."""
    b, h, t, d = v.shape
    step = max(1, _CHUNK_BYTES // (h * t * t * 4))
    out = v.new_empty(b, t, h, d).permute(0, 2, 1, 3)  # laid out (B, T, H, D): merging the heads is a view
    scores = q.new_empty(b, t, dtype=torch.float32)
    for i in range(0, b, step):
        part = slice(i, i + step)
        out[part], scores[part] = attention_and_significance_dense(
            q[part], k[part], v[part], None if bias is None else bias[part], scale)
    return out, scores


def attention_and_significance_dense(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float
                                     ) -> tuple[Tensor, Tensor]:
    """``attention_and_significance_torch`` on the whole batch at once: (B, H, T, D) q, k, v -> ((B, H, T, D)
    float32 output, (B, T) float32 scores). A chunk of the CPU op, and the op as an ONNX export runs it (a
    batch that may be symbolic cannot be cut into chunks)."""
    e = _logits(q, k, bias, scale)
    e = e.sub_(e.amax(-1, keepdim=True)).exp_()  # unnormalised, (B, H, T, T)
    inv = e.sum(-1, keepdim=True).reciprocal_()  # (B, H, T, 1)
    scores = torch.matmul(inv.transpose(-2, -1), e).sum(1).squeeze(1)
    return torch.matmul(e, v.float()).mul_(inv), scores


@torch.library.custom_op("tokenpool::attention_with_significance", mutates_args=())
def _joint_op(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float, kernel: str = "auto"
              ) -> tuple[Tensor, Tensor]:
    """``kernel``: the config's ``kernels.attention`` (``torch`` keeps the torch implementation on CUDA). Each
    device's kernel notes the path it took (``runtime.note_dispatch``, T with the prefix)."""
    note_dispatch("attention", "torch", q.shape[2])
    return attention_and_significance_torch(q, k, v, bias, scale)


def one_pass_fits(q: Tensor) -> bool:
    """Whether the joint op's CUDA kernel runs the one-pass Triton kernel for queries q (B, H, T, D)
    (``attention_with_columns_triton``): Triton at hand, at most ``FUSED_MAX_TOKENS`` tokens (every key of
    a head in one tile), a head dim up to 256."""
    return attention_with_columns_triton is not None and q.shape[2] <= FUSED_MAX_TOKENS and q.shape[-1] <= 256


@_joint_op.register_kernel("cuda")
def _joint_cuda(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float, kernel: str = "auto"
                ) -> tuple[Tensor, Tensor]:
    if kernel == "torch" or not one_pass_fits(q):  # T > FUSED_MAX_TOKENS falls back here, whatever the choice
        note_dispatch("attention", "torch", q.shape[2])
        return attention_and_significance_torch(q, k, v, bias, scale)
    note_dispatch("attention", "triton-one-pass", q.shape[2])
    return attention_with_columns_triton(q, k, v, bias, scale)


@_joint_op.register_fake
def _joint_fake(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float, kernel: str = "auto"
                ) -> tuple[Tensor, Tensor]:
    b, h, t, d = v.shape
    return v.new_empty(b, t, h, d).permute(0, 2, 1, 3), q.new_empty(b, t, dtype=torch.float32)


def _through_softmax(probs: Tensor, dprobs: Tensor, q: Tensor, k: Tensor, bias: Tensor | None, scale: float,
                     bias_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """From P = softmax(scale q k^T + bias) (B, H, T, T) and the gradient dP (broadcastable to it):
    dlogits = P (dP - rowsum(P dP)), then (dq, dk) in q's and k's dtypes and the bias gradient
    (None unless ``bias_grad`` and there is a bias)."""
    dlogits = probs * (dprobs - (probs * dprobs).sum(-1, keepdim=True))
    dq = torch.matmul(dlogits, k.float()) * scale
    dk = torch.matmul(dlogits.transpose(-2, -1), q.float()) * scale
    dbias = dlogits.sum((1, 2)).to(bias.dtype) if bias is not None and bias_grad else None
    return dq.to(q.dtype), dk.to(k.dtype), dbias


def _joint_setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, scale, _ = inputs
    ctx.save_for_backward(q, k, v, bias)
    ctx.scale = scale


def _joint_backward(ctx, grad_out: Tensor | None, grad_scores: Tensor | None):
    """Through P = softmax(logits) (B, H, T, T), recomputed once: out = P v and s_j = sum_h sum_i P_ij,
    so dP = dout v^T + g_j, dlogits = P (dP - rowsum(P dP)), dv = P^T dout."""
    q, k, v, bias = ctx.saved_tensors
    probs = _logits(q, k, bias, ctx.scale).softmax(-1)
    if grad_out is None:
        dprobs = torch.zeros_like(probs)
    else:
        dprobs = torch.matmul(grad_out.float(), v.float().transpose(-2, -1))
    if grad_scores is not None:
        dprobs = dprobs + grad_scores.float()[:, None, None, :]
    dq, dk, dbias = _through_softmax(probs, dprobs, q, k, bias, ctx.scale, ctx.needs_input_grad[3])
    dv = torch.zeros_like(v) if grad_out is None else torch.matmul(probs.transpose(-2, -1), grad_out.float())
    return dq, dk, dv.to(v.dtype), dbias, None, None


_joint_op.register_autograd(_joint_backward, setup_context=_joint_setup_context)


@torch.library.custom_op("tokenpool::attention_significance", mutates_args=())
def _significance_op(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    """(the (B, T) scores, the (B, H, T) row log-sum-exps computed on the way, kept for the backward;
    empty when given ``lse``). The attention output comes from the fused attention beside it: each device's
    kernel notes ``sdpa+eq4`` (eq. 4 in Triton) or ``sdpa+eq4-torch``."""
    note_dispatch("attention", "sdpa+eq4-torch", q.shape[2])
    return significance_and_lse_torch(q, k, bias, scale, lse)


@_significance_op.register_kernel("cuda")
def _significance_cuda(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    if significance_and_lse_triton is None:
        note_dispatch("attention", "sdpa+eq4-torch", q.shape[2])
        return significance_and_lse_torch(q, k, bias, scale, lse)
    note_dispatch("attention", "sdpa+eq4", q.shape[2])
    return significance_and_lse_triton(q, k, bias, scale, lse)


@_significance_op.register_fake
def _significance_fake(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, lse: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    b, h, t, _ = q.shape
    row_lse = q.new_empty(b, h, t, dtype=torch.float32) if lse is None else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(b, t, dtype=torch.float32), row_lse


def _setup_context(ctx, inputs, output) -> None:
    q, k, bias, scale, lse = inputs
    ctx.save_for_backward(q, k, bias, output[1] if lse is None else lse)
    ctx.scale = scale


def _no_grad_bias(q: Tensor) -> Tensor:
    """The backward op's bias gradient where there is none to give: an empty float32 tensor (a custom op
    returns tensors, not None)."""
    return q.new_empty(0, dtype=torch.float32)


def significance_backward_torch(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, grad: Tensor,
                                lse: Tensor, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The scores' gradients for the score gradient ``grad`` (B, T), from the forward's row log-sum-exps
    ``lse`` (B, H, T), forming P (B, H, T, T) once: (dq, dk) in q's and k's dtypes, and the bias
    gradient (B, T) float32 where ``bias_grad`` asks for it (an empty tensor otherwise: carried sizes
    get no gradient, and the sum over (B, H, T, T) it takes is then skipped)."""
    probs = _logits(q, k, bias, scale).sub_(lse.float().unsqueeze(-1)).exp_()
    g = grad.float()[:, None, None, :]  # (B, 1, 1, T): d s_j / d P_ij = g_j
    dq, dk, dbias = _through_softmax(probs, g, q, k, bias, scale, bias_grad)
    return dq, dk, _no_grad_bias(q) if dbias is None else dbias.float()


@torch.library.custom_op("tokenpool::attention_significance_backward", mutates_args=())
def _backward_op(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, grad: Tensor, lse: Tensor,
                 bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``significance_backward_torch``; on CUDA the Triton kernels. An op of its own so that a compiled
    backward (AOT autograd traces it with fake tensors) keeps the Triton launches as one opaque call
    instead of tracing into them: the first compiled training step on an H200 failed so."""
    return significance_backward_torch(q, k, bias, scale, grad, lse, bias_grad)


@_backward_op.register_kernel("cuda")
def _backward_cuda(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, grad: Tensor, lse: Tensor,
                   bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    if significance_backward_triton is None:
        return significance_backward_torch(q, k, bias, scale, grad, lse, bias_grad)
    dq, dk, dbias = significance_backward_triton(q, k, bias, scale, grad, lse)  # its kernel writes dbias anyway
    return dq, dk, dbias if bias_grad and dbias is not None else _no_grad_bias(q)


@_backward_op.register_fake
def _backward_fake(q: Tensor, k: Tensor, bias: Tensor | None, scale: float, grad: Tensor, lse: Tensor,
                   bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    dbias = q.new_empty(bias.shape, dtype=torch.float32) if bias is not None and bias_grad else _no_grad_bias(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), dbias  # contiguous, as both kernels return them


def _backward(ctx, grad: Tensor, _grad_lse: Tensor | None):
    """d s_j / d logit_ij = P_ij (g_j - sum_j' P_ij' g_j'), with P_ij = exp(logit_ij - lse_i) from the
    forward's row log-sum-exps (given, or computed there), by ``_backward_op``.

    ``lse`` is a function of q and k (the forward's, or a fused attention's statistic): these
    gradients are the whole derivative through q and k, and ``lse`` gets none."""
    q, k, bias, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[2]
    dq, dk, dbias = _backward_op(q, k, bias, ctx.scale, grad, lse, bias_grad)
    return dq, dk, dbias.to(bias.dtype) if bias_grad else None, None, None


_significance_op.register_autograd(_backward, setup_context=_setup_context)


def attention_significance(q: Tensor, k: Tensor, scale: float, bias: Tensor | None = None,
                           lse: Tensor | None = None) -> Tensor:
    """Eq. 4: the attention each token receives, summed over heads and queries.

    Args:
        q, k: (B, H, T, D) queries and keys, any float dtype (the sums are float32).
        scale: the logit scale (``head_dim ** -0.5``, or 1 for pre-scaled queries).
        bias: (B, T) added to the logits of every query row (log sizes for proportional attention).
        lse: (B, H, T) float32 log-sum-exp of every logit row (bias included), where a fused attention
            kernel returned it: the scores then skip computing it. Detached: it gets no gradient, and
            the scores' gradient through q and k is the whole derivative.

    Returns:
        (B, T) float32 scores; each sample's scores add up to H * T.
    """
    if lse is not None and tuple(lse.shape) != tuple(q.shape[:3]):
        raise InputError(f"lse must have shape (B, H, T) = {tuple(q.shape[:3])} to match q, got {tuple(lse.shape)}; "
                         "pass the row log-sum-exps of the attention over these queries and keys")
    if lse is not None and lse.requires_grad:  # the fused kernels' lse is not differentiable: no op
        lse = lse.detach()
    if exporting():
        return significance_and_lse_torch(q, k, bias, float(scale), lse)[0]
    return _significance_op(q, k, bias, float(scale), lse)[0]


def attention_and_significance(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None = None,
                               kernel: str = "auto") -> tuple[Tensor, Tensor]:
    """Softmax attention (no dropout) and eq. 4 from one set of logits: the CPU's, and CUDA inference's.

    Args:
        q, k, v: (B, H, T, D).
        scale, bias: as for ``attention_significance``; the bias is also the attention's.
        kernel: the config's ``kernels.attention``; ``torch`` keeps the torch implementation on CUDA.

    Returns:
        ((B, H, T, D) attention output in v's dtype, (B, T) float32 scores).
    """
    if exporting():
        out, scores = attention_and_significance_dense(q, k, v, bias, float(scale))
        return out.to(v.dtype), scores
    return _joint_op(q, k, v, bias, float(scale), kernel)


def cls_significance(q: Tensor, k: Tensor, scale: float, bias: Tensor | None = None) -> Tensor:
    """The class token's row of eq. 4 (EViT's token attentiveness): ``s_j = sum_h softmax_j(scale q_0 . k_j + bias_j)``.

    One query row a head: B*H*T*D multiply-adds, where eq. 4 takes B*H*T^2*D, so plain torch ops
    suffice (autograd differentiates them; ``torch.compile`` fuses them). Computed in float32 with
    autocast off, as eq. 4 is.

    Args:
        q, k: (B, H, T, D) queries and keys; token 0 is the class token.
        scale, bias: as for ``attention_significance``.

    Returns:
        (B, T) float32 scores; each sample's scores add up to H.
    """
    with torch.autocast(q.device.type, enabled=False):
        query = q[:, :, :1].float() * scale  # (B, H, 1, D)
        logits = (k * query).sum(-1)  # (B, H, T) float32 (type promotion: k is read in its own dtype, not copied)
        if bias is not None:
            logits = logits + bias.float().unsqueeze(1)
        return logits.softmax(-1).sum(1)
