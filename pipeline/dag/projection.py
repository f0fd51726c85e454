"""The GPU-hours of a whole experiment, projected from measured GPU step rates (docs/cluster.md), never from
the CPU step times of a rehearsal.

``projected_gpu_hours`` is the one entry point: it takes the arithmetic and the measured figures from
``benchmarks/cluster_budget.py`` (the script behind the table in docs/cluster.md) and applies them to an
experiment's own stage counts and epochs.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from pipeline.config import Config

BUDGET_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cluster_budget.py"
# benchmarks/cluster_budget.py's --step-rate and --loop-efficiency defaults: the unmodified DeiT-S training
# step on an H200 (bf16, batch 128, measured) and the loop's share of it (assumed, docs/cluster.md).
STEP_RATE = 8331.0
LOOP_EFFICIENCY = 0.95


@dataclass(frozen=True)
class Projection:
    """GPU-hours of the whole experiment, each width at the reference model's step cost scaled by its GFLOPs
    (the low end) or at the reference model's cost (the high end); ``note`` says what was assumed, or why
    there is no figure (then the hours are None)."""

    low: float | None
    high: float | None
    note: str

    def line(self) -> str:
        if self.low is None:
            return f"projected GPU-hours: not available ({self.note})"
        return f"projected GPU-hours of the full experiment: {_hours(self.low)} to {_hours(self.high)} ({self.note})"


def _hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _budget_module() -> ModuleType | None:
    if not BUDGET_SCRIPT.is_file():
        return None
    spec = importlib.util.spec_from_file_location("cluster_budget", BUDGET_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_images(config: Config, budget: ModuleType) -> tuple[int | None, str]:
    """The real training set's size: from its metadata, else ImageNet-1k's for a 1,000-class config."""
    from pipeline.data.write import metadata_path

    path = config.data.train and metadata_path(config.data.train)
    if path is not None and path.is_file():
        return int(json.loads(path.read_text())["num_images"]), f"{config.data.train}'s images"
    if config.data.num_classes == 1000:
        return budget.IMAGENET_TRAIN, "ImageNet-1k's training images (data.train is not readable here)"
    return None, "data.train is not readable here, so the epoch's size is unknown"


def _arch_gflops(config: Config) -> list[float]:
    """GFLOPs of each width's unmodified model (fvcore, as ``pipeline flops`` counts them)."""
    from pipeline.dag.plan import archs, base_stage
    from pipeline.flops import count_flops
    from pipeline.train.build import build_model

    return [count_flops(build_model(base_stage(config, arch).config)).total for arch in archs(config)]


def projected_gpu_hours(config: Config) -> Projection:
    """The experiment's GPU-hours at the measured H200 step rate of DeiT-S (``benchmarks/cluster_budget.py``)."""
    budget = _budget_module()
    if budget is None:
        return Projection(None, None, f"{BUDGET_SCRIPT} is not in this installation")
    images, source = _train_images(config, budget)
    if images is None:
        return Projection(None, None, source)
    exp = config.experiment
    base_epochs = exp.base.epochs or config.recipe.epochs
    levels = len(exp.lambdas or exp.levels or [])
    epochs = budget.width_epochs(tuple(exp.methods), levels, base=base_epochs, lambdas=len(exp.lambdas or []),
                                 ksearch=exp.ksearch.epochs or config.recipe.epochs,
                                 finetune=exp.finetune.epochs or config.recipe.epochs)
    if not exp.baseline:
        epochs -= exp.finetune.epochs or config.recipe.epochs  # width_epochs counts the baseline finetune
    epoch_h = images / (STEP_RATE * LOOP_EFFICIENCY) / 3600
    reference = budget.GFLOPS["deit_small"]
    gflops = _arch_gflops(config)
    low = sum(epochs * epoch_h * g / reference for g in gflops)
    high = epochs * epoch_h * len(gflops)
    return Projection(low, high, f"{epochs:,.0f} epochs a width at DeiT-S's cost; {images:,} images an epoch "
                      f"({source}); {STEP_RATE:,.0f} images/s x {LOOP_EFFICIENCY} on an H200; low end: widths "
                      "in proportion to GFLOPs, high end: each like DeiT-S (docs/cluster.md)")
