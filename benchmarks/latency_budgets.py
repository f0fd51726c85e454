"""Budgets hit: K searches toward latency targets, and their keep lists measured on the tables' machine.

For every table and target fraction, one K search (``pipeline.train.loop.train_local``: the trainer the DAG's
K-search stages run, with ``train.ksearch_target``) of the training config's model, then what the DAG does
between the K-search and finetune sweeps (``targets.repair_keep`` with ``dag.latency.measure_on_table``: the
searched list measured against the unmodified model, paired at the table's setting, and rounded again under
a tighter limit while it measures over the target), then the final list measured ``--measurements`` more
times. It prints, per search, how close it landed before rounding (``landed``: the soft list's predicted
ratio), the rounded list's predicted ratio, what the check measured and repaired, and the final list's
measured ratio (median, range) against the target: within +-5% or not.

    D=configs/latency/amd-epyc/deit_small_patch16_224-m384-d12-224px-p16
    python benchmarks/latency_budgets.py configs/train/deit_s_ksearch_fmnist.yaml \\
        $D/{powerbert,wkmedoids,kmeans,tome}-b1-fp32-none-t1-cpuclock.json \\
        --fractions 0.5 0.65 0.8 --images 640 --measurements 3 --out runs/latency_budgets

The searches train on the first ``--images`` Fashion-MNIST training images (an image folder, torch loader)
and validate on 16 test images; a finished search is resumed from its checkpoint, not run again.
``--smoke``: a tiny model and table measured here, on synthetic images, to check that the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from functools import partial
from pathlib import Path

from pipeline.bench.blocks import BlocksSettings, ModelSpec, measure_table
from pipeline.config import Config, load_config
from pipeline.config.train import CostTarget
from pipeline.cost import CostModel, load_cost_model
from pipeline.dag.latency import measure_on_table, retention_weights
from pipeline.data import open_source, write_folder
from pipeline.methods import method_spec
from pipeline.targets import repair_keep
from pipeline.train.checkpoint import SUMMARY_FILE
from pipeline.train.launch import resolve_paths
from pipeline.train.loop import train_local
from pipeline.train.session import latest_local_checkpoint, local_checkpoints


def write_data(source: str, limit: int, out: Path) -> str:
    """An image folder of the first ``limit`` images of ``source`` (``pipeline data folder``), once."""
    if not out.is_dir():
        write_folder(open_source(source, limit=limit), out, None, log=lambda _: None)
    return str(out)


def search_config(base: Config, table: Path, fraction: float, out: Path, train: str, val: str) -> Config:
    """``base`` as a K search toward ``fraction`` of the unmodified model's latency through ``table``."""
    method = load_cost_model(table).key["method"]
    target = CostTarget(cost="latency", fraction=fraction, table=str(table))
    data = base.data.model_copy(update={"train": train, "val": val, "loader": "torch"})
    settings = base.train.model_copy(update={
        "mode": "ksearch", "ksearch_target": target, "name": f"{method}-{fraction:g}",
        "storage_path": str(out / "ray"), "tracking_uri": f"sqlite:///{out / 'mlflow.db'}",
        "artifact_root": str(out / "mlartifacts"), "experiment": "latency_budgets"})
    return resolve_paths(base.model_copy(update={"data": data, "train": settings}))


def search(config: Config) -> tuple[list[int], Path, dict]:
    """Runs (or resumes) the K search; its rounded keep list, checkpoint and last epoch's summary."""
    train_local(config)
    checkpoint = latest_local_checkpoint(local_checkpoints(config))
    summary = json.loads((checkpoint / SUMMARY_FILE).read_text())
    return summary["keep"], checkpoint, summary


def check(config: Config, table: CostModel, measurements: int) -> dict:
    """One search, its check and repair as the DAG does it, and the final list measured again."""
    fraction = config.train.ksearch_target.fraction
    keep, checkpoint, summary = search(config)
    repair = repair_keep(retention_weights(str(checkpoint)), table, fraction, keep,
                         partial(measure_on_table, log=lambda _: None))
    samples = []
    for _ in range(measurements if repair.measured is not None else 0):
        ratio, _status = measure_on_table(table, repair.keep, log=lambda _: None)
        samples.append(ratio)
    return {"method": table.key["method"], "target": fraction, "landed": summary["target_landed"],
            "rounded": summary["target_rounded"], "searched": keep, "first": repair.first, "keep": repair.keep,
            "predicted": table.predict(repair.keep) / table.unmodified(), "tries": repair.tries,
            "samples": samples, "status": repair.status}


def report(rows: list[dict]) -> str:
    """The markdown table of every search, and the count within +-5% of its target."""
    lines = ["| method | target | landed (soft) | rounded, predicted | searched list | its check | repairs | "
             "final list | predicted | measured: median (range) | error |",
             "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    errors = []
    for r in rows:
        first = "n/a" if r["first"] is None else f"{r['first']:.3f}"
        if r["samples"]:
            median = statistics.median(r["samples"])
            errors.append(median / r["target"] - 1)
            measured = f"{median:.3f} ({min(r['samples']):.3f}-{max(r['samples']):.3f})"
            error = f"{errors[-1]:+.1%}"
        else:
            measured, error = "not measured: " + r["status"], "n/a"
        lines.append(f"| {r['method']} | {r['target']:g} | {r['landed']:.4f} | {r['rounded']:.3f} | "
                     f"{','.join(map(str, r['searched']))} | {first} | {r['tries']} | "
                     f"{','.join(map(str, r['keep']))} | {r['predicted']:.3f} | {measured} | {error} |")
    if errors:
        lines.append(f"\n{len(errors)} searches: within +-5% of the target: {sum(abs(e) <= 0.05 for e in errors)}; "
                     f"median |error| {statistics.median(abs(e) for e in errors):.1%}, "
                     f"worst {max(errors, key=abs):+.1%}")
    return "\n".join(lines)


def run(config: Config, tables: list[Path], fractions: list[float], images: int, measurements: int, out: Path,
        sources: tuple[str, str] = ("fashion-mnist:train", "fashion-mnist:test")) -> str:
    train = write_data(sources[0], images, out / "data" / f"train-{images}")
    val = write_data(sources[1], 16, out / "data" / "val-16")
    rows = []
    for path in tables:
        table = load_cost_model(path)
        for fraction in fractions:
            print(f"[budgets] {table.key['method']} toward {fraction:g} of the unmodified model", flush=True)
            rows.append(check(search_config(config, path, fraction, out, train, val), table, measurements))
            (out / "rows.json").write_text(json.dumps(rows, indent=1))
    text = report(rows)
    (out / "results.md").write_text(text + "\n")
    return text


def smoke() -> str:
    """A 2-block model's PoWER-BERT table measured here, two short searches on synthetic images."""
    out = Path(tempfile.mkdtemp())
    spec = ModelSpec("deit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                     num_classes=4)
    settings = BlocksSettings(spec, "powerbert", method_spec("powerbert").resolve("powerbert", {}), batch=2, step=8,
                              warmup=1, repeats=2, min_sample_s=0.0, threads=1, clock="cpu")
    table = measure_table(settings, out / "powerbert.json", log=lambda _: None)[0]
    cheapest = table.predict([0] * table.depth) / table.unmodified()  # the fixed part is much of a tiny model
    config = load_config("configs/train/tiny_synthetic.yaml", overrides=[
        "model.name=deit_tiny_patch16_224", "model.embed_dim=16", "model.depth=2", "data.batch_size=8",
        "recipe.epochs=1", "train.workers=0", "train.progress_bar=false"])
    fractions = [round(cheapest + share * (1 - cheapest), 3) for share in (0.5, 0.8)]
    return run(config, [out / "powerbert.json"], fractions, 32, 1, out,
               ("synthetic:classes=4,count=32,size=16", "synthetic:classes=4,count=16,size=16"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, help="the training config of the searches (its model "
                        "must be the tables')")
    parser.add_argument("tables", nargs="*", type=Path, help="latency tables (`pipeline bench blocks`)")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.65, 0.8])
    parser.add_argument("--images", type=int, default=640, help="training images of each search")
    parser.add_argument("--measurements", type=int, default=3, help="measurements of each final list (each "
                        "paired 7 times)")
    parser.add_argument("--out", type=Path, default=Path("runs/latency_budgets"))
    parser.add_argument("--smoke", action="store_true", help="a tiny model and table: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        print(smoke())
        return
    if args.config is None or not args.tables:
        parser.error("give the training config and at least one latency table")
    args.out.mkdir(parents=True, exist_ok=True)
    print(run(load_config(args.config), args.tables, args.fractions, args.images, args.measurements, args.out))


if __name__ == "__main__":
    main()
