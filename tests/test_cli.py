"""The real command line, run as users run it: ``python -m pipeline ...`` in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def refused(capsys, *args: str) -> str:
    """``python -m pipeline ARGS``'s error line, through the same entry point in this process (a refusal needs no
    start-up of its own: 8 s of imports a subprocess here); exit status 2."""
    from pipeline.cli import main

    assert main(list(args)) == 2
    return capsys.readouterr().err


def parser_help(capsys, *args: str) -> str:
    """``python -m pipeline ARGS --help`` through the same parser, in this process (no start-up per call)."""
    from pipeline.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*args, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_only_working_commands(capsys):
    out = run("--help").stdout  # once as a user runs it
    listed = set(re.findall(r"^    (\w+)\s", out, flags=re.M))
    assert listed == {"config", "methods", "flops", "bench", "data", "train", "run", "report", "select", "serve",
                      "viz", "analyze", "evaluate", "export", "doctor"}
    subcommands = {"bench": {"ops", "throughput", "loop", "loader", "kernels", "serve", "blocks", "latency-check",
                             "onnx"},
                   "analyze": {"redundancy", "reconstruction", "convergence"}, "viz": {"clusters"},
                   "data": {"write", "folder", "check"}, "config": {"show"}}
    for command, expected in subcommands.items():
        assert set(re.findall(r"^    ([\w-]+)\s", parser_help(capsys, command), flags=re.M)) == expected, command
        for sub in expected:  # each listed subcommand answers its own --help
            assert "usage:" in parser_help(capsys, command, sub)
    for command in listed - set(subcommands):
        assert "usage:" in parser_help(capsys, command)


@pytest.mark.slow  # a CLI subprocess or two: over 5 s (tests/tiers.py)
def test_methods_lists_the_registry():
    from pipeline.methods import METHODS

    lines = run("methods").stdout.splitlines()
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == list(METHODS)
    options = [line.split()[0] for line in lines if line.startswith(" ")]
    assert options == [f"pooling.options.{name}.{key}" for name, spec in METHODS.items() for key in spec.options]
    assert "    pooling.options.wkmedoids.iters = 5 (>= 1): rounds of assignment and centre update" in lines
    assert ("    pooling.options.tome.cluster_on = 'metric' (tokens, metric; counted in GFLOPs): match on the tokens, "
            "or on the cheaper metric (keys averaged over heads)") in lines


def test_config_show_prints_resolved_yaml(tmp_path):
    out = run("config", "show", "configs/bench_ops.yaml", "--set", "pooling.options.wkmedoids.iters=2",
              "--out", str(tmp_path))
    assert "iters: 2" in out.stdout
    assert (tmp_path / "config.yaml").is_file()


def test_bad_config_exits_2_with_a_clear_message():
    proc = run("config", "show", "--set", "pooling.itres=3", check=False)
    assert proc.returncode == 2
    assert "pooling.itres: unknown key; allowed keys here:" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bench_ops_prints_the_table(tmp_path):
    out_file = tmp_path / "bench.md"
    proc = run("bench", "ops", "configs/bench_ops.yaml", "--set", "bench.model=deit_tiny_patch16_224",
               "--set", "bench.batch=2", "--set", "bench.warmup=0", "--set", "bench.repeats=2",
               "--set", "bench.keep=[98, 49]", "--set", "bench.methods=[wkmedoids, tome, conv]",
               "--out", str(out_file))
    table = proc.stdout
    assert re.search(r"block forward: [\d.]+ ms", table)
    rows = re.findall(r"^\| ([\w ().]+?) \| (\d+|-) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| - \|$",
                      table, flags=re.M)
    labels = [(label, k) for label, k, *_ in rows]
    assert labels == [("distance matrix (torch.cdist)", "-"), ("Gram matrix (bmm)", "-"), ("wkmedoids", "98"),
                      ("wkmedoids", "49"),
                      ("wkmedoids on keys", "98"), ("wkmedoids on keys", "49"), ("tome", "98"), ("tome", "49"),
                      ("tome on tokens", "98"), ("tome on tokens", "49"), ("conv", "49")]
    assert all(float(ms) > 0 and float(block) > 0 and float(share) > 0 for _, _, ms, _, block, share, _ in rows)
    ops = {(label, k): int(n) for label, k, *_, n in rows}
    assert ops[("Gram matrix (bmm)", "-")] <= 3 < ops[("wkmedoids", "98")]
    assert out_file.read_text().startswith("machine: ")
    assert "[11/11] conv K=49" in proc.stderr, "progress goes to stderr"


@pytest.mark.slow
def test_bench_ops_times_a_tome_reference_checkout(tmp_path):
    # A stand-in with ToMe's merge API (bipartite_soft_matching, merge_wavg): the loader and the
    # side-by-side row are exercised here; a real checkout is timed the same way.
    module = tmp_path / "ToMe" / "tome" / "merge.py"
    module.parent.mkdir(parents=True)
    module.write_text(textwrap.dedent("""
        import torch

        def bipartite_soft_matching(metric, r, class_token=False, distill_token=False):
            def merge(x, mode="mean"):
                return x[:, : x.shape[1] - r]
            return merge, None

        def merge_wavg(merge, x, size=None):
            return merge(x), None
    """))
    proc = run("bench", "ops", "--set", "bench.model=deit_tiny_patch16_224", "--set", "bench.batch=2",
               "--set", "bench.warmup=0", "--set", "bench.repeats=1", "--set", "bench.keep=[147, 49]",
               "--set", "bench.methods=[tome]", "--set", f"bench.tome_reference={module.parents[1]}")
    assert "| tome (reference) | 147 |" in proc.stdout
    assert "| tome (reference) | 49 |" not in proc.stdout, "one ToMe call cannot merge more than half the tokens"


@pytest.mark.parametrize(
    "override,message",
    [
        ("bench.keep=[196]", "every K must be below the 196 tokens"),
        ("bench.tome_reference=/nonexistent", "no tome/merge.py under /nonexistent"),
    ],
)
def test_bench_ops_bad_input(override, message, capsys):
    assert message in refused(capsys, "bench", "ops", "--set", "bench.model=deit_tiny_patch16_224", "--set",
                              "bench.batch=1", "--set", "bench.repeats=1", "--set", override)


@pytest.mark.slow
def test_bench_throughput_reports_the_realised_fraction():
    proc = run("bench", "throughput", "--model", "deit_tiny_patch16_224", "--methods", "tome,powerbert",
               "--keep", "196,150,120,100,80,60,50,40,30,20,10,5", "--batch", "2",
               "--set", "bench_throughput.repeats=2", "--set", "bench_throughput.warmup=1")
    out = proc.stdout
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\| ([\w :]+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) / (\d+) \| - \| - \|$",
        out, flags=re.M)}
    assert list(rows) == ["tome", "powerbert", "ceiling: random drop"], out
    for gflops, _, speedup, ratio, realised, ops_cpu, ops_dense in rows.values():
        assert float(realised) == pytest.approx(float(speedup) / float(ratio), abs=2e-3)
        assert float(ratio) == pytest.approx(1.258 / float(gflops), rel=5e-3)  # both rounded to 3 decimals
        assert int(ops_dense) <= int(ops_cpu)
    base = re.search(r"^\| unmodified \| ([\d.]+) \| [\d.]+ \| 1 \| 1 \| - \| (\d+) \| - \| - \|$", out, flags=re.M)
    assert float(base.group(1)) == pytest.approx(1.258, abs=1e-3)  # DeiT-Ti, Table 1
    assert int(base.group(2)) < int(rows["tome"][5]), "downsampling dispatches ops of its own"
    assert "inference, batch 2, fp32, compile none, keep 196,150,120,100,80,60,50,40,30,20,10,5" in out
    assert "fp32, compile none, keep 196,150,120,100,80,60,50,40,30,20,10,5, patch embedding conv (every model), " \
           "1 call(s) a timed sample" in out, "one call a sample on the CPU by default"
    assert "host ms a call: " not in out, "the host's time is measured on CUDA only"


@pytest.mark.slow
def test_bench_loop_times_the_loop_against_its_bare_step():
    """The real train_one_epoch against the bare step on DeiT-Ti; 5 steps at log_every 2 read the device
    at steps 2 and 4 and at the end (timings are the benchmark's business, not this test's)."""
    keep = "150,120,90,80,70,60,50,40,30,20,10,0"
    proc = run("bench", "loop", "--model", "deit_tiny_patch16_224", "--methods", "none,kmedoids", "--keep", keep,
               "--batch", "2", "--steps", "5", "--repeats", "1", "--log-every", "2")
    out = proc.stdout
    assert f"model deit_tiny_patch16_224, training, batch 2, fp32, compile none, keep {keep}, 5 steps an epoch, " \
           "log_every 2, median of 1 pairs" in out, out
    rows = re.findall(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|$", out, flags=re.M)
    assert [row[0] for row in rows] == ["unmodified", "kmedoids"], out
    for _, step, loop, efficiency, reads in rows:
        assert float(efficiency) > 0 and float(step) > 0 and float(loop) > 0
        assert int(reads) == 3, out


def test_bench_loop_refuses_bf16_on_the_cpu(capsys):
    assert "training autocasts to bf16 on CUDA only" in refused(capsys, "bench", "loop", "--dtype", "bf16")


@pytest.mark.slow  # builds DeiT-Ti before it reads the keep list: 5 s in a process's first import of timm
def test_bench_throughput_level_and_bad_keep(capsys):
    assert "no sparsity levels for 'deit_tiny_patch16_224'" in refused(
        capsys, "bench", "throughput", "--model", "deit_tiny_patch16_224", "--level", "3")
    assert "keep has 2 entries" in refused(capsys, "bench", "throughput", "--model", "deit_tiny_patch16_224",
                                           "--keep", "196,300")


@pytest.mark.slow
def test_bench_throughput_patch_embed_matmul_times_every_model_with_it():
    proc = run("bench", "throughput", "--model", "deit_tiny_patch16_224", "--methods", "random",
               "--keep", "196,150,120,100,80,60,50,40,30,20,10,5", "--batch", "2", "--patch-embed", "matmul",
               "--set", "bench_throughput.repeats=1", "--set", "bench_throughput.warmup=0",
               "--set", "bench_throughput.ceiling=false", "--profile", "--calls", "2")
    assert "patch embedding matmul (every model), 2 call(s) a timed sample" in proc.stdout
    # --profile: a profile of one call of each model on stderr (on the CPU, torch.profiler's table)
    for label in ("the unmodified model", "random"):
        assert re.search(rf"profile of one call of {label}:\n-[- ]+\n\s+Name\s+Self CPU %", proc.stderr), proc.stderr
    # the same GFLOPs as timm's convolution (fvcore counts the matmul as the convolution's MACs)
    assert re.search(r"^\| unmodified \| 1\.258 \|", proc.stdout, flags=re.M), proc.stdout
    bad = run("bench", "throughput", "--patch-embed", "unfold", check=False)
    assert bad.returncode == 2 and "--patch-embed" in bad.stderr


def _leaf_parsers(parser, path=()):
    """``(command words, parser)`` for every command that takes arguments of its own."""
    import argparse

    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from _leaf_parsers(sub, (*path, name))


def _parsed(parser, argv: list[str]) -> tuple[str, dict | None, str]:
    """What argparse makes of ``argv``: ``("ok", namespace, "")``, or ``("exit", None, its message)``."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return "ok", vars(parser.parse_args(argv)), ""
        except SystemExit:
            return "exit", None, err.getvalue()


@pytest.mark.parametrize("value", ["-5", "-0.5", "-1e-3", "-5,3", "-inf"])
def test_every_option_takes_a_negative_number_as_its_value(value):
    """``--opt -5`` parses as ``--opt=-5`` for every option of every command that takes a value, so a negative
    number reaches the option's own check (argparse read ``-5,3`` and ``-1e-3`` as unknown options)."""
    from pipeline.cli import build_parser

    parser, checked = build_parser(), 0
    for path, leaf in _leaf_parsers(parser):
        required = []
        for action in leaf._actions:
            if action.required and action.nargs != 0:
                word = str(action.choices[0]) if action.choices else "1"
                required += [word] if not action.option_strings else [action.option_strings[0], word]
        for group in leaf._mutually_exclusive_groups:  # select's budget: one of them is required
            if group.required:
                required += [group._group_actions[0].option_strings[0], "1"]
        for action in leaf._actions:
            if not action.option_strings or action.nargs is not None or action.help == "==SUPPRESS==":
                continue
            flag = action.option_strings[-1]
            apart = _parsed(parser, [*path, *required, flag, value])
            joined = _parsed(parser, [*path, *required, f"{flag}={value}"])
            assert apart == joined, (path, flag, apart, joined)
            assert "expected one argument" not in apart[2], (path, flag, apart)
            checked += 1
    assert checked > 60  # every command's options were reached


def test_the_docs_method_table_is_the_registrys():
    """docs/usage.md's method table is what ``pipeline methods --markdown`` prints from the specs."""
    from pipeline.cli.info import methods_table

    usage = (ROOT / "docs" / "usage.md").read_text()
    assert methods_table() in usage
