"""Line plots of the analyses: labelled axes, one legend, and styles that survive grayscale."""

from __future__ import annotations

from pathlib import Path

from pipeline.report import STYLES


def figure(rows: int, cols: int, *, width: float = 4.6, height: float = 3.4):
    """A grid of axes (always 2-D) at 100 dpi, each with a light grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.4), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    return fig, axes


def style(index: int) -> str:
    """Marker and line style of the index-th curve (colour alone would not survive grayscale)."""
    return STYLES[index % len(STYLES)]


def save(fig, legend_ax, path: Path, *, title: str, below: bool = False) -> Path:
    """Writes the figure; the legend of ``legend_ax`` goes inside it, or under all panels with ``below``."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    if below:
        handles, labels = legend_ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
        rows = -(-len(labels) // 3)
        fig.tight_layout(rect=(0, 0.04 + 0.06 * rows, 1, 0.95))
    else:
        legend_ax.legend(fontsize=8)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
