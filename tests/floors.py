"""The floors of docs/architecture.md, held by import-linter: the table there is the one source.

    python tests/floors.py           # check the package (run by `make test` before pytest)
    python tests/floors.py --print   # the import-linter configuration the table gives

The configuration is made from the table on every run, not kept in a file beside it, so there is no second
copy to fall out of step: a package moved in the table is checked on its new floor at once. Two contracts:
- a layers contract over ``pipeline``, one layer a floor, top floor first; siblings on a floor are joined
  with ``:`` (import-linter's non-independent layer), so they may import each other; ``exhaustive`` makes
  a package that the table does not name an error;
- an ``acyclic_siblings`` contract over the same packages and the modules inside each (depth 1): whatever
  imports siblings make, no cycle (``dag.runner`` and ``dag.select`` once imported each other inside functions).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
_HEADING = "## The floors"
_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


class FloorsError(ValueError):
    """docs/architecture.md's floors table is missing or malformed."""


def read_floors(text: str) -> list[list[str]]:
    """The packages of each floor, bottom floor first, from the table under ``## The floors``."""
    if _HEADING not in text:
        raise FloorsError(f"docs/architecture.md has no '{_HEADING}' section; the floors table belongs under it")
    section = text.split(_HEADING, 1)[1].split("\n## ", 1)[0]
    floors: dict[int, list[str]] = {}
    for line in section.splitlines():
        match = _ROW.match(line.strip())
        if match is None:
            continue
        number, cell = int(match.group(1)), match.group(2)
        names = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)
        if not names or number in floors:
            raise FloorsError(f"floor {number} of the floors table: expected one row of `package` names, got {line!r}")
        floors[number] = names
    if sorted(floors) != list(range(1, len(floors) + 1)) or not floors:
        raise FloorsError(f"the floors table must number its floors 1, 2, ... with no gap; got {sorted(floors)}")
    names = [name for number in sorted(floors) for name in floors[number]]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise FloorsError(f"a package stands on two floors of the table: {twice}")
    return [floors[number] for number in sorted(floors)]


def contract(floors: list[list[str]], package: str = "pipeline") -> str:
    """import-linter's INI configuration for ``floors`` (bottom first)."""
    layers = "\n".join(f"    {' : '.join(names)}" for names in reversed(floors))
    return f"""[importlinter]
root_package = {package}

[importlinter:contract:floors]
name = No package imports from a floor above its own (docs/architecture.md)
type = layers
containers = {package}
exhaustive = true
layers =
{layers}

[importlinter:contract:siblings]
name = Packages import each other with no cycle (docs/architecture.md)
type = acyclic_siblings
ancestors = {package}
depth = 1
"""


def check(config: str) -> int:
    """Runs import-linter with ``config``; its exit status (0: every contract kept)."""
    from importlinter.cli import lint_imports

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "importlinter.ini"
        path.write_text(config)
        return lint_imports(config_filename=str(path), no_cache=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the configuration instead of checking")
    args = parser.parse_args(argv)
    try:
        config = contract(read_floors(ARCHITECTURE.read_text()))
    except FloorsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.print:
        print(config, end="")
        return 0
    return check(config)


if __name__ == "__main__":
    sys.exit(main())
