"""``train``: one training job."""

from __future__ import annotations

import argparse

from pipeline.cli.common import add_config_args
from pipeline.config import load_config


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


def add_commands(commands) -> None:
    train = commands.add_parser("train", help="one training job on Ray Train (base, ksearch, finetune, baseline)")
    add_config_args(train, required=True)
    train.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    train.set_defaults(func=cmd_train)
