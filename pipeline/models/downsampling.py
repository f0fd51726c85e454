"""A downsampling step inside every block of a timm ViT, between the attention and the MLP.

``apply_downsampling`` swaps ``model.blocks`` for ``DownsamplingBlocks``: an ``nn.Sequential`` of
the very same block modules (so state-dict keys and weights stay as they are) whose forward runs
each block from its own parts, as the block's adapter (``models.families``: pre-norm with LayerScale,
or post-norm) says, with the downsampling step placed between the two halves. LayerScale, register
and distillation tokens keep working because nothing of the block is re-implemented but its two
residual lines, and the tests compare against the unpatched timm model. A model the step would not
run in is refused before anything of it changes (``families.decide_family``).

Placement: the paper's GFLOPs are reproduced only when block l keeps K_l tokens after its attention
and before its MLP (PoWER-BERT's placement): for DeiT-S at sparsity level 1 the analytic count is
2.93 GFLOPs there (paper: 2.9) against 3.17 when pooling after the whole block (tests/test_flops.py).
The next block then sees K_l + prefix tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.errors import InputError
from pipeline.methods import METHODS, build_downsampler, downsamples, method_spec
from pipeline.models.attention import attend
from pipeline.models.families import BlockAdapter, check_method, decide_family, pooled_class, refuse_direct_calls
from pipeline.models.keep import effective_keep
from pipeline.pooling.common import PoolResult, one_hot, stable_ranks
from pipeline.pooling.conv import grid_shape
from pipeline.runtime import KernelChoice

QK_NORM = ("fixed", "learned")


@dataclass(frozen=True)
class DownsamplingConfig:
    """How a model downsamples: the method, its options and the effective keep list."""

    method: str
    keep: list[int]
    carry: bool = False
    qk_norm: str | None = None  # None, "fixed" or "learned" alpha (Appendix F)
    alpha: float = 1.0
    soft_extract: bool = False  # PoWER-BERT's K-search layer instead of hard downsampling
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockRecord:
    """What one block did, for analysis hooks (``DownsamplingBlocks.recorder``); non-prefix tokens only.

    Attributes:
        layer: block index, from 0.
        before: (B, N, M) the block's input tokens.
        attended: (B, N, M) the attention branch's output (after LayerScale), before the residual sum.
        mixed: (B, N, M) ``before + attended``: what the downsampling step receives.
        scores: (B, N) significance from this block's attention (eq. 4, or the class token's row of it
            for a method with ``significance: cls``).
        keys: (B, N, head_dim) keys averaged over heads.
        assign: (B, N) output slot of each token, -1 for a dropped one; None when the block keeps
            every token.
    """

    layer: int
    before: Tensor
    attended: Tensor
    mixed: Tensor
    scores: Tensor
    keys: Tensor
    assign: Tensor | None


class DownsamplingBlocks(nn.Sequential):
    """timm blocks run with downsampling; x (B, P+N, M) -> (B, P+K_L, M)."""

    def __init__(self, blocks: nn.Sequential, config: DownsamplingConfig, *, adapter: BlockAdapter, num_prefix: int,
                 num_tokens: int, grid: tuple[int, int] | None, kernels: KernelChoice | None = None) -> None:
        super().__init__(*blocks)
        self.config = config
        self.adapter = adapter  # how each block runs as two residual halves (models.families)
        # The implementation of each fused step, handed to the attention and the step as arguments: a
        # compiled graph keeps the value it was traced with (``set_kernels`` before compiling changes it).
        self.kernels = kernels or KernelChoice()
        self.num_prefix = num_prefix
        self.num_tokens = num_tokens
        spec = METHODS[config.method]
        self.learnable, self.takes_kernels = spec.learnable, spec.takes_kernels
        self.needs_scores, self.needs_keys = spec.needs_scores, spec.needs_metric(config.options)
        self.significance = spec.significance(config.options)
        # Analysis hook (pipeline.analysis): called with a BlockRecord per block when set.
        self.recorder: Callable[[BlockRecord], None] | None = None
        dim = blocks[0].attn.proj.out_features
        if self.learnable:
            self._attach_per_block(dim, grid)
        else:
            self.step = build_downsampler(config.method, **config.options)
        if config.qk_norm is not None:
            for block in self:
                block.qk_alpha = nn.Parameter(torch.tensor(float(config.alpha)),
                                              requires_grad=config.qk_norm == "learned")
        if config.soft_extract:
            for block in self:
                block.retention = nn.Parameter(torch.ones(num_tokens))

    def _attach_per_block(self, dim: int, grid: tuple[int, int] | None) -> None:
        """Gives each block that downsamples its own instance of a learnable method, built for the
        grid it receives (``build(dim, grid=(h, w), k=K)``); a module's ``out_grid`` is the next grid."""
        n = self.num_tokens
        grid = grid_shape(n, grid)
        build = METHODS[self.config.method].factory()
        for layer, (block, k) in enumerate(zip(self, self.config.keep)):
            if k >= n:
                continue
            try:
                block.downsample = build(dim, grid=grid, k=k, **self.config.options)
            except ValueError as err:
                raise InputError(f"keep[{layer}] is {k}, but {err} (block {layer + 1})") from None
            grid = getattr(block.downsample, "out_grid", None)
            n = k

    def forward(self, x: Tensor, shared_bias: Tensor | None = None, ropes: tuple[Tensor, ...] | None = None
                ) -> Tensor:
        """x (B, P+N, M) -> (B, P+K_L, M); ``shared_bias`` (1, H, P+N, P+N): the model's shared relative position
        bias, for blocks whose adapter has one and whose attention holds none of its own; ``ropes``: each block's
        rotary embedding of the N patch tokens, (N, 2D) or (H, N, 2D), for a rotary adapter (Eva)."""
        b, t, _ = x.shape
        if t - self.num_prefix != self.num_tokens:  # another image size (timm's dynamic_img_size)
            raise InputError(f"this model's keep list was made for {self.num_tokens} tokens an image, but "
                             f"{t - self.num_prefix} arrive (an image of another size); build the model at the size "
                             "it runs at (create_model(..., img_size=...), model.img_size in a config)")
        sizes = torch.ones(b, t, device=x.device, dtype=torch.float32) if self.config.carry else None
        positions = None  # (B, P+n, P+N): each token's weights over the tokens the biases were made for; None: I
        origin = None  # (B, n): the patch token behind each non-prefix token, for the rotations; None: 0..N-1
        for layer, block in enumerate(self):
            rope = None if ropes is None else rotary_rows(ropes[layer], origin)
            x, sizes, positions, origin = self._run_block(layer, block, x, sizes, positions, shared_bias, rope, origin)
        return x

    # ---- a block's three parts, which the model and the latency tables (``bench.blocks``) both run ----

    def attention_half(self, block: nn.Module, x: Tensor, *, sizes: Tensor | None = None, scores: bool = False,
                       keys: bool = False, position_bias: Tensor | None = None, rope: Tensor | None = None
                       ) -> tuple[Tensor, Any]:
        """The attention branch of ``block`` on x (B, P+n, M), after LayerScale and drop-path, before the residual
        sum: ((B, P+n, M), ``AttentionStats`` with the scores and keys asked for, or None). ``position_bias``
        (1 or B, H, P+n, P+n): the block's relative position bias over these tokens (``pooled_bias``); ``rope``
        the rotary embedding of the n non-prefix tokens (``rotary_rows``)."""
        out, stats = attend(
            block.attn, self.adapter.attention_input(block, x), num_prefix=self.num_prefix,
            log_sizes=None if sizes is None else sizes.log(), qk_alpha=getattr(block, "qk_alpha", None),
            scores=scores, keys=keys, significance=self.significance, kernels=self.kernels,
            position_bias=position_bias, rope=rope,
        )
        return self.adapter.attention_branch(block, out), stats

    def pool_step(self, block: nn.Module, x: Tensor, k: int, stats: Any, sizes: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None, PoolResult]:
        """The method's step on x (B, P+n, M) to k non-prefix tokens, in float32 whatever autocast does to the
        blocks: ((B, P+k, M), the carried sizes (B, P+k) or None, the step's ``PoolResult``, whose ``assign`` is
        computed only when read)."""
        p = self.num_prefix
        step = block.downsample if self.learnable else self.step
        with torch.autocast(x.device.type, enabled=False):
            result = step(
                x[:, p:], k, scores=None if stats is None else stats.scores,
                metric=None if stats is None else stats.keys, sizes=None if sizes is None else sizes[:, p:],
                validate=False, **({"kernels": self.kernels} if self.takes_kernels else {}),
            )
        x = torch.cat([x[:, :p], result.tokens.to(x.dtype)], dim=1)
        sizes = None if sizes is None else torch.cat([sizes[:, :p], result.sizes], dim=1)
        return x, sizes, result

    def mlp_half(self, block: nn.Module, x: Tensor) -> Tensor:
        """The MLP half of ``block`` with its residual sum: (B, T, M) -> (B, T, M)."""
        return self.adapter.mlp_half(block, x)

    def _run_block(self, layer: int, block: nn.Module, x: Tensor, sizes: Tensor | None, positions: Tensor | None,
                   shared_bias: Tensor | None, rope: Tensor | None, origin: Tensor | None
                   ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        p, k, record = self.num_prefix, self.config.keep[layer], self.recorder is not None
        downsample = k < x.shape[1] - p
        pool = downsample and k > 0
        soft = hasattr(block, "retention")
        bias = self.adapter.position_bias(block, shared_bias)
        attended, stats = self.attention_half(block, x, sizes=sizes, keys=record or (pool and self.needs_keys),
                                              scores=record or soft or (pool and self.needs_scores),
                                              position_bias=None if bias is None else pooled_bias(bias, positions),
                                              rope=rope)
        before = x
        x = mixed = before + attended
        assign = None
        if soft:
            x = torch.cat([x[:, :p], soft_extract(x[:, p:], stats.scores, block.retention)], dim=1)
        elif downsample and k == 0:  # "0": only the prefix tokens go on (the paper's tables)
            if record:
                assign = torch.full(x[:, p:, 0].shape, -1, dtype=torch.long, device=x.device)
            x = x[:, :p]
            positions = None if bias is None else pooled_positions(positions, None, None, p, 0, before.shape[1])
            origin = None if rope is None else torch.zeros(x.shape[0], 0, dtype=torch.long, device=x.device)
            sizes = None if sizes is None else sizes[:, :p]
        elif downsample:
            members = None if sizes is None else sizes[:, p:]
            x, sizes, result = self.pool_step(block, x, k, stats, sizes)
            assign = result.assign if record else None
            if bias is not None:
                positions = pooled_positions(positions, result.assign, members, p, k, before.shape[1])
            if rope is not None:  # a pooled token rotates as the input token behind it (MethodSpec.keeps_positions)
                if result.index is None:
                    raise InputError(f"method {self.config.method!r} declares keeps_positions but its step returned "
                                     "no index of the input token behind each output (PoolResult.index)")
                origin = result.index if origin is None else origin.gather(1, result.index)
        if record:
            self.recorder(BlockRecord(layer, before[:, p:], attended[:, p:], mixed[:, p:], stats.scores,
                                      stats.keys, assign))
        return self.mlp_half(block, x), sizes, positions, origin


def pooled_positions(positions: Tensor | None, assign: Tensor | None, members: Tensor | None, p: int, k: int,
                     t: int) -> Tensor:
    """Each token's weights over the tokens a relative position bias was made for, after a step: (B, P+k, P+N).

    A pooled token stands for the size-weighted mean of its members (``members``, the carried sizes (B, n), or
    one each): a kept token for itself alone, a cluster or a merge for its members by size. ``positions``
    (B, P+n, P+N) are the weights before the step (None: every token its own, n = N and t = P+N tokens);
    ``assign`` (B, n) the output slot of each of the n tokens (-1: dropped), None when k = 0.
    """
    if positions is None:
        b = 1 if assign is None else assign.shape[0]
        device = None if assign is None else assign.device
        positions = torch.eye(t, device=device).expand(b, t, t)
    if k == 0:
        return positions[:, :p]
    weights = torch.ones(assign.shape, device=assign.device) if members is None else members.float()
    share = one_hot(assign.clamp(min=0), k, torch.float32) * (weights * (assign >= 0))[:, None, :]  # (B, k, n)
    share = share / share.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.cat([positions[:, :p], share @ positions[:, p:]], dim=1)


def rotary_rows(rope: Tensor, origin: Tensor | None) -> Tensor:
    """A block's rotary embedding of the patch tokens, (N, 2D) or per head (H, N, 2D), for the tokens now in the
    block: origin (B, n), the patch token behind each -> (B, 1 or H, n, 2D); the embedding itself while every
    token is its own (origin None)."""
    if origin is None:
        return rope
    if rope.dim() == 2:
        return rope[origin].unsqueeze(1)
    if rope.dim() == 3:
        return rope[:, origin].transpose(0, 1)
    raise InputError(f"a rotary embedding of shape {tuple(rope.shape)}: expected (N, 2D) or (H, N, 2D) for a block")


def pooled_bias(bias: Tensor, positions: Tensor | None) -> Tensor:
    """A relative position bias (1, H, T0, T0) over the tokens now in the block: positions (B, T, T0) -> (B, H, T, T),
    ``b_ij = sum_ab w_ia w_jb bias_ab`` (the size-weighted mean over both tokens' members); the bias itself while
    every token is its own (positions None)."""
    if positions is None:
        return bias
    return torch.einsum("zia,hac,zjc->zhij", positions, bias[0].float(), positions)


def unit_interval(retention: Tensor) -> Tensor:
    """``retention`` clamped to [0, 1] with the gradient passed straight through.

    A plain ``clamp`` has zero gradient at the bounds, and retention starts at exactly 1, so the
    K search would never move; ``project_retention`` keeps the stored values inside [0, 1].
    """
    return retention + (retention.clamp(0.0, 1.0) - retention).detach()


@torch.no_grad()
def project_retention(model: nn.Module) -> None:
    """Clips every soft-extract weight back into [0, 1] after an optimiser step (PoWER-BERT)."""
    for block in model.blocks:
        if hasattr(block, "retention"):
            block.retention.clamp_(0.0, 1.0)


def soft_extract(tokens: Tensor, scores: Tensor, retention: Tensor) -> Tensor:
    """PoWER-BERT's soft-extract layer: scales the token of significance rank j by retention[j].

    tokens (B, N, M), scores (B, N), retention (N,) clamped to [0, 1] -> (B, N, M).
    """
    ranks = stable_ranks(scores, descending=True)  # (B, N), equal scores keep the token order
    return tokens * unit_interval(retention)[ranks].unsqueeze(-1).to(tokens.dtype)


def retention_penalty(model: nn.Module, strength: float) -> Tensor:
    """PoWER-BERT's mass penalty: strength * sum over blocks l of l * sum_j retention_l[j] (l from 1)."""
    blocks = [block for block in model.blocks if hasattr(block, "retention")]
    if not blocks:
        raise InputError("the model has no soft-extract layers; apply_downsampling(..., soft_extract=True)")
    return strength * sum((layer + 1) * unit_interval(block.retention).sum() for layer, block in enumerate(blocks))


def retention_keep(model: nn.Module) -> list[int]:
    """Turns learned retention weights into a non-increasing integer keep list (the K search's result).

    K_l is the rounded retained mass of block l, at most K_{l-1}.
    """
    keep, previous = [], None
    for block in model.blocks:
        if not hasattr(block, "retention"):
            raise InputError("the model has no soft-extract layers; apply_downsampling(..., soft_extract=True)")
        mass = int(torch.round(block.retention.detach().clamp(0.0, 1.0).sum()).item())
        previous = mass if previous is None else min(previous, mass)
        keep.append(previous)
    return keep


def _check_head_keeps_tokens(model: nn.Module, keep: list[int]) -> None:
    """Refuses a keep list that leaves the head nothing of the image.

    K = 0 passes only the prefix tokens on (the paper's lists end in 0 for DeiT's class token). A
    head that pools only the non-prefix tokens (timm's ``global_pool`` avg, max, avgmax, or an
    attention pool, without ``pool_include_prefix``) would pool zero tokens (NaN logits for the
    averages, the same logits for every image for an attention pool), and a model without prefix
    tokens would have no token of the image left at all.
    """
    if 0 not in keep:
        return
    pool, prefix = getattr(model, "global_pool", "token"), model.num_prefix_tokens
    patches_only = pool not in ("token", "") and not getattr(model, "pool_include_prefix", False)
    if patches_only or prefix == 0:
        layer = keep.index(0)
        why = (f"this model's head pools only the patch tokens (global_pool={pool!r}) and none would be left"
               if patches_only else
               "this model has no prefix (class or register) token, so no token of the image would be left")
        raise InputError(f"keep[{layer}] (block {layer + 1}) is 0, but {why}; keep at least 1 token in every "
                         "block (K = 0 suits models whose head reads the class token)")


def apply_downsampling(
    model: nn.Module,
    method: str,
    keep: list[int] | None = None,
    *,
    carry: bool = False,
    qk_norm: str | None = None,
    alpha: float = 1.0,
    soft_extract: bool = False,
    kernels: KernelChoice | None = None,
    **options: Any,
) -> nn.Module:
    """Adds a downsampling step to every block of a timm ViT instance, in place; returns the model.

    Args:
        model: a timm ``VisionTransformer`` (DeiT, ViT, with or without LayerScale, register or
            distillation tokens, pre- or post-norm blocks), trained or not; any other family is refused in one
            line (``models.families``, docs/models.md).
        method: a name from ``pipeline.methods.METHODS``.
        keep: K_1..K_L, the most non-prefix tokens after each block; default: keep all.
        carry: carry cluster sizes and use proportional attention (Appendix E).
        qk_norm: ``"fixed"`` or ``"learned"``: L2-normalised queries and keys with logits
            ``alpha * q . k`` (Appendix F); adds one ``qk_alpha`` parameter per block.
        alpha: the initial (or fixed) alpha.
        soft_extract: add PoWER-BERT's soft-extract layer to every block (one learnable retention
            weight per significance rank, initialised to 1) for the K search; see
            ``retention_penalty`` and ``retention_keep``. It needs ``method="none"`` and no keep list.
        kernels: the implementation of each fused step (the config's ``kernels``); default all ``auto``.
        options: the method's options (its ``MethodSpec``'s; ``pipeline methods`` lists them).
    """
    if isinstance(getattr(model, "blocks", None), DownsamplingBlocks):
        raise InputError("this model already downsamples; build a fresh model to change the method")
    if getattr(model, "grad_checkpointing", False):
        raise InputError("gradient checkpointing runs timm's blocks one by one and would skip the downsampling; "
                         "call model.set_grad_checkpointing(False) first")
    adapter = decide_family(model)  # the family refused in one line before anything of the model changes
    options = method_spec(method).resolve(method, options)
    if qk_norm not in (None, *QK_NORM):
        raise InputError(f"qk_norm must be None or one of {QK_NORM}, got {qk_norm!r}")
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise InputError(f"alpha must be a finite number > 0 (the scale of the normalised logits), got {alpha!r}")
    if soft_extract and (downsamples(method) or keep is not None):
        raise InputError("soft_extract is the K search: use it with method='none' and no keep list")
    num_tokens = model.patch_embed.num_patches
    depth = len(model.blocks)
    keep = [num_tokens] * depth if keep is None else effective_keep(keep, depth=depth, num_tokens=num_tokens)
    _check_head_keeps_tokens(model, keep)
    check_method(model, adapter, method)
    if adapter.relative_bias and kernels is not None and kernels.attention not in ("auto", "torch"):
        raise InputError(f"kernels.attention is {kernels.attention!r}, but this model's attention adds a relative "
                         "position bias per pair of tokens, which only the dense torch softmax takes; give auto or "
                         "torch")
    if METHODS[method].significance(options) == "cls" and getattr(model, "cls_token", None) is None:
        raise InputError(f"method {method!r} with significance='cls' scores tokens by the class token's attention, "
                         "but this model has no class token; use significance='eq4' (the paper's scores)")
    config = DownsamplingConfig(method=method, keep=keep, carry=carry, qk_norm=qk_norm, alpha=alpha,
                                soft_extract=soft_extract, options=options)
    grid = tuple(model.patch_embed.grid_size) if hasattr(model.patch_embed, "grid_size") else None
    blocks = DownsamplingBlocks(model.blocks, config, adapter=adapter, num_prefix=model.num_prefix_tokens,
                                num_tokens=num_tokens, grid=grid, kernels=kernels)
    refuse_direct_calls(blocks)
    model.blocks = blocks
    model.__class__ = pooled_class(model)  # timm's own, or one whose forward calls the blocks as one (families)
    return model


def set_kernels(model: nn.Module, kernels: KernelChoice) -> nn.Module:
    """Makes ``model`` (a downsampling ViT, or one inside DDP or ``torch.compile``) run ``kernels`` from its
    next trace or eager call on; an unmodified timm model runs none of the fused steps and is left as it
    is. Call it before compiling: a compiled graph keeps the choice it was traced with."""
    inner = getattr(model, "_orig_mod", model)
    inner = inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else inner
    if isinstance(getattr(inner, "blocks", None), DownsamplingBlocks):
        inner.blocks.kernels = kernels
    return model
