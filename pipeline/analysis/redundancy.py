"""How redundant a network's tokens are, per block (the paper's Section 3.3: attention is a low-pass filter).

Per block and per point in the block (its input, the attention branch's output, and their sum, which
the downsampling step receives), over the non-prefix tokens of each image:

- the mean pairwise cosine similarity;
- the fewest clusters whose K-Means (Token Pooling's own, eq. 6-7, initialised at the K most
  significant tokens) reconstructs 90% and 99% of the token variance, by eq. 2's error.

If attention smooths its input, its output needs fewer clusters and is more self-similar than the
block input. With normalised queries and keys (Appendix F; the model's own, or imposed with a fixed
alpha) the same numbers show how the normalisation changes the filtering.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.analysis.probe import AnalysisError, Subject, block_records, normalise, with_method
from pipeline.analysis.reconstruction import nn_error, token_variance
from pipeline.plots import figure, save, style
from pipeline.pooling import token_pool

STAGES = {"before": "block input", "attended": "attention output", "mixed": "input + attention"}
FRACTIONS = (0.9, 0.99)
COLUMNS = ["attention", "layer", "stage", "tokens", "images", "mean_cosine", "k90", "k99"]
_GRID_BELOW = 64  # every K up to this many tokens; a geometric grid of K above


def mean_cosine(x: Tensor) -> Tensor:
    """Mean cosine similarity over distinct token pairs: x (B, N, M) -> (B,)."""
    n = x.shape[1]
    if n < 2:
        raise AnalysisError("mean pairwise similarity needs at least two tokens")
    u = F.normalize(x.double(), dim=-1)
    sim = u @ u.transpose(1, 2)
    return (sim.sum((1, 2)) - sim.diagonal(dim1=1, dim2=2).sum(-1)) / (n * (n - 1))


def k_grid(num_tokens: int) -> list[int]:
    """The K values tried: all of 1..N for small N, else about 48 values spread geometrically."""
    if num_tokens <= _GRID_BELOW:
        return list(range(1, num_tokens + 1))
    return sorted({int(k) for k in np.unique(np.round(np.geomspace(1, num_tokens, 48)))} | {num_tokens})


def clusters_needed(x: Tensor, scores: Tensor, *, fractions: Sequence[float] = FRACTIONS,
                    ks: Sequence[int] | None = None, iters: int = 5) -> dict[float, Tensor]:
    """Per image, the smallest K on the grid whose K-Means keeps ``fraction`` of the token variance.

    x (B, N, M), scores (B, N) (the K-Means initialisation) -> {fraction: (B,) float}; N where
    no smaller K reaches it.
    """
    b, n, _ = x.shape
    variance = token_variance(x).clamp_min(1e-30)
    needed = {f: torch.full((b,), float(n), dtype=torch.float64) for f in fractions}
    for k in reversed(ks or k_grid(n)):  # descending: the last K that reaches a fraction is the smallest
        if k >= n:
            continue
        y = token_pool(x, k, method="kmeans", init="topk", init_scores=scores, iters=iters, validate=False).tokens
        kept = 1.0 - nn_error(x, y) / variance
        for f in fractions:
            needed[f] = torch.where(kept >= f, torch.tensor(float(k), dtype=torch.float64), needed[f])
    return needed


def redundancy_rows(subject: Subject, batches: Iterable[np.ndarray], *, qk_alpha: float | None = None,
                    log=print) -> list[dict[str, Any]]:
    """Per block and stage, the mean cosine similarity and clusters needed for 90% / 99% of the variance,
    averaged over every image of ``batches`` (uint8 (B, R, R, 3) arrays).

    ``qk_alpha`` imposes L2-normalised queries and keys with that fixed alpha on the trained weights
    (Appendix F) instead of the model's own attention.
    """
    variant = None if qk_alpha is None else {**subject.variant, "qk_norm": "fixed", "alpha": qk_alpha}
    net = with_method(subject, "none", None, variant=variant)
    own = subject.variant.get("qk_norm")
    attention = (f"normalised qk, alpha {qk_alpha:g} (imposed)" if qk_alpha is not None
                 else f"normalised qk ({own})" if own else "softmax(qk / sqrt(d))")
    sums: dict[tuple[int, str], np.ndarray] = {}
    images = 0
    for index, batch in enumerate(batches):
        for record in block_records(net, normalise(subject, batch)):
            for stage in STAGES:
                x = getattr(record, stage)
                needed = clusters_needed(x, record.scores)
                values = np.array([float(mean_cosine(x).sum())] + [float(needed[f].sum()) for f in FRACTIONS])
                sums[(record.layer, stage)] = sums.get((record.layer, stage), 0) + values
        images += batch.shape[0]
        log(f"[redundancy] batch {index + 1}: {images} images")
    if images == 0:
        raise AnalysisError("no images to analyse")
    order = list(STAGES)
    return [{"attention": attention, "layer": layer + 1, "stage": stage, "tokens": subject.num_tokens,
             "images": images, "mean_cosine": cos / images, "k90": k90 / images, "k99": k99 / images}
            for (layer, stage), (cos, k90, k99) in sorted(sums.items(), key=lambda kv: (kv[0][0],
                                                                                        order.index(kv[0][1])))]


def plot_redundancy(rows: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Mean cosine similarity, and clusters for 90% and for 99% of the variance, vs block (three panels)."""

    panels = (("mean_cosine", "mean pairwise cosine similarity"),
              ("k90", f"clusters for 90% of the variance (of {rows[0]['tokens']})"),
              ("k99", f"clusters for 99% of the variance (of {rows[0]['tokens']})"))
    fig, axes = figure(1, len(panels))
    curves = list(dict.fromkeys((r["attention"], r["stage"]) for r in rows))
    several = len({a for a, _ in curves}) > 1
    for ax, (key, label) in zip(axes[0], panels):
        for i, (attention, stage) in enumerate(curves):
            points = [r for r in rows if r["attention"] == attention and r["stage"] == stage]
            ax.plot([p["layer"] for p in points], [p[key] for p in points], style(i),
                    label=STAGES[stage] + (f" [{attention}]" if several else ""))
        ax.set_xlabel("block")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["layer"] for r in rows}))
    return save(fig, path, legend_ax=axes[0, 0], title=title, below=True)
