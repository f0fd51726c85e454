"""Budgets hit: K searches toward latency targets, and their keep lists measured on the tables' machine.

For every table and target fraction, one K search (``pipeline.train.launch.run_local``: the trainer the DAG's
K-search stages run, with ``train.ksearch_target``) of the training config's model, then what the DAG does
between the K-search and finetune sweeps (``targets.repair_keep`` with ``dag.latency.measure_on_table``: the
searched list measured against the unmodified model, paired at the table's setting, and rounded again under
a tighter limit while it measures over the target), then the final list measured ``--measurements`` more
times. A line a search while it runs; at the end a table of every search: how close it landed before rounding
(``landed``: the soft list's predicted ratio), the rounded list's predicted ratio, what the check measured and
repaired, and the final list's predicted and measured ratio (median, range) against the target.

    D=configs/latency/amd-epyc/deit_small_patch16_224-m384-d12-224px-p16
    python benchmarks/latency_budgets.py configs/train/deit_s_ksearch_fmnist.yaml \\
        $D/{powerbert,wkmedoids,kmeans,tome}-b1-fp32-none-t1-cpuclock.json \\
        --fractions 0.5 0.65 0.8 --images 640 --measurements 3 --out runs/latency_budgets

The searches train on ``--images`` Fashion-MNIST training images (a class-balanced subset written as an image
folder, torch loader) and validate on 16 test images. A search's run is named by its table's file and target;
a rerun with the same config resumes it (a finished one is not trained again), another config under the same
``--out`` is refused (``train.launch.check_rerun``). ``--smoke``: the shipped config at a tiny size, a table
measured here and synthetic images, run twice (the second resumes): checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from pipeline.bench.blocks import BlocksSettings, ModelSpec, measure_table
from pipeline.config import CONFIG_DIR, Config, load_config
from pipeline.cost import CostModel, load_cost_model
from pipeline.dag.latency import measure_on_table, retention_weights
from pipeline.data import open_source, write_folder
from pipeline.errors import PipelineError
from pipeline.methods import method_spec
from pipeline.targets import repair_keep
from pipeline.train.launch import resolve_paths, run_local

CONFIG = CONFIG_DIR / "train" / "deit_s_ksearch_fmnist.yaml"
MIN_IMAGES = 16  # one batch of the shipped config at least, spread over the classes


@dataclass
class Row:
    """One search. Keep lists: one count a block, (L,) ints; ratios: of the unmodified model's time."""

    method: str
    table: str
    target: float
    landed: float  # the soft list's predicted ratio at the search's end, before rounding
    rounded: float  # the rounded (searched) list's predicted ratio
    searched: list[int]
    first: float | None  # the check's measurement of the searched list; None: not measurable here
    checked: float | None  # the check's last measurement (of the final list)
    tries: int  # roundings under a tightened limit
    keep: list[int]  # the final list: the searched one, or the repaired one
    predicted: float
    samples: list[float]  # the final list measured again
    status: str

    @property
    def error(self) -> float | None:
        """The median measured ratio over the target, less 1; None where nothing was measured."""
        return statistics.median(self.samples) / self.target - 1 if self.samples else None


def write_data(source: str, limit: int, out: Path) -> str:
    """An image folder of ``limit`` images of ``source`` (``pipeline data folder``: spread over the classes), once."""
    if not out.is_dir():
        write_folder(open_source(source, limit=limit), out, None, log=lambda _: None)
    return str(out)


def search_config(path: Path, overrides: list[str], table: Path, fraction: float, out: Path, train: str,
                  val: str) -> Config:
    """The config at ``path`` (with ``overrides``) as a K search toward ``fraction`` of the unmodified model's
    latency through ``table``, validated as ``--set`` overrides are."""
    target = f"{{cost: latency, fraction: {fraction}, table: '{table}'}}"
    return resolve_paths(load_config(path, overrides=[
        *overrides, f"data.train={train}", f"data.val={val}", "data.loader=torch", "train.mode=ksearch",
        f"train.ksearch_target={target}", f"train.name={table.stem}-{fraction:g}", f"train.storage_path={out / 'ray'}",
        f"train.tracking_uri=sqlite:///{out / 'mlflow.db'}", f"train.artifact_root={out / 'mlartifacts'}",
        "train.experiment=latency_budgets"]))


def check(config: Config, table: CostModel, measurements: int) -> Row:
    """One search (run or resumed), its check and repair as the DAG does it, and the final list measured again."""
    target = config.train.ksearch_target
    result = run_local(config)
    repair = repair_keep(retention_weights(result.checkpoint), table, target.fraction, result.keep,
                         partial(measure_on_table, log=lambda _: None))
    samples = []
    for _ in range(measurements if repair.measured is not None else 0):
        ratio, _status = measure_on_table(table, repair.keep, log=lambda _: None)
        samples.append(ratio.ratio)  # a paired ratio's median (bench.paired)
    return Row(table.key["method"], Path(target.table).name, target.fraction, result.summary["target_landed"],
               result.summary["target_rounded"], result.keep, repair.first, repair.measured, repair.tries,
               repair.keep, table.predict(repair.keep) / table.unmodified(), samples, repair.status)


def report(rows: list[Row]) -> str:
    """The markdown table of every search, and how many measured within +-5% of their targets."""
    lines = ["| method | table | target | landed (soft) | rounded, predicted | searched list | its check | repairs | "
             "final list | predicted | measured: median (range) | error |",
             "|---|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        first = "n/a" if r.first is None else f"{r.first:.3f}"
        if r.samples:
            measured = f"{statistics.median(r.samples):.3f} ({min(r.samples):.3f}-{max(r.samples):.3f})"
            error = f"{r.error:+.1%}"
        else:
            measured, error = "not measured: " + r.status, "n/a"
        lines.append(f"| {r.method} | {r.table} | {r.target:g} | {r.landed:.4f} | {r.rounded:.3f} | "
                     f"{','.join(map(str, r.searched))} | {first} | {r.tries} | {','.join(map(str, r.keep))} | "
                     f"{r.predicted:.3f} | {measured} | {error} |")
    errors = [r.error for r in rows if r.error is not None]
    if errors:
        lines.append(f"\n{len(errors)} searches measured of {len(rows)}: within +-5% of the target: "
                     f"{sum(abs(e) <= 0.05 for e in errors)}, at or under it: {sum(e <= 0 for e in errors)}; "
                     f"median |error| {statistics.median(abs(e) for e in errors):.1%}, "
                     f"worst {max(errors, key=abs):+.1%}")
    return "\n".join(lines)


def run(config: Path, overrides: list[str], tables: list[Path], fractions: list[float], images: int,
        measurements: int, out: Path, sources: tuple[str, str] = ("fashion-mnist:train", "fashion-mnist:test")
        ) -> list[Row]:
    """Every (table, fraction) search of ``config`` in ``out``; writes ``rows.json`` as it goes and
    ``results.md`` at the end."""
    load_config(config, overrides)  # a bad config, and a missing or unreadable table, before any work
    loaded = [(path, load_cost_model(path)) for path in tables]
    train = write_data(sources[0], images, out / "data" / f"train-{images}")
    val = write_data(sources[1], 16, out / "data" / "val-16")
    rows = []
    for path, table in loaded:
        for fraction in fractions:
            print(f"[budgets] {path.name} toward {fraction:g} of the unmodified model", flush=True)
            settings = search_config(config, overrides, path, fraction, out, train, val)
            rows.append(check(settings, table, measurements))
            (out / "rows.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (out / "results.md").write_text(report(rows) + "\n")
    return rows


def smoke() -> str:
    """The shipped config at 2 blocks of 16 tokens, its PoWER-BERT table measured here, two short searches on
    synthetic images, then the same again: the second run resumes the finished searches."""
    spec = ModelSpec("deit_small_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                     num_classes=4)
    overrides = ["model.img_size=16", "model.patch_size=4", "model.embed_dim=16", "model.depth=2",
                 "model.num_heads=2", "data.num_classes=4", "recipe.epochs=1"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        settings = BlocksSettings(spec, "powerbert", method_spec("powerbert").resolve("powerbert", {}), batch=2,
                                  step=8, warmup=1, repeats=3, min_sample_s=0.002, threads=1, clock="cpu",
                                  # a loose interval, under a cap only a hang reaches: a smoke run on a loaded machine
                                  anchor_tolerance=0.5, anchor_cap_s=300.0)
        table = measure_table(settings, out / "powerbert.json", log=lambda _: None)[0]
        cheapest = table.predict([0] * table.depth) / table.unmodified()  # the fixed part is much of a tiny model
        fractions = [round(cheapest + share * (1 - cheapest), 3) for share in (0.5, 0.8)]
        sources = ("synthetic:classes=4,count=32,size=16", "synthetic:classes=4,count=16,size=16")
        first = run(CONFIG, overrides, [out / "powerbert.json"], fractions, 32, 1, out, sources)
        again = run(CONFIG, overrides, [out / "powerbert.json"], fractions, 32, 1, out, sources)
        resumed = [r.searched for r in again] == [r.searched for r in first]
        return f"{report(first)}\nresumed: the same searched lists {resumed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, help="the training config of the searches (its model "
                        "must be the tables')")
    parser.add_argument("tables", nargs="*", type=Path, help="latency tables (`pipeline bench blocks`)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override of the config (repeatable)")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.65, 0.8])
    parser.add_argument("--images", type=int, default=640, help="training images of each search")
    parser.add_argument("--measurements", type=int, default=3, help="measurements of each final list (each "
                        "a paired ratio, bench.paired)")
    parser.add_argument("--out", type=Path, default=Path("runs/latency_budgets"))
    parser.add_argument("--smoke", action="store_true", help="a tiny model and table: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        print(smoke())
        return
    if args.config is None or not args.tables:
        parser.error("give the training config and at least one latency table")
    if args.images < MIN_IMAGES or args.measurements < 1 or not all(0 < f <= 1 for f in args.fractions):
        parser.error(f"--images {args.images}, --measurements {args.measurements}, --fractions {args.fractions}: "
                     f"give at least {MIN_IMAGES} images, 1 measurement and fractions in (0, 1]")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(args.config, args.overrides, args.tables, args.fractions, args.images, args.measurements, args.out)
    except PipelineError as err:  # a bad config, table or dataset: one line, as `python -m pipeline` says it
        raise SystemExit(f"latency_budgets: {err}") from None
    print(report(rows))


if __name__ == "__main__":
    main()
