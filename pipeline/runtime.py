"""How a model runs: its ``torch.compile`` mode (``none | default | reduce-overhead | max-autotune``),
its autocast dtype (``fp32 | bf16 | fp16``) and the kernel of each fused step (``KernelChoice``), the
settings shared by training, evaluation and the benchmarks.

Every forward in this package is written for it: static shapes from the keep list, no host syncs,
no data-dependent Python branches, so ``fullgraph=True`` holds for every method (tested with the
``aot_eager`` backend on the CPU). ``reduce-overhead`` adds CUDA graphs, which only exist on CUDA.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pipeline.errors import InputError
from pipeline.kernel_choices import COMPILE_MODES, KERNEL_CHOICES


def check_compile(mode: str, device: torch.device | str) -> None:
    """Raises ValueError for a mode this device cannot run, saying what to use instead."""
    if mode not in COMPILE_MODES:
        raise InputError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "reduce-overhead" and torch.device(device).type != "cuda":
        raise InputError("compile mode 'reduce-overhead' captures CUDA graphs and needs a CUDA device; "
                         "on the CPU use 'default' (or 'none')")


def compile_model(model: nn.Module, mode: str, device: torch.device | str, *, backend: str = "inductor"
                  ) -> Callable[..., torch.Tensor]:
    """``model`` compiled with ``fullgraph=True`` in ``mode``, or the model itself for ``none``."""
    check_compile(mode, device)
    if mode == "none":
        return model
    # Each model (method, keep list) is a new specialisation of the same forward code; a process
    # that compiles several (bench throughput, the tests) must not hit dynamo's default of 8,
    # which is a hard error under fullgraph=True.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(model, mode=None if mode == "default" else mode, fullgraph=True, backend=backend)


def step_marker(mode: str) -> Callable[[], None]:
    """What to call before each invocation: CUDA graphs must be told where a new step begins."""
    if mode == "reduce-overhead":
        return torch.compiler.cudagraph_mark_step_begin
    return lambda: None


def warm_up(fn: Callable[[], object], calls: int = 2, log: Callable[[str], None] | None = None,
            label: str = "model") -> float:
    """Runs ``fn`` ``calls`` times (the first compiles); returns and logs the seconds the first call took."""
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    for _ in range(calls - 1):
        fn()
    if log is not None:
        log(f"{label}: first call (compilation included) {seconds:.1f} s")
    return seconds


@contextlib.contextmanager
def cuda_settings(device: torch.device | str) -> Iterator[None]:
    """On CUDA: TF32 for float32 matmuls (the distances of the clustering steps) and cuDNN autotuning
    (``cudnn.benchmark``, as timm's training script sets it: without it the patch embedding's
    stride-16 convolution ran as cuDNN's implicit GEMM, 18% of DeiT-S's GPU time on an H200). Both are
    restored on exit; nothing changes on the CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    precision, benchmark = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.benchmark = benchmark


DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device | str, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 / fp16 autocast on ``device``, or nothing for fp32."""
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype])


@contextlib.contextmanager
def inference(device: torch.device | str, dtype: str) -> Iterator[None]:
    """The context of an inference call, and of a loop of them: ``no_grad`` and ``autocast``.

    Held across calls, autocast casts each float32 weight to bf16 / fp16 once and reuses the copy until
    the outermost context exits. Entered anew for each call, or under ``torch.inference_mode`` (where
    autocast keeps no copies), it casts every weight again in every forward: 127 casts a DeiT-S forward
    in bf16 against 27 (counted on the CPU, docs/benchmarks.md), each a kernel launch on a GPU. Weights
    must not change while it is held (the copies would go stale): a training step enters autocast itself.
    """
    with torch.no_grad(), autocast(device, dtype):
        yield


def resolve_setting(device: str, dtype: str, compile: str, cuda: bool) -> tuple[str, str, str]:
    """``auto`` values made concrete: the GPU with bf16 and ``default`` compilation where there is
    one (``cuda``), else the CPU in fp32 eager."""
    device = ("cuda" if cuda else "cpu") if device == "auto" else device
    dtype = ("bf16" if device == "cuda" else "fp32") if dtype == "auto" else dtype
    compile = ("default" if device == "cuda" else "none") if compile == "auto" else compile
    check_compile(compile, device)
    return device, dtype, compile


# Which implementation runs each fused step (the ``kernels:`` config section, ``pipeline.config.kernels``): the
# values are defined once, in ``pipeline.kernel_choices`` (torch-free, for the config), and re-exported here.
@dataclass(frozen=True)
class KernelChoice:
    """The implementation of each fused step, as a model runs it; the ops take it as arguments, so a
    compiled graph keeps the choice of the config it was built from. ``KERNEL_CHOICES`` lists the values."""

    kmedoids: str = "auto"
    kmeans: str = "auto"
    merge: str = "auto"
    attention: str = "auto"
    native: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in KERNEL_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"kernels.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


# ---- what each fused step ran ----

# (kernel, implementation, tokens) of every path a fused step's dispatch took since ``forget_dispatches``, noted
# where the dispatch decides: in a custom op's device kernel, which runs at call time, compiled or not; or in
# code that torch.compile traces, where the note is taken once, when the graph is traced (``comptime``): the
# graph runs that path on every call, and a Python side effect replayed by dynamo would guard on the set's
# contents and recompile. A set: a process that runs forever (a scoring server) holds one entry a path and shape.
_DISPATCHED: set[tuple[str, str, int]] = set()


def note_dispatch(kernel: str, implementation: str, tokens: int) -> None:
    """Notes that ``kernel`` (a ``KernelChoice`` field: kmedoids, kmeans, merge, attention) ran
    ``implementation`` on ``tokens`` tokens (the N clustered, or the T of an attention, prefix included). Traced
    by torch.compile, it notes the path once, at the shape the graph is traced at."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_note_traced)
        return
    _DISPATCHED.add((kernel, implementation, tokens))


def _note_traced(ctx) -> None:
    """``note_dispatch``'s note at trace time, from its locals (a dynamic token count gives its traced value)."""
    def value(name: str) -> object:
        var = ctx.get_local(name)
        return var.as_python_constant() if var.is_python_constant() else int(var.as_fake().node.hint)

    _DISPATCHED.add((value("kernel"), value("implementation"), value("tokens")))


def exporting() -> bool:
    """Whether ``torch.export`` is tracing this forward (``pipeline export``, on its way to ONNX). Every fused step
    then traces as its torch reference, the self-check's, instead of its custom op: an exported graph is for a
    runtime other than torch, which has no implementation of the project's ops (``pipeline.export``)."""
    return torch.compiler.is_exporting()


def forget_dispatches() -> None:
    """Starts the record of what ran afresh (a job, an evaluation: what ran before it is not its record). A graph
    compiled before it keeps running its traced paths unnoted: start the record before compiling."""
    _DISPATCHED.clear()


def dispatched() -> frozenset[tuple[str, str, int]]:
    """Every (kernel, implementation, tokens) noted since ``forget_dispatches`` (``models.selfcheck.kernels_ran``
    names them)."""
    return frozenset(_DISPATCHED)


@contextlib.contextmanager
def unrecorded_dispatches() -> Iterator[None]:
    """What runs inside is left out of the record (the device self-check's cases are not the model's calls)."""
    saved = set(_DISPATCHED)
    try:
        yield
    finally:
        _DISPATCHED.clear()
        _DISPATCHED.update(saved)
def peak_memory_mb(device: torch.device | str) -> float:
    """The memory high mark of this process so far, in MB: the CUDA allocator's peak on a GPU, else the
    peak resident set size (Linux reports ``ru_maxrss`` in KiB)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
