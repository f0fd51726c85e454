"""The values of each fused step's kernel choice and of the compile mode, defined once and without torch:
``runtime.KernelChoice`` validates against them and the config's ``kernels:`` section (``config/kernels.py``)
types its keys from them (the config loads where torch is not installed)."""

from __future__ import annotations

from typing import Literal, get_args

# ``torch.compile``'s modes, or none: the config's ``compile`` keys and ``runtime.compile_model`` take these.
CompileMode = Literal["none", "default", "reduce-overhead", "max-autotune"]
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)

# ``auto`` is the fastest implementation the device has; every other value names an alternative. ``torch`` is
# the reference the device self-check (``pipeline.models.selfcheck``) compares each fused kernel against.
KERNEL_CHOICES: dict[str, tuple[str, ...]] = {
    "kmedoids": ("auto", "tiled", "torch"),  # CUDA: one fused Triton launch, or two tiled ones an iteration
    "kmeans": ("auto", "torch"),  # CUDA: one Triton launch, or the torch iterations traced by inductor
    "merge": ("auto", "torch"),  # the Triton (CUDA) or native (CPU) cluster means, or torch's
    "attention": ("auto", "sdpa", "torch"),  # CUDA inference with eq. 4: one-pass Triton, SDPA + eq. 4, torch
    "native": ("auto", "torch"),  # CPU: the clustering iterations and means as native C code, or torch ops
}
