"""Mutation scores of the core modules (mutmut 3.8.1), each module against its own focused tests.

    python tests/mutation.py                     # every module, one after the other (`make mutation`)
    python tests/mutation.py cost pooling/merge  # some of them

Not part of `make test` or CI: a run takes tens of minutes on 2 cores. mutmut runs from its own venv
(``.venv-mutmut``, made here when missing) whose ``.pth`` file puts the project venv's site-packages on its
path: mutmut and its few dependencies (installed under constraints.txt where they overlap) never enter the
project venv. Each module runs in its own folder, ``.mutmut/<module>/``, which holds links to ``pipeline/``,
``tests/`` and ``configs/``, a copy of pyproject.toml with a ``[tool.mutmut]`` section for that module and
without pytest's ``addopts`` (``-n`` and ``--durations``; mutmut adds ``-x -q``), and mutmut's ``mutants/``.
Every run starts from no ``mutants/``: mutmut keeps a mutant's verdict while its function is unchanged, even
after the tests change. Timeouts are mutmut's defaults. One mutmut process and one child at a time
(``--max-children 1``), as the 2 cores allow, and torch on one thread (``ONE_THREAD``).

The score is (killed + timed out) / generated: a mutant in a function no selected test calls counts as a
survivor. The tests that ``torch.compile`` traces are deselected, because mutmut's wrapper of each function
(a ContextVar read) does not trace (``fullgraph=True`` refuses it); so are the registry's end-to-end tests
(``INTEGRATION``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = "mutmut==3.8.1"
VENV = ROOT / ".venv-mutmut"
WORK = ROOT / ".mutmut"
PROJECT_PYTHON = Path(sys.executable)  # the project venv's (`make mutation` runs this with it)
LINKED = ("pipeline", "tests", "configs")  # what the focused tests read, beside the package

# The tests that torch.compile traces (node ids matching any of these), which the wrapper cannot pass through.
COMPILED = (r"test_powerbert_keeps_top_scores\[True\]", r"test_tome_matches_reference\[.*compiled: bipartite merge",
            r"test_tome_merges_with_the_bipartite_groups_only_when_compiled\[True\]")


# mutmut forks each mutant's pytest from a process whose tests already ran torch ops on several threads: the fork
# then hangs at its first OpenMP region (libgomp is not fork-safe), and mutmut would record a survivor as timed out.
# One thread starts no OpenMP pool.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# test_registry.py's end-to-end tests of a method (training, the CLI in subprocesses, a model's forward): 5-60 s each,
# and every mutant of the registry's lookups would run them all before the unit tests that kill it, hours in all.
INTEGRATION = ("test_a_registered_method_trains", "test_a_plugins_entry_point_registers_its_method",
               "test_a_broken_plugin_is_named_in_one_line", "test_the_moved_build_downsampler_still_imports",
               "test_a_registered_method_counts_flops_and_benchmarks", "test_a_step_written_without_the_kernels_arg",
               "test_a_spec_that_disagrees_with_its_operator")


@dataclass(frozen=True)
class Module:
    source: str  # the file mutated
    tests: tuple[str, ...]  # its focused tests
    floor: float  # the lowest score accepted (docs/reliability.md says why for each)
    deselect: tuple[str, ...] = ()  # patterns of node ids left out (COMPILED, INTEGRATION)


MODULES = {
    "cost": Module("pipeline/cost.py", ("tests/test_cost.py",), 0.85),
    "targets": Module("pipeline/targets.py", ("tests/test_targets.py",), 0.85),
    "sparsity": Module("pipeline/sparsity.py", ("tests/test_sparsity.py",), 0.85),
    "pareto": Module("pipeline/pareto.py", ("tests/test_pareto.py",), 0.95),
    "pooling/common": Module("pipeline/pooling/common.py",
                             ("tests/test_pooling_reference.py", "tests/test_pooling_properties.py",
                              "tests/test_pooling_errors.py", "tests/test_merge.py"), 0.85, COMPILED),
    "pooling/merge": Module("pipeline/pooling/merge.py", ("tests/test_merge.py",), 0.95),
    "methods": Module("pipeline/methods.py", ("tests/test_registry.py",), 0.90, INTEGRATION),
}


def ensure_venv() -> Path:
    """``.venv-mutmut/bin/mutmut``, made when missing: mutmut in a venv of its own that sees the project's."""
    mutmut = VENV / "bin" / "mutmut"
    if mutmut.exists():
        return mutmut
    site = subprocess.run([str(PROJECT_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([str(PROJECT_PYTHON), "-m", "venv", str(VENV)], check=True)
    python = VENV / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-c", str(ROOT / "constraints.txt"), MUTMUT], check=True)
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    Path(own, "project-venv.pth").write_text(site + "\n")  # after mutmut's own packages on sys.path
    return mutmut


def deselected(module: Module) -> list[str]:
    """The node ids of ``module``'s tests that match its ``deselect`` patterns."""
    if not module.deselect:
        return []
    proc = subprocess.run([str(PROJECT_PYTHON), "-m", "pytest", "--collect-only", "-q", "-o", "addopts=",
                           "-p", "no:xdist", *module.tests], cwd=ROOT, check=True, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    return [i for i in ids if any(re.search(p, i) for p in module.deselect)]


def pyproject(module: Module, deselect: list[str]) -> str:
    """The project's pyproject.toml without pytest's addopts, with a ``[tool.mutmut]`` section for ``module``."""
    text = re.sub(r"(?m)^addopts\s*=.*\n", "", (ROOT / "pyproject.toml").read_text())
    cli = ["-p", "no:randomly", "-p", "no:xdist"] + [arg for i in deselect for arg in ("--deselect", i)]
    return text + "\n".join([
        "", "[tool.mutmut]",
        'source_paths = ["pipeline/"]',
        f"only_mutate = {json.dumps([module.source])}",
        'also_copy = ["configs/"]',
        f"pytest_add_cli_args = {json.dumps(cli)}",
        f"pytest_add_cli_args_test_selection = {json.dumps(list(module.tests))}", ""])


def measure(name: str, module: Module, mutmut: Path) -> dict[str, int]:
    """Runs mutmut over ``module`` from no earlier results; its counts (mutmut's CI/CD stats)."""
    work = WORK / name.replace("/", "-")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for linked in LINKED:
        (work / linked).symlink_to(ROOT / linked, target_is_directory=True)
    drop = deselected(module)
    (work / "pyproject.toml").write_text(pyproject(module, drop))
    log = work / "run.log"
    with log.open("w") as out:
        rc = subprocess.run([str(mutmut), "run", "--max-children", "1"], cwd=work, stdout=out, stderr=subprocess.STDOUT,
                            env=os.environ | ONE_THREAD)
        if rc.returncode != 0:
            raise SystemExit(f"{name}: mutmut exited with {rc.returncode}; see {log}")
        subprocess.run([str(mutmut), "export-cicd-stats"], cwd=work, stdout=out, stderr=subprocess.STDOUT, check=True)
        survivors = subprocess.run([str(mutmut), "results"], cwd=work, capture_output=True, text=True, check=True)
    (work / "survivors.txt").write_text(survivors.stdout)
    counts = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
    return {**counts, "deselected": len(drop)}


def row(name: str, module: Module, counts: dict[str, int], seconds: float) -> str:
    caught = counts["killed"] + counts["timeout"]
    total = counts["total"]
    score = caught / total if total else 0.0
    covered = caught / (total - counts["no_tests"]) if total > counts["no_tests"] else 0.0
    verdict = "ok" if score >= module.floor else "BELOW"
    return (f"| `{module.source}` | {total} | {counts['killed']} | {counts['timeout']} | {counts['survived']} | "
            f"{counts['no_tests']} | {100 * score:.1f}% | {100 * covered:.1f}% | {100 * module.floor:.0f}% {verdict} | "
            f"{', '.join(module.tests)} | {seconds / 60:.1f} |")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE", help=f"some of {', '.join(MODULES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.modules if name not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    names = args.modules or list(MODULES)
    mutmut = ensure_venv()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    header = ("| module | mutants | killed | timed out | survived | no test | score | covered | floor | tests | min |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    rows, below = [], []
    for name in names:
        module = MODULES[name]
        print(f"{time.strftime('%H:%M:%S')} mutmut over {module.source} with {', '.join(module.tests)}", flush=True)
        start = time.monotonic()
        counts = measure(name, module, mutmut)
        rows.append(row(name, module, counts, time.monotonic() - start))
        print(rows[-1], flush=True)
        total = counts["total"]
        if not total or (counts["killed"] + counts["timeout"]) / total < module.floor:
            below.append(name)
    print(f"\n{date.today()}, commit {commit} (and the working tree), {machine()}; survivors in "
          f".mutmut/<module>/survivors.txt\n\n{header}\n" + "\n".join(rows))
    if below:
        print(f"below their floor: {', '.join(below)}", file=sys.stderr)
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
