"""docker/README.md's shell blocks run as written, each on its own, on a host like the development machine.

A small parser reads each ``bash`` block the way the shell would (quotes, ``\\`` continuations, comments,
``;``/``&&``/``||``/``|``/``&``, subshells, ``VAR=value`` prefixes, ``export``, ``$VAR`` and ``$(...)``, a command
held in a variable such as ``$RUN``, ``sh -c`` scripts, ``nice``/``env``/``sudo`` wrappers) and follows what each
command would see. Nothing is executed but ``bash -n``; no container is built or run. It checks:

- every ``podman`` command sees ``CONTAINERS_CONF`` pointing at ``docker/containers.conf`` (set in its block:
  exported, or as the command's prefix). Without it podman's defaults fail on hosts like the development machine
  (``podman run`` exits 126, "error setting rlimits"); ``docker/build.sh`` and ``docker/base-image.sh`` set it
  themselves;
- every ``$VAR`` a block uses is set in that block, so a block pasted into a fresh shell works;
- ``apt-get install`` runs unattended (``-y``) after an ``apt-get update`` in the same block;
- a command started in the background (the wheel mirror's HTTP server) is stopped by its block.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "docker" / "README.md"
FENCE = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```$", re.M | re.S)
# Set by the shell itself (or by the user's login) in any fresh shell
ALWAYS_SET = {"PWD", "HOME", "PATH", "USER", "UID", "OLDPWD", "RANDOM", "SHELL", "HOSTNAME"}
SPECIAL = set("!?$#@*-0123456789")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONF = ROOT / "docker" / "containers.conf"
UNKNOWN = "\x00"  # in an expanded word: a value not known here (a command's output, $!, an unset variable)
ENGINE_VERBS = {"run", "build", "create", "start", "exec", "image", "images", "rmi", "system", "container", "import",
                "pull", "push", "tag", "inspect", "ps", "rm", "volume", "builder"}
RESERVED = {"if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac", "function",
            "{", "}", "[[", "!", "select", "coproc"}


class Unsupported(ValueError):
    """A shell construct this parser does not follow (keep the README's blocks to the ones it does)."""


# ---------------------------------------------------------------- words and tokens

@dataclass
class Part:
    """A piece of a word: literal text, a parameter (``$NAME``, ``${NAME:-default}``), or a command
    substitution (``$(...)``, whose text is kept to be parsed in its turn)."""

    kind: str  # "lit", "var", "cmd"
    value: str
    quoted: bool = False  # inside "..." or '...': no word splitting
    has_default: bool = False  # ${NAME:-x}, ${NAME-x}: fine when NAME is unset


@dataclass
class Word:
    parts: list[Part]
    line: int

    @property
    def literal(self) -> str | None:
        """The word's text when it holds no expansion."""
        if all(p.kind == "lit" for p in self.parts):
            return "".join(p.value for p in self.parts)
        return None


@dataclass
class Op:
    value: str  # && || ; & | ( ) \n, or a redirection (>, >>, <, >&, &>)
    line: int


def _closing_paren(text: str, start: int) -> int:
    """The index of the ``)`` that closes the ``(`` just before ``start``, skipping quoted text."""
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "'":
            i = text.index("'", i + 1) + 1
            continue
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise Unsupported(f"unbalanced parentheses in {text[start - 2:start + 40]!r}")


def _dollar(text: str, i: int, quoted: bool) -> tuple[Part, int]:
    """The expansion that starts at ``text[i] == '$'``, and the index after it."""
    nxt = text[i + 1] if i + 1 < len(text) else ""
    if text.startswith("$((", i):
        end = _closing_paren(text, i + 3)  # the inner ( ... ) of $(( ... ))
        if text[end + 1:end + 2] != ")":
            raise Unsupported(f"arithmetic expansion at {text[i:i + 40]!r}")
        return Part("cmd", "echo " + text[i + 3:end], quoted), end + 2  # its $VAR and $(...) as a command's
    if nxt == "(":
        end = _closing_paren(text, i + 2)
        return Part("cmd", text[i + 2:end], quoted), end + 1
    if nxt == "{":
        end = text.index("}", i)
        inner = text[i + 2:end]
        name = NAME.match(inner) or re.match(r"[!?$#@*\-0-9]", inner)
        if not name:
            raise Unsupported(f"parameter expansion {text[i:end + 1]!r}")
        rest = inner[name.end():]
        return Part("var", name.group(), quoted, has_default=rest.startswith((":-", "-", ":=", "="))), end + 1
    name = NAME.match(text, i + 1)
    if name:
        return Part("var", name.group(), quoted), name.end()
    if nxt and nxt in SPECIAL:
        return Part("var", nxt, quoted), i + 2
    return Part("lit", "$", quoted), i + 1


def tokenize(text: str) -> list[Word | Op]:
    """The block's words and operators, as bash splits them (comments and ``\\``-newlines dropped)."""
    tokens: list[Word | Op] = []
    parts: list[Part] = []
    i = start = 0
    started = False  # a word is in progress (an empty "" still makes a word)

    def line_at(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def flush():
        nonlocal parts, started
        if started:
            merged: list[Part] = []
            for part in parts:  # adjacent literal characters as one part
                if merged and part.kind == merged[-1].kind == "lit" and part.quoted == merged[-1].quoted:
                    merged[-1] = Part("lit", merged[-1].value + part.value, part.quoted)
                else:
                    merged.append(part)
            tokens.append(Word(merged, line_at(start)))
        parts, started = [], False

    def begin():
        nonlocal started, start
        if not started:
            started, start = True, i

    while i < len(text):
        c = text[i]
        if c == "\\":
            if text[i + 1:i + 2] == "\n":
                i += 2
                continue
            begin()
            parts.append(Part("lit", text[i + 1:i + 2]))
            i += 2
        elif c == "'":
            begin()
            end = text.index("'", i + 1)
            parts.append(Part("lit", text[i + 1:end], quoted=True))
            i = end + 1
        elif c == '"':
            begin()
            i += 1
            buf = ""
            while text[i] != '"':
                if text[i] == "\\" and text[i + 1] in '$`"\\\n':
                    buf += text[i + 1] if text[i + 1] != "\n" else ""
                    i += 2
                elif text[i] == "$":
                    if buf:
                        parts.append(Part("lit", buf, quoted=True))
                        buf = ""
                    part, i = _dollar(text, i, quoted=True)
                    parts.append(part)
                elif text[i] == "`":
                    raise Unsupported("backquotes: use $(...)")
                else:
                    buf += text[i]
                    i += 1
            parts.append(Part("lit", buf, quoted=True))
            i += 1
        elif c == "$":
            begin()
            part, i = _dollar(text, i, quoted=False)
            parts.append(part)
        elif c == "`":
            raise Unsupported("backquotes: use $(...)")
        elif c == "#" and not started:
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
        elif c in " \t":
            flush()
            i += 1
        elif c == "\n":
            flush()
            tokens.append(Op("\n", line_at(i)))
            i += 1
        elif c in "<>" or (c == "&" and text[i + 1:i + 2] == ">"):
            if started and all(p.kind == "lit" and p.value.isdigit() for p in parts):
                parts, started = [], False  # the file descriptor of 2>
            flush()
            if text.startswith("<<", i):
                raise Unsupported("here-documents")
            op = re.match(r"&>>?|>>|>&|<&|>|<", text[i:]).group()
            tokens.append(Op(op, line_at(i)))
            i += len(op)
        elif c in ";&|()":
            flush()
            op = text[i:i + 2] if text[i:i + 2] in ("&&", "||", ";;") else c
            if op == ";;":
                raise Unsupported("case statements")
            tokens.append(Op(op, line_at(i)))
            i += len(op)
        else:
            begin()
            parts.append(Part("lit", c))
            i += 1
    flush()
    return tokens


# ---------------------------------------------------------------- following the commands

@dataclass
class Scope:
    """A shell's variables (``UNKNOWN`` in a value: not known here) and which of them are exported."""

    variables: dict[str, str] = field(default_factory=dict)
    exported: set[str] = field(default_factory=set)
    background: list[int] = field(default_factory=list)  # lines of commands left running with &
    stops: bool = False  # a kill, a wait, or a trap that kills ran in this shell

    def child(self) -> Scope:
        """A subshell: a copy of everything (its changes stay inside)."""
        return Scope(dict(self.variables), set(self.exported))

    def environment(self) -> dict[str, str]:
        return {k: v for k, v in self.variables.items() if k in self.exported}


@dataclass
class Invocation:
    """A command the block runs on the host: its words and its environment (``UNKNOWN`` where not known here)."""

    argv: list[str]
    env: dict[str, str]
    line: int


@dataclass
class Trace:
    invocations: list[Invocation] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


WRAPPER_OPTIONS_WITH_VALUE = {"nice": {"-n", "--adjustment"}, "sudo": {"-u", "-g", "-C", "-D", "-h", "-p", "-U"},
                              "env": {"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}, "time": {"-f", "-o"},
                              "timeout": {"-s", "--signal", "-k", "--kill-after"}, "nohup": set()}


class Shell:
    """Follows a block's commands through ``Scope``s, noting each command run and each problem."""

    def __init__(self, trace: Trace):
        self.trace = trace

    # -- expansion

    def expand(self, word: Word, scope: Scope, split: bool = False) -> list[str]:
        """The word's value(s) in ``scope``, with ``UNKNOWN`` standing for what is not known here (a command's
        output, ``$!``). ``split``: an unquoted ``$VAR`` holding several words becomes several words (what
        ``$RUN id`` relies on)."""
        out = [""]
        for part in word.parts:
            if part.kind == "lit":
                out[-1] += part.value
            elif part.kind == "cmd":
                self.run(part.value, scope.child(), word.line - 1)
                out[-1] += UNKNOWN
            else:
                value = self.lookup(part, scope, word.line)
                if split and not part.quoted and len(value.split()) > 1:
                    pieces = value.split()
                    out[-1] += pieces[0]
                    out += pieces[1:]
                else:
                    out[-1] += value
        return out

    def lookup(self, part: Part, scope: Scope, line: int) -> str:
        name = part.value
        if name == "PWD":
            return str(ROOT)  # the README's commands run from the repository root
        if name in scope.variables:
            return scope.variables[name]
        if name not in ALWAYS_SET and name not in SPECIAL and not part.has_default:
            self.trace.problems.append(f"line {line}: ${name} is used but not set in this block")
        return UNKNOWN

    # -- commands

    def run(self, text: str, scope: Scope, line_offset: int = 0) -> None:
        tokens = tokenize(text)
        for token in tokens:
            token.line += line_offset
        self.sequence(tokens, scope)
        self.close(scope)

    def close(self, scope: Scope) -> None:
        """The end of a shell: what it left running in the background must have been stopped."""
        if scope.background and not scope.stops:
            lines = ", ".join(str(n) for n in scope.background)
            self.trace.problems.append(f"line {lines}: a command started in the background (&) is never stopped "
                                       f"(no kill, wait or `trap 'kill ...' EXIT` in its shell)")

    def sequence(self, tokens: list[Word | Op], scope: Scope) -> None:
        """Runs a list of tokens: simple commands separated by operators, ``( ... )`` subshells."""
        i, command = 0, []
        while i < len(tokens):
            token = tokens[i]
            if isinstance(token, Op) and token.value == "(" and not command:
                depth, j = 1, i + 1
                while depth:
                    if j >= len(tokens):
                        raise Unsupported(f"line {token.line}: unclosed (")
                    if isinstance(tokens[j], Op) and tokens[j].value in "()":
                        depth += 1 if tokens[j].value == "(" else -1
                    j += 1
                inner = scope.child()
                self.sequence(tokens[i + 1:j - 1], inner)
                self.close(inner)
                i = j
                continue
            if isinstance(token, Op) and token.value in ("&&", "||", ";", "&", "|", "\n", ")"):
                self.simple(command, scope, background=token.value == "&")
                command = []
            else:
                command.append(token)
            i += 1
        self.simple(command, scope, background=False)

    def simple(self, tokens: list[Word | Op], scope: Scope, background: bool) -> None:
        """One simple command: its ``VAR=value`` prefixes, its words, its redirections."""
        words: list[Word] = []
        skip = False
        for token in tokens:
            if isinstance(token, Op):
                skip = True  # a redirection: its target word follows
            elif skip:
                self.expand(token, scope)
                skip = False
            else:
                words.append(token)
        if not words:
            return
        line = words[0].line
        prefix: dict[str, str] = {}
        while words and (first := words[0].parts[0] if words[0].parts else None) is not None \
                and first.kind == "lit" and not first.quoted and re.match(r"[A-Za-z_]\w*=", first.value):
            name, _, rest = first.value.partition("=")
            value_word = Word([Part("lit", rest, first.quoted), *words[0].parts[1:]], line)
            prefix[name] = self.expand(value_word, scope)[0]
            words = words[1:]
        if not words:  # plain assignments
            scope.variables.update(prefix)
            return
        if words[0].literal in RESERVED:
            raise Unsupported(f"line {line}: {words[0].literal!r} (compound commands); keep README blocks to plain "
                              f"commands, or teach this parser")
        argv: list[str] = []
        for word in words:
            argv += self.expand(word, scope, split=True)
        if background:
            scope.background.append(line)
        self.command(argv, {**scope.environment(), **prefix}, scope, line)

    def command(self, argv: list[str], env: dict[str, str], scope: Scope, line: int) -> None:
        name = Path(argv[0]).name
        if name == "export":
            for arg in argv[1:]:
                key, eq, value = arg.partition("=")
                if eq:
                    scope.variables[key] = value
                scope.variables.setdefault(key, UNKNOWN)
                scope.exported.add(key)
            return
        if name == "unset":
            for arg in argv[1:]:
                scope.variables.pop(arg, None)
                scope.exported.discard(arg)
            return
        if name in ("kill", "wait"):
            scope.stops = True
        if name == "trap" and len(argv) > 1 and "kill" in argv[1].split():
            scope.stops = True
        if name in WRAPPER_OPTIONS_WITH_VALUE:
            self.wrapped(name, argv, env, scope, line)
            return
        self.trace.invocations.append(Invocation(argv, env, line))
        if name in ("sh", "bash") and "-c" in argv[1:-1]:
            script = argv[argv.index("-c") + 1]
            if UNKNOWN in script:
                self.trace.problems.append(f"line {line}: {name} -c runs a script that is not known here")
                return
            # a new shell: it sees the exported variables only
            self.run(script, Scope(dict(env), set(env)), line - 1)

    def wrapped(self, name: str, argv: list[str], env: dict[str, str], scope: Scope,
                line: int) -> None:
        """``nice``, ``env``, ``sudo``, ``time``, ``timeout``, ``nohup``: the command they run, in the environment
        they give it (``env`` adds ``VAR=value``s; ``sudo`` keeps only those unless ``-E``)."""
        rest, options = argv[1:], WRAPPER_OPTIONS_WITH_VALUE[name]
        keep_env = name != "sudo"
        while rest and rest[0].startswith("-"):
            option = rest.pop(0)
            if option in ("-E", "--preserve-env"):
                keep_env = True
            if option in ("-i", "--ignore-environment") and name == "env":
                keep_env = False
            if option in options and rest:
                rest.pop(0)
        if name == "timeout" and rest:
            rest.pop(0)  # the duration
        env = dict(env) if keep_env else {}
        while rest and re.match(r"[A-Za-z_]\w*=", rest[0]):
            key, _, value = rest.pop(0).partition("=")
            env[key] = value
        if rest:
            self.command(rest, env, scope, line)


def trace_block(text: str) -> Trace:
    trace = Trace()
    Shell(trace).run(text, Scope())
    return trace


def shell_blocks(markdown: str) -> list[tuple[int, str]]:
    """The ``bash`` blocks of a Markdown text, with the line each starts on."""
    return [(markdown.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(markdown)]


# ---------------------------------------------------------------- the checks

def may_be_podman(argv: list[str]) -> bool:
    """``podman ...``, or a container command through an engine chosen when the block runs (``$ENGINE run``)."""
    if Path(argv[0]).name == "podman":
        return True
    return UNKNOWN in argv[0] and len(argv) > 1 and argv[1] in ENGINE_VERBS


def podman_problems(trace: Trace) -> list[str]:
    """Each podman command that does not see CONTAINERS_CONF set to docker/containers.conf."""
    problems = []
    for inv in trace.invocations:
        if not may_be_podman(inv.argv):
            continue
        what = " ".join(inv.argv[:2]).replace(UNKNOWN, "?")
        conf = inv.env.get("CONTAINERS_CONF")
        if conf is None:
            problems.append(f"line {inv.line}: `{what}` runs without CONTAINERS_CONF (set "
                            f"`export CONTAINERS_CONF=$PWD/docker/containers.conf` in the block)")
        elif UNKNOWN in conf or (ROOT / conf).resolve() != CONF:  # a relative path: from the repository root
            problems.append(f"line {inv.line}: `{what}` gets CONTAINERS_CONF={conf.replace(UNKNOWN, '?')}, "
                            f"not docker/containers.conf")
    return problems


def apt_problems(trace: Trace) -> list[str]:
    """``apt-get install`` without an ``apt-get update`` before it in the block, or without ``-y``."""
    problems, updated = [], False
    for inv in trace.invocations:
        if Path(inv.argv[0]).name not in ("apt-get", "apt"):
            continue
        operands = [a for a in inv.argv[1:] if not a.startswith("-")]
        if operands[:1] == ["update"]:
            updated = True
        elif operands[:1] == ["install"]:
            if not updated:
                problems.append(f"line {inv.line}: apt-get install with no apt-get update before it in the block "
                                f"(a fresh host's package lists are empty or stale)")
            flags = [a for a in inv.argv[1:] if re.fullmatch(r"-[a-zA-Z]*y[a-zA-Z]*|--yes|--assume-yes", a)]
            if not flags:
                problems.append(f"line {inv.line}: apt-get install without -y stops at its prompt (and aborts "
                                f"when the block runs from a script)")
    return problems


def block_problems(text: str) -> list[str]:
    trace = trace_block(text)
    return trace.problems + podman_problems(trace) + apt_problems(trace)


def readme_problems(markdown: str) -> list[str]:
    """Every problem of every shell block, named by the README line it is on."""
    problems = []
    for start, block in shell_blocks(markdown):
        for problem in block_problems(block):
            line, _, message = problem.partition(": ")
            number = re.match(r"line (\d+)", line)
            problems.append(f"README line {start + int(number.group(1)) - 1}: {message}" if number else problem)
    return problems


# ---------------------------------------------------------------- the README as it is

BLOCKS = shell_blocks(README.read_text())


def test_the_readme_has_the_blocks_a_user_follows():
    text = "\n".join(block for _, block in BLOCKS)
    for step in ("apt-get update", "docker/base-image.sh", "docker/build.sh cpu", "import_check.py",
                 "data write", "configs/experiments/tiny.yaml", "image prune"):
        assert step in text, f"docker/README.md has no shell block with {step!r}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("start,block", BLOCKS, ids=[f"line{start}" for start, _ in BLOCKS])
def test_each_block_is_valid_bash(start, block):
    proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    assert proc.returncode == 0, f"docker/README.md line {start}: {proc.stderr}"


@pytest.mark.parametrize("start,block", BLOCKS, ids=[f"line{start}" for start, _ in BLOCKS])
def test_each_block_runs_on_its_own(start, block):
    problems = [f"docker/README.md block at line {start}: {p}" for p in block_problems(block)]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the parser, on planted blocks

def test_a_podman_run_through_a_variable_without_containers_conf_is_named():
    # the run block of the README at 0e926ff: it set CONTAINERS_CONF in another block
    block = ('M=/tmp/mnt; mkdir -p $M/data\n'
             'RUN="podman run --rm --user 1000 -v $M/data:/mnt/shared/data ghcr.io/token-pooling/token-pooling:cpu"\n'
             '$RUN id\n')
    assert block_problems(block) == ["line 3: `podman run` runs without CONTAINERS_CONF (set "
                                     "`export CONTAINERS_CONF=$PWD/docker/containers.conf` in the block)"]


@pytest.mark.parametrize("block", [
    "export CONTAINERS_CONF=$PWD/docker/containers.conf\npodman run --rm img id",
    "CONTAINERS_CONF=$PWD/docker/containers.conf podman run --rm img id",
    "CONTAINERS_CONF=docker/containers.conf; export CONTAINERS_CONF\n( podman run --rm img id )",
    "export CONTAINERS_CONF=$PWD/docker/containers.conf\nsh -c 'podman run --rm img id && podman images'",
    "export CONTAINERS_CONF=$PWD/docker/containers.conf\nnice -n 10 env A=1 podman run img",
    "sudo CONTAINERS_CONF=$PWD/docker/containers.conf podman run img",
    'export CONTAINERS_CONF="${PWD}/docker/containers.conf"  # comment\nR="podman run"; $R img',
    "docker run --rm img id",  # Docker has no containers.conf
    'export CONTAINERS_CONF=$PWD/docker/containers.conf\nENGINE=$(command -v podman || command -v docker)\n'
    '$ENGINE run img',
])
def test_a_podman_command_that_sees_containers_conf_passes(block):
    assert podman_problems(trace_block(block)) == [], block


@pytest.mark.parametrize("block", [
    "podman run --rm img id",
    "CONTAINERS_CONF=$PWD/docker/containers.conf\npodman run img",  # set, not exported
    "( export CONTAINERS_CONF=$PWD/docker/containers.conf )\npodman run img",  # the subshell's export stays there
    "podman build -t x . && export CONTAINERS_CONF=$PWD/docker/containers.conf",  # too late
    "export CONTAINERS_CONF=/etc/containers/other.conf\npodman run img",
    "sudo podman run img",  # sudo drops the environment
    "export CONTAINERS_CONF=$PWD/docker/containers.conf\nsudo podman run img",
    "export CONTAINERS_CONF=$PWD/docker/containers.conf\nenv -i podman run img",
    'R="podman run --rm"; echo "$(date)"\n$R img',
    'ENGINE=$(basename "$(command -v podman || command -v docker)")\n"$ENGINE" image prune -f',  # may be podman
])
def test_a_podman_command_without_containers_conf_is_named(block):
    assert len(podman_problems(trace_block(block))) == 1, block


def test_a_variable_from_another_block_is_named_and_a_containers_own_is_not():
    problems = trace_block('$RUN id\necho "$M/data" \'$NOT_HERE\'\n'
                           "podman run img sh -c 'echo $HOME $X'\nsh -c 'echo $Y'\n").problems
    assert problems == ["line 1: $RUN is used but not set in this block",
                        "line 2: $M is used but not set in this block",
                        "line 4: $Y is used but not set in this block"]
    assert trace_block("A=1; sh -c 'echo $A'").problems == ["line 1: $A is used but not set in this block"]
    assert trace_block("export A=1; sh -c 'echo $A'; echo ${B:-x} $(( $(getconf PAGE_SIZE) * 2 ))").problems == []


@pytest.mark.parametrize("block,count", [
    ("apt-get install -y podman", 1),
    ("apt-get update && apt-get install podman", 1),
    ("apt-get install podman", 2),
    ("apt-get update\napt-get install -y --no-install-recommends podman", 0),
    ("apt-get update -q && apt-get -qy install podman", 0),
])
def test_apt_get_install_needs_an_update_before_it_and_no_prompt(block, count):
    assert len(apt_problems(trace_block(block))) == count, block


@pytest.mark.parametrize("block,stopped", [
    ("python3 -m http.server 8765 -d /opt &\nmake", False),
    ("python3 -m http.server 8765 -d /opt &\npid=$!\nmake\nkill $pid", True),
    ('(\n  python3 -m http.server 8765 -d /opt >/dev/null 2>&1 &\n  trap "kill $!" EXIT\n  make\n)', True),
    ('( python3 -m http.server &\n)\ntrap "kill 1" EXIT', False),  # the trap is in another shell
])
def test_a_server_left_in_the_background_is_named(block, stopped):
    problems = [p for p in trace_block(block).problems if "background" in p]
    assert (problems == []) is stopped, (block, problems)


def test_the_tokenizer_follows_quotes_continuations_and_redirections():
    tokens = tokenize("A=\"x y\" cmd 'a b' c\\\n  d 2>&1 >/dev/null # note\n")
    words = [t.literal if isinstance(t, Word) else t.value for t in tokens]
    assert words == ["A=x y", "cmd", "a b", "c", "d", ">&", "1", ">", "/dev/null", "\n"]
    with pytest.raises(Unsupported):
        tokenize("cat <<EOF\nx\nEOF\n")
