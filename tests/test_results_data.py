"""Every result table has its data: each table in docs/results.md sits in a section that cites a file (or folder) under
docs/data/ that exists and holds at least one figure of the table, or says in its own line that it has none
(``**No data file:**`` right under the table, with why), so a table whose raw output was not kept is marked, not
passed off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs/results.md"
NO_DATA = "**No data file:**"
ROW = re.compile(r"^\s*\|")
RULE = re.compile(r"^\s*\|[-|: ]+\|\s*$")
CITED = re.compile(r"\]\((data/[^)#\s]+)\)|docs/(data/[^`\s)]+)")
TEXT_SUFFIXES = {".csv", ".md", ".txt", ".log", ".json", ".tsv", ".yaml"}


def tables(text: str) -> list[tuple[int, int, str]]:
    """``(first line, line after, section text)`` of each markdown table, with the section it sits in (from the
    heading above it to the next)."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("#")]
    found, i = [], 0
    while i < len(lines) - 1:
        if ROW.match(lines[i]) and RULE.match(lines[i + 1]):
            end = i + 2
            while end < len(lines) and ROW.match(lines[end]):
                end += 1
            top = max([h for h in heads if h < i], default=0)
            bottom = min([h for h in heads if h > i], default=len(lines))
            found.append((i, end, "\n".join(lines[top:bottom])))
            i = end
        else:
            i += 1
    return found


def figures(rows: list[str]) -> list[tuple[str, object]]:
    """A table's figures: decimals (``69.65``, found at the precision printed, or as a fraction: ``0.6965``), integer
    lists as one figure (``46, 44, 31, 0``, found as consecutive numbers) and percentages (``90%``, or ``0.8984``)."""
    body = "\n".join(rows[2:]).replace("**", "")
    found: list[tuple[str, object]] = []
    for number in dict.fromkeys(re.findall(r"(?<![\w.,])\d+\.\d+(?![\w.%])", body)):
        found.append(("decimal", number))
    for match in dict.fromkeys(re.findall(r"\d+(?:,\s*\d+){2,}", body)):
        found.append(("list", tuple(int(n) for n in re.findall(r"\d+", match))))
    for number in dict.fromkeys(re.findall(r"(?<![\w.])(\d+(?:\.\d+)?)%", body)):
        found.append(("percent", number))
    return found


def cited_files(section: str) -> list[Path]:
    paths = {next(g for g in match.groups() if g) for match in CITED.finditer(section)}
    return sorted(ROOT / "docs" / p.rstrip(".,;") for p in paths)


def share_found(files: list[Path], rows: list[str]) -> tuple[int, int]:
    """How many of the table's figures the files hold, of how many."""
    numbers: list[str] = []
    for path in files:
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            if file.is_file() and file.suffix in TEXT_SUFFIXES:
                numbers += re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", file.read_text(errors="replace"))
    values = [float(n) for n in numbers]
    ints = [int(n) for n in numbers if re.fullmatch(r"-?\d+", n)]
    rounded = {k: {round(v, k) for v in values} | {round(100 * v, k) for v in values if abs(v) <= 1}
               for k in range(0, 6)}

    def holds(kind: str, figure) -> bool:
        if kind == "list":
            n = len(figure)
            return any(tuple(ints[i:i + n]) == figure for i in range(len(ints) - n + 1))
        digits = len(figure.partition(".")[2])
        return round(float(figure), digits) in rounded[min(digits, 5)]

    table = figures(rows)
    return sum(holds(kind, figure) for kind, figure in table), len(table)


def marked(lines: list[str], end: int) -> bool:
    after = [line for line in lines[end:end + 3] if line.strip()]
    return bool(after) and after[0].lstrip().startswith(NO_DATA)


TEXT = RESULTS.read_text()
LINES = TEXT.splitlines()
TABLES = tables(TEXT)


def test_results_md_has_its_tables():
    assert len(TABLES) >= 15, len(TABLES)


@pytest.mark.parametrize("start, end, section", TABLES, ids=[f"line{t[0] + 1}" for t in TABLES])
def test_a_result_table_cites_a_data_file_that_holds_its_figures(start: int, end: int, section: str):
    rows = LINES[start:end]
    if marked(LINES, end):
        note = next(line for line in LINES[end:end + 3] if line.strip())
        assert len(note) > len(NO_DATA) + 20, f"line {end + 1}: say why the table has no data file"
        return
    files = cited_files(section)
    missing = [str(f.relative_to(ROOT)) for f in files if not f.exists()]
    assert files, (f"docs/results.md line {start + 1}: its section cites no file under docs/data/; cite the raw "
                   f"output it was read from, or mark it '{NO_DATA} <why>' right under it")
    assert not missing, f"docs/results.md line {start + 1}: cited but not there: {missing}"
    held, count = share_found(files, rows)
    assert count and 2 * held >= count, (f"docs/results.md line {start + 1}: {held} of the table's {count} figures "
                                         f"are in {[str(f.relative_to(ROOT)) for f in files]}; at least half must be")


def test_a_table_whose_cited_file_lacks_its_figures_fails(tmp_path):
    data = tmp_path / "out.csv"
    data.write_text("level,top1\nL1,70.10\nL2,0.6500\n")
    rows = ["| level | top-1 | keep |", "|---|---:|---|", "| L1 | 69.65 | 46, 44, 31, 0 |", "| L2 | 65.00 | 90% |"]
    assert share_found([data], rows) == (1, 4)  # 0.65 is 65.00 as a fraction; 69.65, the list and 90% are not there
    data.write_text("level,top1,keep,share\nL1,69.65,\"[46, 44, 31, 0]\",0.8984\nL2,65.0,,\n")
    assert share_found([data], rows) == (4, 4)
