"""``doctor``: every fused kernel against the torch path on this device (``models.selfcheck``), at the shapes of
the config's model."""

from __future__ import annotations

import argparse
import os
import sys

from pipeline.cli.common import add_config_args
from pipeline.config import ConfigError, load_config


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    from pipeline.models.selfcheck import doctor, doctor_table, kernels_planned, mismatch_message

    config = load_config(args.config, args.overrides)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    choice = config.kernels.choice()
    shapes = config_shapes(config)
    # Triton reads TRITON_INTERPRET when it is imported: the interpreted checks run only where it was set
    # for this process, not a kernel choice.
    results, skipped = doctor(choice, device, interpret=os.environ.get("TRITON_INTERPRET") == "1", shapes=shapes)
    print(doctor_table(results, skipped, kernels_planned(choice, device), shapes))
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"error: {mismatch_message(result)}", file=sys.stderr)
    return 1 if failed else 0


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
    return model_shapes(create_model(config.model.name, **args, method="kmedoids", keep=keep))


def add_commands(commands) -> None:
    doctor = commands.add_parser("doctor", help="check every fused kernel against the torch path on this device "
                                 "and print the errors and times")
    add_config_args(doctor, required=False)
    doctor.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU where there is one")
    doctor.set_defaults(func=cmd_doctor)
