"""What the analyses look at: a trained network, its inputs, and what each of its blocks did.

A ``Subject`` is the plain network (no downsampling) of a ``pipeline train`` checkpoint or of a timm
model name, plus the variant it was trained with (carry, normalised queries and keys), so that any
method can be applied to it off the shelf with ``with_method``. Inputs come from image files or
from the first images of a ``.beton``; ``block_records`` runs the network once and returns the
``BlockRecord`` of every block (``DownsamplingBlocks.recorder``). ``method_model`` is the network with a method at
a keep list or level (what ``pipeline export`` and ``bench onnx`` take), ``subject_images`` images to check it on.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from PIL import Image
from torch import Tensor, nn

from pipeline.errors import InputError, PipelineError
from pipeline.methods import GRID_CONV, downsamples, method_spec
from pipeline.models import DownsamplingBlocks, apply_downsampling, create_model, parse_keep
from pipeline.models.downsampling import BlockRecord
from pipeline.models.weights import load_state
from pipeline.sparsity import level_keep
from pipeline.train.checkpoint import CheckpointError, model_from_checkpoint


class AnalysisError(PipelineError, ValueError):
    """Bad input to an analysis: a missing image, an impossible layer, an unusable checkpoint."""


@dataclass(frozen=True)
class Subject:
    """A network to analyse, without downsampling, and what it needs of its inputs.

    Attributes:
        model: the plain timm ViT in eval mode (never modified; ``with_method`` copies it).
        state: its state dict, reloaded after a method adds parameters (alpha, conv weights).
        variant: ``carry``, ``qk_norm`` and ``alpha`` it was trained with (a base model: its ``qk_norm`` and
            ``alpha`` where it has them, else empty).
        options: its method's options as trained (``cluster_on``, ``iters``, ...), empty for a base model.
        method, keep: the downsampling it was finetuned with, or ``None`` for a base model.
        res, mean, std, crop_pct: the input size, normalisation and validation crop (timm's data config).
        grid: the patch grid (rows, columns); patch: the patch side in pixels.
        label: where it came from, for titles.
        val: the validation ``.beton`` of its training config, if it has one.
        name: the timm model name it was built as.
    """

    model: nn.Module
    state: dict[str, Any]
    res: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_pct: float
    grid: tuple[int, int]
    patch: int
    label: str
    method: str | None = None
    keep: list[int] | None = None
    variant: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    val: str | None = None
    name: str = ""  # the timm model name it was built as (what the paper's sparsity levels are keyed by)

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def _subject(model: nn.Module, state: dict[str, Any], label: str, **extra: Any) -> Subject:
    cfg = timm.data.resolve_model_data_config(model)
    grid = tuple(int(g) for g in model.patch_embed.grid_size)
    return Subject(model=model.eval(), state=state, res=int(cfg["input_size"][-1]), mean=tuple(cfg["mean"]),
                   std=tuple(cfg["std"]), crop_pct=float(cfg["crop_pct"]), grid=grid,
                   patch=int(model.patch_embed.patch_size[0]), label=label, **extra)


def load_subject(checkpoint: str | Path | None = None, model: str | None = None,
                 weights: str | Path | None = None) -> Subject:
    """The network of a ``pipeline train`` checkpoint, or a timm model by name (``weights``: a state-dict file).

    A finetuned checkpoint keeps its weights and variant but loses its downsampling, which
    ``with_method`` puts back (its own method by default).
    """
    if (checkpoint is None) == (model is None):
        raise AnalysisError("give exactly one of --checkpoint (a `pipeline train` checkpoint) or --model (a timm name)")
    if model is not None:
        net = create_model(model, weights=weights)
        return _subject(net, net.state_dict(), model if weights is None else f"{model} ({Path(weights).name})",
                        name=model)
    return _checkpoint_subject(Path(checkpoint))


def _checkpoint_subject(path: Path) -> Subject:
    try:
        net, config, state = model_from_checkpoint(path, plain=True)
    except CheckpointError as err:
        raise AnalysisError(str(err)) from None
    mode, model = config.train.mode, config.model
    extra: dict[str, Any] = {}
    if model.qk_norm is not None:
        extra["variant"] = {"qk_norm": model.qk_norm, "alpha": model.alpha}
    if mode == "finetune":
        pool = config.pooling
        extra = {"method": pool.method, "keep": state.get("keep"),
                 "variant": {"carry": pool.carry, "qk_norm": model.qk_norm, "alpha": model.alpha},
                 "options": pool.method_options()}
    return _subject(net, state["model"], f"{config.train.name or path.name} ({mode})", val=config.data.val,
                    name=model.name, **extra)


def with_method(subject: Subject, method: str, keep: Sequence[int] | None, *,
                variant: dict[str, Any] | None = None, **options: Any) -> nn.Module:
    """A copy of the subject's network with ``method`` at ``keep`` in every block.

    ``variant`` (carry, qk_norm, alpha) defaults to the one the subject was trained with, and so do
    the method's options when ``method`` is the subject's own (a ToMe model matched on tokens stays so).
    """

    net = copy.deepcopy(subject.model)
    if isinstance(net.blocks, DownsamplingBlocks):  # a model with normalised q/k and no pooling: its plain blocks
        net.blocks = nn.Sequential(*net.blocks)
    variant = subject.variant if variant is None else variant
    if not options and method == subject.method:
        options = dict(subject.options)
    apply_downsampling(net, method, None if keep is None else list(keep), **variant, **options)
    load_state(net, subject.state, subject.label)  # learned alpha / conv weights, where the method has them
    return net.eval()


def check_layers(layers: Sequence[int], depth: int) -> list[int]:
    """1-based block indices, validated against the depth."""
    bad = [layer for layer in layers if not 1 <= layer <= depth]
    if bad:
        raise AnalysisError(f"layer(s) {bad} out of range: the model has {depth} blocks, numbered 1..{depth}")
    return list(layers)


@torch.no_grad()
def block_records(net: nn.Module, inputs: Tensor) -> list[BlockRecord]:
    """Runs ``net`` (with ``DownsamplingBlocks``) on inputs (B, 3, R, R); one record per block."""
    blocks = net.blocks
    if not isinstance(blocks, DownsamplingBlocks):
        raise AnalysisError("block_records needs a model with downsampling blocks; use with_method(subject, ...)")
    records: list[BlockRecord] = []
    blocks.recorder = records.append
    try:
        net(inputs)
    finally:
        blocks.recorder = None
    return records


def normalise(subject: Subject, images: np.ndarray) -> Tensor:
    """uint8 images (B, R, R, 3) -> normalised float inputs (B, 3, R, R)."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(subject.mean).view(1, 3, 1, 1)
    std = torch.tensor(subject.std).view(1, 3, 1, 1)
    return (x - mean) / std


def read_images(paths: Sequence[str | Path], res: int) -> np.ndarray:
    """Image files -> uint8 (B, res, res, 3): the shorter side resized to ``res``, then a centre crop."""

    from pipeline.data.sources import read_image

    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise AnalysisError(f"image not found: {path}")
        try:
            rgb = Image.fromarray(read_image(path))
        except (OSError, SyntaxError, ValueError) as err:
            raise AnalysisError(f"{path}: not a readable image ({err})") from None
        scale = res / min(rgb.size)
        size = (max(res, round(rgb.width * scale)), max(res, round(rgb.height * scale)))
        rgb = rgb.resize(size, Image.BICUBIC)
        left, top = (size[0] - res) // 2, (size[1] - res) // 2
        out.append(np.asarray(rgb.crop((left, top, left + res, top + res))))
    return np.stack(out)


def beton_images(beton: str | Path, subject: Subject, *, count: int | None = None, batch: int = 64
                 ) -> Iterator[np.ndarray]:
    """The first ``count`` images (all if None) of a ``.beton`` as uint8 (B, R, R, 3) batches, in file order.

    Read through the validation pipeline (centre crop at the subject's resolution) with the
    identity normalisation, so the batches are the pixels the model's validation loader sees.
    """
    from pipeline.data.loaders import check_dataset, read_pixels

    # A clear error for a missing, truncated or edited file (or its metadata), before FFCV reads it.
    total = int(check_dataset(beton)["num_images"])
    if count is not None and not 1 <= count <= total:
        raise AnalysisError(f"{beton} holds {total} images; asked for {count}")
    yield from read_pixels(beton, subject.res, subject.crop_pct, total if count is None else count, batch)


def first_batches(beton: str | Path, subject: Subject, *, batches: int, batch: int) -> list[np.ndarray]:
    """Up to ``batches`` batches of ``batch`` images from the start of a ``.beton`` (fewer if it is smaller)."""
    from pipeline.data.loaders import read_metadata

    if batches < 1 or batch < 1:
        raise AnalysisError(f"--batches {batches} --batch-size {batch}: both must be >= 1 (the analyses average "
                            "over that many batches of that many images)")

    count = min(batches * batch, int(read_metadata(beton)["num_images"]))
    return list(beton_images(beton, subject, count=count, batch=batch))


def method_model(subject: Subject, *, method: str | None = None, keep: str | None = None, level: int | None = None):
    """A network to export or time: ``subject``'s (``load_subject``: a checkpoint's, with its own method and keep list
    unless given, or a timm model's) with ``method`` at ``keep`` (a comma-separated list) or at the paper's sparsity
    ``level``. Every call copies the one subject: models of several methods share its weights.

    Returns (the model in eval mode, a label for the messages, ``subject``)."""
    if keep is not None and level is not None:
        raise InputError("give --keep K_1,...,K_L or --level N, not both")
    method = method or subject.method or "none"
    method_spec(method)  # InputError naming the registered methods
    if level is not None:
        try:
            keep_list = level_keep(subject.name, level)
        except ValueError as err:
            raise InputError(f"--level: {err}; give --keep K_1,...,K_L") from None
    elif keep is not None:
        keep_list = parse_keep(keep)
    else:
        keep_list = subject.keep if method == subject.method else None
    if downsamples(method) and method != GRID_CONV and keep_list is None:
        raise InputError(f"method {method} needs a keep list: give --keep K_1,...,K_L or --level N")
    if method == subject.method == "none" or (method == "none" and subject.method is None and not subject.variant):
        net = subject.model  # the unmodified network itself
    else:
        net = with_method(subject, method, keep_list)
    where = f" at {','.join(map(str, keep_list))}" if keep_list else ""
    return net.eval(), f"{subject.label} with {method}{where}", subject


def subject_images(subject, beton: str | Path | None, count: int) -> tuple[Tensor, str]:
    """(B, 3, R, R) normalised images to check a model on (an export), and what they are: the first ``count`` of
    ``beton`` (default: the subject's validation data), or ``count`` random ones where there is no data."""
    from pipeline.data.loaders import check_dataset

    beton = beton or subject.val
    if beton is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(count, 3, subject.res, subject.res, generator=generator), "random images (no --check-data)"
    count = min(count, int(check_dataset(beton)["num_images"]))
    if count < 1:
        raise InputError(f"{beton} holds no images to check the model on; give --check-data a .beton with some")
    pixels = np.concatenate(list(beton_images(beton, subject, count=count, batch=min(count, 256))))
    return normalise(subject, pixels), f"images of {beton}"
