"""``bench ops | throughput | loop | loader | kernels | serve | blocks | latency-check | onnx``: the measurements
(pipeline/bench/)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import get_args

from pipeline.bench.records import training_step_rates, write_record
from pipeline.bench.serve import format_load, load_test
from pipeline.cli.common import add_config_args, int_list, log
from pipeline.config import PatchEmbed, git_sha, load_config
from pipeline.errors import InputError, MissingFileError
from pipeline.methods import METHODS
from pipeline.report import markdown_table


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


def _kernels_line(config, device: str) -> tuple[str, dict[str, str]]:
    """The line every model benchmark prints under its machine line: the kernels ``auto`` resolves to on the device
    where the shape allows (``models.selfcheck.kernels_planned``: a record's key, known before anything runs)."""
    from pipeline.models.selfcheck import kernels_planned

    record = kernels_planned(config.kernels.choice(), device)
    return "kernels: " + ", ".join(f"{key}={value}" for key, value in record.items()), record


def _record(args: argparse.Namespace, kind: str, section, rows: list[dict], kernels: dict[str, str]) -> None:
    """``--record FILE``: the result as JSON (``bench.records``), what the cluster budget reads."""
    from pipeline.bench.ops import machine_line

    if args.record is None:
        return
    write_record(args.record, kind, section.model_dump(mode="json"), rows, machine=machine_line(section.device),
                 kernels=kernels, commit=git_sha(Path(__file__).parent),
                 command="python -m pipeline " + " ".join(sys.argv[1:]))
    print(f"wrote {args.record}", file=sys.stderr)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from pipeline.bench.ops import machine_line
    from pipeline.bench.throughput import format_throughput, run_throughput

    flags = ("model", "batch", "dtype", "compile", "device", "patch_embed", "calls")
    config = load_config(args.config, _bench_overrides(args, "bench_throughput", flags))
    cfg = config.bench_throughput
    result = run_throughput(cfg, config.pooling, log=lambda line: print(line, file=sys.stderr, flush=True),
                            kernels=config.kernels.choice())
    line, kernels = _kernels_line(config, cfg.device)
    print(f"machine: {machine_line(cfg.device)}\n{line}")
    print(format_throughput(cfg, result))
    rows = [{"label": "unmodified", "gflops": result.base_gflops, "images_per_s": result.base_images_per_s,
             "speedup": 1.0}]
    rows += [{"label": r.label, "gflops": r.gflops, "images_per_s": r.images_per_s, "speedup": r.speedup}
             for r in result.rows]
    _record(args, "throughput", cfg, rows, kernels)
    return 0


def cmd_bench_loop(args: argparse.Namespace) -> int:
    from pipeline.bench.loop import format_loop, run_loop_bench
    from pipeline.bench.ops import machine_line

    flags = ("model", "batch", "dtype", "compile", "device", "patch_embed", "steps", "repeats", "log_every")
    config = load_config(args.config, _bench_overrides(args, "bench_loop", flags))
    rows = run_loop_bench(config.bench_loop, config.pooling, log=log, kernels=config.kernels.choice())
    line, kernels = _kernels_line(config, config.bench_loop.device)
    print(f"machine: {machine_line(config.bench_loop.device)}\n{line}")
    print(format_loop(config.bench_loop, rows))
    _record(args, "loop", config.bench_loop, [asdict(row) for row in rows], kernels)
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from pipeline.bench.kernels import DEFAULT_KS, run_kernel_bench

    ks = DEFAULT_KS if args.ks is None else tuple(int_list(args.ks, "--ks"))
    print(run_kernel_bench(args.device, args.batch, ks))
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
    folder, beton = prepare_data(args.work_dir, settings, args.folder, log)
    return format_loader_table(run_loader_benchmark(folder, beton, settings, log), settings)


def _imagenet_like(args: argparse.Namespace) -> str:
    from pipeline.bench.loader import format_imagenet_like, run_imagenet_like, write_imagenet_like

    threads = int_list(args.threads, "--threads") or sorted({1, os.cpu_count() or 1})
    stores = [_store(text) for text in args.store or ["jpg:256:90"]]
    step_rates, res, images = _measured_rates(args.step_rates), args.res or 224, args.images or 3000
    if min(threads) < 1 or images < 1:
        raise InputError("--threads and --images must be positive")
    folder = args.folder or args.work_dir / f"imagenet_like_{images}"
    stats = write_imagenet_like(folder, images, classes=10, seed=0, log=log)
    rates = run_imagenet_like(folder, stores, threads, args.batch, res, args.epochs or 3, log)
    return format_imagenet_like(stats, rates, step_rates, res, args.batch)


def _store(text: str):
    """``MODE:MAX_RES:QUALITY[:COMPRESS_PROBABILITY]`` -> ``WriteSettings``."""

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


def _measured_rates(text: str | None) -> dict[str, float]:
    """``--step-rates``, else the newest H200 training-step record (``bench.records``)."""

    if text is not None:
        return _step_rates(text)
    try:
        return {name: round(rate) for name, rate in training_step_rates().items()}
    except ValueError as err:
        raise InputError(f"{err}; or give --step-rates NAME=IMAGES_PER_S,...") from None


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


def _add_bench_kernels(bench_commands) -> None:
    kernels = bench_commands.add_parser("kernels", help="K-Medoids' Triton kernels against torch, the patch "
                                        "embedding's variants, and the clustering step's products in float32 and "
                                        "bf16, at DeiT-S size (CUDA)")
    kernels.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                         help="cpu: a dry run of the code under TRITON_INTERPRET=1 (no meaningful times)")
    kernels.add_argument("--batch", type=int, default=256)
    kernels.add_argument("--ks", default=None, metavar="K,K,...",
                         help="the clusters of the K-Medoids and K-Means tables (default: 147,98,49, DeiT-S's 196 "
                              "tokens at keep rates 0.75, 0.5, 0.25)")
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
    imagenet.add_argument("--step-rates", default=None,
                          help="a GPU's training-step images/s, NAME=RATE,... (default: the newest H200 training-step "
                               "record in pipeline/bench/measured/, written by `bench throughput --train --record`)")
    loader.set_defaults(func=cmd_bench_loader)


def add_model_bench_args(parser: argparse.ArgumentParser, dtypes: tuple[str, ...]) -> None:
    """The flags ``bench throughput`` and ``bench loop`` share; each sets a key of the command's section."""
    add_config_args(parser, required=False)
    parser.add_argument("--record", type=Path, default=None,
                        help="also write the result as JSON (the cluster budget reads pipeline/bench/measured/)")
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


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if not args.image.is_file():
        raise MissingFileError(f"--image {args.image}: no such file; `pipeline serve` prints the path of an example")
    if args.clients < 1 or args.seconds <= 0:
        raise InputError("--clients and --seconds must be positive")
    result = load_test(args.url.rstrip("/"), args.image.read_bytes(), clients=args.clients, seconds=args.seconds,
                       top_k=args.top_k)
    print(json.dumps(result.as_dict()) if args.json else format_load(args.url, result))
    return 1 if result.errors else 0


def _add_bench_serve(bench_commands) -> None:
    serve = bench_commands.add_parser("serve", help="a bounded load test of a running `pipeline serve`: "
                                      "requests/s, p50 and p99, errors, and whether every answer was the same")
    serve.add_argument("--url", default="http://127.0.0.1:5000", help="the server (default http://127.0.0.1:5000)")
    serve.add_argument("--image", type=Path, required=True, help="an image file to send, again and again")
    serve.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    serve.add_argument("--seconds", type=float, default=10.0, help="how long (default 10)")
    serve.add_argument("--top-k", type=int, default=3)
    serve.add_argument("--json", action="store_true", help="one JSON object (with the answer when all agree)")
    serve.set_defaults(func=cmd_bench_serve)


def _blocks_settings(args: argparse.Namespace):
    """``BlocksSettings`` from ``bench blocks``' flags; the model (and method options) from --config's
    ``model:``, ``data.num_classes`` and ``pooling:`` sections, each flag overriding."""
    from pipeline.bench.blocks import BlocksSettings, ModelSpec

    config = load_config(args.config, args.overrides)
    m = config.model
    spec = ModelSpec(name=args.model or m.name, img_size=m.img_size, patch_size=m.patch_size,
                     embed_dim=args.embed_dim or m.embed_dim, depth=m.depth, num_heads=m.num_heads,
                     num_classes=config.data.num_classes if args.config is not None else None,
                     patch_embed=args.patch_embed or m.patch_embed)
    for flag in ("batch", "threads", "step", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise InputError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if not 0 < args.anchor_tolerance < 1 or not args.anchor_cap_s > 0:
        raise InputError(f"--anchor-tolerance {args.anchor_tolerance} and --anchor-cap-s {args.anchor_cap_s}: give a "
                         "tolerance between 0 and 1 (0.01 is 1% of the ratio) and a positive number of seconds")
    if args.method not in METHODS:
        raise InputError(f"--method {args.method!r}: not a registered method; `pipeline methods` lists them")
    return BlocksSettings(model=spec, method=args.method, options=config.pooling.method_options(args.method),
                          batch=args.batch, dtype=args.dtype, compile=args.compile, threads=args.threads,
                          device=args.device, step=args.step, fine=not args.no_fine, warmup=args.warmup,
                          repeats=args.repeats, anchor_tolerance=args.anchor_tolerance, anchor_cap_s=args.anchor_cap_s,
                          clock=args.clock, kernels=config.kernels.choice())


def cmd_bench_blocks(args: argparse.Namespace) -> int:
    from pipeline.bench.blocks import format_table, log_table_artifact, measure_table

    table, out = measure_table(_blocks_settings(args), args.out, log=log)
    print(format_table(table, out))
    if args.tracking_uri is not None:
        run_id = log_table_artifact(out, table, args.tracking_uri, args.experiment, args.artifact_root)
        print(f"logged {out.name} to MLflow run {run_id} (experiment {args.experiment})")
    return 0


def cmd_bench_latency_check(args: argparse.Namespace) -> int:
    from pipeline.bench.latency import format_check, run_check
    from pipeline.bench.paired import SpeedSettings
    from pipeline.cost import load_cost_model

    if args.lists < 2 or not 0 < args.tolerance < 1 or args.cap_s <= 0:
        raise InputError("--lists must be at least 2 (Kendall's tau compares pairs), --tolerance in (0, 1) and "
                         "--cap-s above 0")
    speed = SpeedSettings(tolerance=args.tolerance, cap_s=args.cap_s, warmup=args.warmup, cap_key="--cap-s")
    table, rows = run_check(load_cost_model(args.table), count=args.lists, seed=args.seed, levels=not args.no_levels,
                            other_device=args.other_device, speed=speed, log=log, where=str(args.table))
    print(format_check(table, rows, str(args.table)))
    return 0


def _add_bench_latency(bench_commands) -> None:
    blocks = bench_commands.add_parser("blocks", help="a latency table for a model and method: attention and MLP "
                                       "halves against tokens, the pooling step against (n, k), a fixed part")
    add_config_args(blocks, required=False)
    blocks.add_argument("--model", default=None, help="timm model name (default: --config's model section)")
    blocks.add_argument("--embed-dim", type=int, default=None, help="the width (an experiment's embed_dims)")
    blocks.add_argument("--method", required=True, help="the downsampling method (options from --config's pooling)")
    blocks.add_argument("--batch", type=int, default=1)
    blocks.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="autocast dtype")
    blocks.add_argument("--compile", choices=("none", "default", "max-autotune"), default="none",
                        help="torch.compile every timed part in this mode")
    blocks.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    blocks.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    blocks.add_argument("--patch-embed", choices=get_args(PatchEmbed), default=None)
    blocks.add_argument("--step", type=int, default=16, help="the token grid: the powers of two below STEP, its "
                        "multiples, and N (default 16)")
    blocks.add_argument("--no-fine", action="store_true", help="leave the powers of two below STEP out of the grid "
                        "(fewer cells: each compiled shape costs a compilation on a GPU)")
    blocks.add_argument("--warmup", type=int, default=2)
    blocks.add_argument("--repeats", type=int, default=7, help="timed pairs a cell; the median ratio is kept")
    blocks.add_argument("--anchor-tolerance", type=float, default=0.01,
                        help="the cells the fixed part comes from (the model, the halves at N) are timed in paired "
                             "ABBA blocks until their 95%% interval's half-width is about this share (bench.paired)")
    blocks.add_argument("--anchor-cap-s", type=float, default=30.0,
                        help="the most seconds each of those cells may take")
    blocks.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="what a sample's seconds are: wall time, or (on the CPU with --threads 1) the process's "
                             "CPU time, which other processes on a shared machine do not inflate")
    blocks.add_argument("--out", type=Path, default=None,
                        help="the table file (default configs/latency/DEVICE/MODEL-mM-dL-IMGpx-pP/"
                             "METHOD-bB-DTYPE-COMPILE-tT[-CLOCKclock].json); OUT.partial.json holds the cells measured "
                             "so far, and a rerun picks it up")
    blocks.add_argument("--tracking-uri", default=None, help="also log the table as an MLflow artifact there")
    blocks.add_argument("--experiment", default="latency-tables", help="the MLflow experiment (with --tracking-uri)")
    blocks.add_argument("--artifact-root", default=None, help="where a new experiment keeps its artifacts (a folder "
                        "or URI; default: the tracking server's)")
    blocks.set_defaults(func=cmd_bench_blocks)
    check = bench_commands.add_parser("latency-check", help="a latency table's predictions against whole-model "
                                      "measurements on held-out keep lists: errors and Kendall tau")
    check.add_argument("table", type=Path, help="a table written by `pipeline bench blocks`")
    check.add_argument("--lists", type=int, default=20, help="held-out keep lists, the paper's levels included")
    check.add_argument("--no-levels", action="store_true", help="random lists only")
    check.add_argument("--seed", type=int, default=0, help="of the random lists")
    check.add_argument("--warmup", type=int, default=2, help="calls of each model before a list is timed")
    check.add_argument("--tolerance", type=float, default=0.02, help="each list's paired ratio is timed in blocks "
                       "until its 95%% interval's half-width is about this share of it (bench.paired)")
    check.add_argument("--cap-s", type=float, default=30.0,
                       help="the most wall-clock seconds a list's measurement (its pilot and blocks) may take")
    check.add_argument("--other-device", action="store_true",
                       help="accept a table measured on another machine (device, threads, versions, kernels): its "
                            "figures are then a prediction, and the output says so")
    check.set_defaults(func=cmd_bench_latency_check)


def cmd_bench_onnx(args: argparse.Namespace) -> int:
    import torch

    from pipeline.analysis.probe import load_subject, method_model
    from pipeline.bench.blocks import device_name
    from pipeline.bench.onnx import onnx_speeds
    from pipeline.bench.paired import SpeedSettings
    from pipeline.export import require_runtime

    require_runtime()
    batches = int_list(args.batches, "--batches") or []
    if not batches or min(batches) < 1:
        raise InputError(f"--batches {args.batches}: give batch sizes of at least 1, comma-separated")
    methods = [m for m in args.methods.split(",") if m]
    if not methods:
        raise InputError("--methods: name at least one method, for example powerbert,wkmedoids")
    subject = load_subject(checkpoint=args.checkpoint, model=args.model, weights=args.weights)  # one set of weights
    reference, _, _ = method_model(subject, method="none")
    models = {m: method_model(subject, method=m, keep=args.keep, level=args.level)[0] for m in methods}
    settings = SpeedSettings(tolerance=args.tolerance, cap_s=args.cap_s, cap_key="--cap-s")
    speeds = onnx_speeds(models, reference, batches=batches, settings=settings, profile=args.profile, log=log)
    rows = [r.row() for r in speeds]
    header = (f"machine: {device_name(torch.device('cpu'))}, 1 thread; onnxruntime {version('onnxruntime')}; "
              f"torch {torch.__version__}; clock: the thread's CPU time")
    table = markdown_table(rows, ["method", "batch", "runtime", "speed_ratio", "speed_ratio_low", "speed_ratio_high",
                                  "speedup", "gflops_ratio", "realised", "realised_low", "realised_high", "blocks"])
    profiles = "".join(f"\n{s.method} batch {s.batch} in onnxruntime, share of node time: "
                       + ", ".join(f"{op} {share:.0%}" for op, share in s.profile) for s in speeds if s.profile)
    print(f"{header}\n\n{table}{profiles}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"{header}\ncommand: python -m pipeline {' '.join(sys.argv[1:])}\n\n{table}{profiles}\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _add_bench_onnx(bench_commands) -> None:
    onnx = bench_commands.add_parser("onnx", help="exported picks against the exported unmodified model in "
                                     "onnxruntime, paired, with torch eager beside them, and the realised fraction")
    onnx.add_argument("--checkpoint", default=None, help="a `pipeline train` checkpoint (directory or .pt)")
    onnx.add_argument("--model", default=None, help="or a timm model name (random weights unless --weights)")
    onnx.add_argument("--weights", default=None, help="a timm state-dict file for --model")
    onnx.add_argument("--methods", default="powerbert,wkmedoids", help="comma-separated (default powerbert,wkmedoids)")
    onnx.add_argument("--keep", default=None, metavar="K_1,...,K_L",
                      help="the keep list (default: the checkpoint's, for its own method)")
    onnx.add_argument("--level", type=int, default=None, help="or one of the paper's sparsity levels for the model")
    onnx.add_argument("--batches", default="1,32", help="batch sizes, comma-separated (default 1,32)")
    onnx.add_argument("--tolerance", type=float, default=0.02, help="the relative half-width aimed at (default 0.02)")
    onnx.add_argument("--cap-s", type=float, default=60.0, help="the most seconds each paired ratio may take")
    onnx.add_argument("--profile", action="store_true", help="also give each pick's share of node time by op type in "
                      "onnxruntime (its own profiler), at each batch size")
    onnx.add_argument("--out", type=Path, default=None, help="also write the table, machine and command to this file")
    onnx.set_defaults(func=cmd_bench_onnx)


def add_commands(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    ops = bench_commands.add_parser("ops", help="time each method against one transformer block")
    add_config_args(ops, required=False)
    ops.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    ops.set_defaults(func=cmd_bench_ops)
    throughput = bench_commands.add_parser("throughput", help="images/s of a downsampling model against the "
                                           "unmodified one, and the realised fraction of the FLOP saving")
    add_model_bench_args(throughput, dtypes=("fp32", "bf16", "fp16"))
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
    add_model_bench_args(loop, dtypes=("fp32", "bf16"))
    loop.add_argument("--steps", type=int, default=None, help="steps of a timed epoch (default 20)")
    loop.add_argument("--repeats", type=int, default=None, help="timed pairs; the median is reported (default 3)")
    loop.add_argument("--log-every", type=int, default=None, help="the loop's train.log_every (default 50)")
    loop.set_defaults(func=cmd_bench_loop)
    _add_bench_loader(bench_commands)
    _add_bench_kernels(bench_commands)
    _add_bench_serve(bench_commands)
    _add_bench_latency(bench_commands)
    _add_bench_onnx(bench_commands)
