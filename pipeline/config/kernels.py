"""``kernels:``, the implementation of each fused step (``runtime.KernelChoice``).

How a model runs, not what it computes: every value gives the same results within the device self-check's
tolerance (``pipeline doctor``). Training identities leave the section out (``config/identity.py``); an
evaluation's identity and every benchmark's output name it, and MLflow records both the values and what
they resolved to on the device (``models.selfcheck.kernels_planned``, and what ran ``kernels_ran``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from pipeline.config.base import Section
from pipeline.kernel_choices import KERNEL_CHOICES

if TYPE_CHECKING:
    from pipeline.runtime import KernelChoice


class KernelsConfig(Section):
    """Which kernel runs each fused step; ``auto`` is the fastest one the device has. The values of each key are
    ``kernel_choices.KERNEL_CHOICES``' (one definition for the config and ``runtime.KernelChoice``)."""

    kmedoids: Literal[KERNEL_CHOICES["kmedoids"]] = Field(
        "auto", description="K-Medoids' iterations: auto (CUDA: one fused Triton launch; CPU: native C code), tiled "
        "(CUDA: two Triton launches an iteration, the kernels of the earlier GPU figures), torch (the torch ops)")
    kmeans: Literal[KERNEL_CHOICES["kmeans"]] = Field(
        "auto", description="K-Means' iterations: auto (CUDA: one Triton launch; CPU: native C code), torch (the "
        "torch iterations, traced by torch.compile; the self-check's reference)")
    merge: Literal[KERNEL_CHOICES["merge"]] = Field(
        "auto", description="the cluster means: auto (CUDA: the Triton kernel; CPU: native C code), torch (CUDA: the "
        "one-hot product; CPU: index_add_ sums)")
    attention: Literal[KERNEL_CHOICES["attention"]] = Field(
        "auto", description="attention with eq. 4 in CUDA inference: auto (the one-pass Triton kernel), sdpa (the "
        "fused attention, then eq. 4 apart: what the earlier GPU figures ran), torch (one set of logits in torch)")
    native: Literal[KERNEL_CHOICES["native"]] = Field(
        "auto", description="the clustering iterations and the cluster means on the CPU: auto (native C kernels, built "
        "on first use where a C compiler exists), torch (the torch iterations and index_add_ sums)")

    def choice(self) -> KernelChoice:
        """The plain value the models and ops take (``runtime`` imports torch, which the config does not)."""
        from pipeline.runtime import KernelChoice

        return KernelChoice(**self.model_dump())
