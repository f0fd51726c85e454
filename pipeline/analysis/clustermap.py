"""Cluster maps (the paper's Figures 1c and 2): which original patches each token stands for, drawn over the image.

Each block's ``assign`` maps its incoming tokens to its outgoing ones (-1: dropped). Composing them
from block 1 traces every output token back to the patches it came from, through merges (ToMe,
carry) and through every layer; a patch whose token was dropped by a selection method stays -1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipeline import plots
from pipeline.analysis.probe import Subject, block_records, check_layers, normalise, with_method
from pipeline.models.downsampling import BlockRecord

# Cluster colours: spread over a perceptually uniform map whose lightness rises monotonically
# (survives grayscale); consecutive ids land far apart in lightness (golden-ratio stride).
COLOURMAP = "viridis"
_GOLDEN = 0.6180339887
DROPPED_RGB = np.array([0.12, 0.12, 0.12])


def patch_groups(records: Sequence[BlockRecord], num_tokens: int) -> Tensor:
    """Group of each original patch after each block: (L, B, N) int64, -1 where it was dropped.

    Group ids after block l index that block's output tokens, so two patches share a group exactly
    when they end up in the same token.
    """
    b = records[0].before.shape[0]
    group = torch.arange(num_tokens).expand(b, num_tokens).clone()
    out = []
    for record in records:
        if record.assign is not None:
            assign = record.assign.cpu()
            group = torch.where(group >= 0, assign.gather(1, group.clamp(min=0)), torch.full_like(group, -1))
        out.append(group.clone())
    return torch.stack(out)


def group_colours(groups: np.ndarray) -> np.ndarray:
    """RGB (N, 3) in [0, 1] for group ids (N,): one colour per group, dark grey for -1."""
    import matplotlib

    cmap = matplotlib.colormaps[COLOURMAP]
    ids = np.unique(groups[groups >= 0])
    rank = {g: i for i, g in enumerate(ids)}  # colours by order of appearance, not by raw slot index
    rgb = np.tile(DROPPED_RGB, (groups.size, 1))
    for i, g in enumerate(groups):
        if g >= 0:
            rgb[i] = cmap(0.1 + 0.85 * ((rank[g] * _GOLDEN) % 1.0))[:3]
    return rgb


def render_map(image: np.ndarray, groups: np.ndarray, grid: tuple[int, int], *, scale: int, alpha: float = 0.5
               ) -> np.ndarray:
    """The image (R, R, 3) uint8 with its patch groups (N,) overlaid -> (R*scale, R*scale, 3) float in [0, 1].

    Each group is tinted with its colour, dropped patches are darkened, and a border is drawn
    wherever two neighbouring pixels belong to different groups.
    """
    rows, cols = grid
    big = np.repeat(np.repeat(image.astype(np.float64) / 255.0, scale, 0), scale, 1)
    h, w = big.shape[:2]
    ph, pw = h // rows, w // cols
    labels = np.repeat(np.repeat(groups.reshape(rows, cols), ph, 0), pw, 1)[:h, :w]
    colours = np.repeat(np.repeat(group_colours(groups).reshape(rows, cols, 3), ph, 0), pw, 1)[:h, :w]
    dropped = (labels < 0)[..., None]
    out = np.where(dropped, 0.25 * big + 0.75 * colours, (1 - alpha) * big + alpha * colours)
    edge = np.zeros((h, w), dtype=bool)  # both pixels of each differing pair: visible at 100% zoom
    across = labels[:, 1:] != labels[:, :-1]
    edge[:, 1:] |= across
    edge[:, :-1] |= across
    down = labels[1:, :] != labels[:-1, :]
    edge[1:, :] |= down
    edge[:-1, :] |= down
    out[edge] = 1.0
    return np.clip(out, 0.0, 1.0)


def _figure(cols: int, rows: int = 1, cell: float = 2.4):
    return plots.figure(rows, cols, width=cell, height=cell + 0.1, grid=False)


def _panel(ax, picture: np.ndarray, title: str) -> None:
    ax.imshow(picture, interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def _tokens_left(groups: np.ndarray) -> str:
    kept = np.unique(groups[groups >= 0]).size
    dropped = int((groups < 0).sum())
    return f"{kept} tokens" + (f", {dropped} patches dropped" if dropped else "")


def layer_figure(image: np.ndarray, groups: Mapping[int, np.ndarray], grid: tuple[int, int], *, title: str,
                 scale: int, path: Path) -> Path:
    """One image, one method: the input and its map after each chosen block (1-based keys) -> PNG."""
    fig, axes = _figure(len(groups) + 1)
    _panel(axes[0, 0], np.repeat(np.repeat(image, scale, 0), scale, 1), "input")
    for ax, (layer, g) in zip(axes[0, 1:], groups.items()):
        _panel(ax, render_map(image, g, grid, scale=scale), f"after block {layer}\n{_tokens_left(g)}")
    return plots.save(fig, path, title=title, top=0.92)  # room for two-line panel titles


def sheet_figure(image: np.ndarray, by_method: Mapping[str, np.ndarray], grid: tuple[int, int], *, layer: int,
                 scale: int, path: Path, title: str) -> Path:
    """One image, every method at the same block, side by side (Figure 2) -> PNG."""
    fig, axes = _figure(len(by_method) + 1)
    _panel(axes[0, 0], np.repeat(np.repeat(image, scale, 0), scale, 1), "input")
    for ax, (method, g) in zip(axes[0, 1:], by_method.items()):
        _panel(ax, render_map(image, g, grid, scale=scale), f"{method}\n{_tokens_left(g)}")
    return plots.save(fig, path, title=f"{title}: after block {layer}", top=0.92)


def default_layers(depth: int, most: int = 4) -> list[int]:
    """Up to ``most`` blocks spread evenly, the last included (1-based)."""
    return sorted({round(depth * (i + 1) / min(most, depth)) for i in range(min(most, depth))})


def display_scale(res: int, target: int = 160) -> int:
    """Integer upscaling that shows a ``res``-pixel image at about ``target`` pixels (1 for large images)."""
    return max(1, round(target / res))


def cluster_maps(subject: Subject, images: np.ndarray, names: Sequence[str], *, methods: Sequence[str],
                 keep: Sequence[int], layers: Sequence[int], out: Path, sheet_layer: int | None = None,
                 log=print) -> list[Path]:
    """Writes ``{name}_{method}.png`` (the chosen blocks) per image and method, and ``{name}_sheet.png``
    (every method after ``sheet_layer``, default the middle chosen layer) per image.

    images: uint8 (B, R, R, 3) at the subject's resolution; names: B file stems.
    """
    layers = check_layers(layers, subject.depth)
    sheet_layer = layers[len(layers) // 2] if sheet_layer is None else check_layers([sheet_layer], subject.depth)[0]
    inputs, scale = normalise(subject, images), display_scale(subject.res)
    keep_text = ",".join(map(str, keep))
    written, at_sheet = [], {name: {} for name in names}
    nets = {method: with_method(subject, method, keep) for method in methods}  # every method checked first
    for method, net in nets.items():
        groups = patch_groups(block_records(net, inputs), subject.num_tokens).numpy()
        for i, name in enumerate(names):
            title = f"{subject.label}: {method}, K = {keep_text}"
            chosen = {layer: groups[layer - 1, i] for layer in layers}
            written.append(layer_figure(images[i], chosen, subject.grid, title=title, scale=scale,
                                        path=out / f"{name}_{method}.png"))
            at_sheet[name][method] = groups[sheet_layer - 1, i]
        log(f"[viz] {method}: {len(names)} image(s)")
    for i, name in enumerate(names):
        written.append(sheet_figure(images[i], at_sheet[name], subject.grid, layer=sheet_layer, scale=scale,
                                    path=out / f"{name}_sheet.png", title=f"{subject.label}, K = {keep_text}"))
    return written
