"""The floors contract (tests/floors.py, import-linter) holds the package to docs/architecture.md's table: a
planted upward import, a planted cycle between siblings and a package the table does not name each fail it,
in a copy of the package, while the copy as it stands passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.floors import ARCHITECTURE, ROOT, FloorsError, contract, read_floors

CHECK = ("import sys; from pathlib import Path; from tests.floors import check; "
         "sys.exit(check(Path(sys.argv[1]).read_text()))")


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the package in ``tmp_path``, with the configuration the real table gives."""
    shutil.copytree(ROOT / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp_path / "floors.ini").write_text(contract(read_floors(ARCHITECTURE.read_text())))
    return tmp_path


def lint(copy: Path) -> subprocess.CompletedProcess:
    """import-linter on the copy (its folder first on the path, so ``pipeline`` is the copy)."""
    env = {"PYTHONPATH": f"{copy}:{ROOT}", "PATH": "/usr/bin:/bin", "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", CHECK, str(copy / "floors.ini")], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=60)


def plant(copy: Path, module: str, line: str) -> None:
    path = copy / "pipeline" / module
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_package_as_it_stands_keeps_both_contracts(copy):
    result = lint(copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_floors(copy):
    plant(copy, "errors.py", "from pipeline.cli import main  # floor 1 reaching floor 9")
    result = lint(copy)
    assert result.returncode == 1
    assert "pipeline.errors is not allowed to import pipeline.cli" in result.stdout
    assert "pipeline.errors -> pipeline.cli" in result.stdout


def test_a_cycle_between_siblings_breaks_the_second_contract(copy):
    # flops imports sparsity (both floor 4, allowed); sparsity importing flops closes a cycle
    plant(copy, "sparsity.py", "import pipeline.flops")
    result = lint(copy)
    assert result.returncode == 1
    assert "No package imports from a floor above its own (docs/architecture.md) KEPT" in result.stdout
    assert "Packages import each other with no cycle (docs/architecture.md) BROKEN" in result.stdout


def test_a_package_the_table_does_not_name_fails(copy):
    (copy / "pipeline" / "stray.py").write_text('"""Not in the floors table."""\n')
    result = lint(copy)
    assert result.returncode == 1
    assert "- pipeline.stray" in result.stdout


def test_the_table_is_read_bottom_floor_first():
    text = ("## The floors\n\n| floor | packages | owns |\n|---|---|---|\n"
            "| 1 | `errors`, `plots` | x |\n| 2 | `cli` | y |\n\n## Next\n| 3 | `ignored` | z |\n")
    assert read_floors(text) == [["errors", "plots"], ["cli"]]
    assert "    cli\n    errors : plots\n" in contract(read_floors(text))


@pytest.mark.parametrize("table, says", [
    ("| 1 | `errors` | x |\n| 3 | `cli` | y |\n", "no gap"),
    ("| 1 | `errors` | x |\n| 2 | `errors` | y |\n", "two floors"),
    ("| 1 | no names here | x |\n", "floor 1"),
])
def test_a_malformed_table_is_named(table, says):
    with pytest.raises(FloorsError, match=says):
        read_floors("## The floors\n\n" + table)
    with pytest.raises(FloorsError, match="no '## The floors' section"):
        read_floors(table)
