"""Which timm ViTs the downsampling step runs in, decided once per model: an adapter for each kind of block it
runs, a one-line refusal for every other family, and a forward that proves the model runs its blocks through
``model.blocks``.

A model is pooled only where three things hold:

1. it is a timm ``VisionTransformer`` (DeiT, DeiT-3, ViT, hybrids, ViTamin, FlexiViT, SigLIP, CLIP, register and
   global-pool models: the families whose ``forward_features`` calls ``self.blocks(x)``), or a
   ``VisionTransformerRelPos``, ``Beit`` or ``Eva`` (run as ``PooledRelPos`` / ``PooledBeit`` / ``PooledEva``, which
   call their blocks as one), and every one of its blocks is of a kind with an adapter here (``ADAPTERS``). The
   adapter says how the block runs as its two residual halves and which position term its attention takes (a
   relative bias, a rotation), so ``DownsamplingBlocks`` places the step between them without reading a block's
   attribute names;
2. its forward reaches ``model.blocks`` as one call (``check_runs_blocks``): a model that loops over its blocks
   itself (XCiT and ConViT do, to hand each block a position term) would never run the step, so it is refused,
   even as a subclass of ``VisionTransformer``;
3. once pooled, a block is never called by itself (``refuse_direct_calls``): timm's ``forward_intermediates``,
   ``forward_features(attn_mask=...)`` and gradient checkpointing call each block directly, which would skip the
   step and read a keep list against tokens it never made, so those calls raise instead.

Families whose blocks take the grid's shape, mix heads (CaiT's talking heads), run attention and MLP in
parallel, or change the token grid (Swin, MViT, PiT, ...) are refused with
the reason (``REFUSED_FAMILIES``, ``REFUSED_BLOCKS``); docs/models.md lists every family of the pinned timm and
``tests/test_model_families.py`` builds one model of each to hold the list to what the code decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from timm.layers import Attention, AttentionRope
from timm.models._registry import _model_to_module
from timm.models.beit import Attention as BeitAttention
from timm.models.beit import Beit
from timm.models.beit import Block as BeitBlock
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.vision_transformer import Block, ResPostBlock, VisionTransformer
from timm.models.vision_transformer_relpos import (
    RelPosAttention,
    RelPosBlock,
    ResPostRelPosBlock,
    VisionTransformerRelPos,
)
from torch import Tensor, nn

from pipeline.errors import InputError
from pipeline.methods import METHODS


def _relpos_bias(block: nn.Module, shared: Tensor | None) -> Tensor | None:
    """``vit_relpos``: the block's own bias (``attn.rel_pos``: a table or an MLP), else the model's shared one."""
    own = block.attn.rel_pos
    return own.get_bias() if own is not None else shared


def _beit_bias(block: nn.Module, shared: Tensor | None) -> Tensor | None:
    """BEiT: the block's own table's bias plus the model's shared one, either or both (as timm's attention adds)."""
    own = block.attn._get_rel_pos_bias() if block.attn.relative_position_bias_table is not None else None
    found = [bias for bias in (own, shared) if bias is not None]
    return None if not found else sum(found[1:], found[0]).reshape(1, *found[0].shape[-3:])


@dataclass(frozen=True)
class BlockAdapter:
    """How one kind of timm block runs as two residual halves, with the downsampling step between them.

    Pre-norm (timm's ``Block``): ``x + drop_path1(ls1(attn(norm1(x))))``, then
    ``x + drop_path2(ls2(mlp(norm2(x))))``; BEiT's block has LayerScale as the parameters ``gamma_1/2`` (or none)
    in place of ``ls1/2``. Post-norm (``ResPostBlock``, ``vit_*_rpn``): the norms sit after the attention and the
    MLP, inside their residual branches: ``x + drop_path1(norm1(attn(x)))``, then ``x + drop_path2(norm2(mlp(x)))``.
    Every part is the block's own module. ``bias`` gives the block's relative position bias over the tokens the
    model was trained on, (1, H, T0, T0), from the block and the model's shared one; None for a block without one.
    """

    name: str
    post_norm: bool
    attention: tuple[type, ...] = (Attention,)  # the exact attention classes the block may hold
    gamma: bool = False  # LayerScale as gamma_1/gamma_2 parameters (BEiT, Eva) rather than ls1/ls2 modules
    bias: Callable[[nn.Module, Tensor | None], Tensor | None] | None = None
    rotary: bool = False  # its attention rotates the queries and keys of the non-prefix tokens by their positions

    @property
    def relative_bias(self) -> bool:
        """Whether the block's attention adds a relative position bias that pooled tokens must carry."""
        return self.bias is not None

    def position_bias(self, block: nn.Module, shared: Tensor | None) -> Tensor | None:
        """The block's relative position bias (1, H, T0, T0) over the tokens it was trained on, or None."""
        return None if self.bias is None else self.bias(block, shared)

    def attention_input(self, block: nn.Module, x: Tensor) -> Tensor:
        """What the attention of ``block`` reads: x (B, T, M), normalised for a pre-norm block."""
        return x if self.post_norm else block.norm1(x)

    def attention_branch(self, block: nn.Module, out: Tensor) -> Tensor:
        """The attention's output (B, T, M) as its residual branch: LayerScale or the post-norm, then drop-path."""
        if self.post_norm:
            return block.drop_path1(block.norm1(out))
        return block.drop_path1(self._scale(block, "1", out))

    def mlp_half(self, block: nn.Module, x: Tensor) -> Tensor:
        """The MLP half of ``block`` with its residual sum: (B, T, M) -> (B, T, M)."""
        if self.post_norm:
            return x + block.drop_path2(block.norm2(block.mlp(x)))
        return x + block.drop_path2(self._scale(block, "2", block.mlp(block.norm2(x))))

    def _scale(self, block: nn.Module, half: str, x: Tensor) -> Tensor:
        """LayerScale of the block's first or second half on x (B, T, M)."""
        if not self.gamma:
            return getattr(block, f"ls{half}")(x)
        gamma = getattr(block, f"gamma_{half}")
        return x if gamma is None else gamma * x


# Exact classes: a subclass may run its parts otherwise (timm's own variants are subclasses of nothing here).
ADAPTERS: dict[type, BlockAdapter] = {
    Block: BlockAdapter("pre-norm", post_norm=False),
    ResPostBlock: BlockAdapter("post-norm", post_norm=True),
    RelPosBlock: BlockAdapter("pre-norm, relative position bias", post_norm=False, attention=(RelPosAttention,),
                              bias=_relpos_bias),
    ResPostRelPosBlock: BlockAdapter("post-norm, relative position bias", post_norm=True, attention=(RelPosAttention,),
                                     bias=_relpos_bias),
    BeitBlock: BlockAdapter("BEiT: pre-norm, gamma LayerScale, relative position bias", post_norm=False,
                            attention=(BeitAttention,), gamma=True, bias=_beit_bias),
    EvaBlock: BlockAdapter("Eva: pre-norm, gamma LayerScale, rotary", post_norm=False,
                           attention=(EvaAttention, AttentionRope), gamma=True, rotary=True),
    EvaBlockPostNorm: BlockAdapter("Eva: post-norm, rotary", post_norm=True, attention=(EvaAttention, AttentionRope),
                                   rotary=True),
}


def _refuse_masks(model: nn.Module, attn_mask: Tensor | None, is_causal: bool) -> None:
    """A pooled model's forward takes the images alone: a mask over the tokens would not follow them as they pool,
    and gradient checkpointing (timm's, block by block) would skip the steps."""
    if attn_mask is not None or is_causal:
        raise InputError("a pooled model's forward takes no attention mask and no causal flag: the mask would be "
                         "over tokens that the downsampling steps pool away")
    if model.grad_checkpointing:
        raise InputError("gradient checkpointing runs timm's blocks one by one and would skip the downsampling; "
                         "call model.set_grad_checkpointing(False)")


class PooledRelPos(VisionTransformerRelPos):
    """timm's ``VisionTransformerRelPos`` with its blocks called as one, ``self.blocks(x, shared_rel_pos)``.

    Why a subclass: timm's ``forward_features`` loops over the blocks to hand each the shared bias, and offers no
    seam to call them otherwise; this is that forward with the loop made one call, the only change. A pooled
    model (``apply_downsampling``) is given this class; the state dict and every module stay timm's.
    """

    def forward_features(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        _refuse_masks(self, attn_mask, is_causal)
        x = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        shared = self.shared_rel_pos.get_bias() if self.shared_rel_pos is not None else None
        return self.norm(self.blocks(x, shared))


class PooledBeit(Beit):
    """timm's ``Beit`` with its blocks called as one, ``self.blocks(x, shared_rel_pos_bias)`` (see ``PooledRelPos``)."""

    def forward_features(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        _refuse_masks(self, attn_mask, is_causal)
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        x = self.pos_drop(x)
        shared = self.rel_pos_bias() if self.rel_pos_bias is not None else None
        return self.norm(self.blocks(x, shared))


class PooledEva(Eva):
    """timm's ``Eva`` with its blocks called as one, ``self.blocks(x, None, ropes)`` (see ``PooledRelPos``):
    ``ropes`` holds each block's rotary embedding over the patch tokens, (N, 2D) or (H, N, 2D) (``rope_mixed``)."""

    def forward_features(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        _refuse_masks(self, attn_mask, is_causal)
        x, rope = self._pos_embed(self.patch_embed(x))
        x = self.norm_pre(x)
        if rope is None:
            ropes = None
        else:
            ropes = tuple(rope.unbind(0)) if getattr(self, "rope_mixed", False) else (rope,) * len(self.blocks)
        return self.norm(self.blocks(x, None, ropes))


# Model classes the step runs in, each with the class it is given while pooled (itself where timm's forward calls
# ``self.blocks(x)``).
POOLED_CLASS: dict[type, type] = {VisionTransformer: VisionTransformer, VisionTransformerRelPos: PooledRelPos,
                                  Beit: PooledBeit, Eva: PooledEva}

# Why each of timm's other ViT-like families is refused (its models' module in timm's registry).
_POSITION_TERMS = "its forward hands every block a position term ({}) in a loop of its own, which the step's pooled " \
                  "tokens would have to carry; not built"
_GRID = "a hierarchical model whose stages change the token grid themselves ({}); no stage of it takes a keep list"
REFUSED_FAMILIES: dict[str, str] = {
    "vision_transformer_sam": _POSITION_TERMS.format("windowed attention with relative positions"),
    "xcit": _POSITION_TERMS.format("the patch grid's height and width, blk(x, Hp, Wp), for cross-covariance "
                                   "attention over channels"),
    "convit": "its forward adds the class token part-way through the blocks, in a loop of its own, and its gated "
              "positional attention has no significance scores of eq. 4",
    "cait": "its class-attention blocks read the class token against every patch token, and its talking-heads "
            "attention mixes the heads' logits, which the step's attention does not",
    "naflexvit": "its blocks run on variable-length packed sequences with an attention mask per image",
    "tnt": "every block runs an inner transformer over the pixels of each patch, which pooled patches would not keep",
    "crossvit": "two branches of patches at two sizes exchange class tokens between their blocks",
    "twins": "its stages alternate locally-grouped and sub-sampled attention on a token grid",
    "hiera": _GRID.format("Hiera"), "hieradet_sam2": _GRID.format("Hiera"), "mvitv2": _GRID.format("MViT-v2"),
    "levit": _GRID.format("LeViT"), "pit": _GRID.format("PiT"), "volo": _GRID.format("VOLO"),
    "swin_transformer": _GRID.format("Swin"), "swin_transformer_v2": _GRID.format("Swin-v2"),
    "swin_transformer_v2_cr": _GRID.format("Swin-v2 CR"), "nest": _GRID.format("NesT"),
    "pvt_v2": _GRID.format("PVT-v2"), "davit": _GRID.format("DaViT"), "gcvit": _GRID.format("GC ViT"),
    "coat": _GRID.format("CoaT"), "tiny_vit": _GRID.format("TinyViT"), "maxxvit": _GRID.format("MaxViT"),
    "efficientformer": _GRID.format("EfficientFormer"), "efficientformer_v2": _GRID.format("EfficientFormer-v2"),
    "mobilevit": "its transformer blocks run inside convolutional stages on unfolded patches, which fold back into "
                 "a feature map of fixed size",
    "deepseek_vit": "a vision tower for a language model, not a timm VisionTransformer",
    "gemma4_vit": "a vision tower for a language model, not a timm VisionTransformer",
    "qwen3_vit": "a vision tower for a language model, not a timm VisionTransformer",
}

# Why the other kinds of block a timm VisionTransformer can be built with are refused (by class name).
REFUSED_BLOCKS: dict[str, str] = {
    "ParallelScalingBlock": "its attention and MLP run in parallel on the same input, so there is no point between "
                            "them for the step",
    "ParallelThingsBlock": "its attention and MLP branches run in parallel on the same input, so there is no point "
                           "between them for the step",
    "DiffParallelScalingBlock": "its differential attention and MLP run in parallel on the same input",
}

REFUSED_ATTENTION: dict[str, str] = {
    "DiffAttention": "differential attention subtracts two attention maps, and eq. 4's significance and proportional "
                     "attention are defined for one",
}


def model_label(model: nn.Module) -> tuple[str, str]:
    """(the model's timm name, or its class's, and its family: the module timm registers it in)."""
    cfg = getattr(model, "pretrained_cfg", None)
    name = (cfg.get("architecture") if isinstance(cfg, dict) else None) or type(model).__name__
    family = _model_to_module.get(name) or type(model).__module__.rsplit(".", 1)[-1]
    return name, family


def block_adapter(model: nn.Module) -> BlockAdapter:
    """The adapter of ``model``'s blocks, or InputError in one line naming the model, its family and why not.

    Decided from the classes alone (no forward): ``check_runs_blocks`` proves the rest.
    """
    name, family = model_label(model)
    where = f"{name} ({family})"
    if not isinstance(model, tuple(POOLED_CLASS)):
        why = REFUSED_FAMILIES.get(family, f"a {type(model).__name__}, not a timm VisionTransformer")
        raise InputError(f"{where} cannot be pooled: {why}. Token Pooling needs a timm VisionTransformer "
                         "(DeiT, ViT, ...; docs/models.md lists every family)")
    kinds = {type(block) for block in model.blocks}
    for kind in kinds:
        if kind not in ADAPTERS:
            why = REFUSED_BLOCKS.get(kind.__name__, f"its blocks are {kind.__name__}, which no adapter runs as two "
                                                    "residual halves")
            raise InputError(f"{where} cannot be pooled: {why} (docs/models.md)")
    for block in model.blocks:
        attn, expected = block.attn, ADAPTERS[type(block)].attention
        if type(attn) not in expected:
            named = " or ".join(kind.__name__ for kind in expected)
            why = REFUSED_ATTENTION.get(type(attn).__name__, f"its attention is {type(attn).__name__}, not timm's "
                                                             f"{named}")
            raise InputError(f"{where} cannot be pooled: {why} (docs/models.md)")
        if getattr(attn, "num_kv_groups", 1) != 1:
            raise InputError(f"{where} cannot be pooled: its attention shares keys and values between heads "
                             "(grouped-query attention), which the step's attention does not run (docs/models.md)")
        if getattr(attn, "gate", None) is not None:
            raise InputError(f"{where} cannot be pooled: its attention is gated (a sigmoid gate on the output), "
                             "which the step's attention does not run (docs/models.md)")
    if getattr(getattr(model, "patch_drop", None), "prob", 0.0) > 0:  # timm's PatchDropout (an Identity when off)
        raise InputError(f"{where} cannot be pooled: its patch dropout (patch_drop_rate) drops tokens before the "
                         "blocks in training, so the keep list would not count the tokens that arrive; build it "
                         "with patch_drop_rate=0")
    if len(kinds) > 1:
        raise InputError(f"{where} cannot be pooled: its blocks are of {len(kinds)} kinds "
                         f"({', '.join(sorted(k.__name__ for k in kinds))}); one adapter runs a model")
    return ADAPTERS[kinds.pop()]


class BlockCalledAlone(InputError):
    """A block of a pooled model called by itself, outside ``model.blocks`` (``refuse_direct_calls``)."""


class _Reached(Exception):
    """Raised by the probe's hook on ``model.blocks``: the forward called the blocks as one."""


def _stop_at_blocks(module: nn.Module, args: tuple) -> None:
    raise _Reached


def _bypassed(module: nn.Module, args: tuple) -> None:
    raise BlockCalledAlone(
        f"a block of a downsampling model ({type(module).__name__}) was called by itself, outside model.blocks, where "
        "its downsampling step does not run (timm's forward_intermediates, forward_features(attn_mask=...), gradient "
        "checkpointing, or a model that loops over its blocks); call the model or forward_features(x)")


def probe_input(model: nn.Module) -> Tensor:
    """One image (1, C, H, W) of zeros at the model's input size, on its parameters' device."""
    embed = model.patch_embed
    size = tuple(embed.img_size) if getattr(embed, "img_size", None) is not None else (224, 224)
    # The first convolution of the patch embedding reads the image (a hybrid's backbone stem, or the projection).
    channels = next((m.in_channels for m in embed.modules() if isinstance(m, nn.Conv2d)), 3)
    device = next(model.parameters()).device
    return torch.zeros(1, channels, *size, device=device)


def check_runs_blocks(model: nn.Module) -> None:
    """Proves that ``model``'s forward runs its blocks as one call of ``model.blocks``, or refuses it in one line.

    A forward of one image stops at the first call of ``model.blocks`` (so it costs the patch embedding alone) and
    fails at the first call of a single block before it: a model that loops over its blocks itself, which would
    never run the step. Runs on any device, the meta device included, and leaves the model's mode and the global
    random state as they were.
    """
    name, family = model_label(model)
    handles = [model.blocks.register_forward_pre_hook(_stop_at_blocks)]
    handles += [block.register_forward_pre_hook(_bypassed) for block in model.blocks]
    training = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            model(probe_input(model))
    except _Reached:
        return
    except BlockCalledAlone:
        raise InputError(f"{name} ({family}) cannot be pooled: its forward calls its blocks one by one itself, so a "
                         "downsampling step in model.blocks would never run (docs/models.md)") from None
    except InputError:
        raise
    except Exception as err:  # a forward that fails on its own input size would fail in every stage
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise InputError(f"{name} ({family}) cannot be pooled: its forward of one image of its input size failed "
                         f"before model.blocks ({type(err).__name__}: {first})") from err
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    raise InputError(f"{name} ({family}) cannot be pooled: its forward never calls model.blocks, so a downsampling "
                     "step there would never run (docs/models.md)")


def pooled_class(model: nn.Module) -> type:
    """The class ``model`` runs as while pooled (``POOLED_CLASS``): its own, or the one that calls its blocks as one."""
    return POOLED_CLASS.get(type(model), type(model))  # a subclass keeps its own forward, which the probe checks


def decide_family(model: nn.Module) -> BlockAdapter:
    """``block_adapter`` and ``check_runs_blocks`` (as the model will run pooled): the adapter of a model the step
    runs in, or InputError; the model is left as it was."""
    adapter = block_adapter(model)
    own = type(model)
    model.__class__ = pooled_class(model)
    try:
        check_runs_blocks(model)
    finally:
        model.__class__ = own
    return adapter


def check_method(model: nn.Module, adapter: BlockAdapter, method: str) -> None:
    """Refuses, in one line, a method that ``model``'s position terms cannot follow: on a model with rotary
    embeddings, a method whose outputs have no input token behind them (``MethodSpec.keeps_positions``)."""
    if adapter.rotary and getattr(model, "rope", None) is not None and not METHODS[method].keeps_positions:
        name, family = model_label(model)
        kept = ", ".join(sorted(m for m, spec in METHODS.items() if spec.keeps_positions and spec.downsamples))
        raise InputError(f"method {method!r} outputs new tokens with no input token behind them, and {name} "
                         f"({family}) rotates each token by its position (rotary embeddings); give a method whose "
                         f"tokens keep a position: {kept}")


def refuse_direct_calls(blocks: nn.Module) -> None:
    """Makes every block in ``blocks`` raise InputError when called by itself (see the module's point 3); the
    downsampling blocks run the blocks' parts, never a block's own forward, so their path pays nothing."""
    for block in blocks:
        block.register_forward_pre_hook(_bypassed)
