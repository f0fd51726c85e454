"""The tiny DAG's settings and readers that tests/test_dag.py (which runs it) and tests/test_dag_plan.py (which runs
nothing) share."""

from __future__ import annotations

from pathlib import Path

from tests.processes import ROOT

TINY = ROOT / "configs" / "experiments" / "tiny.yaml"


# The first test's DAG also searches toward 0.6 of the unmodified GFLOPs, finetuned with PoWER-BERT: the K search
# toward a target, end to end, checked in that test's last part.
TARGET = "experiment.ksearch_targets=[{cost: gflops, fraction: 0.6, methods: [powerbert]}]"


def tiny_overrides(root: Path, data: Path) -> list[str]:
    """The tiny DAG on the betons in ``data``, its runs, stores and reports in ``root``."""
    # Bases train in-process here (multi-worker DDP is tested in test_train.py): CI time.
    return [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
            f"train.storage_path={root / 'ray'}", f"train.tracking_uri=sqlite:///{root / 'mlflow.db'}",
            f"train.artifact_root={root / 'artifacts'}", f"experiment.runs_dir={root / 'experiments'}",
            "train.workers=0"]


# The rehearsed slice of tiny.yaml: one width, one lambda, WK-Medoids and PoWER-BERT.
REHEARSED = ["experiment.embed_dims=[16]", "experiment.lambdas=[0.05]", "experiment.baseline=false",
             "experiment.eval.analysis_images=0", "experiment.eval.analysis_batch=0"]


def rehearsal_rows(text: str) -> dict[str, list[str]]:
    """The rehearsal table's rows by stage: | kind | stage | result | s/step | peak MB | seconds | note |."""
    table = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line.count(" | ") == 6]
    return {cells[1]: cells for cells in table if cells[1] != "stage"}
