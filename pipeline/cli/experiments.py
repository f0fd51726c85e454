"""``run``, ``report`` and ``select``: the stage DAG, its report, and a pick from its Pareto front."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from pipeline.cli.common import add_config_args
from pipeline.config import ConfigError, error_message, load_config
from pipeline.config.serve import MAX_BODY_MB, MAX_IMAGES, MAX_PIXELS, ServeConfig
from pipeline.dag.checks import plan_checks, unmeasured_targets
from pipeline.dag.plan import archs, conv_levels, count_plan
from pipeline.dag.rehearse import RehearsalSettings, run_rehearsal
from pipeline.errors import InputError, MissingFileError
from pipeline.report import rebuild_report
from pipeline.serving.server import DEFAULT_STORE, RUNTIMES, serve
from pipeline.spread import machine_record


def cmd_run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.tracking_uri:
        overrides.append(f"train.tracking_uri={args.tracking_uri}")
    config = load_config(args.config, overrides)
    if config.experiment is None:
        raise ConfigError(f"{args.config}: `pipeline run` needs an experiment section; see configs/experiments/")
    if args.plan:
        plan_checks(config, args.address)
        for line in unmeasured_targets(config):
            print(f"[plan] {line}", file=sys.stderr)
        conv = config.experiment.conv
        for arch in [a for a in archs(config) if conv is not None and (conv.archs is None or a.label in conv.archs)]:
            placements = conv_levels(config, arch)  # 0 said too: a grid too small for every layer count asked for
            print(f"[plan] experiment.conv: {len(placements)} placement(s) for {arch.label}"
                  + (f" ({', '.join(placements)})" if 0 < len(placements) <= 12 else ""), file=sys.stderr)
        counts = count_plan(config)
        if config.model.qk_norm is not None:
            print(f"[plan] model.qk_norm: {config.model.qk_norm} (alpha {config.model.alpha:g}) in every stage: the "
                  "bases, K searches, finetunes and evaluations (Appendix F)", file=sys.stderr)
        untrained = config.experiment.no_finetune
        if untrained is not None:
            print(f"[plan] experiment.no_finetune: {counts.evaluate - counts.finetune} evaluation(s) without training "
                  f"(each base unmodified, then {', '.join(untrained.methods)} at each level, carry "
                  f"{'/'.join('on' if c else 'off' for c in untrained.carry)}); in the report, in no front",
                  file=sys.stderr)
        print(json.dumps(counts.as_dict()))
        return 0
    from pipeline.dag.runner import run_experiment  # here: --plan needs none of torch, Ray or MLflow's runner

    given = [flag for flag, value in (("--rehearse-dir", args.rehearse_dir), ("--rehearse-steps", args.rehearse_steps),
                                      ("--rehearse-fail", args.rehearse_fail)) if value is not None]
    if not args.rehearse and given:
        raise InputError(f"{', '.join(given)}: the --rehearse-* flags belong to --rehearse; add it")
    if args.rehearse:
        settings = RehearsalSettings(fail_method=args.rehearse_fail, **{key: value for key, value in (
            ("root", args.rehearse_dir), ("steps", args.rehearse_steps)) if value is not None})
        return run_rehearsal(config, settings, address=args.address, log=lambda line: print(line, flush=True))
    try:
        run_experiment(config, force=args.force, address=args.address, log=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("interrupted: run the same command again; finished stages are skipped and unfinished trainings "
              "resume from their last checkpoints", file=sys.stderr)
        return 130
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise InputError(f"--out {args.out} is a file; give a folder for report.md and the plots")
    folder = _find_run_folder(args.run, args.tracking_uri)
    out = args.out or folder
    files = rebuild_report(folder, out, log=lambda line: print(line, file=sys.stderr))
    print((out / "report.md").read_text())
    print(f"wrote {', '.join(str(p) for p in files.values())}", file=sys.stderr)
    return 0


def _pick(args: argparse.Namespace):
    from pipeline.select_model import best_under_budget, candidates, open_store

    models = candidates(open_store(args.tracking_uri), args.experiment)
    return best_under_budget(models, max_gflops=args.max_gflops, min_images_per_s=args.min_images_per_s,
                             device=args.device, max_latency_ms=args.max_latency_ms, table=args.table)


def cmd_select(args: argparse.Namespace) -> int:
    from pipeline.select_model import RATE_INTERVAL_SCOPE

    pick = _pick(args)
    interval = "" if pick.images_per_s_low is None else \
        f" [{pick.images_per_s_low:.1f}, {pick.images_per_s_high:.1f}] ({RATE_INTERVAL_SCOPE})"
    print(f"model: {pick.uri}\ntop1: {pick.top1:.2f}\ngflops: {pick.gflops:.4f}\n"
          f"images_per_s: {pick.images_per_s:.1f}{interval} ({pick.device})\n"
          f"method: {pick.method}\nlevel: {pick.level}")
    spread = (machine_record(pick.device_name, pick.threads, pick.timing) if pick.images_per_s_low is not None
              else None)
    if spread is not None:  # the intervals hold within a run; this is how far a run moves on the timed device
        print(f"machine_spread: {spread.between:.1%} between processes (sd/mean), median half-width "
              f"{spread.within:.1%} within one ({spread.source()})")
        low, high = spread.across_runs(pick.images_per_s, pick.images_per_s_low, pick.images_per_s_high)
        print(f"images_per_s_across_runs: [{low:.1f}, {high:.1f}] (the interval widened by that spread, each side "
              f"apart; measured with {spread.window()})")
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

def cmd_serve(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.experiment is None):
        raise InputError("give a MODEL (token-pooling-demo@best) or --experiment NAME with a budget, not both")
    if args.experiment is not None and args.max_gflops is None and args.min_images_per_s is None \
            and args.max_latency_ms is None:
        raise InputError("--experiment needs a budget: --max-gflops X or --min-images-per-s Y")
    limits = _serve_limits(args)
    model = args.model if args.model is not None else _pick(args).uri
    return serve(model, host=args.host, port=args.port, workers=args.workers, tracking_uri=args.tracking_uri,
                 verbose=args.verbose, limits=limits, runtime=args.runtime, log=lambda line: print(line, flush=True))


def _serve_limits(args: argparse.Namespace):
    given = {key: getattr(args, key) for key in ServeConfig.model_fields if getattr(args, key) is not None}
    try:
        return ServeConfig(**given)
    except ValidationError as err:
        problems = "; ".join(f"--{str(e['loc'][0]).replace('_', '-')} {e['input']}: {error_message(e)}"
                             for e in err.errors())
        raise ConfigError(problems) from None


def _add_budget_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    budget = parser.add_mutually_exclusive_group(required=required)
    budget.add_argument("--max-gflops", type=float, default=None)
    budget.add_argument("--min-images-per-s", type=float, default=None,
                        help="measured images/s: a model fits when the lower end of its interval (the select stage's, "
                        "on one scale for every width; at least 90%%: a model's 95%% interval chained with its "
                        "reference's) is at least this")
    budget.add_argument("--max-latency-ms", type=float, default=None,
                        help="latency measured against --table (a K-search target's models; the measured ratio times "
                        "the measured unmodified model's ms, not the table's prediction): a model fits when the "
                        "upper end of its interval (the ratio's 95%% interval times the measured unmodified "
                        "model's ms) is at most this")
    parser.add_argument("--table", default=None, help="the cost table --max-latency-ms refers to")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="only models timed on this device (default: any)")
    parser.add_argument("--tracking-uri", default=DEFAULT_STORE)


def _add_serve_command(commands) -> None:
    serve = commands.add_parser("serve", help="serve a registered model over HTTP: images in, class names out")
    serve.add_argument("model", nargs="?", default=None,
                       help="NAME@ALIAS (token-pooling-demo@best), NAME/VERSION, a models:/ URI or a model folder")
    serve.add_argument("--experiment", default=None, help="or the best model of this experiment under a budget")
    _add_budget_args(serve, required=False)
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=5000)
    serve.add_argument("--workers", type=int, default=1, help="server processes")
    serve.add_argument("--verbose", action="store_true", help="the server's access log")
    serve.add_argument("--runtime", choices=RUNTIMES, default="torch",
                       help="torch (the registered model) or onnxruntime (the ONNX classifier registered beside it, "
                            "NAME-onnx: decoding in PIL and numpy, the network in onnxruntime)")
    limits = serve.add_argument_group("limits per request (over them: HTTP 400, or 413 for the body)")
    limits.add_argument("--max-pixels", type=int, default=None,
                        help=f"pixels per image, read from its header before decoding (default {MAX_PIXELS})")
    limits.add_argument("--max-images", type=int, default=None, help=f"images per request (default {MAX_IMAGES})")
    limits.add_argument("--max-body-mb", type=float, default=None,
                        help=f"request body in MiB (default {MAX_BODY_MB:g})")
    serve.set_defaults(func=cmd_serve)


def add_commands(commands) -> None:
    run = commands.add_parser("run", help="the stage DAG: base, K search, finetune sweep, evaluate, select")
    add_config_args(run, required=True)
    run.add_argument("--force", default=None, metavar="STAGE",
                     help="rerun STAGE (base, ksearch, finetune, evaluate, select) and everything after it")
    run.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the config's SQLite store)")
    run.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    run.add_argument("--plan", action="store_true", help="check what can be known without running (every stage's "
                     "config, K-search targets, learning rates, data paths, batch against the training set, resources "
                     "against the cluster), print the stages per kind and exit (docs/usage.md)")
    run.add_argument("--rehearse", action="store_true",
                     help="a dress rehearsal: a slice of the DAG covering every architecture, method and stage kind "
                          "at the real shapes for a few steps each, on synthetic ImageNet-like data, in its own "
                          "runs folder and MLflow store; prints a table per stage and the projected GPU-hours; "
                          "exits 1 unless every stage it was to run ran and passed")
    run.add_argument("--rehearse-dir", type=Path, default=None,
                     help="the rehearsal's data, Ray storage, MLflow store and report (default: runs/rehearsal); "
                          "each rehearsal empties its store first and keeps its data")
    run.add_argument("--rehearse-steps", type=int, default=None, help="training steps a rehearsed stage (default: 2)")
    run.add_argument("--rehearse-fail", default=None, metavar="METHOD",
                     help="plant a failure at the first step of METHOD's finetune (to see the rehearsal report it)")
    run.add_argument("--verbose", action="store_true",
                       help="also Ray Train's and Tune's per-report and per-checkpoint lines (PIPELINE_VERBOSE=1)")
    run.set_defaults(func=cmd_run)
    report = commands.add_parser("report", help="print the results table and write report.md with plots")
    report.add_argument("run", nargs="?", default=None,
                        help="results folder, experiment name or MLflow parent run id (default: the latest)")
    report.add_argument("--out", type=Path, default=None, help="write the report here instead")
    report.add_argument("--tracking-uri", default=DEFAULT_STORE)
    report.set_defaults(func=cmd_report)
    select = commands.add_parser("select",
                                 help="the best model of an experiment under a GFLOPs, speed or latency budget")
    select.add_argument("--experiment", required=True, help="experiment.name of a `pipeline run`")
    _add_budget_args(select, required=True)
    select.set_defaults(func=cmd_select)
    _add_serve_command(commands)
