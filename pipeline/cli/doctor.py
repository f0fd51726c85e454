"""``doctor``: every fused kernel against the torch path on this device (``models.selfcheck``)."""

from __future__ import annotations

import argparse
import os
import sys

from pipeline.cli.common import add_config_args
from pipeline.config import load_config


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    from pipeline.models.selfcheck import doctor, doctor_table, kernel_record, mismatch_message

    config = load_config(args.config, args.overrides)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    choice = config.kernels.choice()
    # Triton reads TRITON_INTERPRET when it is imported: the interpreted checks run only where it was set
    # for this process, not a kernel choice.
    results, skipped = doctor(choice, device, interpret=os.environ.get("TRITON_INTERPRET") == "1")
    print(doctor_table(results, skipped, kernel_record(choice, device)))
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"error: {mismatch_message(result)}", file=sys.stderr)
    return 1 if failed else 0


def add_commands(commands) -> None:
    doctor = commands.add_parser("doctor", help="check every fused kernel against the torch path on this device "
                                 "and print the errors and times")
    add_config_args(doctor, required=False)
    doctor.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU where there is one")
    doctor.set_defaults(func=cmd_doctor)
