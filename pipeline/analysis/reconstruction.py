"""Reconstruction error by method (the paper's eq. 2): how well each method's K tokens stand for all N.

At every block of the plain network, each method downsamples the same tokens (what the block's
downsampling step would receive: input plus attention output), and the error is that of the
nearest-neighbour upsampling of its K outputs back to the N inputs. This is the quantity Token
Pooling minimises, measured per layer on real inputs; all methods see the same unpooled stream, so
the numbers compare the operators, not the networks finetuned around them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.analysis.probe import AnalysisError, Subject, block_records, normalise, with_method
from pipeline.methods import METHODS, build_downsampler
from pipeline.plots import figure, save, style


def default_methods() -> tuple[str, ...]:
    """The registered methods that downsample off the shelf (``MethodSpec.reconstructs``)."""
    return tuple(name for name, spec in METHODS.items() if spec.reconstructs)

COLUMNS = ["setting", "layer", "method", "k", "tokens", "images", "error", "relative_error", "weighted_error",
           "weighted_relative_error"]


def nn_error(x: Tensor, y: Tensor, weights: Tensor | None = None) -> Tensor:
    """Eq. 2 per image: mean over tokens of ``min_j ||x_i - y_j||^2`` (weighted by ``weights`` if given).

    x (B, N, M), y (B, K, M), weights (B, N) non-negative -> (B,).
    """
    d = torch.cdist(x.double(), y.double(), compute_mode="donot_use_mm_for_euclid_dist").pow(2).amin(-1)  # (B, N)
    if weights is None:
        return d.mean(-1)
    w = weights.double()
    return (d * w).sum(-1) / w.sum(-1).clamp_min(1e-30)


def token_variance(x: Tensor, weights: Tensor | None = None) -> Tensor:
    """Per image, the (weighted) mean squared distance of the tokens to their (weighted) mean: (B,)."""
    x = x.double()
    if weights is None:
        return (x - x.mean(1, keepdim=True)).pow(2).sum(-1).mean(-1)
    w = weights.double() / weights.double().sum(-1, keepdim=True).clamp_min(1e-30)
    centre = (w.unsqueeze(-1) * x).sum(1, keepdim=True)
    return ((x - centre).pow(2).sum(-1) * w).sum(-1)


def check_methods(methods: Sequence[str]) -> list[str]:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise AnalysisError(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    learned = [m for m in methods if METHODS[m].learnable]
    if learned:
        raise AnalysisError(f"{', '.join(learned)} has learned weights per finetuned model and no off-the-shelf "
                            "output; leave it out")
    return list(methods)


def check_ks(ks: Sequence[int], num_tokens: int) -> list[int]:
    bad = [k for k in ks if not 1 <= k <= num_tokens]
    if bad:
        raise AnalysisError(f"K {bad} out of range: the model has {num_tokens} tokens per image; use 1..{num_tokens}")
    return sorted(set(ks))


def layer_ks(subject: Subject, *, ks: Sequence[int] | None, keep: Sequence[int] | None
             ) -> list[tuple[str, list[int | None]]]:
    """(setting label, K per block or None to skip) for fixed ``ks``, or for a model's ``keep`` list."""
    n, depth = subject.num_tokens, subject.depth
    if (ks is None) == (keep is None):
        raise AnalysisError("give either K values (--k) or a keep list")
    if keep is not None:
        if len(keep) != depth:
            raise AnalysisError(f"the keep list has {len(keep)} entries; the model has {depth} blocks")
        return [(f"keep {','.join(map(str, keep))}", [k if 0 < k < n else None for k in keep])]
    return [(f"K = {k}", [k] * depth) for k in check_ks(ks, n)]


def reconstruction_rows(subject: Subject, batches: Iterable[np.ndarray], *, methods: Sequence[str] | None = None,
                        ks: Sequence[int] | None = None, keep: Sequence[int] | None = None, seed: int = 0,
                        log=print) -> list[dict[str, Any]]:
    """Per setting, layer and method: eq. 2's error, its significance-weighted version, and both
    relative to the tokens' variance, over every image of ``batches`` (uint8 (B, R, R, 3) arrays).

    A setting is one K at every block (``ks``) or a model's keep list (``keep``: K_l at block l;
    blocks that keep all tokens or none are left out).
    """
    methods = check_methods(default_methods() if methods is None else methods)
    settings = layer_ks(subject, ks=ks, keep=keep)
    net = with_method(subject, "none", None)
    steps = {m: build_downsampler(m) for m in methods}
    generator = torch.Generator().manual_seed(seed)
    sums: dict[tuple[int, int, str], np.ndarray] = {}
    var = np.zeros((subject.depth, 2))
    images = 0
    for index, batch in enumerate(batches):
        for record in block_records(net, normalise(subject, batch)):
            x, scores = record.mixed, record.scores
            var[record.layer] += [float(token_variance(x).sum()), float(token_variance(x, scores).sum())]
            for s, (_, per_layer) in enumerate(settings):
                k = per_layer[record.layer]
                if k is None:
                    continue
                for method, step in steps.items():
                    y = step(x, k, scores=scores, metric=record.keys, generator=generator).tokens
                    key = (s, record.layer, method)
                    sums[key] = sums.get(key, 0) + np.array([float(nn_error(x, y).sum()),
                                                             float(nn_error(x, y, scores).sum())])
        images += batch.shape[0]
        log(f"[reconstruction] batch {index + 1}: {images} images")
    if images == 0:
        raise AnalysisError("no images to analyse")
    return [{"setting": settings[s][0], "layer": layer + 1, "method": method, "k": settings[s][1][layer],
             "tokens": subject.num_tokens, "images": images, "error": err / images,
             "relative_error": err / var[layer, 0], "weighted_error": werr / images,
             "weighted_relative_error": werr / var[layer, 1]}
            for (s, layer, method), (err, werr) in sorted(sums.items())]


def plot_reconstruction(rows: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Relative error vs block, one curve per method; a column per K, unweighted above, weighted below."""

    settings = list(dict.fromkeys(r["setting"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = figure(2, len(settings))
    for col, setting in enumerate(settings):
        for row, (key, what) in enumerate((("relative_error", "eq. 2 error"),
                                           ("weighted_relative_error", "weighted eq. 2 error"))):
            ax = axes[row, col]
            for i, method in enumerate(methods):
                points = [r for r in rows if r["method"] == method and r["setting"] == setting]
                ax.plot([p["layer"] for p in points], [p[key] for p in points], style(i), label=method)
            ax.set_title(f"{setting} (of {rows[0]['tokens']} tokens)", fontsize=9)
            ax.set_xlabel("block")
            ax.set_ylabel(f"{what} / token variance")
            ax.set_xticks(sorted({r["layer"] for r in rows}))
    return save(fig, path, legend_ax=axes[0, 0], title=title)
