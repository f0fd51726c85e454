"""Self-attention of a timm ``Attention`` module that also returns what the downsampling step needs.

It reads the module's own layers (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``), so a timm
state dict loads unchanged. On CUDA the output always comes from a fused kernel
(``F.scaled_dot_product_attention``, or the kernel it runs, called by name), with proportional
attention as an additive bias and normalised queries and keys as pre-scaled queries; the
significance scores of eq. 4 come from ``attention_significance``, which never forms the normalised
probabilities. Where the fused kernel can return its row log-sum-exps (``fused_attention_lse``:
cuDNN's or flash attention), it hands them to the scores, which then cost one pass over the logits
instead of two. Without autograd (inference) and up to 256 tokens, the CUDA path takes the output
and the scores from one pass instead (``attention_and_significance``, whose CUDA kernel is
``attention_with_columns_triton``: every key of a head in one tile, each row normalised exactly,
P V and the column sums together; the config's ``kernels.attention`` picks ``sdpa``, the fused attention
and the scores apart, or ``torch``, the joint op's torch implementation, instead). On the CPU a block that
needs the scores takes both from one set of logits (``attention_and_significance``), unless attention
dropout is active; ``dense_segments(True)`` gives it the CUDA path (op counts), with the CPU's flash
kernel. A method with
``significance: cls`` gets the class token's row of eq. 4 instead (``cls_significance``, one query
row a head), next to the fused attention on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat
from torch import Tensor, nn

from pipeline.errors import InputError
from pipeline.methods import SIGNIFICANCE
from pipeline.models.significance import (
    attention_and_significance,
    attention_significance,
    cls_significance,
    one_pass_fits,
)
from pipeline.pooling.common import use_dense
from pipeline.runtime import KernelChoice


@dataclass(frozen=True)
class AttentionStats:
    """Per-token statistics of one attention call, for the non-prefix tokens only (None: not asked for)."""

    scores: Tensor | None  # (B, N) significance: attention each token receives, over all heads and queries (eq. 4)
    # or from the class token alone (``significance="cls"``)
    keys: Tensor | None  # (B, N, head_dim) keys averaged over heads, the cheap clustering metric


def attend(
    attn: nn.Module,
    x: Tensor,
    *,
    num_prefix: int,
    log_sizes: Tensor | None = None,
    qk_alpha: Tensor | None = None,
    scores: bool = False,
    keys: bool = False,
    significance: str = "eq4",
    kernels: KernelChoice | None = None,
    position_bias: Tensor | None = None,
    rope: Tensor | None = None,
) -> tuple[Tensor, AttentionStats | None]:
    """Runs ``attn`` on x (B, T, M) with T = prefix + tokens.

    Args:
        attn: a timm ``Attention`` (no gate).
        x: (B, T, M) normalised block input.
        num_prefix: number of prefix tokens at the front of x.
        log_sizes: (B, T) log of each token's size; added to the logits of every query
            (proportional attention, Appendix E). Size 0 gives -inf: the token is ignored.
        qk_alpha: scalar tensor; if given, queries and keys are L2-normalised and the logits are
            ``alpha * q . k`` (Appendix F) instead of ``q . k / sqrt(d)``.
        scores: also return the significance scores of the non-prefix tokens.
        keys: also return their keys averaged over heads.
        significance: which scores: ``"eq4"`` (the paper's) or ``"cls"`` (the class token's
            attention, ``cls_significance``; token 0 must be the class token). With ``"cls"`` the
            output always comes from the fused attention.
        kernels: the model's ``runtime.KernelChoice``; its ``attention`` picks the CUDA inference path.
        position_bias: (1 or B, H, T, T) added to the logits (a relative position bias, ``models.families``);
            the attention and the scores then come from one dense softmax in torch (``_dense_attention``).
        rope: (B or 1, H or 1, N, 2D) the rotary embedding (sines, then cosines) of each non-prefix token, as timm's
            ``apply_rot_embed_cat`` takes it: the queries and keys of those tokens are rotated by it (Eva).

    Returns:
        ((B, T, M) output, AttentionStats, or None when neither statistic was asked for).
    """
    if getattr(attn, "gate", None) is not None:
        raise InputError("gated attention is not supported by the downsampling blocks")
    if significance not in SIGNIFICANCE.choices:
        raise InputError(f"significance must be one of {SIGNIFICANCE.choices}, got {significance!r}")
    b, t, _ = x.shape
    qkv = _qkv(attn, x)
    qkv = qkv.reshape(b, t, 3, attn.num_heads, qkv.shape[-1] // (3 * attn.num_heads)).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # (B, H, T, hd)
    if hasattr(attn, "q_norm"):  # timm's Attention and RelPosAttention; BEiT's has none
        q, k = attn.q_norm(q), attn.k_norm(k)
    if rope is not None:  # as timm's EvaAttention: the prefix tokens are not rotated
        half, p = getattr(attn, "rotate_half", False), num_prefix
        q = torch.cat([q[:, :, :p], apply_rot_embed_cat(q[:, :, p:], rope, half=half)], dim=2).type_as(v)
        k = torch.cat([k[:, :, :p], apply_rot_embed_cat(k[:, :, p:], rope, half=half)], dim=2).type_as(v)
    scale = attn.scale
    if qk_alpha is not None:  # alpha * q^ . k^ as a fused attention with pre-scaled queries
        q, k = F.normalize(q, dim=-1) * qk_alpha.to(q.dtype), F.normalize(k, dim=-1)
        scale = 1.0
    dropout = attn.attn_drop.p if attn.training else 0.0
    eq4 = scores and significance == "eq4"
    if position_bias is not None:
        out, found = _dense_attention(q, k, v, scale, position_bias, log_sizes, dropout,
                                      None if not scores else significance)
        return _output(attn, out, found, k if keys else None, num_prefix, scores)
    found = None
    choice = "auto" if kernels is None else kernels.attention
    if eq4 and dropout == 0.0 and (not use_dense(q) or _one_pass(q, choice)):  # one set of logits for both
        out, found = attention_and_significance(q, k, v, scale, log_sizes, kernel=choice)
    else:
        bias = None if log_sizes is None else log_sizes[:, None, None, :].to(q.dtype)  # (B, 1, 1, T)
        fused = fused_attention_lse(q, k, v, scale, bias, dropout) if eq4 else None
        if fused is not None:  # the scores reuse the attention's row log-sum-exps
            out, lse = fused
            found = attention_significance(q, k, scale, log_sizes, lse=lse)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, dropout_p=dropout)
            if eq4:
                found = attention_significance(q, k, scale, log_sizes)
    if scores and not eq4:
        found = cls_significance(q, k, scale, log_sizes)
    return _output(attn, out, found, k if keys else None, num_prefix, scores)


def _qkv(attn: nn.Module, x: Tensor) -> Tensor:
    """The module's packed queries, keys and values (B, T, 3 H D): its ``qkv`` layer, with BEiT's and Eva's separate
    ``q_bias``/``k_bias``/``v_bias`` added as their forwards add them, or Eva's three projections side by side."""
    if getattr(attn, "qkv", None) is None:
        return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    if getattr(attn, "q_bias", None) is None:
        return attn.qkv(x)
    bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
    return attn.qkv(x) + bias if attn.qkv_bias_separate else F.linear(x, weight=attn.qkv.weight, bias=bias)


def _output(attn: nn.Module, out: Tensor, found: Tensor | None, keys: Tensor | None, num_prefix: int, scores: bool
            ) -> tuple[Tensor, AttentionStats | None]:
    """The attention's projected output (B, T, M) from the heads' outputs (B, H, T, D), and the statistics of the
    non-prefix tokens asked for: the scores ``found`` (B, T), the keys (B, H, T, D) averaged over heads."""
    b, h, t, d = out.shape
    stats = None
    if scores or keys is not None:
        stats = AttentionStats(
            scores=found[:, num_prefix:] if scores else None,
            keys=keys.mean(dim=1)[:, num_prefix:] if keys is not None else None,
        )
    out = out.transpose(1, 2).reshape(b, t, h * d)  # not -1: B may be 0
    norm = getattr(attn, "norm", None)  # timm's Attention has one (scale_norm); RelPosAttention does not
    return attn.proj_drop(attn.proj(out if norm is None else norm(out))), stats


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, position_bias: Tensor, log_sizes: Tensor | None,
                     dropout: float, significance: str | None) -> tuple[Tensor, Tensor | None]:
    """Softmax attention with an additive (1 or B, H, T, T) bias, and its scores, from one dense softmax in torch:
    q, k, v (B, H, T, D) -> ((B, H, T, D) in v's dtype, (B, T) float32 scores or None).

    Why not the fused kernels: they take a per-key bias (proportional attention's log sizes) and no per-pair one.
    The scores are eq. 4 (``"eq4"``: the probabilities summed over heads and queries) or the class token's row
    (``"cls"``); the logits and the softmax are float32 whatever the dtype.
    """
    with torch.autocast(q.device.type, enabled=False):  # float32 under autocast too
        logits = (q.float() * scale) @ k.float().transpose(-2, -1) + position_bias.float()  # (B, H, T, T)
        if log_sizes is not None:
            logits = logits + log_sizes[:, None, None, :].float()
        probs = logits.softmax(dim=-1)
    found = None
    if significance == "eq4":
        found = probs.sum(dim=(1, 2))
    elif significance == "cls":
        found = probs[:, :, 0].sum(dim=1)
    weights = F.dropout(probs, dropout) if dropout else probs
    return (weights.to(v.dtype) @ v), found


def _one_pass(q: Tensor, choice: str = "auto") -> bool:
    """Whether the CUDA path takes attention and eq. 4 from one pass over the logits (the joint op's Triton
    kernel, ``attention_with_columns_triton``, or its torch implementation for ``choice="torch"``): without
    autograd (its backward recomputes the (B, H, T, T) probabilities in torch, where training keeps the fused
    attention's backward), where the kernel takes the shape (``one_pass_fits``), and unless ``choice`` (the
    config's ``kernels.attention``) is ``sdpa``."""
    return choice != "sdpa" and not torch.is_grad_enabled() and one_pass_fits(q)


def fused_attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None, dropout: float
                        ) -> tuple[Tensor, Tensor] | None:
    """The fused attention output (B, H, T, D) and its row log-sum-exps (B, H, T) float32, from the
    kernel that ``scaled_dot_product_attention`` runs for these inputs, called by name because SDPA
    does not return the log-sum-exps; None where there is no such kernel for these inputs.

    On CUDA see ``_cuda_attention_lse``. On the CPU, ``aten._scaled_dot_product_flash_attention_for_cpu``
    (any float dtype, the bias (B, 1, 1, T) as a mask, no dropout); only the CUDA path of
    ``dense_segments(True)`` gets here. All are autograd ops; the log-sum-exps are a statistic of the
    logits and are not differentiated.
    """
    if q.is_cuda:
        return _cuda_attention_lse(q, k, v, scale, bias, dropout)
    if q.device.type == "cpu" and dropout == 0.0:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, attn_mask=bias, scale=scale)
    return None


def _cuda_attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None, dropout: float
                        ) -> tuple[Tensor, Tensor] | None:
    """``fused_attention_lse`` on CUDA: on compute capability 9.x (H100, H200) cuDNN's attention
    (``aten._scaled_dot_product_cudnn_attention``, the kernel SDPA ran in every profile of
    docs/benchmarks.md), on 8.x (A100) flash attention (``aten._scaled_dot_product_flash_attention``).

    None (the caller falls back to SDPA and scores that compute their own log-sum-exps) on other
    cards, in float32, with a bias (proportional attention), for a head dim that is not a multiple of
    8 up to 256, or when q, k and v are not laid out alike (normalised queries and keys): SDPA ran
    these kernels on timm's packed q, k and v. The choice ignores ``torch.backends.cuda.enable_*_sdp``,
    which ``torch.compile`` cannot read.
    """
    b, h, t, d = q.shape
    if bias is not None or q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256:
        return None
    if not q.stride() == k.stride() == v.stride():
        return None
    major = torch.cuda.get_device_properties(q.device).major
    if major == 9:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout, scale=scale)[:2]
    elif major == 8:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, scale=scale)[:2]
    else:
        return None
    return out, lse.reshape(b, h, t)  # cuDNN's is (B, H, T, 1)
