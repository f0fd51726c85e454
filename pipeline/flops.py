"""FLOPs with fvcore, as the paper counts them: one fused multiply-add is one flop.

fvcore has no handle for four ops this code base runs, so four are added here:

- ``aten::scaled_dot_product_attention`` (timm's fused attention, and ours when no statistics are
  needed): Q K^T plus A V, ``B H T S (d + d_v)`` multiply-adds. Without it fvcore silently drops
  the attention matmuls (DeiT-S then counts 0.358 GFLOPs less than the paper's 4.6).
- ``aten::baddbmm`` (the K-Means distances): the batched matmul part, ``B n m p``.
- ``tokenpool::kmeans_gram`` (K-Means' Gram-form iterations on the CPU, one op): ``(iters - 1) B K N^2``,
  the (K, N) x (N, N) products of the later assignments, as the CUDA path's traced iterations count
  them (the CPU's native update multiplies N^2 an iteration; the count stays the model's, whatever runs).
- ``tokenpool::kmedoids`` without the Gram matrices (the CPU's call, which takes a matmul of the starting medoids'
  columns inside the op): the Gram matrix's ``B N^2 M``, what the CUDA path's matmul outside the op counts (the
  CPU's native kernel multiplies about ``B N K M``; the count stays the model's, whatever runs).

and ``tokenpool::attention_with_significance`` (the CPU's attention of a block that also needs the
significance scores) and the fused kernels that such a block calls by name for their row
log-sum-exps (``models.attention.fused_attention_lse``) count as the fused attention, so the count is
the same on any path; like the paper, no count includes the scores' column sums (nor the class
token's attention row of ``significance: cls``, a B H T d product that fvcore does not count).

The downsampling cost is then what the operators really multiply: the K-Medoids Gram matrix
(N^2 M per layer), K-Means' Gram matrix and its later assignments (N^2 M and K N^2 each; the feature
form, for a narrow metric: N K M per assignment and per centre update), the ToMe
similarity matrix, or the strided convolution.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from pipeline.cost import CostModel, Curve, PoolSurface
from pipeline.errors import InputError
from pipeline.methods import METHODS, downsamples, method_spec
from pipeline.sparsity import level_keep

with warnings.catch_warnings():
    # fvcore.nn's focal loss calls torch.jit.script at import, which torch 2.11 deprecates with a
    # FutureWarning that every process counting FLOPs (the evaluate stage's Ray tasks too) would print.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
    from fvcore.nn import FlopCountAnalysis
    from fvcore.nn.jit_handles import get_shape

PARTS = ("patch_embed", "qkv", "attention", "proj", "mlp", "downsampling", "other")


# Every op that is one fused attention: Q K^T plus A V (``_sdpa_flops``).
_FUSED_ATTENTION = ("aten::scaled_dot_product_attention", "tokenpool::attention_with_significance",
                    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention",
                    "aten::_scaled_dot_product_flash_attention_for_cpu")


def _sdpa_flops(inputs: list[Any], outputs: list[Any]) -> int:
    q, k, v = (get_shape(inputs[i]) for i in range(3))
    return math.prod(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])


def _baddbmm_flops(inputs: list[Any], outputs: list[Any]) -> int:
    b, n, m = get_shape(inputs[1])
    return b * n * m * get_shape(inputs[2])[-1]


def _kmedoids_flops(inputs: list[Any], outputs: list[Any]) -> int:
    if get_shape(inputs[1]) is not None:  # the Gram matrices, from a matmul outside the op that fvcore counted
        return 0
    b, n, m = get_shape(inputs[0])  # x (B, N, M), g None, w, medoids, iters
    return b * n * n * m


def _kmeans_gram_flops(inputs: list[Any], outputs: list[Any]) -> int:
    b, n, _ = get_shape(inputs[0])  # gram (B, N, N), w, start (B, K), iters
    return (inputs[3].toIValue() - 1) * b * get_shape(inputs[2])[1] * n * n


@dataclass(frozen=True)
class FlopReport:
    """GFLOPs of one forward pass of one image, in total and by part (the parts add up to the total)."""

    total: float
    patch_embed: float
    qkv: float
    attention: float
    proj: float
    mlp: float
    downsampling: float
    other: float
    keep: list[int] | None

    def as_dict(self) -> dict[str, Any]:
        return {"gflops": self.total} | {k: v for k, v in asdict(self).items() if k != "total"}


def _sum_modules(by_module: dict[str, int], suffixes: Iterable[str]) -> int:
    suffixes = tuple(suffixes)
    return sum(v for name, v in by_module.items() if name.startswith("blocks.") and name.endswith(suffixes)
               and name.count(".") == 2 + suffixes[0].count("."))


def count_flops(model: nn.Module, image_size: int | None = None) -> FlopReport:
    """Counts the GFLOPs of ``model`` (a timm ViT, downsampling or not) on one image."""
    size = image_size or model.patch_embed.img_size[0]
    was_training = model.training
    model.eval()
    analysis = FlopCountAnalysis(model, torch.zeros(1, 3, size, size))
    analysis.set_op_handle("aten::baddbmm", _baddbmm_flops)
    analysis.set_op_handle("tokenpool::kmeans_gram", _kmeans_gram_flops)
    analysis.set_op_handle("tokenpool::kmedoids", _kmedoids_flops)
    for op in _FUSED_ATTENTION:
        analysis.set_op_handle(op, _sdpa_flops)
    analysis.unsupported_ops_warnings(False)
    analysis.uncalled_modules_warnings(False)
    logger = logging.getLogger("fvcore")
    level = logger.level
    logger.setLevel(logging.ERROR)  # fvcore warns about every op it does not count (norm, softmax, ...)
    try:
        with torch.no_grad():
            total = analysis.total()
            by_module = analysis.by_module()
            by_op = analysis.by_operator()
    finally:
        logger.setLevel(level)
        model.train(was_training)
    parts = {
        "patch_embed": by_module.get("patch_embed", 0),
        "qkv": _sum_modules(by_module, ["attn.qkv"]),
        "attention": sum(by_op.get(op.split("::")[1], 0) for op in (*_FUSED_ATTENTION, "aten::matmul")),
        "proj": _sum_modules(by_module, ["attn.proj"]),
        "mlp": _sum_modules(by_module, ["mlp"]),
        "downsampling": sum(by_op.get(op, 0) for op in ("bmm", "baddbmm", "kmeans_gram", "kmedoids"))
        + _sum_modules(by_module, ["downsample"]),
    }
    parts["other"] = total - sum(parts.values())
    config = getattr(model.blocks, "config", None)
    return FlopReport(total=total / 1e9, **{k: v / 1e9 for k, v in parts.items()},
                      keep=None if config is None else list(config.keep))


def format_report(report: FlopReport) -> str:
    lines = [f"total GFLOPs: {report.total:.3f}"]
    lines += [f"  {part:13s} {getattr(report, part):8.3f}" for part in PARTS]
    if report.keep is not None:
        lines.append(f"effective keep: {','.join(map(str, report.keep))}")
    return "\n".join(lines)


# ---- the closed forms of those counts, for GFLOPs targets (the tests hold them equal to fvcore's) ----

NORM_FLOPS = 5  # fvcore's count of a layer norm per element


def clustered_width(model: nn.Module, options: dict[str, Any] | None) -> int:
    """The width of what a pooling step clusters: the tokens' (M), or the head width with ``cluster_on: metric``."""
    first = next(iter(model.blocks))
    if (options or {}).get("cluster_on") == "metric":
        return first.attn.head_dim if hasattr(first.attn, "head_dim") else model.embed_dim // first.attn.num_heads
    return model.embed_dim


def grid(num_tokens: int, step: int) -> list[int]:
    """0, step, 2 step, ... and ``num_tokens`` itself: the token counts a GFLOPs model has points at."""
    return sorted({*range(0, num_tokens, step), num_tokens})


def check_closed_form(model: nn.Module) -> None:
    """Refuses, in one line, a model whose GFLOPs the closed form of ``gflops_cost_model`` does not count as fvcore
    does: it is held equal to fvcore (tests/test_model_families.py) for timm's ``Block``/``ResPostBlock`` with the
    plain ``Attention`` and ``Mlp``, and a final norm over every token, and for nothing else (a relative position
    bias carried through the steps, Eva's blocks, a gated or SwiGLU MLP, a head that normalises the pooled token)."""
    from timm.layers import Attention, Mlp, PatchEmbed  # timm's layers, loaded only with a model at hand
    from timm.models.vision_transformer import Block, ResPostBlock

    first = next(iter(model.blocks))
    why = None
    if type(first) not in (Block, ResPostBlock) or type(first.attn) is not Attention:
        why = f"its blocks are {type(first).__name__} with {type(first.attn).__name__}"
    elif type(first.mlp) is not Mlp or not isinstance(first.attn.norm, nn.Identity):
        why = f"its MLP is {type(first.mlp).__name__}" + ("" if isinstance(first.attn.norm, nn.Identity) else
                                                           " and its attention normalises its output")
    elif isinstance(getattr(model, "norm", None), nn.Identity) and not isinstance(getattr(model, "fc_norm", None),
                                                                                   nn.Identity | None):
        why = "its head normalises the pooled token (fc_norm), not every token"
    elif getattr(model, "attn_pool", None) is not None:
        why = "its head pools the tokens by attention (global_pool='map')"
    elif type(model.patch_embed) is not PatchEmbed:
        why = f"its patch embedding is a {type(model.patch_embed).__name__} (a convolutional stem)"
    if why is not None:
        raise InputError(f"no closed-form GFLOPs count of {type(model).__name__}: {why}; count it with fvcore "
                         "(pipeline flops), and give its K search a latency target or cost: gflops on a ViT/DeiT")


def gflops_cost_model(model: nn.Module, method: str, step: int | None = None,
                      options: dict[str, Any] | None = None) -> CostModel:
    """The GFLOPs of ``model`` (a timm ViT, one image) downsampled by ``method`` with ``options`` (its defaults
    where not given; those its spec declares ``counted`` change the count), as a CostModel, with the pooling step's
    multiply-adds from its ``MethodSpec.flops``.

    Exact at its points (every ``step`` tokens and N; ``step`` default 1 up to 64 tokens, else 8), as
    fvcore counts: linear layers and both attention matmuls, layer norms (5 an element), the patch
    embedding and the head. The norm of a block's tokens out is counted with its MLP half twice: its
    own ``norm2`` and the next block's ``norm1`` (the final norm after the last block), so the curves
    in (n, k) add up exactly.
    """
    spec = method_spec(method)
    if spec.flops is None:
        counted = ", ".join(sorted(name for name, other in METHODS.items() if other.flops is not None))
        raise InputError(f"no closed-form GFLOPs count of method {method!r}'s pooling step (its MethodSpec has no "
                         f"flops); give a latency target with a cost table, or one of {counted}")
    options = spec.resolve(method, options or {})
    first = next(iter(model.blocks))
    check_closed_form(model)
    dim, hidden = model.embed_dim, first.mlp.fc1.out_features
    n_tokens, prefix, depth = model.patch_embed.num_patches, model.num_prefix_tokens, len(list(model.blocks))
    patch = model.patch_embed.proj
    embed = n_tokens * patch.in_channels * patch.kernel_size[0] * patch.kernel_size[1] * dim
    # The heads: a distilled model's second head reads the distillation token (DeiT's VisionTransformerDistilled).
    heads = [getattr(model, name, None) for name in ("head", "head_dist")]
    head = sum(dim * h.out_features for h in heads if isinstance(h, nn.Linear))
    pre_norm = 0 if isinstance(getattr(model, "norm_pre", None), nn.Identity | None) else 1  # CLIP's norm_pre
    points = grid(n_tokens, step or (1 if n_tokens <= 64 else 8))

    def attn(n: int) -> float:  # qkv, Q K^T and A V, projection
        t = n + prefix
        return (3 * t * dim * dim + 2 * t * t * dim + t * dim * dim) / 1e9

    def mlp(k: int) -> float:  # fc1, fc2, and the two norms of the tokens out
        t = k + prefix
        return (2 * t * dim * hidden + 2 * NORM_FLOPS * t * dim) / 1e9

    pool, width = spec.flops, clustered_width(model, options)
    surface = PoolSurface(tuple(points), tuple(
        Curve(tuple(k for k in points if k <= n), tuple(pool(n, k, width, options) / 1e9 for k in points if k <= n))
        for n in points))
    fixed = (embed + head + (1 + pre_norm) * NORM_FLOPS * (n_tokens + prefix) * dim) / 1e9  # the first norm1
    return CostModel("gflops", num_tokens=n_tokens, prefix=prefix, depth=depth, fixed=fixed,
                     attn=Curve(tuple(points), tuple(attn(n) for n in points)),
                     mlp=Curve(tuple(points), tuple(mlp(k) for k in points)), pool=surface,
                     key={"model": type(model).__name__, "embed_dim": dim, "method": method,
                          "options": spec.counted(options)})




def model_flops(name: str, *, embed_dim: int | None = None, method: str = "none", keep: str | None = None,
                level: int | None = None, options: dict[str, Any] | None = None,
                img_size: int | None = None) -> FlopReport:
    """``pipeline flops``: the count of timm model ``name`` (or a DeiT of width ``embed_dim``), built for images of
    ``img_size`` (its default where None), downsampled by ``method`` with ``options`` at ``keep``
    (``"K_1,...,K_L"``) or the paper's sparsity ``level``; InputError for arguments that do not fit together."""
    from pipeline.models import create_model, parse_keep

    if level is not None and keep is not None:
        raise InputError("give --keep or --level, not both")
    if level is not None and embed_dim is not None:
        raise InputError(f"--level holds the paper's keep lists of its models, not of {name} at width "
                         f"{embed_dim}; name the model (e.g. --model deit_e252_patch16_224) or give --keep")
    if embed_dim is not None and embed_dim < 1:
        raise InputError(f"--embed-dim {embed_dim}: a width is at least 1 (DeiT-S is 384)")
    if keep is not None and not downsamples(method):
        raise InputError("--keep without --method keeps every token (method none); give --method too")
    keeps = level_keep(name, level) if level is not None else None if keep is None else parse_keep(keep)
    options = method_spec(method).resolve(method, options or {})
    if img_size is not None and img_size < 1:
        raise InputError(f"--img-size {img_size}: an image is at least 1 pixel a side (DeiT-S takes 224)")
    return count_flops(create_model(name, embed_dim=embed_dim, img_size=img_size, method=method, keep=keeps,
                                    options=options))
