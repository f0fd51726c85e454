"""Results tables and plots of an experiment: the paper's Figures 1b/3 (top-1 vs GFLOPs per method),
Figure 4 (per width) and the K lists per sparsity level, as CSV, PNG and a markdown report."""

from __future__ import annotations

import csv
import inspect
import json
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline import plots
from pipeline.errors import InputError
from pipeline.methods import keeps_all
from pipeline.pareto import Measured, Point, best_at_budgets, measured_front, pareto_front
from pipeline.spread import SpreadRecord
from pipeline.stored import Record, read_record


class ResultsRow(Record):
    """A row of results.csv as ``read_csv`` gives it back (numbers and keep lists parsed, an empty cell None or ""):
    every column the select stage writes, in its order, typed. A results.csv of another release or an edited one is
    refused, not read with columns left empty under a report that announces them."""

    arch: str
    level: str
    method: str
    keep: list[int] | None
    gflops: float
    top1: float
    images_per_s: float
    images_per_s_low: float | None
    images_per_s_high: float | None
    speed_ratio: float | None
    speed_ratio_low: float | None
    speed_ratio_high: float | None
    speed_blocks: int | None
    speed_stop: str
    speed_half_width: float | None
    speed_ties: str
    train_top1: float | None
    checkpoint: str
    stage_id: str
    run_id: str
    analysis: str
    speed_setting: str


COLUMNS = list(ResultsRow.model_fields)
SPEED_COLUMNS = ("images_per_s_low", "images_per_s_high", "speed_ratio", "speed_ratio_low", "speed_ratio_high")
# The cost axes of a Pareto front: GFLOPs, or the measured time per image (lower is better for both).
COSTS = {"gflops": lambda r: r["gflops"], "images_per_s": lambda r: 1.0 / r["images_per_s"]}
COST_LABELS = {"gflops": "GFLOPs lower", "images_per_s": "measured images/s higher"}
# The K-search target table: each model of a target's level, its target, predicted and measured cost.
TARGET_COLUMNS = ["arch", "level", "method", "target_unit", "target_cost", "searched", "predicted", "spent",
                  "measured", "speed_blocks", "speed_stop", "speed_half_width", "cost_status", "gflops", "top1"]


# The models evaluated without finetuning (``experiment.no_finetune``): no_finetune.csv and the report's section.
NO_FINETUNE_COLUMNS = ["arch", "level", "method", "carry", "keep", "gflops", "top1", "speed_ratio", "speed_ratio_low",
                       "speed_ratio_high", "speed_blocks", "speed_stop", "speed_half_width", "run_id"]

# Beside results.csv: what else a report was written from (its title, budgets, bases, targets, the speed warning,
# the tie margin and the machine's spread), so that ``rebuild_report`` writes the same report again.
REPORT_INPUTS = "report.json"

EMPTY = (None, "", "None")  # a cell without a value, as write_csv leaves it
REWRITE = "it was not written by this release's `pipeline run`, or was edited; run `pipeline run` again to write it"


def write_csv(rows: Sequence[dict[str, Any]], path: Path, columns: Sequence[str] = COLUMNS) -> Path:
    return plots.write_csv(rows, path, columns)


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The results table back, with numbers and keep lists parsed."""
    rows = []
    with path.open() as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        missing = [column for column in COLUMNS if column not in header]
        extra = [column for column in header if column not in COLUMNS]
        if missing or extra:
            said = ([f"lacks the column(s) {', '.join(missing)}"] if missing else []) + (
                [f"has the column(s) {', '.join(extra)}, which this release does not write"] if extra else [])
            raise InputError(f"{path} {' and '.join(said)}; {REWRITE}")
        for line, row in enumerate(reader, start=2):
            try:
                for key in ("gflops", "top1", "images_per_s", "train_top1", "speed_half_width", *SPEED_COLUMNS):
                    row[key] = float(row[key]) if row.get(key) not in EMPTY else None
                row["speed_blocks"] = int(row["speed_blocks"]) if row.get("speed_blocks") not in EMPTY else None
                row["keep"] = json.loads(row["keep"]) if row.get("keep") not in EMPTY else None
            except (ValueError, TypeError) as err:
                raise InputError(f"{path}, line {line}: a value that is not a number or a keep list ({err}); run "
                                 "`pipeline run` again to write it") from None
            if None in row:  # more cells than columns
                raise InputError(f"{path}, line {line}: more cells than the header has columns; {REWRITE}")
            rows.append(read_record(ResultsRow, row, f"{path}, line {line}", REWRITE).model_dump())
    return rows


def points(rows: Sequence[dict[str, Any]], cost: str = "gflops") -> list[Point]:
    return [Point(r["stage_id"], COSTS[cost](r), r["top1"]) for r in rows]


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
                      "arch": row.get("arch"), "level": row.get("level"), "gflops": best.cost if best else None})
    return table


def speed_text(row: dict[str, Any]) -> str | None:
    """``0.642 [0.631, 0.655] (31 blocks, tolerance, +-1.7%)``: the speed ratio, its interval and what bounded the
    measurement, where the row has them."""
    if row.get("speed_ratio") is None:
        return None
    text = f"{row['speed_ratio']:.3f} [{row['speed_ratio_low']:.3f}, {row['speed_ratio_high']:.3f}]"
    if row.get("speed_stop"):
        text += f" ({row['speed_blocks']} blocks, {row['speed_stop']}, +-{row['speed_half_width']:.1%})"
    return text


def _front(rows: Sequence[dict[str, Any]], cost: str, margin: float = 0.0) -> list[dict[str, Any]]:
    """The Pareto front of ``rows`` over (``cost``, top-1), cheapest first. By measured speed, where the rows carry
    its interval (``images_per_s_low`` / ``_high``), a model is left out only where another beats it beyond the
    intervals and the relative ``margin`` (``pareto.measured_front``), and ``speed_ties`` names the front's models
    it cannot be told from."""
    if cost != "images_per_s" or any(r.get("images_per_s_low") is None for r in rows):
        return _line(rows, cost)
    by_id = {r["stage_id"]: r for r in rows}
    measured = [Measured(r["stage_id"], 1.0 / r["images_per_s_high"], 1.0 / r["images_per_s_low"], r["top1"])
                for r in rows]
    label = {r["stage_id"]: f"{r['arch']}/{r['level']}/{r['method']}" for r in rows}
    return [by_id[m.id] | {"speed_ties": ", ".join(label[t] for t in ties) or None}
            for m, ties in measured_front(measured, margin)]


def fronts(rows: Sequence[dict[str, Any]], cost: str = "gflops",
           margin: float = 0.0) -> dict[str, list[dict[str, Any]]]:
    """The Pareto front overall (key ``all``) and per method, over (``cost``, top-1), cheapest first (``_front``;
    ``margin``: the relative tie margin of a front by measured speed)."""
    out = {"all": _front(rows, cost, margin)}
    for method in sorted({r["method"] for r in rows}):
        out[method] = _front([r for r in rows if r["method"] == method], cost, margin)
    return out


def _curve(ax, points: Sequence[dict[str, Any]], style: str, label: str, x: str = "gflops", **kw: Any) -> None:
    ax.plot([p[x] for p in points], [p["top1"] for p in points], style, label=label, **kw)


def _save(fig, ax, path: Path, fontsize: int = 8, ncol: int = 1) -> Path:
    return plots.save(fig, path, legend_ax=ax, fontsize=fontsize, ncol=ncol)


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path, cost: str = "gflops", margin: float = 0.0) -> Path:
    """Top-1 vs GFLOPs (Figures 1b, 3) or vs measured images/s: one curve per method (its Pareto front),
    the overall front as a wide grey line (``margin``: the tie margin of the fronts by measured speed)."""
    if cost == "gflops":
        fig, ax = plots.chart("Top-1 vs GFLOPs (each method's Pareto front)", "GFLOPs per image", "top-1 (%)")
    else:
        setting = rows[0].get("speed_setting") or ""
        fig, ax = plots.chart(f"Top-1 vs measured speed ({setting})".replace(" ()", ""), "images/s", "top-1 (%)")
    method_fronts = fronts(rows, cost, margin)
    for index, method in enumerate(m for m in method_fronts if m != "all"):
        _curve(ax, _line(method_fronts[method], cost), plots.style(index), method, x=cost, markersize=5)
    overall = _line(method_fronts["all"], cost)
    _curve(ax, overall, "-", "overall front", x=cost, color="black", alpha=0.35, linewidth=4, zorder=0)
    ties = [r for r in method_fronts["all"] if r not in overall]
    if ties:  # on the measured front, off the line: ties within the intervals
        _curve(ax, ties, "o", "overall front: ties within the intervals", x=cost, color="black", alpha=0.35,
               fillstyle="none", markersize=9, zorder=0)
    return _save(fig, ax, path)


def _line(rows: Sequence[dict[str, Any]], cost: str) -> list[dict[str, Any]]:
    """The point front of ``rows``: the models none of them beats on the point figures, cheapest first. Also the
    line a plot draws through a front by measured speed, which holds ties that are less accurate and not surely
    slower (a line through those would zigzag)."""
    by_id = {r["stage_id"]: r for r in rows}
    return [by_id[p.id] for p in pareto_front(points(rows, cost))]


def plot_widths(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per width: the no-downsampling baselines, and each method's front (Figure 4)."""
    fig, ax = plots.chart("Token downsampling vs a narrower model (per width)", "GFLOPs per image", "top-1 (%)")
    baselines = sorted((r for r in rows if keeps_all(r["method"])), key=lambda r: r["gflops"])
    _curve(ax, baselines, "k*-", "no downsampling (width sweep)", markersize=10)
    for index, arch in enumerate(sorted({r["arch"] for r in rows})):
        arch_rows = [r for r in rows if r["arch"] == arch and not keeps_all(r["method"])]
        front = fronts(arch_rows)["all"] if arch_rows else []
        _curve(ax, front, plots.style(index), f"{arch}: best downsampling", markersize=5)
    return _save(fig, ax, path)


def plot_keep_lists(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """The keep list K_l of every (width, level)."""
    fig, ax = plots.chart("Keep lists per sparsity level", "block", "tokens kept (K_l)")
    seen = set()
    index = 0
    for r in rows:
        if r["keep"] is None or (r["arch"], r["level"]) in seen:
            continue
        seen.add((r["arch"], r["level"]))
        ax.plot(range(1, len(r["keep"]) + 1), r["keep"], plots.style(index), label=f"{r['arch']} {r['level']}",
                markersize=4)
        index += 1
    return _save(fig, ax, path, fontsize=7, ncol=2)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):  # numpy's floats too
            return f"{value:.4f}" if value < 10 else f"{value:.2f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_no_finetune(rows: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Top-1 against GFLOPs of one model without finetuning (the paper's Appendix E figure), one line per method, dashed
    with carry; the unmodified model (``keep`` empty) as a star where ``rows`` hold it. ``rows``:
    ``NO_FINETUNE_COLUMNS``."""
    fig, ax = plots.chart(title, "GFLOPs per image", "top-1 (%)")
    for index, method in enumerate(dict.fromkeys(r["method"] for r in rows if r["keep"])):
        for with_carry in (False, True):
            points = sorted((r["gflops"], r["top1"]) for r in rows
                            if r["keep"] and r["method"] == method and r["carry"] == with_carry)
            if points:
                ax.plot([g for g, _ in points], [t for _, t in points], marker=plots.style(index)[0],
                        color=f"C{index}", linestyle="--" if with_carry else "-",
                        label=f"{method}{', carry' if with_carry else ''}")
    for base in [r for r in rows if not r["keep"]][:1]:  # none where its evaluation failed, or was not rehearsed
        ax.plot([base["gflops"]], [base["top1"]], "k*", markersize=10, label="unmodified")
    return plots.save(fig, path, legend_ax=ax)


def no_finetune_section(rows: Sequence[dict[str, Any]], out_dir: Path, files: dict[str, Path]) -> list[str]:
    """The report's section of the models evaluated without finetuning: no_finetune.csv and one figure per architecture
    (added to ``files``), and the section's lines."""
    ordered = sorted(rows, key=lambda r: (r["arch"], bool(r["keep"]), r["method"], r["carry"], -r["gflops"]))
    files["no_finetune"] = write_csv(ordered, out_dir / "no_finetune.csv", NO_FINETUNE_COLUMNS)
    text = ["## Without finetuning (Appendix E)", "",
            "Each base with a method inserted at each level's keep list and no training, with and without `carry` "
            "(cluster sizes carried into the next blocks' softmax); `none` at `full` is the base itself. A measurement "
            "of the reconstruction argument, not a pick: these models are in no front, budget table or registry alias "
            "above. `speed`: as above, against the same base.", ""]
    for arch in dict.fromkeys(r["arch"] for r in ordered):
        mine = [r for r in ordered if r["arch"] == arch]
        name = f"no_finetune_plot_{arch}"
        files[name] = plot_no_finetune(mine, out_dir / f"no_finetune_{arch}.png", title=f"{arch}: no finetuning")
        text += [f"![{arch} without finetuning]({files[name].name})", ""]
    text += [markdown_table([{**r, "speed": speed_text(r)} for r in ordered],
                            ["arch", "level", "method", "carry", "gflops", "top1", "speed", "keep"]), ""]
    return text


def deit_2x_rows(bases: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per base with a baseline finetune: the base's top-1 on ``data.val`` (``test_top1`` where a held-out split
    ranked it, else ``val_top1``), the baseline's (DeiT-2x: as many epochs again, no downsampling) and the gain."""
    full = {r["arch"]: r for r in rows if keeps_all(r["method"])}
    out = []
    for base in bases:
        own = base.get("test_top1") if base.get("test_top1") not in EMPTY else base.get("val_top1")
        if base["arch"] in full and own not in EMPTY:
            twice = float(full[base["arch"]]["top1"])
            out.append({"arch": base["arch"], "base_top1": float(own), "deit_2x_top1": twice,
                        "gain": twice - float(own)})
    return out


def across_runs(row: dict[str, Any], spread: SpreadRecord | None) -> dict[str, str]:
    """``{"images_per_s_across_runs": "[low, high]"}``: the row's images/s interval widened by the timed device's
    run-to-run spread (``SpreadRecord.across_runs``), where there are both; else nothing."""
    if spread is None or row.get("images_per_s_low") in EMPTY:
        return {}
    low, high = spread.across_runs(row["images_per_s"], row["images_per_s_low"], row["images_per_s_high"])
    return {"images_per_s_across_runs": f"[{low:.0f}, {high:.0f}]"}


def machine_lines(spread: SpreadRecord | None, tie_margin: float) -> list[str]:
    """The report's paragraph on the timed device's run-to-run spread and the tie margin, where there is either
    (none: the report as without them)."""
    lines = []
    if spread is not None:
        lines.append(f"Run-to-run on the device the models were timed on ({spread.device}, {spread.threads} thread(s), "
                     f"`pipeline doctor --speed`: {spread.source()}): one pair's ratio in {spread.k} fresh processes "
                     f"spread {spread.between:.1%} (sd/mean; {min(spread.ratios):.3f} to {max(spread.ratios):.3f}) "
                     f"against a median half-width of {spread.within:.1%} within a process ({spread.window()}): the "
                     "intervals above hold within this run; between runs a ratio moves by about the spread. "
                     "`images_per_s_across_runs` is each interval widened by it, each side apart.")
    if tie_margin > 0:
        lines.append(f"Tie margin {tie_margin:.1%} (`experiment.select.tie_margin`): models whose times differ by "
                     "less than it are ties and none leaves the front for another.")
    return [line for text in lines for line in (text, "")]


def write_report(rows: Sequence[dict[str, Any]], out_dir: Path, budgets: Sequence[float] | None = None,
                 title: str = "Experiment report", bases: Sequence[dict[str, Any]] = (),
                 targets: Sequence[dict[str, Any]] = (), speed_warning: str | None = None,
                 tie_margin: float = 0.0, spread: SpreadRecord | None = None,
                 no_finetune: Sequence[dict[str, Any]] = (), record_inputs: bool = True) -> dict[str, Path]:
    """Writes results.csv, pareto.csv, budgets.csv, three plots, report.md and (``record_inputs``) report.json, the
    other arguments, for ``rebuild_report``, into ``out_dir``.

    ``bases``: one row per base model (arch, val_top1, test_top1, run_id), shown with both numbers.
    ``targets``: the models of K-search target levels with their target, predicted and measured cost
    (``dag.select.target_rows``), as targets.csv and a section. ``speed_warning``: why this run's speeds are in
    doubt (the unmodified model against itself excluded 1), printed above the speed front. ``tie_margin``: the
    relative margin under which the speed front's models are ties (``experiment.select.tie_margin``); ``spread``:
    the run-to-run spread of the device the speeds were measured on (``pipeline doctor --speed``), shown with them.
    ``no_finetune``: each base's models with a method inserted and no training (``NO_FINETUNE_COLUMNS``, the paper's
    Appendix E), as no_finetune.csv, a figure per architecture and a section; never in the fronts.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda r: (r["arch"], r["method"], -r["gflops"]))
    budgets = list(budgets) if budgets else default_budgets(rows)
    front, speed_front = fronts(rows, "gflops")["all"], fronts(rows, "images_per_s", tie_margin)["all"]
    table = budget_table(rows, budgets)
    files = {
        "results": write_csv(ordered, out_dir / "results.csv"),
        "pareto": write_csv(front, out_dir / "pareto.csv"),
        "pareto_speed": write_csv(speed_front, out_dir / "pareto_speed.csv"),
        "budgets": write_csv(table, out_dir / "budgets.csv", ["budget_gflops", "top1", "method", "arch", "level",
                                                              "gflops"]),
        "tradeoff_plot": plot_tradeoff(rows, out_dir / "tradeoff.png"),
        "speed_plot": plot_tradeoff(rows, out_dir / "tradeoff_speed.png", cost="images_per_s", margin=tie_margin),
        "width_plot": plot_widths(rows, out_dir / "widths.png"),
        "keep_plot": plot_keep_lists(rows, out_dir / "keep_lists.png"),
    }
    shown = ["arch", "level", "method", "gflops", "top1", "images_per_s"]
    timed = [{**r, "speed": speed_text(r), **across_runs(r, spread)} for r in speed_front]
    setting = sorted({r.get("speed_setting") or "" for r in rows} - {""})
    measured = f" (measured {', '.join(setting)})" if setting else ""
    text = [f"# {title}", "", "## Pareto front (GFLOPs lower, top-1 higher)", "", markdown_table(front, shown), "",
            f"## Pareto front by measured speed (images/s higher, top-1 higher){measured}", "",
            *([f"**Warning: {speed_warning}.**", ""] if speed_warning else []),
            "Each model's time is a paired ratio to its architecture's unmodified model with a 95% interval that holds "
            "within this run (one process's blocks) "
            "(`speed`: ratio [low, high], then the blocks measured, why they stopped and the half-width reached: "
            "`tolerance` within the tolerance, `wider` not, `cap` or `max_blocks` stopped early); images/s are the "
            "references' rates over it, on one scale for every width, with an interval of at least 90% within this "
            "run (the model's 95% interval chained with its reference's). "
            "A model is left out only where another is at least as accurate and faster beyond the intervals; "
            "`speed_ties` names the models of the front it cannot be told apart from (a less accurate tie stays: the "
            "measurement cannot say it is not the faster).", "", *machine_lines(spread, tie_margin),
            markdown_table(timed, ["arch", "level", "method", "gflops", "top1", "images_per_s",
                                   *(["images_per_s_across_runs"] if spread is not None else []), "speed",
                                   "speed_ties"]), "",
            "## Best top-1 within a GFLOPs budget", "",
            markdown_table(table, ["budget_gflops", "top1", "method", "arch", "level", "gflops"]), "",
            "## Plots", "", "![top-1 vs GFLOPs](tradeoff.png)", "", "![top-1 vs images/s](tradeoff_speed.png)", "",
            "![per width](widths.png)", "", "![keep lists](keep_lists.png)", "", "## All models", "",
            "`top1`: the evaluate stage on `data.val` (the test set when `data.holdout` > 0); `speed`: as above; "
            "`train_top1`: the finetune's last validation top-1 (on the held-out split when `data.holdout` > 0).", "",
            markdown_table([{**r, "speed": speed_text(r)} for r in ordered], shown + ["speed", "train_top1", "keep"]),
            ""]
    if bases:
        text += ["## Base models", "", "`val_top1` ranks (the held-out split when `data.holdout` > 0); `test_top1` "
                 "is `data.val`, measured once after the last epoch (empty without a held-out split).", "",
                 markdown_table(list(bases), ["arch", "val_top1", "test_top1", "run_id"]), ""]
        doubled = deit_2x_rows(bases, ordered)
        if doubled:
            text += ["## DeiT against DeiT-2x (Appendix C)", "",
                     "The paper compares every method with its DeiT finetuned for as many epochs again without "
                     "downsampling (DeiT-2x), so that a method's gain is not the extra training: each base on "
                     "`data.val` beside its baseline finetune (`none`, level `full`), the reference of the fronts "
                     "above.", "", markdown_table(doubled, ["arch", "base_top1", "deit_2x_top1", "gain"]), ""]
    analysed = [r for r in ordered if r.get("analysis")]
    if analysed:
        text += ["## Analysis artifacts", "",
                 "Per model (MLflow artifacts): cluster maps of validation images (`maps/`), token redundancy per "
                 "block (`redundancy.png`, `.csv`) and each method's eq. 2 reconstruction error at the model's keep "
                 "list (`reconstruction.png`, `.csv`).", "",
                 markdown_table([r | {"analysis": f"[{r['analysis']}]({r['analysis']})"} for r in analysed],
                                ["arch", "level", "method", "analysis"]), ""]
    if targets:
        columns = TARGET_COLUMNS
        files["targets"] = write_csv(targets, out_dir / "targets.csv", columns)
        text += ["## K-search targets", "", "Per model finetuned at a target's level: the target as an absolute "
                 "figure; `searched`, where the K search's soft keep list landed before it was rounded (its cost "
                 "over the unmodified model's: the target's fraction if the search hit it); the cost model's "
                 "prediction at the model's keep list for its method, and `spent`, that prediction over the target "
                 "(a list predicted more than 3% under it is flagged UNDER in `cost_status`); and the measured cost "
                 "where there is one (`cost_status` says which).", "", markdown_table(list(targets), columns), ""]
    if no_finetune:
        text += no_finetune_section(no_finetune, out_dir, files)
    if record_inputs:
        inputs = {"title": title, "budgets": budgets, "bases": list(bases), "targets": list(targets),
                  "speed_warning": speed_warning, "tie_margin": tie_margin, "spread": spread and asdict(spread),
                  "no_finetune": list(no_finetune)}
        files["inputs"] = out_dir / REPORT_INPUTS
        files["inputs"].write_text(json.dumps(inputs, indent=1, default=_plain))
    files["report"] = out_dir / "report.md"
    files["report"].write_text("\n".join(text))
    return files


# What report.json holds: ``write_report``'s parameters besides the rows, the folder and ``record_inputs``; a
# parameter added there and not written is refused by ``read_inputs`` (the rebuild's test), not dropped.
INPUT_KEYS = frozenset(inspect.signature(write_report).parameters) - {"rows", "out_dir", "record_inputs"}


def _plain(value: Any) -> Any:
    """What JSON has no type for, in report.json: numpy's and torch's scalars as numbers, paths as text."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"report.json cannot hold a {type(value).__name__} ({value!r})")


def read_inputs(path: Path) -> dict[str, Any]:
    """``write_report``'s arguments besides the rows, from the report.json at ``path``."""
    try:
        inputs = json.loads(path.read_text())
        spread = inputs.pop("spread")
        inputs["spread"] = spread and SpreadRecord(**spread)
        if set(inputs) != INPUT_KEYS:
            raise KeyError(f"keys {sorted(inputs)}")
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise InputError(f"{path}: not what `pipeline run` writes ({type(err).__name__}: {err}); delete it for a "
                         "report of results.csv alone, or run `pipeline run` again to write both") from None
    return inputs


def rebuild_report(folder: Path, out_dir: Path, log: Callable[[str], None]) -> dict[str, Path]:
    """``write_report`` again from ``folder``'s results.csv and the inputs it was written with (``REPORT_INPUTS``)
    into ``out_dir``. A folder without report.json (a results.csv the select stage did not write) gets a report of
    the rows alone, said in ``log``, and no report.json: nothing claims it had no bases, targets or margin."""
    rows = read_csv(folder / "results.csv")
    path = folder / REPORT_INPUTS
    if path.is_file():
        return write_report(rows, out_dir, **read_inputs(path))
    log(f"warning: no {path}: the report holds the rows of results.csv alone (no base models, K-search targets, "
        "speed warning, tie margin or machine spread)")
    return write_report(rows, out_dir, title=f"Experiment {folder.name}", record_inputs=False)
