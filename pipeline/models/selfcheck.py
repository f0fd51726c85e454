"""The device self-check of the fused kernels, and the record of which kernels run.

Each fused kernel that a ``runtime.KernelChoice`` selects on a device is run once, on a small random case,
against the torch path on the same device, the first time a model is built for that device in a process
(``check_model``, called eagerly before compiling, never inside an op: a check during CUDA-graph capture
would sync). Results are cached per device, dtype, choice and library versions. A mismatch beyond the
kernel's tolerance raises ``KernelMismatchError``, naming the kernel, the device, the error found and the
config value that selects the torch path. ``pipeline doctor`` runs every check and prints them
(``doctor_table``).

What runs where:

- CUDA: the Triton kernels (K-Medoids fused or tiled, K-Means, the merge, the one-pass attention);
- CPU: the native C kernels of K-Medoids and K-Means (``pooling.native``), bit-identical to torch by
  design, so their tolerance is 0; with ``interpret=True`` (``TRITON_INTERPRET=1``, which must be set
  before Triton is imported) also the Triton kernels' code, on CPU tensors under Triton's interpreter.

``kernel_record(choice, device)`` names what each step runs once ``auto`` is resolved, with the torch and
Triton versions: the flat dict that MLflow and every benchmark figure record.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from pipeline.errors import PipelineError
from pipeline.models.downsampling import DownsamplingBlocks
from pipeline.models.significance import attention_and_significance_torch, one_pass_fits
from pipeline.pooling import clustering, merge, native
from pipeline.runtime import KernelChoice

try:  # Triton ships with CUDA builds of torch
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# The torch path's value of each choice: what the error message tells the user to set.
TORCH_PATH = {"kmedoids": "torch", "kmeans": "torch", "merge": "torch", "attention": "torch"}
# Assignments are compared as the fraction of tokens placed differently. The native kernels round as torch
# does (-ffp-contract=off), so they must agree exactly; a Triton kernel sums in another order, which may
# flip a near-tie: 1 token in 100 is allowed. Means and attention compare by the largest error relative to
# the largest reference value.
TOLERANCE = {"native": 0.0, "index": 0.01, "float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


class KernelMismatchError(PipelineError, RuntimeError):
    """A fused kernel disagrees with the torch path on this device beyond its tolerance."""


@dataclass(frozen=True)
class CheckResult:
    """One kernel checked against the torch path: the largest error, its tolerance, and the median
    milliseconds of one call of each (the first call, compilation included, is not timed)."""

    kernel: str  # the config key: kmedoids, kmeans, merge, attention
    implementation: str  # what ran: triton-fused, native-c, ...
    device: str
    dtype: str
    error: float
    tolerance: float
    fused_ms: float
    torch_ms: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


@dataclass(frozen=True)
class _Check:
    kernel: str
    implementation: str
    dtype: torch.dtype
    fused: Callable[[], object]
    reference: Callable[[], object]
    error: Callable[[object, object], float]
    tolerance: float


def triton_version() -> str:
    return "none" if triton is None else triton.__version__


def kernel_record(choice: KernelChoice, device: torch.device | str) -> dict[str, str]:
    """What each fused step runs on ``device`` under ``choice``, ``auto`` resolved, and the torch and Triton
    versions: ``{"kmedoids": "triton-fused", ..., "torch": "2.14.1", "triton": "3.8.0"}``. The attention entry
    is the inference path of a method that reads eq. 4 (training runs the fused attention and eq. 4 apart)."""
    kind = torch.device(device).type
    if kind == "cuda":
        record = _cuda_record(choice)
    elif kind == "cpu":
        on = choice.native != "torch" and native.library() is not None
        record = {"kmedoids": "native-c" if on and choice.kmedoids != "torch" else "torch",
                  "kmeans": "native-c" if on and choice.kmeans != "torch" else "torch",
                  "merge": "torch", "attention": "torch"}
    else:
        record = dict.fromkeys(("kmedoids", "kmeans", "merge", "attention"), "torch")
    return record | {"torch": torch.__version__, "triton": triton_version()}


def kernel_params(choice: KernelChoice, device: torch.device | str) -> dict[str, str]:
    """``kernel_record`` as MLflow params: ``kernels_run.kmedoids``, ..., ``kernels_run.torch``, beside the
    config's own ``kernels.*`` values."""
    return {f"kernels_run.{key}": value for key, value in kernel_record(choice, device).items()}


def _cuda_record(choice: KernelChoice) -> dict[str, str]:
    has = clustering.kmedoids_triton is not None
    kmedoids = {"auto": "triton-fused", "tiled": "triton-tiled", "torch": "torch"}[choice.kmedoids]
    attention = {"auto": "triton-one-pass", "sdpa": "sdpa+eq4", "torch": "torch"}[choice.attention]
    return {"kmedoids": kmedoids if has else "torch",
            "kmeans": "triton-fused" if has and choice.kmeans == "auto" else "torch",
            "merge": "triton" if merge.cluster_means_triton is not None and choice.merge == "auto" else "torch",
            "attention": attention if has or choice.attention == "sdpa" else "torch"}


def _assign_error(got: object, want: object) -> float:
    """The fraction of tokens whose cluster differs (and of medoids, for K-Medoids' pair of outputs)."""
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return max(float((g.cpu() != w.cpu()).float().mean()) for g, w in zip(got, want))


def _float_error(got: object, want: object) -> float:
    """The largest absolute error of each output relative to its largest reference value."""
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want))


def _clustering_case(device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tokens (4, 49, 32) float32, weights (4, 49), 12 starting indices (4, 12) and the Gram matrices: a
    DeiT-S level's N at a tenth of its width, so a check costs a fraction of a millisecond."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 49, 32, generator=g).to(device)
    w = (torch.rand(4, 49, generator=g) + 0.1).to(device)
    start = torch.rand(4, 49, generator=g).topk(12, dim=-1).indices.to(device)
    return x, w, start, clustering.gram(x)


def _clustering_checks(choice: KernelChoice, device: torch.device, interpret: bool) -> list[_Check]:
    """K-Medoids and K-Means on ``device`` against their torch iterations (the CPU's native kernels, CUDA's
    Triton kernels, or with ``interpret`` the CUDA kernels' code on CPU tensors)."""
    x, w, start, g = _clustering_case(device)
    use_native = choice.native != "torch"
    iters, checks = 5, []
    if interpret:  # the ops' CUDA kernels, called on CPU tensors under Triton's interpreter
        medoids = lambda: clustering._kmedoids_cuda(g, w, start, iters, choice.kmedoids, use_native)  # noqa: E731
        means = lambda: clustering._kmeans_gram_cuda(g, w, start, iters, use_native)  # noqa: E731
        record = _cuda_record(choice)
    else:
        medoids = lambda: clustering._kmedoids_op(g, w, start, iters, choice.kmedoids, use_native)  # noqa: E731
        means = lambda: clustering._kmeans_gram_op(g, w, start, iters, use_native)  # noqa: E731
        record = kernel_record(choice, device)
    tolerance = TOLERANCE["native" if device.type == "cpu" and not interpret else "index"]
    if record["kmedoids"] != "torch":
        reference = lambda: clustering.kmedoids_dense(clustering.dists_from_gram(g), w, start, iters)  # noqa: E731
        checks.append(_Check("kmedoids", record["kmedoids"], torch.float32, medoids, reference, _assign_error,
                             tolerance))
    if record["kmeans"] != "torch":
        reference = lambda: clustering.kmeans_gram_iterations(g, w, start, iters)  # noqa: E731
        checks.append(_Check("kmeans", record["kmeans"], torch.float32, means, reference, _assign_error, tolerance))
    if record["merge"] != "torch":
        assign = clustering.kmeans_gram_iterations(g, w, start, iters)
        fused = merge._cluster_means_cuda if interpret else merge.cluster_means
        checks.append(_Check("merge", record["merge"], torch.float32,
                             lambda: fused(x, w, assign, 12, start, choice.merge),
                             lambda: merge._means_dense(x, w, assign, 12, start), _float_error, TOLERANCE["float32"]))
    return checks


def _attention_check(choice: KernelChoice, device: torch.device, dtype: torch.dtype, interpret: bool
                     ) -> list[_Check]:
    """The one-pass attention with eq. 4 against its torch implementation: (2, 6, 50, 64) q, k, v in ``dtype``."""
    from pipeline.models import significance

    record = _cuda_record(choice) if interpret else kernel_record(choice, device)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, 50, 64, generator=g).to(device, dtype) for _ in range(3))
    if record["attention"] != "triton-one-pass" or not one_pass_fits(q):
        return []
    fused = significance._joint_cuda if interpret else significance.attention_and_significance
    return [_Check("attention", record["attention"], dtype, lambda: fused(q, k, v, None, 0.125),
                   lambda: attention_and_significance_torch(q, k, v, None, 0.125), _float_error,
                   TOLERANCE[str(dtype).removeprefix("torch.")])]


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[object, float]:
    """fn's output (its first call) and the median milliseconds of ``repeats`` more calls (0 for none)."""
    out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1000 * (time.perf_counter() - start))
    return out, statistics.median(times) if times else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_checks(choice: KernelChoice, device: torch.device | str, dtype: torch.dtype = torch.float32, *,
               repeats: int = 0, interpret: bool = False) -> list[CheckResult]:
    """Every fused kernel ``choice`` selects on ``device`` against the torch path; the attention in ``dtype``
    (the clustering kernels always work in float32). ``repeats`` timed calls of each side (0: no timing)."""
    device = torch.device(device)
    checks = _clustering_checks(choice, device, interpret) + _attention_check(choice, device, dtype, interpret)
    results = []
    with torch.no_grad():
        for check in checks:
            got, fused_ms = _timed(check.fused, device, repeats)
            want, torch_ms = _timed(check.reference, device, repeats)
            results.append(CheckResult(check.kernel, check.implementation, str(device), str(check.dtype)
                                       .removeprefix("torch."), check.error(got, want), check.tolerance,
                                       fused_ms, torch_ms))
    return results


def mismatch_message(result: CheckResult) -> str:
    """What failed, where, by how much, and the config value that runs the torch path instead."""
    fix = f"kernels.{result.kernel}: {TORCH_PATH[result.kernel]}"
    if result.implementation == "native-c":
        fix += " (or kernels.native: torch)"
    what = "the fraction of tokens assigned differently" if result.kernel in ("kmedoids", "kmeans") \
        else "the largest relative error"
    return (f"the {result.implementation} kernel of {result.kernel} disagrees with the torch path on {result.device} "
            f"({result.dtype}): {what} is {result.error:.3g}, tolerance {result.tolerance:g}; set {fix} in the config "
            f"(--set kernels.{result.kernel}={TORCH_PATH[result.kernel]}) to run the torch path, and report it")


_CHECKED: dict[tuple, list[CheckResult]] = {}


def self_check(choice: KernelChoice, device: torch.device | str, dtype: torch.dtype = torch.float32
               ) -> list[CheckResult]:
    """``run_checks`` once per process for each (device, dtype, choice, torch and Triton versions); raises
    ``KernelMismatchError`` (``mismatch_message``) for the first kernel beyond its tolerance."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype, choice, torch.__version__, triton_version())
    if key not in _CHECKED:
        results = run_checks(choice, device, dtype)
        for result in results:
            if not result.ok:
                raise KernelMismatchError(mismatch_message(result))
        _CHECKED[key] = results
    return _CHECKED[key]


def check_model(model: nn.Module, device: torch.device | str, dtype: torch.dtype = torch.float32
                ) -> list[CheckResult]:
    """``self_check`` for the kernels ``model`` runs (its ``set_kernels`` choice); nothing for a model that
    runs no fused step (an unmodified timm model, or one inside DDP or ``torch.compile`` likewise)."""
    inner = getattr(model, "_orig_mod", model)
    inner = inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else inner
    blocks = getattr(inner, "blocks", None)
    if not isinstance(blocks, DownsamplingBlocks):
        return []
    return self_check(blocks.kernels, device, dtype)


def _skipped(choice: KernelChoice, device: torch.device, interpret: bool, results: list[CheckResult]) -> list[str]:
    """A line for every step that ``doctor`` did not check against the torch path, saying why."""
    checked = {(r.kernel, r.implementation) for r in results}
    lines = []
    for kernel, value in choice.as_dict().items():
        if kernel in TORCH_PATH and value == TORCH_PATH[kernel]:
            lines.append(f"{kernel}: kernels.{kernel} is {value}, the torch path itself")
    if device.type == "cpu":
        if not any(impl == "native-c" for _, impl in checked):
            lines.append("native C kernels: none at hand (kernels.native: torch, or no C compiler); the torch "
                         "iterations run")
        lines.append("merge, attention: no fused kernel runs on the CPU (the torch path does)")
        if not interpret:
            lines.append("Triton kernels (kmedoids fused and tiled, kmeans, merge, one-pass attention): they need "
                         "CUDA; `TRITON_INTERPRET=1 python -m pipeline doctor` runs their code under Triton's "
                         "interpreter")
    elif device.type == "cuda" and triton is None:
        lines.append("Triton kernels: Triton is not installed; the torch path runs")
    return lines


def _untimed(result: CheckResult) -> CheckResult:
    """A check run under Triton's interpreter: its times mean nothing."""
    return replace(result, implementation=f"{result.implementation} (interpreted)", fused_ms=float("nan"),
                   torch_ms=float("nan"))


def doctor(choice: KernelChoice, device: torch.device | str, *, interpret: bool = False, repeats: int = 5
           ) -> tuple[list[CheckResult], list[str]]:
    """Every self-check on ``device`` (timed over ``repeats`` calls), and what was skipped and why. On CUDA the
    attention in float32 and bfloat16; on the CPU with ``interpret`` also the Triton kernels' code under
    Triton's interpreter (untimed: interpreted times mean nothing)."""
    device = torch.device(device)
    results = run_checks(choice, device, torch.float32, repeats=repeats)
    if device.type == "cuda":
        results += [r for r in run_checks(choice, device, torch.bfloat16, repeats=repeats) if r.kernel == "attention"]
    interpreted = interpret and device.type == "cpu"
    if interpreted:
        results += [_untimed(r) for r in run_checks(choice, device, torch.float32, interpret=True)]
    if choice.kmedoids == "auto" and (device.type == "cuda" or interpreted):  # the alternative kept for timing
        tiled = run_checks(replace(choice, kmedoids="tiled"), device, torch.float32,
                           repeats=0 if interpreted else repeats, interpret=interpreted)
        results += [_untimed(r) if interpreted else r for r in tiled if r.implementation == "triton-tiled"]
    return results, _skipped(choice, device, interpret, results)


def doctor_table(results: list[CheckResult], skipped: list[str], record: dict[str, str]) -> str:
    """The doctor's report: one row a check, then what was skipped and the kernel record."""
    rows = ["| kernel | implementation | device | dtype | max error | tolerance | fused ms | torch ms | result |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms = ("-", "-") if r.fused_ms != r.fused_ms else (f"{r.fused_ms:.3f}", f"{r.torch_ms:.3f}")  # NaN: untimed
        rows.append(f"| {r.kernel} | {r.implementation} | {r.device} | {r.dtype} | {r.error:.3g} | {r.tolerance:g} | "
                    f"{ms[0]} | {ms[1]} | {'ok' if r.ok else 'MISMATCH'} |")
    lines = ["\n".join(rows), ""]
    lines += [f"skipped: {line}" for line in skipped]
    lines.append("kernels: " + ", ".join(f"{key}={value}" for key, value in record.items()))
    return "\n".join(lines)
