"""``python -m pipeline``: the command line. Each command parses, loads its config and calls into pipeline/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from pipeline.config import ConfigError, PatchEmbed, dump_config, load_config, write_resolved
from pipeline.errors import InputError, MissingFileError, PipelineError
from pipeline.methods import downsamples


def _add_config_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument("config", type=Path, nargs=None if required else "?", default=None,
                        help="experiment YAML under configs/" + ("" if required else " (default: built-in defaults)"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, for example --set pooling.iters=3 (repeatable)")


def cmd_config_show(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    print(dump_config(config), end="")
    if args.out is not None:
        print(f"wrote {write_resolved(config, args.out)}", file=sys.stderr)
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from pipeline.methods import METHODS

    for name, spec in METHODS.items():
        needs = "significance scores" if spec.needs_scores else "-"
        kind = "learnable" if spec.learnable else "parameter-free"
        options = ", ".join(f"{k}={v}" for k, v in spec.options.items()) or "-"
        print(f"{name:11s} {spec.summary:30s} {kind:15s} needs: {needs:20s} options: {options}")
    return 0


def cmd_bench_ops(args: argparse.Namespace) -> int:
    from pipeline.bench.ops import format_table, machine_line, run_ops_benchmark

    config = load_config(args.config, args.overrides)
    timings = run_ops_benchmark(config.bench, config.pooling, seed=config.seed,
                                log=lambda line: print(line, file=sys.stderr, flush=True))
    table = format_table(timings)
    print(f"machine: {machine_line(config.bench.device)}")
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"machine: {machine_line(config.bench.device)}\n\n{table}\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    import json

    from pipeline.flops import count_flops, format_report
    from pipeline.methods import method_spec
    from pipeline.models import create_model, parse_keep
    from pipeline.sparsity import level_keep

    if args.level is not None and args.keep is not None:
        raise InputError("give --keep or --level, not both")
    if args.level is not None and args.embed_dim is not None:
        raise InputError(f"--level holds the paper's keep lists of its models, not of {args.model} at width "
                         f"{args.embed_dim}; name the model (e.g. --model deit_e252_patch16_224) or give --keep")
    if args.keep is not None and not downsamples(args.method):
        raise InputError("--keep without --method keeps every token (method none); give --method too")
    if args.level is not None:
        keep = level_keep(args.model, args.level)
    else:
        keep = None if args.keep is None else parse_keep(args.keep)
    options = {"iters": args.iters} if "iters" in method_spec(args.method).options else {}
    model = create_model(args.model, embed_dim=args.embed_dim, method=args.method, keep=keep, options=options)
    report = count_flops(model)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0


def _bench_overrides(args: argparse.Namespace, section: str, flags: tuple[str, ...]) -> list[str]:
    """``--set`` overrides of a model benchmark's section from its command-line flags."""
    overrides = list(args.overrides)
    if args.methods is not None:
        overrides.append(f"{section}.methods=[{args.methods}]")
    for flag in flags:
        if getattr(args, flag, None) is not None:
            overrides.append(f"{section}.{flag}={getattr(args, flag)}")
    for flag in ("train", "profile"):
        if getattr(args, flag, False):
            overrides.append(f"{section}.{flag}=true")
    if args.keep is not None:
        overrides += [f"{section}.keep=[{args.keep}]", f"{section}.level=null"]
    if args.level is not None:
        overrides += [f"{section}.level={args.level}", f"{section}.keep=null"]
    return overrides


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from pipeline.bench.ops import machine_line
    from pipeline.bench.throughput import format_throughput, run_throughput

    flags = ("model", "batch", "dtype", "compile", "device", "patch_embed", "calls")
    config = load_config(args.config, _bench_overrides(args, "bench_throughput", flags))
    result = run_throughput(config.bench_throughput, config.pooling,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"machine: {machine_line(config.bench_throughput.device)}")
    print(format_throughput(config.bench_throughput, result))
    return 0


def cmd_bench_loop(args: argparse.Namespace) -> int:
    from pipeline.bench.loop import format_loop, run_loop_bench
    from pipeline.bench.ops import machine_line

    flags = ("model", "batch", "dtype", "compile", "device", "patch_embed", "steps", "repeats", "log_every")
    config = load_config(args.config, _bench_overrides(args, "bench_loop", flags))
    rows = run_loop_bench(config.bench_loop, config.pooling, log=_log)
    print(f"machine: {machine_line(config.bench_loop.device)}")
    print(format_loop(config.bench_loop, rows))
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from pipeline.bench.kernels import run_kernel_bench

    print(run_kernel_bench(args.device, args.batch))
    return 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_data_write(args: argparse.Namespace) -> int:
    from pipeline.data import WriteSettings, open_source, write_beton

    source = open_source(args.source, limit=args.limit)
    mode = args.mode or ("jpg" if args.source.startswith("imagefolder:") else "raw")
    settings = WriteSettings(mode=mode, max_res=args.max_res or None, quality=args.quality,
                             compress_probability=args.compress_probability, workers=args.workers,
                             strict=args.strict, overwrite=args.overwrite)
    write_beton(source, args.out, settings, log=_log)
    return 0


def cmd_data_folder(args: argparse.Namespace) -> int:
    from pipeline.data import open_source, write_folder

    write_folder(open_source(args.source, limit=args.limit), args.out, args.size, log=_log)
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    import json

    from pipeline.data.loaders import check_dataset

    meta = check_dataset(args.beton, args.num_classes, full_checksum=True)
    shown = {key: meta[key] for key in ("source", "num_images", "num_classes", "settings", "bytes", "sha256")}
    shown["skipped"] = len(meta["skipped"])
    print(json.dumps(shown, indent=2))
    print(f"ok: {args.beton} matches its metadata (size and SHA-256)", file=sys.stderr)
    return 0


def cmd_bench_loader(args: argparse.Namespace) -> int:
    from pipeline.bench.ops import machine_line

    if args.folder is not None and not args.folder.is_dir():
        raise MissingFileError(f"--folder {args.folder}: no such folder; give an image folder PATH/<class>/<images> "
                               "or leave --folder out to generate one")
    print(f"machine: {machine_line('cpu')}")
    print(_imagenet_like(args) if args.imagenet_like else _fmnist_loaders(args))
    return 0


def _fmnist_loaders(args: argparse.Namespace) -> str:
    from pipeline.bench.loader import LoaderBenchSettings, format_loader_table, prepare_data, run_loader_benchmark

    settings = LoaderBenchSettings(images=args.images or 5000, size=args.size, res=args.res or 128, batch=args.batch,
                                   workers=args.workers, epochs=args.epochs or 4)
    folder, beton = prepare_data(args.work_dir, settings, args.folder, _log)
    return format_loader_table(run_loader_benchmark(folder, beton, settings, _log), settings)


def _imagenet_like(args: argparse.Namespace) -> str:
    import os

    from pipeline.bench.loader import format_imagenet_like, run_imagenet_like, write_imagenet_like

    threads = _int_list(args.threads, "--threads") or sorted({1, os.cpu_count() or 1})
    stores = [_store(text) for text in args.store or ["jpg:256:90"]]
    step_rates, res, images = _step_rates(args.step_rates), args.res or 224, args.images or 3000
    if min(threads) < 1 or images < 1:
        raise InputError("--threads and --images must be positive")
    folder = args.folder or args.work_dir / f"imagenet_like_{images}"
    stats = write_imagenet_like(folder, images, classes=10, seed=0, log=_log)
    rates = run_imagenet_like(folder, stores, threads, args.batch, res, args.epochs or 3, _log)
    return format_imagenet_like(stats, rates, step_rates, res, args.batch)


def _store(text: str):
    """``MODE:MAX_RES:QUALITY[:COMPRESS_PROBABILITY]`` -> ``WriteSettings``."""
    import os

    from pipeline.data import WriteSettings

    parts = text.split(":")
    try:
        mode, max_res, quality = parts[0], int(parts[1]), int(parts[2])
        probability = float(parts[3]) if len(parts) == 4 else 0.5
    except (IndexError, ValueError):
        raise InputError(f"--store {text!r}: give MODE:MAX_RES:QUALITY[:COMPRESS_PROBABILITY], for example "
                         "jpg:256:90 or proportion:256:90:0.5") from None
    if mode not in ("jpg", "raw", "smart", "proportion") or len(parts) > 4:
        raise InputError(f"--store {text!r}: MODE is one of jpg, raw, smart, proportion")
    return WriteSettings(mode=mode, max_res=max_res, quality=quality, compress_probability=probability,
                         workers=os.cpu_count() or 1)


def _step_rates(text: str) -> dict[str, float]:
    rates = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        try:
            rates[name.strip()] = float(value)
        except ValueError:
            raise InputError(f"--step-rates {text!r}: give NAME=IMAGES_PER_S pairs, comma-separated") from None
    if not rates or min(rates.values()) <= 0:
        raise InputError(f"--step-rates {text!r}: give at least one positive NAME=IMAGES_PER_S")
    return rates


def cmd_train(args: argparse.Namespace) -> int:
    from pipeline.train import run_training

    overrides = list(args.overrides) + ([f"train.address={args.address}"] if args.address else [])
    config = load_config(args.config, overrides)
    result = run_training(config)
    summary = result.summary
    print(f"done: {config.train.mode} {config.train.name}: val_top1 {summary['val_top1']:.2f}% after "
          f"{summary['epoch']} epochs")
    if result.keep is not None:
        print(f"keep: {','.join(map(str, result.keep))}")
    print(f"checkpoint: {result.checkpoint}")
    print(f"mlflow: run {result.run_id} in {config.train.tracking_uri}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import json

    from pipeline.dag.plan import count_plan
    from pipeline.dag.runner import run_experiment

    overrides = list(args.overrides)
    if args.tracking_uri:
        overrides.append(f"train.tracking_uri={args.tracking_uri}")
    config = load_config(args.config, overrides)
    if config.experiment is None:
        raise ConfigError(f"{args.config}: `pipeline run` needs an experiment section; see configs/experiments/")
    if args.plan:
        print(json.dumps(count_plan(config).as_dict()))
        return 0
    run_experiment(config, force=args.force, address=args.address, log=lambda line: print(line, flush=True))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pipeline.report import read_csv, write_report

    folder = _find_run_folder(args.run, args.tracking_uri)
    rows = read_csv(folder / "results.csv")
    out = args.out or folder
    files = write_report(rows, out, title=f"Experiment {folder.name}")
    print((out / "report.md").read_text())
    print(f"wrote {', '.join(str(p) for p in files.values())}", file=sys.stderr)
    return 0


def cmd_select(args: argparse.Namespace) -> int:
    from pipeline.budget import best_under_budget, candidates, open_store

    models = candidates(open_store(args.tracking_uri), args.experiment)
    pick = best_under_budget(models, max_gflops=args.max_gflops, min_images_per_s=args.min_images_per_s,
                             device=args.device)
    print(f"model: {pick.uri}\ntop1: {pick.top1:.2f}\ngflops: {pick.gflops:.4f}\n"
          f"images_per_s: {pick.images_per_s:.1f} ({pick.device})\nmethod: {pick.method}\nlevel: {pick.level}")
    return 0


def _find_run_folder(run: str | None, tracking_uri: str) -> Path:
    """RUN: a folder with results.csv, an experiment name under runs/experiments, or an MLflow parent run id."""
    base = Path("runs/experiments")
    if run is None:
        found = sorted(base.glob("*/results.csv"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise MissingFileError("no experiment results under runs/experiments; run `python -m pipeline run` first")
        return found[-1].parent
    for candidate in (Path(run), base / run):
        if (candidate / "results.csv").is_file():
            return candidate
    from pipeline.tracking import store_missing

    if store_missing(tracking_uri):  # reading must not create a store: MLflow would make an empty database there
        raise MissingFileError(f"{run!r} is neither a folder with results.csv nor an experiment under {base}, and "
                               f"there is no MLflow store at {tracking_uri} to look the run up in")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        local = client.download_artifacts(run, "report")
    except Exception as err:  # noqa: BLE001 - MLflow raises several types for an unknown run
        raise MissingFileError(f"{run!r} is neither a folder with results.csv, an experiment under {base}, nor an "
                                f"MLflow run in {tracking_uri} with a report ({err})") from None
    return Path(local)


def _subject(args: argparse.Namespace):
    from pipeline.analysis import load_subject

    return load_subject(checkpoint=args.checkpoint, model=args.model, weights=args.weights)


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, got {text!r}") from None


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
        import numpy as np

        pictures = np.concatenate(list(beton_images(args.data, subject, count=args.count, batch=args.count)))
        names = [f"{Path(args.data).stem}{i:04d}" for i in range(len(pictures))]
    else:
        raise InputError("give --images PATH... or --data BETON")
    layers = _int_list(args.layers, "--layers") or default_layers(subject.depth)
    files = cluster_maps(subject, pictures, names, methods=methods, keep=keep, layers=layers, out=args.out,
                         sheet_layer=args.sheet_layer, log=_log)
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
    print("\n".join(str(f) for f in write_redundancy(subject, data, args.out, qk_alphas=alphas, log=_log)))
    return 0


def cmd_analyze_reconstruction(args: argparse.Namespace) -> int:
    from pipeline.analysis.artifacts import write_reconstruction
    from pipeline.analysis.probe import first_batches
    subject = _subject(args)
    ks = _int_list(args.k, "--k")
    if ks is None and subject.keep is None:
        ks = [max(1, subject.num_tokens // 4)]
    data = first_batches(args.data, subject, batches=args.batches, batch=args.batch_size)
    methods = args.method.split(",") if args.method else None
    files = write_reconstruction(subject, data, args.out, methods=methods, ks=ks,
                                 keep=subject.keep if ks is None else None, log=_log)
    print("\n".join(str(f) for f in files))
    return 0


def _add_subject_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, help="a `pipeline train` checkpoint (directory or .pt)")
    parser.add_argument("--model", default=None, help="or a timm model name (random weights unless --weights)")
    parser.add_argument("--weights", default=None, help="a timm state-dict file for --model")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the PNGs and CSVs")


def _add_analysis_commands(commands) -> None:
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
    for parser in (redundancy, reconstruction):
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


def _add_run_commands(commands) -> None:
    run = commands.add_parser("run", help="the stage DAG: base, K search, finetune sweep, evaluate, select")
    _add_config_args(run, required=True)
    run.add_argument("--force", default=None, metavar="STAGE",
                     help="rerun STAGE (base, ksearch, finetune, evaluate, select) and everything after it")
    run.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the config's SQLite store)")
    run.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    run.add_argument("--plan", action="store_true", help="print the number of stages per kind and exit")
    run.set_defaults(func=cmd_run)
    report = commands.add_parser("report", help="print the results table and write report.md with plots")
    report.add_argument("run", nargs="?", default=None,
                        help="results folder, experiment name or MLflow parent run id (default: the latest)")
    report.add_argument("--out", type=Path, default=None, help="write the report here instead")
    report.add_argument("--tracking-uri", default="sqlite:///runs/mlflow.db")
    report.set_defaults(func=cmd_report)
    select = commands.add_parser("select", help="the best model of an experiment under a GFLOPs or speed budget")
    select.add_argument("--experiment", required=True, help="experiment.name of a `pipeline run`")
    budget = select.add_mutually_exclusive_group(required=True)
    budget.add_argument("--max-gflops", type=float, default=None)
    budget.add_argument("--min-images-per-s", type=float, default=None,
                        help="measured images/s, as the evaluate stage timed them")
    select.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="only models timed on this device (default: any)")
    select.add_argument("--tracking-uri", default="sqlite:///runs/mlflow.db")
    select.set_defaults(func=cmd_select)


def _add_train_command(commands) -> None:
    train = commands.add_parser("train", help="one training job on Ray Train (base, ksearch, finetune, baseline)")
    _add_config_args(train, required=True)
    train.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    train.set_defaults(func=cmd_train)


def _add_data_commands(commands) -> None:
    data = commands.add_parser("data", help="write and check datasets")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    write = data_commands.add_parser("write", help="write a source to an FFCV .beton (+ .beton.json metadata)")
    write.add_argument("--source", required=True,
                       help="imagefolder:PATH | fashion-mnist:train | fashion-mnist:test | "
                            "synthetic[:classes=C,count=N,size=S]")
    write.add_argument("--out", required=True, type=Path, help="the .beton to write (atomically)")
    write.add_argument("--max-res", type=int, default=256, help="longest side kept (default 256; 0: keep as is)")
    write.add_argument("--quality", type=int, default=90, help="JPEG quality, 1..100 (jpg, smart, proportion)")
    write.add_argument("--compress-probability", type=float, default=0.5,
                       help="mode proportion: the share of images stored as JPEG, the rest raw (default 0.5)")
    write.add_argument("--mode", choices=("jpg", "raw", "smart", "proportion"), default=None,
                       help="how images are stored (default: raw for fashion-mnist and synthetic, jpg otherwise)")
    write.add_argument("--workers", type=int, default=2, help="writer processes")
    write.add_argument("--limit", type=int, default=None, help="write only N images, spread over all classes")
    write.add_argument("--strict", action="store_true", help="fail on the first unreadable file instead of skipping it")
    write.add_argument("--overwrite", action="store_true", help="replace an existing --out (refused otherwise)")
    write.set_defaults(func=cmd_data_write)
    folder = data_commands.add_parser("folder", help="write a source as a JPEG folder PATH/<class>/*.jpg")
    folder.add_argument("--source", required=True, help="as for data write")
    folder.add_argument("--out", required=True, type=Path, help="the folder to create (must not exist)")
    folder.add_argument("--size", type=int, default=None, help="resize every image to SIZE x SIZE")
    folder.add_argument("--limit", type=int, default=None, help="write only N images, spread over all classes")
    folder.set_defaults(func=cmd_data_folder)
    check = data_commands.add_parser("check", help="verify a .beton against its metadata (size and SHA-256)")
    check.add_argument("beton", type=Path)
    check.add_argument("--num-classes", type=int, default=None, help="also require this many classes")
    check.set_defaults(func=cmd_data_check)


def _add_bench_kernels(bench_commands) -> None:
    kernels = bench_commands.add_parser("kernels", help="K-Medoids' Triton kernels against torch, the patch "
                                        "embedding's variants, and the clustering step's products in float32 and "
                                        "bf16, at DeiT-S size (CUDA)")
    kernels.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                         help="cpu: a dry run of the code under TRITON_INTERPRET=1 (no meaningful times)")
    kernels.add_argument("--batch", type=int, default=256)
    kernels.set_defaults(func=cmd_bench_kernels)


def _add_bench_loader(bench_commands) -> None:
    loader = bench_commands.add_parser("loader", help="FFCV against torchvision's DataLoader on one JPEG folder; "
                                       "--imagenet-like: FFCV's host work per core at ImageNet's sizes")
    loader.add_argument("--folder", type=Path, default=None,
                        help="an image folder to read (default: generated in --work-dir)")
    loader.add_argument("--work-dir", type=Path, default=Path("runs/bench_loader"), help="where data is written")
    loader.add_argument("--images", type=int, default=None,
                        help="images in the generated folder (default 5000; 3000 with --imagenet-like)")
    loader.add_argument("--size", type=int, default=160, help="side of the generated Fashion-MNIST JPEGs")
    loader.add_argument("--res", type=int, default=None,
                        help="output resolution (default 128; 224, DeiT's, with --imagenet-like)")
    loader.add_argument("--batch", type=int, default=128)
    loader.add_argument("--workers", type=int, default=2, help="the same for both loaders")
    loader.add_argument("--epochs", type=int, default=None,
                        help="the first is reported apart, compilation (default 4; 3 with --imagenet-like)")
    imagenet = loader.add_argument_group("--imagenet-like")
    imagenet.add_argument("--imagenet-like", action="store_true",
                          help="JPEGs of ImageNet's sizes and natural-image statistics, stored as --store, loaded "
                               "with DeiT's random-resized crop and flip, one decoding thread a core")
    imagenet.add_argument("--store", action="append", default=None, metavar="MODE:MAX_RES:QUALITY[:P]",
                          help="how the .beton stores them, as `data write` flags (repeatable; default jpg:256:90, "
                               "configs/experiments/paper_deit_imagenet.yaml's); P: proportion's compress probability")
    imagenet.add_argument("--threads", default=None, help="decoding threads to time, comma-separated (default: 1 and "
                          "every core)")
    imagenet.add_argument("--step-rates", default="unmodified=8331,wkmedoids=9085",
                          help="a GPU's training-step images/s, NAME=RATE,... (default: DeiT-S, H200, bf16, batch "
                               "128, compiled: docs/benchmarks.md)")
    loader.set_defaults(func=cmd_bench_loader)


def _add_model_bench_args(parser: argparse.ArgumentParser, dtypes: tuple[str, ...]) -> None:
    """The flags ``bench throughput`` and ``bench loop`` share; each sets a key of the command's section."""
    _add_config_args(parser, required=False)
    parser.add_argument("--model", default=None, help="timm model name")
    parser.add_argument("--methods", "--method", dest="methods", default=None,
                        help="downsampling method(s), comma-separated, timed in one run")
    parser.add_argument("--keep", default=None, help="K_1..K_L, comma-separated")
    parser.add_argument("--level", type=int, default=None, help="the paper's sparsity level")
    parser.add_argument("--batch", type=int, default=None, help="batch size")
    parser.add_argument("--dtype", choices=dtypes, default=None, help="autocast dtype (default fp32)")
    parser.add_argument("--compile", choices=("none", "default", "reduce-overhead", "max-autotune"),
                        default=None, help="torch.compile every model in this mode (default none)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default cpu")
    parser.add_argument("--patch-embed", choices=get_args(PatchEmbed), default=None,
                        help="every model's patch embedding: timm's convolution (default) or the same function as "
                             "one matmul")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description="Token Pooling in Vision Transformers.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = commands.add_parser("config", help="validate and print a resolved config")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="print the resolved config (defaults, file, --set)")
    _add_config_args(show, required=False)
    show.add_argument("--out", type=Path, default=None, help="also write config.yaml into this directory")
    show.set_defaults(func=cmd_config_show)

    methods = commands.add_parser("methods", help="list the downsampling methods")
    methods.set_defaults(func=cmd_methods)

    flops = commands.add_parser("flops", help="GFLOPs of a (downsampling) model, with a breakdown (fvcore)")
    flops.add_argument("--model", default="deit_small_patch16_224", help="timm model name")
    flops.add_argument("--embed-dim", type=int, default=None, help="a DeiT of this width instead of --model's")
    flops.add_argument("--method", default="none", help="downsampling method (python -m pipeline methods)")
    flops.add_argument("--keep", default=None, help="K_1..K_L, comma-separated (default: keep all)")
    flops.add_argument("--level", type=int, default=None, help="the paper's sparsity level (configs/sparsity/)")
    flops.add_argument("--iters", type=int, default=5, help="clustering iterations (they cost FLOPs for K-Means)")
    flops.add_argument("--json", action="store_true", help="print a JSON object with a 'gflops' field")
    flops.set_defaults(func=cmd_flops)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    ops = bench_commands.add_parser("ops", help="time each method against one transformer block")
    _add_config_args(ops, required=False)
    ops.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    ops.set_defaults(func=cmd_bench_ops)
    throughput = bench_commands.add_parser("throughput", help="images/s of a downsampling model against the "
                                           "unmodified one, and the realised fraction of the FLOP saving")
    _add_model_bench_args(throughput, dtypes=("fp32", "bf16", "fp16"))
    throughput.add_argument("--calls", type=int, default=None,
                            help="calls a timed sample queues back to back before one device sync (default 10 on "
                                 "CUDA: throughput; 1 measures each call's latency from an idle GPU)")
    throughput.add_argument("--train", action="store_true",
                            help="time a training step (forward, backward, AdamW) instead of inference")
    throughput.add_argument("--profile", action="store_true",
                            help="also log a profile of one call of each model (stderr): on CUDA the device time by "
                                 "kernel group and the longest kernels, then torch.profiler's table")
    throughput.set_defaults(func=cmd_bench_throughput)
    loop = bench_commands.add_parser("loop", help="the training loop against the bare step it runs (loop "
                                     "efficiency), on batches already on the device")
    _add_model_bench_args(loop, dtypes=("fp32", "bf16"))
    loop.add_argument("--steps", type=int, default=None, help="steps of a timed epoch (default 20)")
    loop.add_argument("--repeats", type=int, default=None, help="timed pairs; the median is reported (default 3)")
    loop.add_argument("--log-every", type=int, default=None, help="the loop's train.log_every (default 50)")
    loop.set_defaults(func=cmd_bench_loop)
    _add_bench_loader(bench_commands)
    _add_bench_kernels(bench_commands)
    _add_data_commands(commands)
    _add_train_command(commands)
    _add_run_commands(commands)
    _add_analysis_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PipelineError as err:  # ours, on purpose: one line; anything else keeps its traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
