"""Eq. 4 significance from queries and keys, next to a fused attention kernel.

``attention_significance(q, k, scale, bias)`` returns ``s_j = sum_h sum_i softmax_j(scale q_i . k_j + bias_j)``
without ever holding the normalised (B, H, T, T) probabilities:

- on CUDA, two Triton passes (``significance_triton``): row log-sum-exps, then column sums of
  ``exp(logit - lse)``, both recomputing the logits tile by tile;
- on the CPU (and on CUDA without Triton), the same math in torch: the row-normalised column sum
  is one matmul of the reciprocal row sums against the unnormalised ``exp(logit - rowmax)``, so the
  (B, H, T, T) matrix is never normalised.

It is a ``torch.library`` custom op, so ``torch.compile(fullgraph=True)`` keeps it as one opaque call
and autograd uses the backward below (the weighted methods differentiate through their weights).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch path
    from pipeline.models.significance_triton import significance_triton
except ImportError:  # pragma: no cover - depends on the install
    significance_triton = None


def _logits(q: Tensor, k: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """(B, H, T, D) x (B, H, T, D) -> (B, H, T, T) float32 logits, bias (B, T) added to every row."""
    logits = torch.matmul(q.float() * scale, k.float().transpose(-2, -1))
    if bias is not None:
        logits = logits + bias.float()[:, None, None, :]
    return logits


def significance_torch(q: Tensor, k: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """The fast eq. 4 in plain torch: (B, H, T, D) queries and keys -> (B, T) float32."""
    e = _logits(q, k, bias, scale)
    e = e.sub_(e.amax(-1, keepdim=True)).exp_()  # unnormalised, (B, H, T, T)
    inv = e.sum(-1, keepdim=True).reciprocal_()  # (B, H, T, 1): 1 / row sums
    return torch.matmul(inv.transpose(-2, -1), e).sum(1).squeeze(1)  # (B, 1, T) per head, summed


@torch.library.custom_op("tokenpool::attention_significance", mutates_args=())
def _significance_op(q: Tensor, k: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    return significance_torch(q, k, bias, scale)


@_significance_op.register_kernel("cuda")
def _significance_cuda(q: Tensor, k: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    if significance_triton is None:
        return significance_torch(q, k, bias, scale)
    return significance_triton(q, k, bias, scale)


@_significance_op.register_fake
def _significance_fake(q: Tensor, k: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[2], dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    q, k, bias, scale = inputs
    ctx.save_for_backward(q, k, bias)
    ctx.scale = scale


def _backward(ctx, grad: Tensor):
    """d s_j / d logit_ij = P_ij (g_j - sum_j' P_ij' g_j'), recomputing P (B, H, T, T) once."""
    q, k, bias = ctx.saved_tensors
    probs = _logits(q, k, bias, ctx.scale).softmax(-1)
    g = grad.float()[:, None, None, :]  # (B, 1, 1, T)
    dlogits = probs * (g - (probs * g).sum(-1, keepdim=True))
    dq = torch.matmul(dlogits, k.float()) * ctx.scale
    dk = torch.matmul(dlogits.transpose(-2, -1), q.float()) * ctx.scale
    dbias = dlogits.sum((1, 2)).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
    return dq.to(q.dtype), dk.to(k.dtype), dbias, None


_significance_op.register_autograd(_backward, setup_context=_setup_context)


def attention_significance(q: Tensor, k: Tensor, scale: float, bias: Tensor | None = None) -> Tensor:
    """Eq. 4: the attention each token receives, summed over heads and queries.

    Args:
        q, k: (B, H, T, D) queries and keys, any float dtype (the sums are float32).
        scale: the logit scale (``head_dim ** -0.5``, or 1 for pre-scaled queries).
        bias: (B, T) added to the logits of every query row (log sizes for proportional attention).

    Returns:
        (B, T) float32 scores; each sample's scores add up to H * T.
    """
    return _significance_op(q, k, bias, float(scale))
