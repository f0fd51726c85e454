"""The project's one set of matplotlib helpers (the report, the analyses, the cluster maps), and its
results-table helpers (CSV in and out): headless, labelled axes, styles that survive grayscale."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Distinguishable in grayscale: markers and line styles carry the series as well as the colour.
STYLES = ["o-", "s--", "^-.", "D:", "v-", "P--", "X-.", "*:", "h-", "<--"]


def style(index: int) -> str:
    """Marker and line style of the index-th curve."""
    return STYLES[index % len(STYLES)]


def figure(rows: int = 1, cols: int = 1, *, width: float = 4.6, height: float = 3.4, dpi: int = 100,
           grid: bool = True):
    """A grid of axes (always 2-D) on the Agg backend, each with a light grid unless ``grid`` is False."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.4), dpi=dpi, squeeze=False)
    if grid:
        for ax in axes.flat:
            ax.grid(alpha=0.3)
    return fig, axes


def chart(title: str, xlabel: str, ylabel: str):
    """One labelled panel, 7 x 4.5 inches: the report's line plots."""
    fig, axes = figure(width=7, height=4.1, dpi=120)
    ax = axes[0, 0]
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig, ax


def save(fig, path: Path, *, legend_ax=None, title: str | None = None, below: bool = False, fontsize: int = 8,
         ncol: int = 1, top: float = 0.95) -> Path:
    """Writes the figure and closes it. ``legend_ax``'s legend goes inside that panel, or under all panels
    with ``below``; ``title`` is the figure's title, with ``top`` the share of the height left to panels."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title, fontsize=10)
    rect = (0, 0, 1, top if title is not None else 1)
    if legend_ax is not None and below:
        handles, labels = legend_ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=fontsize)
        rect = (0, 0.04 + 0.06 * -(-len(labels) // 3), 1, rect[3])
    elif legend_ax is not None:
        legend_ax.legend(fontsize=fontsize, ncol=ncol)
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_csv(rows: Sequence[dict[str, Any]], path: Path, columns: Sequence[str]) -> Path:
    """Rows as CSV with the given columns (lists as JSON); other keys are left out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    return path
