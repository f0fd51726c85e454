"""Checks, without a container runtime, that a Dockerfile's runtime stage can load the compiled code.

Two things break an image only when it runs, on the cluster:

- a shared library that a compiled extension links (FFCV's ``_libffcv``, OpenCV's ``cv2``, the
  clustering kernels built from ``pipeline/pooling/clustering_cpu.c``) whose Debian package the
  runtime stage does not install: the build stage had it (``-dev`` packages pull it in), the runtime
  stage does not, and ``import`` fails there;
- a venv that the runtime stage copies from a different path than the build stage made it at, or
  puts off ``PATH``, or runs on a different Python: its scripts and ``pyvenv.cfg`` name absolute paths.

The libraries are resolved on this host, which must be the images' Debian release: each extension's
libraries (``ldd``, all levels, as the loader sees them) become files, files become packages
(``dpkg -S``), and each package must be in what the runtime stage has: Debian's minimal base
(the Essential packages and apt, as in ``mmdebstrap --variant=minbase``), the packages its
``apt-get install`` lines name, and everything those depend on (``Depends``/``Pre-Depends`` from the
dpkg database). Libraries inside the venv travel with it and need nothing.

    python docker/check_runtime.py docker/Dockerfile.cpu docker/Dockerfile.gpu
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEBIAN_RELEASE = "bookworm"  # the images' base: python:3.11-slim-bookworm (docker/base-image.sh)
# apt-get options that take the next word as their value (not a package name)
APT_OPTIONS_WITH_VALUE = {"-o", "--option", "-t", "--target-release", "-c", "--config-file"}
SHELL_SEPARATORS = re.compile(r"&&|\|\||[;|\n]")


# ---------------------------------------------------------------- the Dockerfile

@dataclass
class Stage:
    """One ``FROM`` block: its base image, its name (``AS``) and its instructions (keyword, arguments)."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


def logical_lines(text: str) -> list[str]:
    """The Dockerfile's instructions, one per string: continuation lines joined, comments dropped
    (Docker drops comment lines inside a continued instruction too)."""
    lines, current = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def parse_stages(text: str) -> list[Stage]:
    """The stages of a Dockerfile, in order; ``ARG`` lines before the first ``FROM`` are not a stage."""
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]  # --platform=...
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return stages


def run_shell_text(rest: str) -> str:
    """A RUN instruction's command: its ``--mount``/``--network`` flags dropped, exec form joined."""
    while rest.startswith("--"):
        rest = rest.split(None, 1)[1] if " " in rest else ""
    if rest.startswith("["):
        return " ".join(json.loads(rest))
    return rest


def apt_operands(args: list[str]) -> list[str]:
    """An apt command's words that are not options nor option values: the verb, then the packages."""
    operands, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word in APT_OPTIONS_WITH_VALUE:
            skip = True
        elif not word.startswith("-"):
            operands.append(word)
    return operands


def apt_installed(stage: Stage) -> set[str]:
    """The packages that the stage's ``apt-get install`` / ``apt install`` commands name (versions
    ``=1.2`` and architectures ``:amd64`` stripped)."""
    packages: set[str] = set()
    for rest in stage.args("RUN"):
        for command in SHELL_SEPARATORS.split(run_shell_text(rest)):
            words = shlex.split(command, comments=True)
            while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value prefixes
                words.pop(0)
            if len(words) < 2 or Path(words[0]).name not in ("apt-get", "apt"):
                continue
            operands = apt_operands(words[1:])
            if operands[:1] == ["install"]:
                packages |= {re.split(r"[=:]", word, maxsplit=1)[0] for word in operands[1:]}
    return packages


def runtime_and_build(stages: list[Stage]) -> tuple[Stage, Stage | None]:
    """The final stage (what the image runs) and the stage it copies the venv from, if any."""
    runtime = stages[-1]
    names = {s.name: s for s in stages if s.name}
    for rest in runtime.args("COPY"):
        match = re.search(r"--from=(\S+)", rest)
        if match and match.group(1) in names:
            return runtime, names[match.group(1)]
    return runtime, None


# ---------------------------------------------------------------- the two stages agree on Python

def env_values(stage: Stage) -> dict[str, str]:
    """The stage's ``ENV`` settings, in order (``ENV A=1 B=2`` and the old ``ENV A 1`` form)."""
    values: dict[str, str] = {}
    for rest in stage.args("ENV"):
        words = shlex.split(rest)
        if words and "=" not in words[0]:
            values[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            key, _, value = word.partition("=")
            values[key] = value.replace("$PATH", values.get("PATH", "$PATH"))
    return values


def venv_made(stage: Stage) -> str | None:
    """Where the build stage makes its venv (``python -m venv PATH``, ``virtualenv PATH``)."""
    for rest in stage.args("RUN"):
        match = re.search(r"(?:-m\s+venv|virtualenv)\s+(?:--?\S+\s+)*(/\S+)", run_shell_text(rest))
        if match:
            return match.group(1).rstrip("/")
    return None


def python_problems(name: str, build: Stage, runtime: Stage) -> list[str]:
    """Where the venv is made, copied and put on ``PATH``, and the Python that both stages start from."""
    where = f"{name}:"
    venv = venv_made(build)
    if venv is None:
        return [f"{where} the build stage makes no venv (`python -m venv PATH`) for the runtime stage to copy"]
    problems = []
    if build.base != runtime.base:
        problems.append(f"{where} the build stage starts FROM {build.base} and the runtime stage FROM "
                        f"{runtime.base}; the venv's interpreter link (pyvenv.cfg `home`) needs the same Python")
    copies = [rest.split() for rest in runtime.args("COPY") if f"--from={build.name}" in rest]
    copies = [[w for w in words if not w.startswith("--")] for words in copies]
    if not any(words[0].rstrip("/") == venv and words[-1].rstrip("/") == venv for words in copies):
        found = ", ".join(f"{w[0]} -> {w[-1]}" for w in copies) or "nothing"
        problems.append(f"{where} the build stage makes its venv at {venv} but the runtime stage copies {found} "
                        f"from it; copy {venv} to the same path (the venv's scripts name it)")
    for stage, label in ((build, "build"), (runtime, "runtime")):
        path = env_values(stage).get("PATH", "").split(":")
        if not path or path[0] != f"{venv}/bin":
            problems.append(f"{where} the {label} stage's PATH does not start with {venv}/bin (it is "
                            f"{':'.join(path) or 'unset'}); its `python`/`pip` would not be the venv's")
    cache_build, cache_run = (env_values(s).get("PIPELINE_NATIVE_CACHE") for s in (build, runtime))
    if cache_build != cache_run or not (cache_run or "").startswith(venv + "/"):
        problems.append(f"{where} PIPELINE_NATIVE_CACHE is {cache_build!r} in the build stage and {cache_run!r} "
                        f"in the runtime stage; both must be one folder inside {venv}, where the kernels are "
                        f"built and then copied")
    return problems


# ---------------------------------------------------------------- the libraries the extensions load

@dataclass(frozen=True)
class Need:
    """A system library that an extension loads, and the Debian package that ships it."""

    extension: Path
    library: str
    path: str
    package: str


def extensions() -> list[Path]:
    """The compiled code the pipeline loads at run time from this host's venv: FFCV's extension, OpenCV's
    module, and the clustering kernels (built here if they are not cached yet)."""
    found = []
    # find_spec of a top-level package does not import it (importing ffcv would start numba and torch)
    for package, pattern in (("ffcv", "_libffcv*.so"), ("cv2", "cv2*.so")):
        spec = importlib.util.find_spec(package)
        files = sorted(Path(spec.origin).parent.glob(pattern)) if spec and spec.origin else []
        if not files:
            raise RuntimeError(f"{package} ({pattern}) is not installed in this venv; run `make setup`")
        found += files
    from pipeline.pooling import native

    if native.library() is None:
        raise RuntimeError("the clustering CPU kernels did not build here; install a C compiler (make setup)")
    return found + [native.library_path()]


def linked_files(extension: Path) -> dict[str, str]:
    """Every library ``extension`` loads, at every level, as soname -> file (``ldd``)."""
    proc = subprocess.run(["ldd", str(extension)], capture_output=True, text=True, check=True)
    files = {}
    for line in proc.stdout.splitlines():
        match = re.match(r"\s*(\S+) => (\S+|not found)", line)
        if match:
            files[match.group(1)] = match.group(2)
    missing = sorted(so for so, path in files.items() if path == "not found")
    if missing:
        raise RuntimeError(f"{extension} needs {', '.join(missing)}, which this host does not have either")
    return files


def owners(paths: set[str]) -> dict[str, str]:
    """path -> the Debian package that ships it (``dpkg -S``; the /usr-merged twin of a path counts)."""
    variants = {}
    for path in paths:
        resolved = str(Path(path).resolve())
        for v in (path, resolved):
            variants[v] = path
            variants[v[4:] if v.startswith("/usr/") else "/usr" + v] = path
    proc = subprocess.run(["dpkg", "-S", *sorted(variants)], capture_output=True, text=True)
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith(("diversion by", "local diversion")):
            continue
        packages, _, path = line.partition(": ")
        if path in variants:
            found.setdefault(variants[path], packages.split(",")[0].split(":")[0].strip())
    return found


def system_needs(venv: Path) -> list[Need]:
    """The system libraries (outside ``venv``) that the extensions load, with their packages."""
    needs, inside = [], (f"{venv}/", f"{venv.resolve()}/")
    for ext in extensions():
        files = {so: path for so, path in linked_files(ext).items() if not path.startswith(inside)}
        packages = owners(set(files.values()))
        for so, path in sorted(files.items()):
            if path not in packages:
                raise RuntimeError(f"{ext} loads {path} ({so}), which no Debian package ships; the image "
                                   f"cannot get it from apt")
            needs.append(Need(ext, so, path, packages[path]))
    return needs


# ---------------------------------------------------------------- what apt brings in

@dataclass(frozen=True)
class Debian:
    """The dpkg database of this host: each installed package's dependencies, and the base set."""

    depends: dict[str, list[list[str]]]  # package -> alternatives groups (first installed one is taken)
    provides: dict[str, str]  # virtual package -> an installed package that provides it
    essential: frozenset[str]

    @classmethod
    def load(cls) -> Debian:
        fmt = "${Package}\t${Essential}\t${Pre-Depends}, ${Depends}\t${Provides}\t${db:Status-Abbrev}\n"
        out = subprocess.run(["dpkg-query", "-W", f"-f={fmt}"], capture_output=True, text=True,
                             check=True).stdout
        depends, provides, essential = {}, {}, set()
        for line in out.splitlines():
            package, is_essential, deps, provided, status = line.split("\t")
            if not status.startswith("ii"):
                continue
            depends[package] = [[re.split(r"[\s(:]", alt.strip())[0] for alt in group.split("|")]
                                for group in deps.split(",") if group.strip()]
            for virtual in provided.split(","):
                if virtual.strip():
                    provides.setdefault(re.split(r"[\s(]", virtual.strip())[0], package)
            if is_essential == "yes":
                essential.add(package)
        return cls(depends, provides, frozenset(essential))

    def real(self, package: str) -> str:
        """An installed package by that name, else one that provides it (a virtual package)."""
        return package if package in self.depends else self.provides.get(package, package)

    def closure(self, packages: set[str]) -> set[str]:
        """``packages`` and everything apt installs with them (Depends and Pre-Depends, recursively)."""
        seen, todo = set(), [self.real(p) for p in packages]
        while todo:
            package = todo.pop()
            if package in seen:
                continue
            seen.add(package)
            for group in self.depends.get(package, []):
                chosen = next((self.real(alt) for alt in group if alt in self.depends or alt in self.provides),
                              None)
                if chosen:
                    todo.append(chosen)
        return seen


def library_problems(name: str, runtime: Stage, needs: list[Need], debian: Debian) -> list[str]:
    """One message per system library whose package the runtime stage lacks."""
    named = apt_installed(runtime)
    has = debian.closure(set(debian.essential) | {"apt"} | named)
    return [f"{name}: the runtime stage lacks {need.library} ({need.path}, Debian package {need.package}), "
            f"which {need.extension} loads; add {need.package} to the runtime stage's apt-get install "
            f"(it installs {', '.join(sorted(named)) or 'nothing'})"
            for need in needs if need.package not in has]


# ---------------------------------------------------------------- both checks

def host_release() -> str:
    text = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    match = re.search(r"^VERSION_CODENAME=(\S+)", text, re.M)
    return match.group(1) if match else "unknown"


def check(dockerfile: Path, needs: list[Need], debian: Debian, name: str | None = None) -> list[str]:
    """Every problem of ``dockerfile``'s runtime stage: missing libraries, and Python paths that disagree."""
    name = name or str(dockerfile)
    stages = parse_stages(dockerfile.read_text())
    if not stages:
        return [f"{name}: no FROM line"]
    runtime, build = runtime_and_build(stages)
    if DEBIAN_RELEASE not in runtime.base:
        return [f"{name}: the runtime stage starts FROM {runtime.base}, not a Debian {DEBIAN_RELEASE} image; "
                f"this check resolves packages for {DEBIAN_RELEASE}"]
    problems = library_problems(name, runtime, needs, debian)
    if build is None:
        return problems + [f"{name}: the runtime stage copies nothing `--from` a build stage; where is the venv?"]
    return problems + python_problems(name, build, runtime)


def main(argv: list[str]) -> int:
    if host_release() != DEBIAN_RELEASE:
        print(f"check_runtime: this host is Debian {host_release()!r}, not {DEBIAN_RELEASE}; its packages would "
              f"not be the image's", file=sys.stderr)
        return 2
    needs, debian = system_needs(Path(sys.prefix)), Debian.load()
    problems = [p for arg in argv or ["docker/Dockerfile.cpu", "docker/Dockerfile.gpu"]
                for p in check(Path(arg), needs, debian)]
    print("\n".join(problems) or f"ok: {len(needs)} system libraries of {len({n.extension for n in needs})} "
          f"extensions, all in the runtime stages; the venv paths agree")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
