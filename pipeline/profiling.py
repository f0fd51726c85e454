"""What a forward pass dispatches: aten ops (a proxy for eager launch overhead), host syncs, CUDA launches."""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that make the host wait for the device (or that would, on CUDA).
HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "item", "masked_select", "is_nonzero")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside the ``with`` block, by name (``aten.bmm.default``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def host_syncs(self) -> dict[str, int]:
        """The counted ops that synchronise with the host, by name."""
        return {name: n for name, n in self.ops.items() if name.split(".")[1] in HOST_SYNC_OPS}


def count_ops(fn: Callable[[], object]) -> OpCounter:
    """Runs ``fn`` once under an ``OpCounter`` (no autograd) and returns the counter."""
    with torch.no_grad(), OpCounter() as counter:
        fn()
    return counter


_LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                  "cudaGraphLaunch")


def count_launches(fn: Callable[[], object]) -> int:
    """Kernel (and CUDA graph) launches of one call of ``fn``, from torch.profiler; CUDA only."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(event.count for event in prof.key_averages() if event.key in _LAUNCH_EVENTS)


def kernel_table(fn: Callable[[], object], rows: int = 30) -> str:
    """torch.profiler's table of one call of ``fn``, sorted by device time (self CUDA time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
