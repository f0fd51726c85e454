"""``data write | folder | check``: datasets."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.cli.common import log
from pipeline.console import verbose


def cmd_data_write(args: argparse.Namespace) -> int:
    from pipeline.data import WriteSettings, open_source, write_beton

    source = open_source(args.source, limit=args.limit)
    mode = args.mode or ("jpg" if args.source.startswith("imagefolder:") else "raw")
    settings = WriteSettings(mode=mode, max_res=args.max_res or None, quality=args.quality,
                             compress_probability=args.compress_probability, workers=args.workers,
                             strict=args.strict, overwrite=args.overwrite)
    write_beton(source, args.out, settings, log=log, verbose=verbose())  # --verbose or PIPELINE_VERBOSE=1
    return 0


def cmd_data_folder(args: argparse.Namespace) -> int:
    from pipeline.data import open_source, write_folder

    write_folder(open_source(args.source, limit=args.limit), args.out, args.size, log=log)
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    from pipeline.data.loaders import check_dataset

    meta = check_dataset(args.beton, args.num_classes, full_checksum=True)
    shown = {key: meta[key] for key in ("source", "num_images", "num_classes", "settings", "bytes", "sha256")}
    shown["skipped"] = len(meta["skipped"])
    print(json.dumps(shown, indent=2))
    print(f"ok: {args.beton} matches its metadata (size and SHA-256)", file=sys.stderr)
    return 0


def add_commands(commands) -> None:
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
    write.add_argument("--verbose", action="store_true",
                       help="a failed writer process's traceback above the one-line error")
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
