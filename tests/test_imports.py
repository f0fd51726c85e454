"""An import inside a function is there to defer something heavy or optional, and for nothing else.

The rule, held here over the source (``ast``, nothing imported): every import that is not at a module's top level
must bring in, through its target's top-level imports, a package of ``DEFERRED`` that the importing module's own
top-level imports do not already bring in, or break an import circle (its target imports the importer). Any other
indented import is one to move to the top. An import inside ``try`` is a probe for an optional dependency: at the top
level it counts as the module's own, inside a function it is left to its ``except``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"
# What a module may defer: the heavy or optional packages (torch's CUDA-side compiler too), and PIL, which the
# config section of the server reads only when it checks a limit (the config loads without it).
DEFERRED = {"torch", "timm", "ray", "mlflow", "ffcv", "fvcore", "triton", "numba", "matplotlib", "cv2",
            "torchvision", "optuna", "PIL", "torch._dynamo", "onnx", "onnxscript", "onnxruntime"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def targets(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The modules an import statement loads (a ``from`` import of a submodule loads that submodule too)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer.split(".") if FILES[importer].name == "__init__.py" else importer.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in FILES)]


def imports(name: str) -> tuple[list[str], list[tuple[int, str, list[str]]]]:
    """A module's top-level import targets, and its indented imports as (line, source, targets)."""
    tree = ast.parse(FILES[name].read_text())
    top: list[str] = []
    indented: list[tuple[int, str, list[str]]] = []

    def visit(statements: list[ast.stmt], at_top: bool) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if at_top:
                    top.extend(targets(node, name))
                else:
                    indented.append((node.lineno, ast.unparse(node), targets(node, name)))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, ast.Try) and not at_top:
                continue
            else:
                stays = at_top and isinstance(node, (ast.Try, ast.If, ast.With))
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []) or [], stays)
                for handler in getattr(node, "handlers", []) or []:
                    visit(handler.body, stays)

    visit(tree.body, True)
    return top, indented


TOP, INDENTED = {}, {}
for _name in FILES:
    TOP[_name], INDENTED[_name] = imports(_name)


def closure(name: str, seen: set[str] | None = None, packages: bool = True) -> set[str]:
    """Every module that importing ``name`` loads through top-level imports (with ``packages``, its packages'
    ``__init__`` too: what an import loads; without, what the module itself reaches: where a circle runs)."""
    seen = set() if seen is None else seen
    if name in seen:
        return seen
    seen.add(name)
    parts = name.split(".")
    for depth in range(1, len(parts) if packages else 1):
        closure(".".join(parts[:depth]), seen, packages)
    for target in TOP.get(name, []):
        closure(target, seen, packages)
    return seen


def deferred(modules: set[str]) -> set[str]:
    return {package for package in DEFERRED for module in modules
            if module == package or module.startswith(package + ".")}


def needless_indented_imports() -> list[str]:
    found = []
    for name in sorted(FILES):
        mine = closure(name)
        own = deferred(mine)
        for line, source, names in INDENTED[name]:
            loaded = set().union(*(closure(target) for target in names))
            circle = name in set().union(*(closure(target, packages=False) for target in names))
            if all(target in mine for target in names) or not (deferred(loaded) - own or circle):
                found.append(f"{FILES[name].relative_to(ROOT)}:{line}: {source}")
    return found


def test_every_indented_import_defers_something_heavy_or_breaks_a_circle():
    assert needless_indented_imports() == [], "move these imports to the top of their modules"


def test_the_rule_finds_an_indented_import_that_defers_nothing(monkeypatch):
    """A planted ``import json`` inside a function of a module, one of a light pipeline module, and one of a module
    its top already imports (though a parent package of it imports the importer) are reported; an indented
    ``import ray`` in a module without ray at its top is not."""
    name = "pipeline.cost"
    monkeypatch.setitem(INDENTED, name, [*INDENTED[name], (1, "import json", ["json"]),
                                         (2, "from pipeline.errors import InputError", ["pipeline.errors"]),
                                         (3, "import ray", ["ray"])])
    writer = "pipeline.data.write"
    monkeypatch.setitem(INDENTED, writer, [*INDENTED[writer], (4, "from pipeline.data.sources import Source",
                                                               ["pipeline.data.sources"])])
    assert needless_indented_imports() == ["pipeline/cost.py:1: import json",
                                           "pipeline/cost.py:2: from pipeline.errors import InputError",
                                           "pipeline/data/write.py:4: from pipeline.data.sources import Source"]


def test_the_config_loads_without_torch():
    """The torch-free floor the deferral protects: the config and the registry import nothing of ``DEFERRED``."""
    for name in ("pipeline.config", "pipeline.methods", "pipeline.config.identity"):
        assert deferred(closure(name)) == set(), name


def private_imports(files: dict[str, Path]) -> list[str]:
    """Every ``from pipeline.x import _name`` in ``files`` whose ``_name`` is private to another module: what one
    module shares with another is a public name (``merge.means_dense``), not its own helpers."""
    found = []
    for name, path in sorted(files.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module in (None, "__future__"):
                continue
            target = targets(node, name)[0]
            for alias in node.names:
                if target.startswith("pipeline") and target != name and alias.name.startswith("_") \
                        and not alias.name.startswith("__"):
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                    found.append(f"{where}:{node.lineno}: {alias.name} from {target}")
    return found


def test_no_module_imports_another_modules_private_names(tmp_path):
    assert private_imports(FILES) == [], "make these names public in the module that defines them"
    planted = tmp_path / "planted.py"
    planted.write_text("from pipeline.pooling.merge import _empty_to_start, means_dense\n")
    assert private_imports({"pipeline.bench.planted": planted}) == [
        "planted.py:1: _empty_to_start from pipeline.pooling.merge"]
