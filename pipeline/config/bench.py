"""``bench:``, ``bench_throughput:`` and ``bench_loop:``: the benchmarks' settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import MethodName, PatchEmbed, Section
from pipeline.errors import InputError
from pipeline.kernel_choices import CompileMode
from pipeline.methods import KEEP_ALL, downsampling_methods


class BenchOpsConfig(Section):
    """``pipeline bench ops``: each method timed against one transformer block on the same input."""

    model: str = "deit_small_patch16_224"
    batch: int = Field(64, ge=1)
    keep: list[int] = Field(default_factory=lambda: [147, 98, 49], min_length=1)
    methods: list[MethodName] = Field(
        default_factory=downsampling_methods,  # every registered method that downsamples
        min_length=1,
    )
    warmup: int = Field(3, ge=0)
    repeats: int = Field(10, ge=1, description="timed runs per row; the median is reported")
    threads: int | None = Field(None, ge=1, description="torch CPU threads; default: torch's choice")
    device: Literal["cpu", "cuda"] = "cpu"
    tome_reference: str | None = Field(
        None, description="path to a checkout of facebookresearch/ToMe, to time its merge side by side"
    )

    @field_validator("keep")
    @classmethod
    def _keep_positive(cls, keep: list[int]) -> list[int]:
        if any(k < 1 for k in keep):
            raise InputError(f"every K must be >= 1, got {keep}")
        return keep


class _BenchModels(Section):
    """What the model benchmarks share: which models, on which batch, in which dtype and compile mode."""

    model: str = "deit_small_patch16_224"
    methods: list[MethodName] = Field(default_factory=lambda: ["wkmedoids"], min_length=1,
                                      description="timed in one run, each against the same reference")
    keep: list[int] | None = Field(None, description="K_1..K_L; default: the sparsity level below")
    level: int | None = Field(3, ge=0, le=7, description="the paper's sparsity level (configs/sparsity/)")
    batch: int = Field(64, ge=1)
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast dtype of every model")
    compile: CompileMode = Field("none", description="torch.compile mode of every model (fullgraph)")
    patch_embed: PatchEmbed = Field("conv", description="the patch embedding of every model timed")
    threads: int | None = Field(None, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"

    @model_validator(mode="after")
    def _one_keep_source(self) -> _BenchModels:
        section = "bench_loop" if isinstance(self, BenchLoopConfig) else "bench_throughput"
        if self.keep is not None and self.level is not None:
            raise InputError(f"set {section}.keep or {section}.level, not both (set level: null)")
        if self.compile == "reduce-overhead" and self.device != "cuda":
            raise InputError(f"{section}.compile 'reduce-overhead' captures CUDA graphs: it needs device cuda")
        return self


class BenchThroughputConfig(_BenchModels):
    """``pipeline bench throughput``: downsampling models against the unmodified one, side by side."""

    train: bool = Field(False, description="time an optimizer step (forward, backward, AdamW), not inference")
    ceiling: bool = Field(True, description="add a row of plain random token dropping at the same keep list")
    profile: bool = Field(False, description="log a profile of one call of each model: on CUDA the device time "
                         "by kernel group and the longest kernels, then torch.profiler's table")
    warmup: int = Field(2, ge=0)
    repeats: int = Field(10, ge=1, description="timed samples of each model, paired")
    calls: int | None = Field(None, ge=1, description="calls a timed sample queues back to back before one device "
                              "sync (default: 10 on CUDA, which measures throughput; 1 on the CPU)")


class BenchLoopConfig(_BenchModels):
    """``pipeline bench loop``: the training loop (``train_one_epoch``) against the bare step it runs, on the
    same model, batch, dtype and compile mode, fed from batches already on the device."""

    methods: list[MethodName] = Field(default_factory=lambda: [KEEP_ALL, "wkmedoids"], min_length=1,
                                      description=f"{KEEP_ALL}: the unmodified model")
    batch: int = Field(32, ge=2, description="per step (even: Mixup/CutMix pairs images when enabled)")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="bf16: autocast on CUDA (recipe.amp)")
    steps: int = Field(20, ge=1, description="steps of one timed epoch")
    repeats: int = Field(3, ge=1, description="timed (bare steps, loop epoch) pairs; the median is reported")
    log_every: int = Field(50, ge=1, description="train.log_every of the loop")

    @model_validator(mode="after")
    def _bf16_on_cuda(self) -> BenchLoopConfig:
        if self.dtype == "bf16" and self.device != "cuda":
            raise InputError("bench_loop.dtype bf16: training autocasts to bf16 on CUDA only (recipe.amp); use fp32 "
                             "on the CPU")
        return self
