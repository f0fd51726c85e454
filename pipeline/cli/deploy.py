"""``export``: a trained model, with its downsampling, to an ONNX file checked in ONNX Runtime (pipeline/export.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import log
from pipeline.errors import InputError


def cmd_export(args: argparse.Namespace) -> int:
    from pipeline.analysis.probe import load_subject, method_model, subject_images
    from pipeline.export import ExportError, check_onnx, export_onnx, require_runtime

    require_runtime()  # before minutes of loading: a missing runtime is one line
    if args.batch is not None and args.batch < 1:
        raise InputError(f"--batch {args.batch}: give a static batch size of at least 1, or leave it out for a "
                         "dynamic one")
    if args.check_images < 1:
        raise InputError(f"--check-images {args.check_images}: give at least 1")
    if args.out.suffix != ".onnx" or args.out.is_dir():
        raise InputError(f"--out {args.out}: give a file name ending in .onnx")
    model, label, subject = method_model(load_subject(checkpoint=args.checkpoint, model=args.model,
                                                      weights=args.weights),
                                         method=args.method, keep=args.keep, level=args.level)
    images, source = subject_images(subject, args.check_data, args.check_images)  # before minutes of exporting

    def check(partial: Path) -> None:
        log(f"checking the export in onnxruntime on {len(images)} {source}")
        result = check_onnx(model, partial, images, batch=args.batch, label=label)
        print(result.line())
        if not result.passed:
            raise ExportError(f"{label}: the export's logits differ from torch's; {args.out} was not written")

    log(f"exporting {label} ({'batch ' + str(args.batch) if args.batch else 'dynamic batch'})")
    print(f"wrote {export_onnx(model, args.out, batch=args.batch, label=label, check=check)}")
    return 0


def add_commands(commands) -> None:
    export = commands.add_parser("export", help="a trained model with its downsampling to ONNX, checked in onnxruntime")
    export.add_argument("--checkpoint", default=None, help="a `pipeline train` checkpoint (directory or .pt)")
    export.add_argument("--model", default=None, help="or a timm model name (random weights unless --weights)")
    export.add_argument("--weights", default=None, help="a timm state-dict file for --model")
    export.add_argument("--method", default=None, help="the downsampling method (default: the checkpoint's own; none "
                        "for a base or a timm model)")
    export.add_argument("--keep", default=None, metavar="K_1,...,K_L",
                        help="the keep list (default: the checkpoint's, where --method is its own)")
    export.add_argument("--level", type=int, default=None, help="or one of the paper's sparsity levels for the model")
    export.add_argument("--batch", type=int, default=None, help="a static batch size (default: a dynamic batch)")
    export.add_argument("--check-data", type=Path, default=None,
                        help="a .beton whose first images check the export (default: the checkpoint's validation data; "
                             "random images for a timm model)")
    export.add_argument("--check-images", type=int, default=256, help="how many images check it (default 256)")
    export.add_argument("--out", type=Path, required=True, help="the .onnx file to write")
    export.set_defaults(func=cmd_export)
