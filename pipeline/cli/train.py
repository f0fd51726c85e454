"""``train``: one training job."""

from __future__ import annotations

import argparse
import sys

from pipeline.cli.common import add_config_args
from pipeline.config import load_config
from pipeline.console import redact
from pipeline.train import run_training
from pipeline.train.launch import epochs_done, resolve_paths, run_folder


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f"train.address={args.address}"] if args.address else [])
    config = load_config(args.config, overrides)
    try:
        result = run_training(config, restart=args.restart)
    except KeyboardInterrupt:
        print(f"interrupted: {_where_it_stopped(config)}; run the same command again to resume from there",
              file=sys.stderr)
        return 130
    summary = result.summary
    print(f"done: {config.train.mode} {config.train.name}: val_top1 {summary['val_top1']:.2f}% after "
          f"{summary['epoch']} epochs")
    if result.keep is not None:
        print(f"keep: {','.join(map(str, result.keep))}")
    print(f"checkpoint: {result.checkpoint}")
    print(f"mlflow: run {result.run_id} in {redact(config.train.tracking_uri)}")
    return 0


def _where_it_stopped(config) -> str:
    folder = run_folder(resolve_paths(config))
    done = 0 if folder is None or not folder.exists() else epochs_done(folder)
    if not done:
        return f"{config.train.name} stopped before its first checkpoint"
    return f"{config.train.name} stopped after the checkpoint of epoch {done} of {config.recipe.epochs} ({folder})"


def add_commands(commands) -> None:
    train = commands.add_parser("train", help="one training job on Ray Train (base, ksearch, finetune, baseline)")
    add_config_args(train, required=True)
    train.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    train.add_argument("--restart", action="store_true",
                       help="set an earlier run of the same train.name aside (renamed, kept) and start over")
    train.add_argument("--verbose", action="store_true",
                       help="also Ray Train's and Tune's per-report and per-checkpoint lines (PIPELINE_VERBOSE=1)")
    train.set_defaults(func=cmd_train)
