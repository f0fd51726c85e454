"""``config show``, ``methods`` and ``flops``: what a config, the registry and a model are."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import yaml

from pipeline.cli.common import add_config_args
from pipeline.config import dump_config, load_config, write_resolved
from pipeline.errors import InputError, PipelineWarning
from pipeline.methods import METHODS, plugin_of


def cmd_config_show(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    print(dump_config(config), end="")
    if args.out is not None:
        print(f"wrote {write_resolved(config, args.out)}", file=sys.stderr)
    return 0


def methods_table() -> str:
    """The registry as the Markdown table of docs/usage.md: each method's summary, what it reads, its options
    (default and allowed values) and whether its pooling step has closed-form GFLOPs."""
    lines = ["| name | method | reads | options (`pooling.options.NAME.KEY`: default, allowed) | closed-form GFLOPs |",
             "|---|---|---|---|---|"]
    for name, spec in METHODS.items():
        options = "; ".join(f"`{key}`: {option.describe()}" for key, option in spec.options.items()) or "-"
        reads = "scores" if spec.needs_scores else "-"
        lines.append(f"| `{name}` | {spec.summary} | {reads} | {options} | {'yes' if spec.flops else '-'} |")
    return "\n".join(lines) + "\n"


def cmd_methods(args: argparse.Namespace) -> int:
    """Every method, with the package and version of each plugin's (``--markdown``: docs/usage.md's table); exit 2
    when a plugin was left out, or a method's operator fails with one of its options (``models.probe``)."""
    from pipeline.models.probe import probe_method

    with warnings.catch_warnings():  # the plugins left out are listed below as errors, not warned twice
        warnings.simplefilter("ignore", PipelineWarning)
        names = list(METHODS)
    if args.markdown:
        print(methods_table(), end="")
        names = []
    for name in names:
        spec, plugin = METHODS[name], plugin_of(name)
        needs = "significance scores" if spec.needs_scores else "-"
        kind = "learnable" if spec.learnable else "parameter-free"
        source = "built-in" if name in METHODS.builtin else f"from {plugin}" if plugin else "registered in code"
        flops = "closed-form GFLOPs" if spec.flops is not None else "GFLOPs by fvcore only"
        print(f"{name:11s} {spec.summary:30s} {kind:15s} needs: {needs:20s} {flops:22s} {source}")
        for key, option in spec.options.items():
            print(f"    pooling.options.{name}.{key} = {option.describe()}" + (f": {option.doc}" if option.doc else ""))
    problems = list(METHODS.problems.values())
    for name in list(METHODS):
        try:
            probe_method(name)
        except InputError as err:
            problems.append(str(err))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def parse_option(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--option``, the value read as YAML."""

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise InputError(f"--option {item!r}: expected KEY=VALUE, for example --option iters=3")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise InputError(f"--option {item!r}: the value is not YAML ({str(err).splitlines()[0]})") from None


def cmd_flops(args: argparse.Namespace) -> int:
    from pipeline.flops import format_report, model_flops

    report = model_flops(args.model, embed_dim=args.embed_dim, method=args.method, keep=args.keep, level=args.level,
                         options=dict(parse_option(item) for item in args.option), img_size=args.img_size)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0


def add_commands(commands) -> None:
    config = commands.add_parser("config", help="validate and print a resolved config")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="print the resolved config (defaults, file, --set)")
    add_config_args(show, required=False)
    show.add_argument("--out", type=Path, default=None, help="also write config.yaml into this directory")
    show.set_defaults(func=cmd_config_show)

    methods = commands.add_parser("methods", help="list the downsampling methods")
    methods.add_argument("--markdown", action="store_true", help="the registry as docs/usage.md's Markdown table")
    methods.set_defaults(func=cmd_methods)

    flops = commands.add_parser("flops", help="GFLOPs of a (downsampling) model, with a breakdown (fvcore)")
    flops.add_argument("--model", default="deit_small_patch16_224", help="timm model name")
    flops.add_argument("--embed-dim", type=int, default=None, help="a DeiT of this width instead of --model's")
    flops.add_argument("--img-size", type=int, default=None,
                       help="images of this size a side (default: the model's); the keep list counts its tokens")
    flops.add_argument("--method", default="none", help="downsampling method (python -m pipeline methods)")
    flops.add_argument("--keep", default=None, help="K_1..K_L, comma-separated (default: keep all)")
    flops.add_argument("--level", type=int, default=None, help="the paper's sparsity level (configs/sparsity/)")
    flops.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="an option of --method (`pipeline methods` lists them; the value is YAML), for example "
                       "--option iters=3 (K-Means' later iterations cost FLOPs); repeatable")
    flops.add_argument("--json", action="store_true", help="print a JSON object with a 'gflops' field")
    flops.set_defaults(func=cmd_flops)
