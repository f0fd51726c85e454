"""The cluster budget (benchmarks/cluster_budget.py, docs/cluster.md) read from benchmark records, not constants."""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from pipeline.bench.records import MEASURED, read_record, training_step_rates

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cluster_budget.py"
TRAIN_RECORD = "h200_2026-11-27_train-step.json"


def budget(*args: str) -> str:
    """The script's output, run in this process (its imports are already loaded here)."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(SCRIPT), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def hours(text: str) -> dict[str, int]:
    found = re.findall(r"^\| (DeiT-S alone|all four widths, the \w+ end)[^|]*\| ([\d,]+) \|", text, flags=re.M)
    return {label: int(value.replace(",", "")) for label, value in found}


def test_the_docs_hold_what_the_budget_computes_from_the_records():
    """Every table line and summary the script prints is in docs/cluster.md: a changed record that the doc
    does not follow fails here."""
    out, doc = budget(), (ROOT / "docs" / "cluster.md").read_text()
    lines = [line for line in out.splitlines() if line.strip()]
    assert len([line for line in lines if line.startswith("| ")]) == 10 + 2 + 3, out  # inputs, header, hours
    missing = [line for line in lines if line not in doc]
    assert not missing, missing
    # Every figure without a measurement says so, in the output and so in the doc.
    assumed = re.findall(r"^\| (\w+) training-step speed-up \| [\d.]+ \| assumed", out, flags=re.M)
    assert sorted(assumed) == ["importance", "kmeans", "kmedoids", "powerbert", "random", "tome", "wkmeans"], out
    assert "| loop efficiency (loop / bare step) | 0.950 | assumed |" in out


def test_a_changed_record_changes_the_budget(tmp_path):
    """Halving the recorded unmodified step rate doubles every GPU-hour figure (hours = epochs x images /
    rate), and a recorded training step of ToMe replaces its assumed 1.0x."""
    records = tmp_path / "measured"
    shutil.copytree(MEASURED, records)
    before = hours(budget("--records", str(records)))
    record = json.loads((records / TRAIN_RECORD).read_text())
    rate = record["rows"][0]["images_per_s"]
    record["rows"][0]["images_per_s"] = rate / 2
    (records / TRAIN_RECORD).write_text(json.dumps(record))
    after = hours(budget("--records", str(records)))
    assert before.keys() == after.keys() and len(before) == 3
    for label, value in before.items():
        assert after[label] == pytest.approx(2 * value, abs=1.5), label  # both rounded to whole hours
    record["rows"].append({"label": "tome", "gflops": 2.3, "images_per_s": 2 * rate, "speedup": 2.0})
    (records / TRAIN_RECORD).write_text(json.dumps(record))
    out = budget("--records", str(records))
    assert re.search(r"^\| tome training-step speed-up \| 2\.000 \| measured on earlier kernels \| "
                     + re.escape(TRAIN_RECORD), out, flags=re.M), out
    assert hours(out)["DeiT-S alone"] < after["DeiT-S alone"]


def test_the_records_are_the_stored_outputs_of_their_runs():
    """The converted H200 records hold the figures of the raw outputs they came from, and say that their
    kernels were not recorded."""
    for name, source in ((TRAIN_RECORD, "h200_2026-11-27_kmeans-and-training-step/train-reduce-overhead-wkmedoids.md"),
                         ("h200_2026-11-27_compiled-kmeans.json",
                          "h200_2026-11-27_tome-kmeans-eager/compiled-reduce-overhead-kmeans.md")):
        record = read_record(MEASURED / name)
        raw = (ROOT / "docs" / "data" / "gpu" / source).read_text()
        assert record["kernels"] is None and "torch 2.11.0" in record["machine"]
        for row in record["rows"]:
            assert re.search(rf"^\| {row['label']} \| [\d.]+ \| {row['images_per_s']} \| ", raw, flags=re.M), row
        assert len(record["rows"]) == len(re.findall(r"^\| (?!model|---)", raw, flags=re.M))  # every row
    assert training_step_rates() == {"unmodified": 8331.2, "wkmedoids": 9084.5}
