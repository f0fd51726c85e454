"""Machine-readable benchmark results: what ``bench throughput --record`` and ``bench loop --record`` write,
and what the cluster budget (``benchmarks/cluster_budget.py``) and ``bench loader --imagenet-like`` read.

A record is one JSON file: the command's setting (model, device, dtype, compile, batch, keep, inference or
training step), one row a model, the machine line, the torch and Triton versions, the kernels that ran
(``models.selfcheck.kernels_planned``), the date and the commit. The records the commands read at run time
live in ``MEASURED`` inside the package (Docker images copy the package, not ``docs/``); a run on a lent
GPU adds its files there.

Records of runs made before the commands wrote them are converted from the tables those runs printed
(``record_from_output``, kept in ``docs/data/``): they carry ``"kernels": null``, which says that the
kernels they ran were not recorded, and ``kernels_current`` calls them measured on earlier kernels.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

MEASURED = Path(__file__).with_name("measured")
KINDS = ("throughput", "loop")


def write_record(path: Path, kind: str, setting: dict[str, Any], rows: list[dict[str, Any]], *, machine: str,
                 kernels: dict[str, str] | None, commit: str, command: str) -> dict[str, Any]:
    """Writes one record (returns it); ``rows``: one dict a model, ``label`` first."""
    record = {"kind": kind, "setting": setting, "rows": rows, "machine": machine, "kernels": kernels,
              "date": time.strftime("%Y-%m-%d"), "commit": commit, "command": command}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def read_record(path: Path) -> dict[str, Any]:
    """One record, checked for the keys the readers use; a ValueError naming the file otherwise."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a benchmark record ({err})") from None
    missing = {"kind", "setting", "rows", "machine", "kernels", "date", "commit"} - set(record)
    if missing or record["kind"] not in KINDS:
        raise ValueError(f"{path}: not a benchmark record (missing {sorted(missing)} or kind not in {KINDS}); "
                         "write one with `bench throughput --record FILE` or `bench loop --record FILE`")
    return record


def find_record(folder: Path, *, kind: str, device: str, train: bool | None = None, label: str | None = None
                ) -> tuple[Path, dict[str, Any]] | None:
    """The newest record (by date, then file name) in ``folder`` of ``kind`` on a ``device`` whose name holds the
    given one as a whole word ("H200" matches "NVIDIA H200", not "NVIDIA GH200"), timing a training step or not
    (``train``), with a row ``label``; None if there is none."""
    found, word = [], re.compile(rf"(?<!\w){re.escape(device)}(?!\w)", re.I)
    for path in sorted(folder.glob("*.json")):
        record = read_record(path)
        setting = record["setting"]
        if record["kind"] != kind or word.search(record["machine"]) is None:
            continue
        if train is not None and setting.get("train", kind == "loop") != train:
            continue
        if label is not None and label not in {row["label"] for row in record["rows"]}:
            continue
        found.append((record["date"], path.name, path, record))
    return None if not found else max(found)[2:]


def row(record: dict[str, Any], label: str) -> dict[str, Any]:
    return next(r for r in record["rows"] if r["label"] == label)


def kernels_current(record: dict[str, Any], current: dict[str, str]) -> bool:
    """Whether the record ran the kernels ``current`` names (versions left out); False where it did not say."""
    ran = record["kernels"]
    steps = ("kmedoids", "kmeans", "merge", "attention")
    return ran is not None and all(ran.get(step) == current.get(step) for step in steps)


_SETTING = re.compile(r"^model (?P<model>\S+), (?P<kind>inference|training step(?: \([^)]*\))?), batch (?P<batch>\d+), "
                      r"(?P<dtype>\w+), compile (?P<compile>[\w-]+), keep (?P<keep>\d+(?:,\d+)*|all)", re.M)
_ROW = re.compile(r"^\| (?P<label>[^|]+?) \| (?P<gflops>[\d.]+) \| (?P<ips>[\d.]+) \| (?P<speedup>[\d.]+) \|", re.M)


def record_from_output(text: str, *, commit: str, date: str, source: str) -> dict[str, Any]:
    """A throughput record from the table a ``bench throughput`` run printed (``format_throughput``) before the
    command wrote records: its setting line, machine line and rows; ``kernels`` null (not recorded)."""
    setting, machine = _SETTING.search(text), re.search(r"^machine: (.+)$", text, flags=re.M)
    rows = [{"label": m["label"], "gflops": float(m["gflops"]),
             "images_per_s": float(m["ips"]), "speedup": float(m["speedup"])} for m in _ROW.finditer(text)]
    if setting is None or machine is None or not rows:
        raise ValueError(f"{source}: no `bench throughput` setting line, machine line and table found")
    keep = None if setting["keep"] == "all" else [int(k) for k in setting["keep"].split(",")]
    return {"kind": "throughput", "setting": {"model": setting["model"], "train": setting["kind"] != "inference",
                                              "batch": int(setting["batch"]), "dtype": setting["dtype"],
                                              "compile": setting["compile"], "keep": keep},
            "rows": rows, "machine": machine[1], "kernels": None, "date": date, "commit": commit,
            "command": f"bench throughput (converted from {source})"}


def training_step_rates(folder: Path = MEASURED, device: str = "H200") -> dict[str, float]:
    """The training step's images/s of each model in the newest training-step record on ``device``
    (``{"unmodified": 8331.2, "wkmedoids": 9084.5}``); a ValueError saying how to make one where there is none."""
    found = find_record(folder, kind="throughput", device=device, train=True, label="unmodified")
    if found is None:
        raise ValueError(f"no training-step record on {device} in {folder}: run `bench throughput --train --record "
                         f"{folder}/NAME.json` on one")
    return {r["label"]: r["images_per_s"] for r in found[1]["rows"]}
