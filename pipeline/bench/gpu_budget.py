"""The GPU budget of the paper's protocol (docs/cluster.md): its inputs read from the benchmark records
(``pipeline/bench/measured/``, ``pipeline.bench.records``), each with its status (measured, measured on
earlier kernels, or assumed), and the epochs a width trains. ``benchmarks/cluster_budget.py`` prints the
table of docs/cluster.md from it, and ``pipeline run --rehearse`` projects an experiment's GPU-hours with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.bench.records import find_record, kernels_current, row
from pipeline.errors import InputError
from pipeline.models.selfcheck import kernels_planned
from pipeline.runtime import KernelChoice

IMAGENET_TRAIN = 1_281_167
PAPER_METHODS = ("kmeans", "kmedoids", "wkmeans", "wkmedoids", "powerbert", "random", "importance", "tome")
GFLOPS = {"deit_tiny": 1.258, "deit_e252": 2.08, "deit_e318": 3.22, "deit_small": 4.608}  # fvcore, Table 1
# Measured on the development machine's CPU (`bench loader --imagenet-like`, docs/benchmarks.md).
LOADER_PER_CORE = 1638
ASSUMED_LOOP_EFFICIENCY = 0.95  # assumption 1 of docs/cluster.md, until a GPU `bench loop` record exists


@dataclass(frozen=True)
class Input:
    name: str
    value: float
    status: str  # "measured", "measured on earlier kernels", "assumed"
    source: str


def _status(record: dict, current: dict[str, str]) -> str:
    return "measured" if kernels_current(record, current) else "measured on earlier kernels"


def step_inputs(records: Path, gpu: str) -> tuple[Input, dict[str, Input]]:
    """The unmodified DeiT-S training step rate and each paper method's training-step speed-up."""
    current = kernels_planned(KernelChoice(), "cuda")
    found = find_record(records, kind="throughput", device=gpu, train=True, label="unmodified")
    if found is None:
        raise InputError(f"no {gpu} training-step record in {records}: run `pipeline bench throughput --train "
                         "--record` on that GPU")
    path, train = found
    rate = Input("DeiT-S training step, unmodified (images/s)", row(train, "unmodified")["images_per_s"], "measured",
                 f"{path.name} ({train['date']}, {train['commit'][:7]})")
    speedups = {}
    for method in PAPER_METHODS:
        if method in {r["label"] for r in train["rows"]}:
            speedups[method] = Input(f"{method} training-step speed-up", row(train, method)["speedup"],
                                     _status(train, current), path.name)
            continue
        inference = find_record(records, kind="throughput", device=gpu, train=False, label=method)
        if inference is not None and method in ("kmeans", "wkmeans"):
            value = row(inference[1], "kmeans" if method == "wkmeans" else method)["speedup"]
            speedups[method] = Input(f"{method} training-step speed-up", value, "assumed: the compiled inference "
                                     f"speed-up, {_status(inference[1], current)}", inference[0].name)
        elif method == "wkmeans" and "kmeans" in speedups:
            speedups[method] = Input(f"{method} training-step speed-up", speedups["kmeans"].value,
                                     "assumed: K-Means' figure", speedups["kmeans"].source)
        else:
            speedups[method] = Input(f"{method} training-step speed-up", 1.0, "assumed: the unmodified rate", "-")
    return rate, speedups


def loop_input(records: Path, gpu: str) -> Input:
    found = find_record(records, kind="loop", device=gpu, label="unmodified")
    if found is None:
        return Input("loop efficiency (loop / bare step)", ASSUMED_LOOP_EFFICIENCY, "assumed", "no GPU `bench loop` "
                     "record")
    return Input("loop efficiency (loop / bare step)", row(found[1], "unmodified")["efficiency"], "measured",
                 found[0].name)


def width_epochs(speedups: dict[str, float], methods: tuple[str, ...], levels: int, *, base: int = 300,
                 lambdas: int = 8, ksearch: int = 30, finetune: int = 300) -> float:
    """One width's training, in epochs at the unmodified model's cost."""
    return base + lambdas * ksearch + levels * finetune * sum(1 / speedups[m] for m in methods) + finetune
