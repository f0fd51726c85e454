"""How fast the clustering converges, per block and method (``pipeline analyze convergence``): the paper says K-Medoids
"requires less than 5 iterations to converge" (Section 4); this measures it on a model's own tokens.

Each method runs on the tokens its block hands the downsampling step (``BlockRecord.mixed``) with ``iters`` = 1 ... T
(the algorithm is deterministic from its initial centres, so the run with t iterations is the state after t). Per t:
the clustering objective, the significance-weighted (for the weighted methods) squared distance of every token to the
output token of its cluster; and whether each image's assignments still change. An image has converged at the first t
from which its assignments stay the same up to T.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline import plots
from pipeline.analysis.probe import AnalysisError, Subject, block_records, normalise, with_method
from pipeline.analysis.reconstruction import layer_ks
from pipeline.methods import build_downsampler, method_spec

CLAIM = "K-Medoids requires less than 5 iterations to converge (Section 4)"
CLUSTERING = ("kmedoids", "wkmedoids", "kmeans", "wkmeans")


def objective(x: Tensor, assign: Tensor, centres: Tensor, weights: Tensor | None) -> Tensor:
    """Per image (B,): sum over tokens of ``w_i ||x_i - centres[assign_i]||^2`` (x (B, N, M), assign (B, N) slots,
    centres (B, K, M), weights (B, N) or None for 1)."""
    picked = torch.gather(centres, 1, assign.clamp(min=0)[..., None].expand(-1, -1, x.shape[-1]))
    per_token = ((x - picked) ** 2).sum(-1)
    return (per_token if weights is None else weights * per_token).sum(-1)


def converged_at(assignments: Sequence[Tensor]) -> Tensor:
    """Per image (B,): the first iteration t (1-based) from which its assignments (one (B, N) tensor per iteration
    1 ... T) stay the same up to T; T + 1 where they changed at the last iteration (still changing)."""
    count, last = len(assignments), assignments[-1]
    stable = torch.ones(last.shape[0], dtype=torch.bool)
    found = torch.full((last.shape[0],), count, dtype=torch.int64)
    for t in range(count - 1, 0, -1):  # iteration t's assignments, walking back while every later one equals the last
        stable &= (assignments[t - 1] == last).all(-1)
        found[stable] = t
    return torch.where(found == count, count + 1, found)


def convergence_rows(subject: Subject, batches: Iterable[np.ndarray], *, methods: Sequence[str],
                     ks: Sequence[int] | None, keep: Sequence[int] | None, iters: int,
                     log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Per block, method and iteration: the mean objective over the images, and the share of images already
    converged; plus each block's and method's median and largest converged-at iteration."""
    if iters < 2:
        raise AnalysisError(f"--iters {iters}: convergence needs at least 2 iterations to compare")
    for method in methods:
        if "iters" not in method_spec(method).options:
            raise AnalysisError(f"--method {method}: it has no iterations (the clustering methods: "
                                f"{', '.join(CLUSTERING)})")
    (_, per_layer), *more = layer_ks(subject, ks=ks, keep=keep)
    if more:
        raise AnalysisError("give one K (--k) or a keep list: convergence is measured at one setting")
    net = with_method(subject, "none", None)
    steps = {(m, t): build_downsampler(m, iters=t) for m in methods for t in range(1, iters + 1)}
    sums: dict[tuple[int, str], np.ndarray] = {}
    converged: dict[tuple[int, str], list[Tensor]] = {}
    images = 0
    for batch in batches:
        for record in block_records(net, normalise(subject, batch)):
            k = per_layer[record.layer]
            if k is None:
                continue
            for method in methods:
                weights = record.scores if method.startswith("w") else None
                results = [steps[method, t](record.mixed, k, scores=record.scores, metric=record.keys)
                           for t in range(1, iters + 1)]
                values = torch.stack([objective(record.mixed, r.assign, r.tokens, weights) for r in results], 1)
                key = (record.layer, method)
                sums[key] = sums.get(key, 0) + values.sum(0).double().numpy()
                converged.setdefault(key, []).append(converged_at([r.assign for r in results]))
        images += batch.shape[0]
        log(f"[convergence] {images} images")
    if images == 0:
        raise AnalysisError("no images to analyse")
    rows = []
    for (layer, method), total in sorted(sums.items()):
        at = torch.cat(converged[layer, method])
        for t in range(1, iters + 1):
            rows.append({"layer": layer + 1, "method": method, "k": per_layer[layer], "iteration": t,
                         "objective": total[t - 1] / images, "relative_objective": total[t - 1] / total[0],
                         "converged": float((at <= t).double().mean()), "median_converged_at": float(at.median()),
                         "max_converged_at": int(at.max()), "images": images})
    return rows


def summary_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per block and method: K, the median and largest iteration at which an image's assignments stopped
    changing (a value above the iterations run: still changing at the last), and the share converged by 4."""
    out = []
    for row in rows:
        if row["iteration"] == 1:
            by_four = next(r["converged"] for r in rows if (r["layer"], r["method"]) == (row["layer"], row["method"])
                           and r["iteration"] == min(4, max(x["iteration"] for x in rows)))
            out.append({"layer": row["layer"], "method": row["method"], "k": row["k"],
                        "median_converged_at": row["median_converged_at"], "max_converged_at": row["max_converged_at"],
                        "converged_by_4": by_four})
    return out


def plot_convergence(rows: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """The objective relative to its first iteration against the iteration, one line per block and method."""
    fig, ax = plots.chart(title, "iteration", "objective / objective after 1 iteration")
    lines = list(dict.fromkeys((r["method"], r["layer"]) for r in rows))
    methods = list(dict.fromkeys(m for m, _ in lines))
    for method, layer in lines:
        points = [(r["iteration"], r["relative_objective"]) for r in rows if (r["method"], r["layer"]) == (method,
                                                                                                       layer)]
        index = methods.index(method)
        ax.plot([t for t, _ in points], [v for _, v in points], marker=plots.style(index)[0], color=f"C{index}",
                alpha=0.4 + 0.6 * layer / max(r["layer"] for r in rows), label=f"{method}, block {layer}")
    ax.axvline(4, color="black", linestyle=":", linewidth=1, label="the paper: under 5 iterations")
    return plots.save(fig, path, legend_ax=ax, fontsize=6, ncol=2)
