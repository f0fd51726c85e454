"""Docs that run: every ``python -m pipeline ...`` and ``make ...`` command in the user-facing docs parses with the real
parser as printed, and every ``pipeline run`` passes ``--plan`` (docs/testing.md, "Commands in the docs").

A command is found wherever it is printed: a line of a fenced shell block (``\\`` continuations joined, shell
variables the block itself sets expanded) or an inline code span in the prose. Its variable parts are placeholders
in one convention, ``<NAME>`` (``<CHECKPOINT>``, ``<BETON>``, ``<OUT>``), which the test fills with tiny fixtures;
``[...]`` marks an optional part, checked as if given; a path written with ``...`` in it is refused, since nothing
can fill it.
A command added to these docs later is checked with no change here."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/paper.md", "docs/results.md", "docs/usage.md", "docs/cluster.md")

# What each placeholder becomes; `plan_fixtures` makes the files the paths name before a `--plan` reads them.
PLACEHOLDERS = {
    "CHECKPOINT": "{tmp}/checkpoint", "BETON": "{tmp}/val.beton", "VAL_BETON": "{tmp}/val.beton",
    "TRAIN_BETON": "{tmp}/train.beton", "WEIGHTS": "{tmp}/weights.pth", "OUT": "{tmp}/out", "CONFIG":
    "configs/experiments/demo.yaml", "K": "8", "KEEP": "8,4,2,0", "LEVEL": "3", "RUN": "demo", "NAME": "demo",
    "GFLOPS": "0.005", "IMAGE": "{tmp}/image.png", "TABLE": "{tmp}/table.json", "URI": "sqlite:///{tmp}/mlflow.db",
    "ADDRESS": "127.0.0.1:6379", "N": "2", "MODEL": "deit_small_patch16_224", "METHOD": "wkmedoids",
    "SOURCE": "fashion-mnist:train", "MS": "10",
}
PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)>")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
NOT_SHELL = {"python", "yaml", "json", "text", "toml", "dockerfile", "ini", "csv"}
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
START = r"(?:^|&&|;|\|\||\bdo\b|\bthen\b)\s*(?:\$\s+)?(?:time\s+)?(?:[A-Z_][A-Z0-9_]*=\S+\s+)*"
PIPELINE = re.compile(START + r"(?:\S*/)?python3?\s+-m\s+pipeline\b(?P<args>[^;&|]*)")
MAKE = re.compile(START + r"make\s+(?P<args>[^;&|#]*)")


@dataclass(frozen=True)
class Command:
    """One printed command: where it is, its text as printed (shell variables of its block expanded), and
    the plan counts a comment beside it documents (``--plan   # {"base": 4, ...}``)."""

    where: str
    text: str
    tool: str  # "pipeline" or "make"
    counts: dict | None = None

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _join_lines(block: str) -> list[str]:
    return block.replace("\\\n", " ").splitlines()


def shell_values(block: str) -> dict[str, str]:
    """What a block sets for its commands to use: arrays (``name=(...)``, over lines), scalars (``name=value``),
    ``set -- ...`` (``"$@"``) and a ``for`` loop's first value."""
    values: dict[str, str] = {}
    for name, body in re.findall(r"^\s*(\w+)=\((.*?)\)\s*$", block, flags=re.M | re.S):
        values[f"{name}[@]"] = " ".join(line.split("#")[0] for line in body.replace("\\\n", " ").splitlines())
    for line in _join_lines(block):
        if match := re.match(r"^\s*(\w+)=([^\s(][^\s]*)\s*(?:#.*)?$", line):
            values[match[1]] = match[2]
        elif match := re.match(r"^\s*set --\s+(.*)$", line):
            values["@"] = match[1]
        elif match := re.match(r"^\s*for\s+(\w+)\s+in\s+(\S+)", line):
            values[match[1]] = match[2]
    return values


def expand(text: str, values: dict[str, str]) -> str:
    """``text`` with the block's own shell variables put in; anything else that expands is left, to be refused."""
    def one(match: re.Match) -> str:
        name = match["braced"] or match["plain"]
        return values[name] if name in values else match[0]

    return re.sub(r'"?\$(?:\{(?P<braced>\w+(?:\[@\])?)\}|(?P<plain>@|\w+))"?', one, text)


def _counts(comment: str) -> dict | None:
    match = re.search(r"\{\s*\"base\".*?\}", comment)
    return json.loads(match[0]) if match else None


def commands_in(text: str, where: str) -> list[Command]:
    """Every pipeline and make command in a markdown text, in the order printed."""
    found: list[Command] = []
    prose = text
    for fence in FENCE.finditer(text):
        prose = prose.replace(fence[0], "\n" * fence[0].count("\n"))
        if fence[1].lower() in NOT_SHELL:
            continue
        values = shell_values(fence[2])
        start = text[:fence.start()].count("\n") + 2
        for offset, line in enumerate(_join_lines(fence[2])):
            found += _in_line(expand(line, values), f"{where} (block at line {start}, line {offset + 1})")
    for span in INLINE.finditer(prose):
        line = prose[:span.start()].count("\n") + 1
        found += _in_line(" ".join(span[1].split()), f"{where}:{line}")
    return found


def _in_line(line: str, where: str) -> list[Command]:
    body, _, comment = _split_comment(line)
    found = [Command(where, "python -m pipeline" + m["args"].rstrip(), "pipeline", _counts(comment))
             for m in PIPELINE.finditer(body)]
    found += [Command(where, "make " + m["args"].strip(), "make") for m in MAKE.finditer(body)]
    return found


def _split_comment(line: str) -> tuple[str, str, str]:
    """A line's command and its trailing ``# comment`` (a ``#`` that starts a word outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], "#", line[i:]
    return line, "", ""


def all_commands() -> list[Command]:
    return [cmd for doc in DOCS for cmd in commands_in((ROOT / doc).read_text(), doc)]


def argv_of(cmd: Command, tmp: Path) -> list[str]:
    """The command's arguments after ``python -m pipeline``, placeholders filled and optional parts given;
    raises ValueError with what is wrong with it as printed."""
    unknown = sorted(set(PLACEHOLDER.findall(cmd.text)) - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(f"placeholder(s) {', '.join(f'<{n}>' for n in unknown)} are not in the convention "
                         f"(tests/test_docs_commands.py PLACEHOLDERS: {', '.join(sorted(PLACEHOLDERS))})")
    text = PLACEHOLDER.sub(lambda m: PLACEHOLDERS[m[1]].format(tmp=tmp), cmd.text)
    if "$" in text:
        raise ValueError("a shell expansion its block does not set; write a <PLACEHOLDER>")
    try:
        words = shlex.split(text, comments=True)
    except ValueError as err:
        raise ValueError(f"not one shell command ({err})") from None
    words = [w for w in (_unbracket(word) for word in words) if w]
    elided = [w for w in words if "..." in w or "\u2026" in w]
    if elided:
        raise ValueError(f"{elided[0]!r} leaves a part out ('...'); write a <PLACEHOLDER> the test can fill")
    return words[3:] if cmd.tool == "pipeline" else words[1:]


def _unbracket(word: str) -> str:
    """An optional part's brackets (``[--out <OUT>]``) dropped; a bracket inside a value (``x=[a]``) kept."""
    if word.startswith("[") and ("=" not in word and "," not in word or word.startswith("[--")):
        word = word[1:]
    if word.endswith("]") and "[" not in word:
        word = word[:-1]
    return word


def subcommand_names(parser) -> dict:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


@functools.cache
def _parser():
    from pipeline.cli import build_parser

    return build_parser()  # argparse keeps no state between parse_args calls: one parser serves every command


def check_parses(cmd: Command, tmp: Path) -> None:
    """Raises ValueError naming what fails: the pipeline parser's own message, or a make target that does not exist."""
    argv = argv_of(cmd, tmp)
    if cmd.tool == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        missing = [t for t in argv if not t.startswith("-") and "=" not in t and t not in targets]
        if not argv or missing:
            raise ValueError(f"no make target {missing or argv}")
        return
    parser, names = _parser(), argv
    while names and (choices := subcommand_names(parser)) and names[0] in choices:
        parser, names = choices[names[0]], names[1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser().parse_args(argv)
    except SystemExit as exit_:
        # A command named on its own in prose (`written by python -m pipeline data write`) names one that exists.
        if exit_.code and not (not names and "required" in err.getvalue()):
            raise ValueError(err.getvalue().strip().splitlines()[-1]) from None


COMMANDS = all_commands()
IDS = [f"{i}:{c.where.split(' ')[0]}:{c.text[:60]}" for i, c in enumerate(COMMANDS)]


def test_the_docs_print_commands_of_both_kinds_and_a_plan_count():
    tools = {c.tool for c in COMMANDS}
    assert tools == {"pipeline", "make"}, tools
    assert any(c.counts for c in COMMANDS), "no documented --plan count found"
    assert len(COMMANDS) >= 60, len(COMMANDS)


def test_every_documented_command_parses_as_printed(tmp_path):
    failures = []
    for cmd in COMMANDS:
        try:
            check_parses(cmd, tmp_path)
        except ValueError as err:
            failures.append(f"{cmd}\n    -> {err}")
    assert not failures, f"{len(failures)} documented command(s) fail as printed:\n" + "\n".join(failures)


@pytest.mark.parametrize("bad, says", [
    ("python -m pipeline viz clusters --checkpoint <CHECKPOINT> --data <BETON> --method kmedoids --keep 8,4",
     "--out"),
    ("python -m pipeline run configs/experiments/demo.yaml --plna", "unrecognized"),
    ("python -m pipeline evaluate --checkpoint runs/ray/demo-base-M32-.../checkpoint_... --data <BETON> "
     "--keep 8,4 --out <OUT>", "leaves a part out"),
    ("python -m pipeline select --experiment <NAME> --max-gflops <BUDGET>", "<BUDGET>"),
    ("python -m pipeline analyze convergence --checkpoint $CK --data <BETON> --k 8 --out <OUT>", "shell expansion"),
    ("python -m pipeline flopz --model deit_small_patch16_224", "invalid choice"),
    ("make demoo", "no make target"),
])
def test_a_planted_bad_command_fails_the_check(tmp_path, bad: str, says: str):
    doc = f"# planted\n\n```bash\n{bad}   # as a doc would print it\n```\n\nAnd inline: `{bad}`.\n"
    found = commands_in(doc, "planted.md")
    assert len(found) == 2 and all(c.text.split("#")[0].strip() == bad for c in found), found
    for cmd in found:
        with pytest.raises(ValueError, match=re.escape(says)):
            check_parses(cmd, tmp_path)


def test_the_extraction_reads_continuations_block_variables_and_plan_counts():
    doc = ("```bash\ncommon=(--set a=1\n        --set b=2)\nset -- --set c=3\nfor W in 1 2; do\n"
           "  python -m pipeline run x.yaml \\\n    --set w=$W \"${common[@]}\" \"$@\"   # a comment\ndone\n"
           "python -m pipeline run x.yaml --plan   # {\"base\": 1, \"ksearch\": 2, \"finetune\": 3, \"evaluate\": 4}\n"
           "cd somewhere && make demo\n```\n")
    first, second, make = commands_in(doc, "x.md")
    assert first.text.split() == "python -m pipeline run x.yaml --set w=1 --set a=1 --set b=2 --set c=3".split(), first
    assert second.counts == {"base": 1, "ksearch": 2, "finetune": 3, "evaluate": 4}
    assert make.text == "make demo" and make.tool == "make"


# --- `pipeline run` commands pass --plan ---------------------------------------------------------------------------

RUNS = list({" ".join(c.text.split()): c for c in reversed(COMMANDS)
             if c.tool == "pipeline" and c.text.split()[3:4] == ["run"]}.values())[::-1]  # each printed run once


def plan_fixtures(argv: list[str], tmp: Path) -> list[str]:
    """``argv`` with ``--plan``, its cluster data paths replaced by the test's tiny (empty) betons, and a
    checkpoint of the right architecture where a placeholder names one."""
    from pipeline.config import load_config

    (tmp / "train.beton").touch()
    (tmp / "val.beton").touch()
    config_path, overrides = argv[1], [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    argv = [*argv, "--plan"] if "--plan" not in argv else list(argv)
    if "/mnt/" in (ROOT / config_path).read_text():  # a cluster's shared folder: the tiny betons instead
        argv += ["--set", f"data.train={tmp}/train.beton", "--set", f"data.val={tmp}/val.beton"]
        overrides += [f"data.train={tmp}/train.beton", f"data.val={tmp}/val.beton"]
    config = load_config(ROOT / config_path, overrides)
    given = config.experiment.base_checkpoints if config.experiment else {}
    if any(str(tmp / "checkpoint") == str(path) for path in given.values()):
        write_base_checkpoint(config, tmp / "checkpoint")
    return argv


def write_base_checkpoint(config, directory: Path) -> None:
    """A checkpoint holding only the architecture record of the given base (what ``--plan`` reads of it)."""
    import torch

    from pipeline.dag.plan import archs, base_stage
    from pipeline.train.build import arch_signature, build_model
    from pipeline.train.checkpoint import save_checkpoint

    directory.mkdir(exist_ok=True)
    arch = next(a for a in archs(config) if a.label in config.experiment.base_checkpoints)
    with torch.device("meta"):
        model = build_model(base_stage(config, arch).config)
    save_checkpoint(directory, {"arch": arch_signature(model)}, {})


def check_plan(cmd: Command, tmp: Path, monkeypatch) -> dict:
    """Runs the command with ``--plan`` in this process; raises ValueError with what it printed where the plan fails
    or its counts differ from the ones documented beside it. Returns the counts."""
    import pipeline.dag.checks as checks
    from pipeline.cli import main

    monkeypatch.chdir(ROOT)
    # A command that names a cluster is planned against one big enough for it: this machine has 2 CPUs, no GPU.
    monkeypatch.setattr(checks, "local_resources", lambda gpus: {"CPU": 1024.0, "GPU": 64.0})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(plan_fixtures(argv_of(cmd, tmp), tmp))
    if code != 0:
        raise ValueError(f"--plan exits {code}: {err.getvalue().strip().splitlines()[-1]}")
    printed = json.loads(out.getvalue().strip().splitlines()[-1])
    if cmd.counts is not None and printed != cmd.counts:
        raise ValueError(f"the doc says {cmd.counts}, --plan prints {printed}")
    return printed


@pytest.mark.slow  # one --plan builds each stage's model on the meta device: 0.2-6 s a command here, 15 s in all
@pytest.mark.parametrize("cmd", RUNS, ids=[f"{i}:{c.where.split(' ')[0]}:{c.text[19:80]}" for i, c in enumerate(RUNS)])
def test_a_documented_run_passes_plan(cmd: Command, tmp_path, monkeypatch):
    try:
        check_plan(cmd, tmp_path, monkeypatch)
    except ValueError as err:
        pytest.fail(f"{cmd}\n    -> {err}")


def test_a_planted_run_whose_plan_fails_fails_the_check(tmp_path, monkeypatch):
    bad = ('python -m pipeline run configs/experiments/paper_deit_imagenet.yaml --set "experiment.levels=[1]" '
           '--set experiment.lambdas=null --set experiment.conv=null --set "experiment.models=[deit_tiny_patch16_224]"')
    (cmd,) = commands_in(f"```bash\n{bad}\n```\n", "planted.md")
    with pytest.raises(ValueError, match="no sparsity levels for 'deit_tiny_patch16_224'"):
        check_plan(cmd, tmp_path, monkeypatch)


@pytest.mark.slow  # a whole plan of the demo
def test_a_planted_wrong_plan_count_fails_the_check(tmp_path, monkeypatch):
    doc = "```bash\npython -m pipeline run configs/experiments/demo.yaml --plan   # {\"base\": 9}\n```\n"
    (cmd,) = commands_in(doc, "planted.md")
    assert cmd.counts == {"base": 9}
    with pytest.raises(ValueError, match="the doc says"):
        check_plan(cmd, tmp_path, monkeypatch)
