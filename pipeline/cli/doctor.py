"""``doctor``: every fused kernel against the torch path on this device (``models.selfcheck``), at the shapes of
the config's model; ``doctor --speed``: the machine's run-to-run spread of a paired speed ratio (``pipeline.spread``),
of the config's pair (default the demo's)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.cli.common import add_config_args, log
from pipeline.config import ConfigError, load_config
from pipeline.errors import InputError
from pipeline.spread import OVER_S, PROCESSES, check_span, measure_spread, pair_spec

DEMO_CONFIG = Path("configs/experiments/demo.yaml")  # whose pair ``doctor --speed`` times without a CONFIG


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.speed:
        return cmd_speed(args)
    if (args.processes, args.over_s, args.out) != (None, None, None):
        raise InputError("--processes, --over-s and --out go with --speed")
    import torch

    from pipeline.models.selfcheck import doctor, doctor_table, kernels_planned, mismatch_message
    from pipeline.pooling import native

    config = load_config(args.config, args.overrides)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    choice = config.kernels.choice()
    shapes = config_shapes(config)
    # Triton reads TRITON_INTERPRET when it is imported: the interpreted checks run only where it was set
    # for this process, not a kernel choice.
    results, skipped = doctor(choice, device, interpret=os.environ.get("TRITON_INTERPRET") == "1", shapes=shapes)
    print(doctor_table(results, skipped, kernels_planned(choice, device), shapes))
    print(f"native C kernels: {native.describe(choice.native != 'torch')}")
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"error: {mismatch_message(result)}", file=sys.stderr)
    return 1 if failed else 0


def cmd_speed(args: argparse.Namespace) -> int:
    """``doctor --speed``: the pair of CONFIG (default the demo's) in ``--processes`` fresh processes over
    ``--over-s`` seconds; progress on stderr, the figures and where they were recorded on stdout."""
    processes = PROCESSES if args.processes is None else args.processes
    over_s = OVER_S if args.over_s is None else args.over_s
    check_span(processes, over_s)  # before the config and torch load
    spec = pair_spec(load_config(args.config or DEMO_CONFIG, args.overrides))
    log(f"[speed] {spec.name} (width {spec.args.get('embed_dim')}, {spec.method} at {spec.keep}) against its "
        f"unmodified model, batch {spec.eval['batch']}, {spec.eval['threads']} thread(s): {processes} processes "
        f"over {over_s:g} s")
    record = measure_spread(spec, processes, over_s, out=args.out, log=log)
    print(f"{record.summary()}; recorded in {record.path}")
    return 0


def config_shapes(config):
    """The shapes of the config's model (``models.selfcheck.model_shapes``) with its keep list (``pooling.keep``, or
    the paper's ``pooling.level``); without one, a keep list that pools in every block (``dag.rehearse.ramp_keep``'s),
    so that every block's N is checked. The shapes depend on the keep list alone, not on the method."""
    from pipeline.models import create_model
    from pipeline.models.selfcheck import model_shapes
    from pipeline.train.build import finetune_keep, model_args

    args = model_args(config) | {"pretrained": False}  # the shapes need no weights
    arch = create_model(config.model.name, **args)
    tokens, depth = int(arch.patch_embed.num_patches), len(arch.blocks)
    try:
        keep = finetune_keep(config)
    except ConfigError:  # no keep list in the config
        keep = [max(1, round(tokens * (depth - layer) / (depth + 1))) for layer in range(depth)]
    return model_shapes(create_model(config.model.name, **args, method="kmedoids", keep=keep,
                                     qk_norm=config.model.qk_norm, alpha=config.model.alpha))


def add_commands(commands) -> None:
    doctor = commands.add_parser("doctor", help="check every fused kernel against the torch path on this device "
                                 "and print the errors and times")
    add_config_args(doctor, required=False)
    doctor.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU where there is one")
    doctor.add_argument("--speed", action="store_true",
                        help="instead: the machine's run-to-run spread of one pooled/unmodified pair's speed ratio "
                        "(CONFIG's pair and experiment.eval, default configs/experiments/demo.yaml), recorded for "
                        "this machine")
    doctor.add_argument("--processes", type=int, default=None, metavar="K",
                        help=f"--speed: fresh timing processes (default {PROCESSES})")
    doctor.add_argument("--over-s", type=float, default=None, metavar="S",
                        help=f"--speed: seconds between the first process's start and the last's (default {OVER_S:g})")
    doctor.add_argument("--out", type=Path, default=None,
                        help="--speed: the record's file (default runs/machine/speed-DEVICE-tTHREADS.json, where "
                        "the report and select look it up)")
    doctor.set_defaults(func=cmd_doctor)
