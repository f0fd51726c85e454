"""``viz clusters`` and ``analyze redundancy | reconstruction``: what downsampling keeps, per block."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from pipeline.cli.common import int_list, log
from pipeline.errors import InputError
from pipeline.plots import write_csv
from pipeline.report import markdown_table, plot_no_finetune
from pipeline.sparsity import level_keep


def _subject(args: argparse.Namespace):
    from pipeline.analysis import load_subject

    return load_subject(checkpoint=args.checkpoint, model=args.model, weights=args.weights)


def cmd_viz_clusters(args: argparse.Namespace) -> int:
    from pipeline.analysis import beton_images, cluster_maps, read_images
    from pipeline.analysis.clustermap import default_layers
    from pipeline.models import parse_keep

    subject = _subject(args)
    methods = args.method.split(",") if args.method else [subject.method] if subject.method else None
    keep = parse_keep(args.keep) if args.keep else subject.keep
    if not methods or keep is None:
        raise InputError("--method and --keep are needed (a base checkpoint or a timm model has no method of its own)")
    if args.images:
        pictures, names = read_images(args.images, subject.res), [Path(p).stem for p in args.images]
    elif args.data:
        pictures = np.concatenate(list(beton_images(args.data, subject, count=args.count, batch=args.count)))
        names = [f"{Path(args.data).stem}{i:04d}" for i in range(len(pictures))]
    else:
        raise InputError("give --images PATH... or --data BETON")
    layers = int_list(args.layers, "--layers") or default_layers(subject.depth)
    files = cluster_maps(subject, pictures, names, methods=methods, keep=keep, layers=layers, out=args.out,
                         sheet_layer=args.sheet_layer, log=log)
    print("\n".join(str(f) for f in files))
    return 0


def cmd_analyze_redundancy(args: argparse.Namespace) -> int:
    from pipeline.analysis.artifacts import write_redundancy
    from pipeline.analysis.probe import first_batches

    subject = _subject(args)
    data = first_batches(args.data, subject, batches=args.batches, batch=args.batch_size)
    try:
        alphas = [float(a) for a in args.qk_norm_alpha.split(",")] if args.qk_norm_alpha else []
    except ValueError:
        raise InputError(f"--qk-norm-alpha must be comma-separated numbers, e.g. 5,10; got {args.qk_norm_alpha!r}") \
            from None
    print("\n".join(str(f) for f in write_redundancy(subject, data, args.out, qk_alphas=alphas, log=log)))
    return 0


def cmd_analyze_reconstruction(args: argparse.Namespace) -> int:
    from pipeline.analysis.artifacts import write_reconstruction
    from pipeline.analysis.probe import first_batches
    subject = _subject(args)
    ks = int_list(args.k, "--k")
    if ks is None and subject.keep is None:
        ks = [max(1, subject.num_tokens // 4)]
    data = first_batches(args.data, subject, batches=args.batches, batch=args.batch_size)
    methods = args.method.split(",") if args.method else None
    files = write_reconstruction(subject, data, args.out, methods=methods, ks=ks,
                                 keep=subject.keep if ks is None else None, log=log)
    print("\n".join(str(f) for f in files))
    return 0


def cmd_analyze_convergence(args: argparse.Namespace) -> int:
    """Per block and method: the clustering objective after each iteration and the iteration at which the
    assignments stop changing, beside the paper's claim."""
    from pipeline.analysis.convergence import CLAIM, convergence_rows, plot_convergence, summary_rows
    from pipeline.analysis.probe import first_batches

    subject = _subject(args)
    ks = int_list(args.k, "--k")
    if ks is None and subject.keep is None:
        ks = [max(1, subject.num_tokens // 4)]
    data = first_batches(args.data, subject, batches=args.batches, batch=args.batch_size)
    rows = convergence_rows(subject, data, methods=[m for m in args.method.split(",") if m], ks=ks,
                            keep=subject.keep if ks is None else None, iters=args.iters, log=log)
    args.out.mkdir(parents=True, exist_ok=True)
    csv = write_csv(rows, args.out / "convergence.csv", list(rows[0]))
    plot = plot_convergence(rows, args.out / "convergence.png", title=f"{subject.label}: clustering convergence")
    summary = summary_rows(rows)
    print(markdown_table(summary, list(summary[0])))
    slowest = max(r["max_converged_at"] for r in summary)
    print(f"the paper: {CLAIM}; here the largest converged-at iteration is {slowest} (above {args.iters}: an image "
          "still changing at the last)")
    print(f"wrote {csv}, {plot}", file=sys.stderr)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """``pipeline evaluate``: a trained model with each method inserted at each keep list, no training (Appendix E)."""
    from pipeline.analysis.offshelf import COLUMNS, offshelf_rows
    from pipeline.bench.paired import SpeedSettings
    from pipeline.models import parse_keep

    if args.batch_size < 1:
        raise InputError(f"--batch-size {args.batch_size}: give at least 1 image a batch")
    if (args.keep is None) == (args.level is None):
        raise InputError("give --keep K_1,...,K_L (repeatable) or --level N (the paper's models), exactly one")
    subject = _subject(args)
    if args.level is not None:
        name = args.model or subject.label
        try:
            keeps = [level_keep(name, level) for level in args.level]
        except ValueError as err:
            raise InputError(f"--level: {err}; give --keep K_1,...,K_L for {name}") from None
    else:
        keeps = [parse_keep(keep) for keep in args.keep]
    methods = [m for m in args.method.split(",") if m]
    carries = {"off": [False], "on": [True], "both": [False, True]}[args.carry]
    speed = SpeedSettings(cap_s=args.speed_cap_s, cap_key="--speed-cap-s") if args.speed else None
    rows = offshelf_rows(subject, args.data, methods, keeps, carries, batch=args.batch_size, speed=speed, log=log)
    args.out.mkdir(parents=True, exist_ok=True)
    csv = write_csv(rows, args.out / "offshelf.csv", COLUMNS)
    plot = plot_no_finetune(rows, args.out / "offshelf.png", title=f"{subject.label}: no finetuning")
    if args.tracking_uri:
        _record_offshelf(rows, subject.label, args)
    print(markdown_rows(rows))
    print(f"wrote {csv}, {plot}", file=sys.stderr)
    return 0


def markdown_rows(rows) -> str:

    shown = [{**r, "carry": "yes" if r["carry"] else "no", "keep": r["keep"] or "every token"} for r in rows]
    speed = ["speed_ratio", "speed_ratio_low", "speed_ratio_high"] if "speed_ratio" in rows[0] else []
    return markdown_table(shown, ["method", "keep", "carry", "top1", "top5", "gflops", *speed])


def _record_offshelf(rows, label: str, args: argparse.Namespace) -> None:
    """Each evaluation as an MLflow run of ``--experiment``, tagged as not finetuned (``pipeline.finetuned``)."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import experiment_id, log_batch

    client = MlflowClient(tracking_uri=args.tracking_uri)
    exp = experiment_id(client, args.experiment, None)
    for row in rows:
        run = client.create_run(exp, run_name=f"{label}-{row['method']}-{row['keep'] or 'all'}"
                                f"{'-carry' if row['carry'] else ''}",
                                tags={"pipeline.stage": "offshelf", "pipeline.finetuned": "false"}).info.run_id
        log_batch(client, run, params={"model": label, "method": row["method"], "keep": row["keep"] or "none",
                                       "carry": str(row["carry"]), "data": str(args.data)},
                  metrics={k: float(row[k]) for k in ("top1", "top5", "gflops", "images", "speed_ratio",
                                                      "speed_ratio_low", "speed_ratio_high") if k in row})
        client.set_terminated(run, "FINISHED")


def _add_subject_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, help="a `pipeline train` checkpoint (directory or .pt)")
    parser.add_argument("--model", default=None, help="or a timm model name (random weights unless --weights)")
    parser.add_argument("--weights", default=None, help="a timm state-dict file for --model")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the PNGs and CSVs")


def add_commands(commands) -> None:
    viz = commands.add_parser("viz", help="pictures of what downsampling keeps")
    viz_commands = viz.add_subparsers(dest="viz_command", required=True, metavar="SUBCOMMAND")
    clusters = viz_commands.add_parser("clusters", help="token groups drawn over images, per block and per method")
    _add_subject_args(clusters)
    clusters.add_argument("--images", nargs="+", default=None, metavar="PATH", help="image files")
    clusters.add_argument("--data", default=None, help="or a .beton: its first --count images")
    clusters.add_argument("--count", type=int, default=4, help="images from --data (default 4)")
    clusters.add_argument("--method", default=None,
                          help="method(s), comma-separated (default: the checkpoint's own)")
    clusters.add_argument("--keep", default=None, help="K_1..K_L, comma-separated (default: the checkpoint's own)")
    clusters.add_argument("--layers", default=None, help="1-based blocks to draw, e.g. 3,6,9 (default: up to 4)")
    clusters.add_argument("--sheet-layer", type=int, default=None,
                          help="the block of the side-by-side sheet of all methods (default: the middle of --layers)")
    clusters.set_defaults(func=cmd_viz_clusters)

    analyze = commands.add_parser("analyze", help="token redundancy and reconstruction error per block")
    analyze_commands = analyze.add_subparsers(dest="analyze_command", required=True, metavar="SUBCOMMAND")
    redundancy = analyze_commands.add_parser("redundancy", help="cosine similarity and clusters for 90%%/99%% of "
                                             "the variance, before and after attention")
    reconstruction = analyze_commands.add_parser("reconstruction", help="eq. 2 error of each method per block")
    convergence = analyze_commands.add_parser("convergence", help="the clustering objective per iteration and the "
                                              "iteration its assignments stop changing, per block and method")
    for parser in (redundancy, reconstruction, convergence):
        _add_subject_args(parser)
        parser.add_argument("--data", required=True, help="a .beton (its first images are used)")
        parser.add_argument("--batches", type=int, default=4, help="batches to average over (default 4)")
        parser.add_argument("--batch-size", type=int, default=64)
    redundancy.add_argument("--qk-norm-alpha", default=None,
                            help="also with normalised queries and keys at these fixed alphas, e.g. 5,10")
    redundancy.set_defaults(func=cmd_analyze_redundancy)
    reconstruction.add_argument("--k", default=None,
                                help="K at every block, comma-separated for several (default: the checkpoint's "
                                     "keep list, else N/4)")
    reconstruction.add_argument("--method", default=None, help="methods, comma-separated (default: all but conv)")
    reconstruction.set_defaults(func=cmd_analyze_reconstruction)
    convergence.add_argument("--k", default=None, help="K at every block (default: the checkpoint's keep list, else "
                             "N/4)")
    convergence.add_argument("--method", default="kmedoids,wkmedoids,kmeans,wkmeans",
                             help="clustering methods, comma-separated")
    convergence.add_argument("--iters", type=int, default=10, help="iterations to run (default 10)")
    convergence.set_defaults(func=cmd_analyze_convergence)

    evaluate = commands.add_parser("evaluate", help="top-1, top-5 and GFLOPs of a trained model with each method "
                                   "inserted at each keep list, no finetuning (the paper's Appendix E)")
    _add_subject_args(evaluate)
    evaluate.add_argument("--data", required=True, help="a .beton: every image is classified")
    evaluate.add_argument("--method", default="kmeans,wkmeans,kmedoids,wkmedoids",
                          help="methods, comma-separated (default the paper's four clustering methods)")
    evaluate.add_argument("--keep", action="append", default=None, metavar="K_1,...,K_L",
                          help="a keep list, one count a block (repeatable)")
    evaluate.add_argument("--level", action="append", type=int, default=None,
                          help="or the paper's sparsity level of a paper model (repeatable)")
    evaluate.add_argument("--carry", choices=["off", "on", "both"], default="both",
                          help="carry cluster sizes into the next blocks' softmax (default both)")
    evaluate.add_argument("--batch-size", type=int, default=64)
    evaluate.add_argument("--speed", action="store_true",
                          help="also each model's paired time against the unmodified model (one CPU thread)")
    evaluate.add_argument("--speed-cap-s", type=float, default=60.0, help="the most seconds each speed may take")
    evaluate.add_argument("--tracking-uri", default=None, help="record each evaluation in this MLflow store")
    evaluate.add_argument("--experiment", default="offshelf", help="the MLflow experiment (with --tracking-uri)")
    evaluate.set_defaults(func=cmd_evaluate)
