"""The GPU-hours of a whole experiment, projected from measured GPU step rates (docs/cluster.md), never from
the CPU step times of a rehearsal.

``projected_gpu_hours`` is the one entry point: it reads the step rate, the methods' speed-ups and the loop
efficiency from the benchmark records (``pipeline.bench.gpu_budget``, what ``benchmarks/cluster_budget.py``
prints docs/cluster.md's table from) and applies them to an experiment's own stage counts and epochs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeline.bench import gpu_budget
from pipeline.bench.records import MEASURED
from pipeline.config import Config
from pipeline.dag.plan import archs, base_stage, conv_levels
from pipeline.errors import InputError
from pipeline.train.build import build_model

GPU = "H200"  # the GPU whose records the projection reads


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


def _train_images(config: Config) -> tuple[int | None, str]:
    """The real training set's size: from its metadata, else ImageNet-1k's for a 1,000-class config."""
    from pipeline.data.write import metadata_path

    path = config.data.train and metadata_path(config.data.train)
    if path is not None and path.is_file():
        return int(json.loads(path.read_text())["num_images"]), f"{config.data.train}'s images"
    if config.data.num_classes == 1000:
        return gpu_budget.IMAGENET_TRAIN, "ImageNet-1k's training images (data.train is not readable here)"
    return None, "data.train is not readable here, so the epoch's size is unknown"


def _arch_gflops(config: Config) -> list[float]:
    """GFLOPs of each width's unmodified model (fvcore, as ``pipeline flops`` counts them)."""
    from pipeline.flops import count_flops

    return [count_flops(build_model(base_stage(config, arch).config)).total for arch in archs(config)]


def projected_gpu_hours(config: Config) -> Projection:
    """The experiment's GPU-hours at the measured H200 training-step rate of DeiT-S and each method's speed-up
    (``pipeline.bench.gpu_budget``; assumed figures are named there and in docs/cluster.md)."""
    try:
        rate, speedup_inputs = gpu_budget.step_inputs(MEASURED, GPU)
    except InputError as err:
        return Projection(None, None, str(err))
    loop = gpu_budget.loop_input(MEASURED, GPU)
    images, source = _train_images(config)
    if images is None:
        return Projection(None, None, source)
    exp = config.experiment
    base_epochs = exp.base.epochs or config.recipe.epochs
    levels = len(exp.lambdas or exp.levels or []) + len(exp.ksearch_targets or [])
    speedups = {m: speedup_inputs[m].value if m in speedup_inputs else 1.0 for m in exp.methods}
    epochs = gpu_budget.width_epochs(speedups, tuple(exp.methods), levels, base=base_epochs,
                                     lambdas=len(exp.lambdas or []) + len(exp.ksearch_targets or []),
                                     ksearch=exp.ksearch.epochs or config.recipe.epochs,
                                     finetune=exp.finetune.epochs or config.recipe.epochs)
    if not exp.baseline:
        epochs -= exp.finetune.epochs or config.recipe.epochs  # width_epochs counts the baseline finetune
    epoch_h = images / (rate.value * loop.value) / 3600
    reference = gpu_budget.GFLOPS["deit_small"]
    gflops = _arch_gflops(config)
    # experiment.conv: each placement a finetune of the width that has it, at no speed-up (assumed: its own layers'
    # cost is not measured on the GPU)
    conv = [len(conv_levels(config, arch)) * (exp.finetune.epochs or config.recipe.epochs) for arch in archs(config)]
    low = sum((epochs + c) * epoch_h * g / reference for c, g in zip(conv, gflops))
    high = sum((epochs + c) * epoch_h for c in conv)
    assumed = sorted(m for m in exp.methods if m not in speedup_inputs
                     or speedup_inputs[m].status.startswith("assumed"))
    placed = f"; conv placements {sum(conv):,.0f} epochs more, at no speed-up" if sum(conv) else ""
    return Projection(low, high, f"{epochs:,.0f} epochs a width at DeiT-S's cost{placed}; {images:,} images an epoch "
                      f"({source}); {rate.value:,.0f} images/s x {loop.value:.2f} ({loop.status}) on an {GPU}; "
                      f"speed-ups assumed for {', '.join(assumed) or 'none'}; low end: widths in proportion to "
                      "GFLOPs, high end: each like DeiT-S (docs/cluster.md)")
