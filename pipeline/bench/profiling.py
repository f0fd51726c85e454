"""What a forward pass dispatches: aten ops (a proxy for eager launch overhead), host syncs, CUDA launches."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
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


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # pipeline/: its files, for DeviceReads' keys
# Tensor methods that copy a tensor to the host without an aten op that OpCounter would see on the CPU.
_HOST_COPY_METHODS = ("tolist", "cpu", "numpy")


class DeviceReads(TorchDispatchMode):
    """Counts the device-to-host reads inside the ``with`` block: the ops of ``HOST_SYNC_OPS`` (``.item()``,
    ``float(t)``, ``bool(t)``, ``nonzero``) and the calls of ``Tensor.tolist``, ``.cpu`` and ``.numpy``, on
    this thread, each keyed by the innermost ``pipeline/`` line that made it.

    On the CPU every tensor is a host tensor, so this counts what *would* make the host wait on a GPU:
    run the CUDA code path on the CPU under it. ``paused()`` leaves out what runs inside (a loader's own
    host-side work). Under ``torch.compile`` it is off while dynamo traces and on while the compiled code
    runs, so it counts what a compiled model dispatches (every aten op with the ``aot_eager`` backend).
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[str] = collections.Counter()
        self._thread = threading.get_ident()
        self._paused = 0
        self._saved: dict[str, Callable] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).split(".")[1] in HOST_SYNC_OPS:
            self._count(str(func))
        return func(*args, **(kwargs or {}))

    def _count(self, what: str) -> None:
        if self._paused or threading.get_ident() != self._thread:
            return
        frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(_PACKAGE)]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "outside pipeline/"
        self.reads[f"{what} at {where}"] += 1

    def __enter__(self):
        for name in _HOST_COPY_METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from the C base class
            setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, own in self._saved.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)
        return super().__exit__(*exc)

    def _counting(self, name: str, original: Callable) -> Callable:
        def method(tensor, *args, **kwargs):
            self._count(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)
        return method

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def count(self) -> int:
        return sum(self.reads.values())


def count_ops(fn: Callable[[], object]) -> OpCounter:
    """Runs ``fn`` once under an ``OpCounter`` (no autograd) and returns the counter."""
    with torch.no_grad(), OpCounter() as counter:
        fn()
    return counter


_LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                  "cudaGraphLaunch")


def _profiled(fn: Callable[[], object], cuda: bool):
    """torch.profiler's record of one call of ``fn``, its device work included when ``cuda``.

    On CUDA the session leaves CUPTI attached after it ends (Kineto tears it down only with TEARDOWN_CUPTI=1,
    pytorch/pytorch#144455), which slows every later kernel launch: the benchmarks time first, then profile.
    """

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return prof


def count_launches(fn: Callable[[], object]) -> int:
    """Kernel (and CUDA graph) launches of one call of ``fn``, from torch.profiler; CUDA only."""
    prof = _profiled(fn, cuda=True)
    return sum(event.count for event in prof.key_averages() if event.key in _LAUNCH_EVENTS)


# Groups of the kernel summary, first match wins, on the names CUDA, cuBLAS / CUTLASS, cuDNN, Triton and
# inductor give kernels ("s1688gemm" and "tf32" are float32 inputs on TF32 tensor cores; nvjet is cuBLAS).
KERNEL_GROUPS = (
    ("attention (fused SDPA)", r"sdpa|flash|fmha|attention"),
    ("scores, eq. 4 (Triton)", r"^_column_sums|^_row_lse|^_row_grad|^_column_grad"),
    ("K-Medoids iterations (Triton)", r"^_assign_kernel|^_cost_kernel"),
    ("GEMM, float32 (TF32)", r"tf32|s1688gemm|s16816gemm|sgemm"),
    ("GEMM, bf16 / fp16", r"gemm|nvjet|cutlass|cublas"),  # nvjet names carry no dtype (all bf16 on the H200 2026-11-27)
    ("top-k, sort", r"topk|sort"),
    ("inductor: GELU", r"^triton_.*gelu"),
    ("inductor: LayerNorm, residual", r"^triton_.*layer_norm"),
    ("inductor: other", r"^triton_"),
    ("memcpy, memset", r"^memcpy|^memset"),
    ("other aten kernels", r"at::native|at::cuda|^void at::"),
)


@dataclass(frozen=True)
class KernelTime:
    name: str
    us: float  # device time of all calls, microseconds
    calls: int


def kernel_group(name: str) -> str:
    """The summary group of a device kernel, by its name (``KERNEL_GROUPS``); "other" if none matches."""
    for group, pattern in KERNEL_GROUPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return group
    return "other"


def _sum_by(kernels: Iterable[KernelTime], key: Callable[[KernelTime], str]) -> list[KernelTime]:
    """Times and calls summed over the kernels of each ``key``, named by it, the largest first."""
    us: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for k in kernels:
        name = key(k)
        us[name] += k.us
        calls[name] += k.calls
    return [KernelTime(name, t, calls[name]) for name, t in us.most_common()]


def group_kernels(kernels: list[KernelTime]) -> list[KernelTime]:
    """Kernel times summed by ``kernel_group``, the largest first."""
    return _sum_by(kernels, lambda k: kernel_group(k.name))


def format_kernels(kernels: list[KernelTime], rows: int = 60) -> str:
    """Markdown: device time by group, then the ``rows`` longest kernels with their names uncut (an inductor
    kernel's name lists the aten ops it fuses)."""
    ranked = sorted(kernels, key=lambda k: -k.us)
    total = sum(k.us for k in kernels) or 1.0
    lines = [f"device time of one call: {total / 1e3:.3f} ms in {sum(k.calls for k in kernels)} kernels", "",
             "| group | ms | share | kernels |", "|---|---:|---:|---:|"]
    lines += [f"| {g.name} | {g.us / 1e3:.3f} | {g.us / total:.1%} | {g.calls} |" for g in group_kernels(kernels)]
    lines += ["", "| kernel | group | ms | calls | us a call |", "|---|---|---:|---:|---:|"]
    for k in ranked[:rows]:
        lines.append(f"| `{k.name}` | {kernel_group(k.name)} | {k.us / 1e3:.3f} | {k.calls} | {k.us / k.calls:.1f} |")
    if len(kernels) > rows:
        rest = ranked[rows:]
        lines.append(f"| {len(rest)} more | | {sum(k.us for k in rest) / 1e3:.3f} | {sum(k.calls for k in rest)} | |")
    return "\n".join(lines)


def device_kernels(events) -> list[KernelTime]:
    """Kernels (and memcpys / memsets) that ran on the device, summed by name, the longest first, from
    torch.profiler's events.

    Only device events count: a CPU op's, and a ``record_function`` range's, device time is that of the
    kernels it launched, which are here already (torch.profiler's table counts both)."""
    ran = (KernelTime(e.name, e.time_range.elapsed_us(), 1) for e in events
           if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))  # torch >= 2.5
    return _sum_by(ran, lambda k: k.name)


def kernel_table(fn: Callable[[], object], rows: int = 30) -> str:
    """A profile of one call of ``fn``: on CUDA the device time by kernel group and the longest kernels
    (``format_kernels``), then torch.profiler's own table, sorted by device time (CPU time off CUDA)."""
    cuda = torch.cuda.is_available()
    prof = _profiled(fn, cuda)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    return f"{kernel_summary(prof)}\n\n{table}" if cuda else table


def kernel_summary(prof) -> str:
    """``format_kernels`` of a finished profile, or one line that says why there is none: it is logged after
    the timings, and a profiler that differs across torch versions must not cost a run its figures."""
    try:
        return format_kernels(device_kernels(prof.events()))
    except Exception as error:  # noqa: BLE001 - any failure of the summary, reported in its place
        return f"(no kernel summary: {type(error).__name__}: {error})"
