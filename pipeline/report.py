"""Results tables and plots of an experiment: the paper's Figures 1b/3 (top-1 vs GFLOPs per method),
Figure 4 (per width) and the K lists per sparsity level, as CSV, PNG and a markdown report."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.pareto import Point, best_at_budgets, pareto_front

COLUMNS = ["arch", "level", "method", "keep", "gflops", "top1", "images_per_s", "train_top1", "checkpoint",
           "stage_id", "run_id", "analysis"]
# Distinguishable in grayscale: markers and line styles carry the method as well as the colour.
STYLES = ["o-", "s--", "^-.", "D:", "v-", "P--", "X-.", "*:", "h-", "<--"]


def write_csv(rows: Sequence[dict[str, Any]], path: Path, columns: Sequence[str] = COLUMNS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    return path


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The results table back, with numbers and keep lists parsed."""
    rows = []
    with path.open() as handle:
        for row in csv.DictReader(handle):
            for key in ("gflops", "top1", "images_per_s", "train_top1"):
                row[key] = float(row[key]) if row.get(key) not in (None, "", "None") else None
            row["keep"] = json.loads(row["keep"]) if row.get("keep") not in (None, "", "None") else None
            rows.append(row)
    return rows


def points(rows: Sequence[dict[str, Any]]) -> list[Point]:
    return [Point(r["stage_id"], r["gflops"], r["top1"]) for r in rows]


def default_budgets(rows: Sequence[dict[str, Any]]) -> list[float]:
    """Eight budgets spread between the cheapest model and the most expensive one."""
    low, high = min(r["gflops"] for r in rows), max(r["gflops"] for r in rows)
    return [round(low + (high - low) * i / 7, 4) for i in range(8)]


def budget_table(rows: Sequence[dict[str, Any]], budgets: Sequence[float]) -> list[dict[str, Any]]:
    """The paper's table of best trade-offs: the best top-1 within each GFLOPs budget, and who reaches it."""
    by_id = {r["stage_id"]: r for r in rows}
    table = []
    for budget, best in best_at_budgets(points(rows), budgets):
        row = by_id[best.id] if best else {}
        table.append({"budget_gflops": budget, "top1": best.top1 if best else None, "method": row.get("method"),
                      "arch": row.get("arch"), "level": row.get("level"), "gflops": best.gflops if best else None})
    return table


def fronts(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The Pareto front overall (key ``all``) and per method."""
    by_id = {r["stage_id"]: r for r in rows}
    out = {"all": [by_id[p.id] for p in pareto_front(points(rows))]}
    for method in sorted({r["method"] for r in rows}):
        out[method] = [by_id[p.id] for p in pareto_front(points([r for r in rows if r["method"] == method]))]
    return out


def _axes(title: str, xlabel: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _curve(ax, points: Sequence[dict[str, Any]], style: str, label: str, **kw: Any) -> None:
    ax.plot([p["gflops"] for p in points], [p["top1"] for p in points], style, label=label, **kw)


def _save(fig, ax, path: Path, fontsize: int = 8, ncol: int = 1) -> Path:
    ax.legend(fontsize=fontsize, ncol=ncol)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Top-1 vs GFLOPs, one curve per method (its Pareto front), the overall front dashed (Figures 1b, 3)."""
    fig, ax = _axes("Top-1 vs GFLOPs (each method's Pareto front)", "GFLOPs per image", "top-1 (%)")
    method_fronts = fronts(rows)
    for index, method in enumerate(m for m in method_fronts if m != "all"):
        _curve(ax, method_fronts[method], STYLES[index % len(STYLES)], method, markersize=5)
    _curve(ax, method_fronts["all"], "-", "overall front", color="black", alpha=0.35, linewidth=4, zorder=0)
    return _save(fig, ax, path)


def plot_widths(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per width: the no-downsampling baselines, and each method's front (Figure 4)."""
    fig, ax = _axes("Token downsampling vs a narrower model (per width)", "GFLOPs per image", "top-1 (%)")
    baselines = sorted((r for r in rows if r["method"] == "none"), key=lambda r: r["gflops"])
    _curve(ax, baselines, "k*-", "no downsampling (width sweep)", markersize=10)
    for index, arch in enumerate(sorted({r["arch"] for r in rows})):
        arch_rows = [r for r in rows if r["arch"] == arch and r["method"] != "none"]
        front = fronts(arch_rows)["all"] if arch_rows else []
        _curve(ax, front, STYLES[index % len(STYLES)], f"{arch}: best downsampling", markersize=5)
    return _save(fig, ax, path)


def plot_keep_lists(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """The keep list K_l of every (width, level)."""
    fig, ax = _axes("Keep lists per sparsity level", "block", "tokens kept (K_l)")
    seen = set()
    index = 0
    for r in rows:
        if r["keep"] is None or (r["arch"], r["level"]) in seen:
            continue
        seen.add((r["arch"], r["level"]))
        ax.plot(range(1, len(r["keep"]) + 1), r["keep"], STYLES[index % len(STYLES)], label=f"{r['arch']} {r['level']}",
                markersize=4)
        index += 1
    return _save(fig, ax, path, fontsize=7, ncol=2)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4f}" if value < 10 else f"{value:.2f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(rows: Sequence[dict[str, Any]], out_dir: Path, budgets: Sequence[float] | None = None,
                 title: str = "Experiment report") -> dict[str, Path]:
    """Writes results.csv, pareto.csv, budgets.csv, three plots and report.md into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda r: (r["arch"], r["method"], -r["gflops"]))
    budgets = list(budgets) if budgets else default_budgets(rows)
    front = fronts(rows)["all"]
    table = budget_table(rows, budgets)
    files = {
        "results": write_csv(ordered, out_dir / "results.csv"),
        "pareto": write_csv(front, out_dir / "pareto.csv"),
        "budgets": write_csv(table, out_dir / "budgets.csv", ["budget_gflops", "top1", "method", "arch", "level",
                                                              "gflops"]),
        "tradeoff_plot": plot_tradeoff(rows, out_dir / "tradeoff.png"),
        "width_plot": plot_widths(rows, out_dir / "widths.png"),
        "keep_plot": plot_keep_lists(rows, out_dir / "keep_lists.png"),
    }
    shown = ["arch", "level", "method", "gflops", "top1", "images_per_s"]
    text = [f"# {title}", "", "## Pareto front (GFLOPs lower, top-1 higher)", "", markdown_table(front, shown), "",
            "## Best top-1 within a GFLOPs budget", "",
            markdown_table(table, ["budget_gflops", "top1", "method", "arch", "level", "gflops"]), "",
            "## Plots", "", "![top-1 vs GFLOPs](tradeoff.png)", "", "![per width](widths.png)", "",
            "![keep lists](keep_lists.png)", "", "## All models", "", markdown_table(ordered, shown + ["keep"]), ""]
    analysed = [r for r in ordered if r.get("analysis")]
    if analysed:
        text += ["## Analysis artifacts", "",
                 "Per model (MLflow artifacts): cluster maps of validation images (`maps/`), token redundancy per "
                 "block (`redundancy.png`, `.csv`) and each method's eq. 2 reconstruction error at the model's keep "
                 "list (`reconstruction.png`, `.csv`).", "",
                 markdown_table([r | {"analysis": f"[{r['analysis']}]({r['analysis']})"} for r in analysed],
                                ["arch", "level", "method", "analysis"]), ""]
    files["report"] = out_dir / "report.md"
    files["report"].write_text("\n".join(text))
    return files
