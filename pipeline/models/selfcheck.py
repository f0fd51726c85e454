"""The device self-check of the fused kernels, and the record of which kernels ran.

Each fused kernel that a ``runtime.KernelChoice`` selects on a device is run once, at the shapes of the model
(``model_shapes``: each pooling block's N tokens in and K out, its width, each block's attention tokens T, heads
and head dim, so that a fault at a tile's edge shows where it would bite), against the torch path on the same
device, the first time a model is built for that device in a process (``check_model``, called eagerly before
compiling, never inside an op: a check during CUDA-graph capture would sync). Results are cached per device,
dtype, choice, shapes and library versions. A mismatch beyond the kernel's tolerance raises
``KernelMismatchError``, naming the kernel, the shape, the device, the error found and the config value that
selects the torch path. ``pipeline doctor`` runs every check at a config's model's shapes and prints them
(``doctor_table``).

What runs where:

- CUDA: the Triton kernels (K-Medoids fused or tiled, K-Means, the merge, the one-pass attention);
- CPU: the native C kernels (``pooling.native``): K-Means' and the merge's bit-identical to torch by design (K-Means'
  tolerance is 0; the merge is checked against the one-hot product, within float32's), K-Medoids' computing the
  distances the matmul does not give in an order of its own (a near-tie may go the other way: the index tolerance,
  as on CUDA); with ``interpret=True`` (``TRITON_INTERPRET=1``, which must be set
  before Triton is imported) also the Triton kernels' code, on CPU tensors under Triton's interpreter.

Two records, kept apart because "could have run" is not "ran":

- ``kernels_ran(runtime.dispatched())``: what each step's dispatch took, per kernel and shape, as the
  dispatches noted it (``runtime.note_dispatch``): what MLflow records as ``kernels_run.*``;
- ``kernels_planned(choice, device)``: what ``auto`` resolves to on a device where the shapes allow (the
  one-pass attention holds at most 256 tokens, and float32 only runs the Triton clustering kernels): the key
  of a benchmark table and record, fixed before anything runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import PipelineError
from pipeline.models import significance
from pipeline.models.downsampling import DownsamplingBlocks
from pipeline.models.significance import attention_and_significance_torch, one_pass_fits
from pipeline.pooling import clustering, merge, native
from pipeline.runtime import KernelChoice, dispatched, unrecorded_dispatches

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
    shape: str = ""  # the case's shape: "B=2 N=196 K=147 M=384" or "B=2 H=6 T=197 D=64"

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
    shape: str


@dataclass(frozen=True)
class CheckShapes:
    """The shapes a model's fused steps run at: (N, K) of each block that pools (its tokens in and out, prefix
    excluded), the token width M, and each block's attention: its tokens T (prefix included), heads and head dim, and
    ``qk_alpha``, the alpha of normalised queries and keys where the model has them (``model.qk_norm``)."""

    pools: tuple[tuple[int, int], ...]
    width: int
    tokens: tuple[int, ...]
    heads: int
    head_dim: int
    qk_alpha: float | None = None

    def describe(self) -> str:
        pools = ", ".join(f"{n}->{k}" for n, k in self.pools) or "none"
        normalised = "" if self.qk_alpha is None else f", normalised queries and keys (alpha {self.qk_alpha:g})"
        return (f"pooling N->K {pools} at M={self.width}; attention T={', '.join(map(str, self.tokens))} with "
                f"{self.heads} heads of {self.head_dim}{normalised}")


# The shapes without a model (``run_checks``' default): a DeiT-S level's N at a tenth of its width, so a check
# costs a fraction of a millisecond, and an attention of 50 tokens at DeiT-S's heads.
SMALL = CheckShapes(pools=((49, 12),), width=32, tokens=(50,), heads=6, head_dim=64)


def model_shapes(model: nn.Module) -> CheckShapes | None:
    """The shapes of ``model``'s fused steps, from its downsampling blocks (their token count, prefix and keep
    list) and its attention; None for a model that runs no fused step (an unmodified timm model, or one inside
    DDP or ``torch.compile`` likewise)."""
    inner = getattr(model, "_orig_mod", model)
    inner = inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else inner
    blocks = getattr(inner, "blocks", None)
    if not isinstance(blocks, DownsamplingBlocks):
        return None
    n, pools, tokens = blocks.num_tokens, [], []
    for k in blocks.config.keep or [n] * len(blocks):
        tokens.append(blocks.num_prefix + n)
        if 0 < k < n:
            pools.append((n, k))
        n = min(n, k)
    attn, alpha = blocks[0].attn, getattr(blocks[0], "qk_alpha", None)
    return CheckShapes(pools=tuple(dict.fromkeys(pools)), width=int(attn.proj.out_features),
                       tokens=tuple(dict.fromkeys(tokens)), heads=int(attn.num_heads), head_dim=int(attn.head_dim),
                       qk_alpha=None if alpha is None else float(alpha.detach()))


def triton_version() -> str:
    return "none" if triton is None else triton.__version__


def kernels_planned(choice: KernelChoice, device: torch.device | str) -> dict[str, str]:
    """What each fused step runs on ``device`` under ``choice`` where its shape allows, ``auto`` resolved, and the
    torch and Triton versions: ``{"kmedoids": "triton-fused", ..., "torch": "2.14.1", "triton": "3.8.0"}``. The key
    of a benchmark table or record, known before anything runs; what did run is ``kernels_ran``'s. The attention
    entry is the inference path of a method that reads eq. 4 at up to 256 tokens (beyond, the one-pass kernel
    falls back to torch; training runs the fused attention and eq. 4 apart)."""
    kind = torch.device(device).type
    if kind == "cuda":
        record = _cuda_plan(choice)
    elif kind == "cpu":
        on = choice.native != "torch" and native.library() is not None
        record = {"kmedoids": "native-c" if on and choice.kmedoids != "torch" else "torch",
                  "kmeans": "native-c" if on and choice.kmeans != "torch" else "torch",
                  "merge": "native-c" if on and choice.merge != "torch" else "torch", "attention": "torch"}
    else:
        record = dict.fromkeys(("kmedoids", "kmeans", "merge", "attention"), "torch")
    return record | {"torch": torch.__version__, "triton": triton_version()}


KERNELS = ("kmedoids", "kmeans", "merge", "attention")
_SIZE = {"attention": "T"}  # the attention's tokens include the prefix; the clustering steps' N do not


def kernels_ran(ran: frozenset[tuple[str, str, int]] | None = None) -> dict[str, str]:
    """What each fused step's dispatch took, from the (kernel, implementation, tokens) they noted (default:
    ``runtime.dispatched()``), and the torch and Triton versions: ``{"kmedoids": "native-c (N=196, 147)",
    "attention": "torch (T=577); triton-one-pass (T=197)", "kmeans": "none noted", ..., "torch": ..., "triton":
    ...}``. Each implementation lists the token counts it ran at, largest first; "none noted": no dispatch of that
    step was noted (the model's method does not run it)."""
    ran = dispatched() if ran is None else ran
    record = {}
    for kernel in KERNELS:
        sizes: dict[str, set[int]] = {}
        for name, implementation, tokens in ran:
            if name == kernel:
                sizes.setdefault(implementation, set()).add(tokens)
        parts = sorted(sizes.items(), key=lambda item: (-max(item[1]), item[0]))
        record[kernel] = "; ".join(f"{impl} ({_SIZE.get(kernel, 'N')}={', '.join(map(str, sorted(n, reverse=True)))})"
                                   for impl, n in parts) or "none noted"
    return record | {"torch": torch.__version__, "triton": triton_version()}


def kernel_params(ran: frozenset[tuple[str, str, int]] | None = None) -> dict[str, str]:
    """``kernels_ran`` as MLflow params: ``kernels_run.kmedoids``, ..., ``kernels_run.torch``, beside the config's
    own ``kernels.*`` values."""
    return {f"kernels_run.{key}": value for key, value in kernels_ran(ran).items()}


def _cuda_plan(choice: KernelChoice) -> dict[str, str]:
    """``kernels_planned`` on CUDA: each step's own Triton kernel where it is at hand (the merge's, K-Means', the
    one-pass attention's and eq. 4's passes are separate imports)."""
    kmedoids = {"auto": "triton-fused", "tiled": "triton-tiled", "torch": "torch"}[choice.kmedoids]
    attention = {"auto": "triton-one-pass" if significance.attention_with_columns_triton is not None else "torch",
                 "sdpa": "sdpa+eq4" if significance.significance_and_lse_triton is not None else "sdpa+eq4-torch",
                 "torch": "torch"}[choice.attention]
    return {"kmedoids": kmedoids if clustering.kmedoids_triton is not None else "torch",
            "kmeans": "triton-fused" if clustering.kmeans_fused_triton is not None and choice.kmeans == "auto"
            else "torch",
            "merge": "triton" if merge.cluster_means_triton is not None and choice.merge == "auto" else "torch",
            "attention": attention}


def _assign_error(got: object, want: object) -> float:
    """The fraction of tokens whose cluster differs (and of medoids, for K-Medoids' pair of outputs)."""
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return max(float((g.cpu() != w.cpu()).float().mean()) for g, w in zip(got, want))


def _float_error(got: object, want: object) -> float:
    """The largest absolute error of each output relative to its largest reference value."""
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want))


def _clustering_case(device: torch.device, n: int, k: int, width: int, seed: int = 0
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tokens (2, n, width) float32, weights (2, n), k starting indices (2, k) and the Gram matrices: two images,
    so that the batch index is exercised at a fraction of the torch reference's cost at a model's N."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n, width, generator=g).to(device)
    w = (torch.rand(2, n, generator=g) + 0.1).to(device)
    start = torch.rand(2, n, generator=g).topk(k, dim=-1).indices.to(device)
    return x, w, start, clustering.gram(x)


def _clustering_checks(choice: KernelChoice, device: torch.device, interpret: bool, shapes: CheckShapes
                       ) -> list[_Check]:
    """K-Medoids, K-Means and the merge on ``device`` against their torch iterations (the CPU's native kernels,
    CUDA's Triton kernels, or with ``interpret`` the CUDA kernels' code on CPU tensors), at each (N, K) of
    ``shapes``."""
    plan = _cuda_plan(choice) if interpret else kernels_planned(choice, device)
    tolerance = TOLERANCE["native" if device.type == "cpu" and not interpret else "index"]  # K-Means
    checks = []
    for n, k in shapes.pools:
        checks += _clustering_shape(choice, device, interpret, plan, tolerance, n, k, shapes.width)
    return checks


def _clustering_shape(choice: KernelChoice, device: torch.device, interpret: bool, plan: dict[str, str],
                      tolerance: float, n: int, k: int, width: int) -> list[_Check]:
    x, w, start, g = _clustering_case(device, n, k, width)
    use_native = choice.native != "torch"
    iters, checks, shape = 5, [], f"B=2 N={n} K={k} M={width}"
    if interpret:  # the ops' CUDA kernels, called on CPU tensors under Triton's interpreter
        medoids = lambda: clustering._kmedoids_cuda(x, g, w, start, iters, choice.kmedoids, use_native)  # noqa: E731
        means = lambda: clustering._kmeans_gram_cuda(g, w, start, iters, use_native)  # noqa: E731
    else:
        gram = None if device.type == "cpu" else g  # as clustering._kmedoids passes it
        medoids = lambda: clustering._kmedoids_op(x, gram, w, start, iters, choice.kmedoids, use_native)  # noqa: E731
        means = lambda: clustering._kmeans_gram_op(g, w, start, iters, use_native)  # noqa: E731
    if plan["kmedoids"] != "torch":
        reference = lambda: clustering.kmedoids_dense(clustering.dists_from_gram(g), w, start, iters)  # noqa: E731
        # the index tolerance on every device: the CPU's kernel, too, computes some distances in an order of its own
        checks.append(_Check("kmedoids", plan["kmedoids"], torch.float32, medoids, reference, _assign_error,
                             TOLERANCE["index"], shape))
    if plan["kmeans"] != "torch":
        reference = lambda: clustering.kmeans_gram_iterations(g, w, start, iters)  # noqa: E731
        checks.append(_Check("kmeans", plan["kmeans"], torch.float32, means, reference, _assign_error, tolerance,
                             shape))
    if plan["merge"] != "torch":
        assign = clustering.kmeans_gram_iterations(g, w, start, iters)
        fused = merge._cluster_means_cuda if interpret else merge.cluster_means
        checks.append(_Check("merge", plan["merge"], torch.float32,
                             lambda: fused(x, w, assign, k, start, choice.merge, use_native),
                             lambda: merge.means_dense(x, w, assign, k, start), _float_error, TOLERANCE["float32"],
                             shape))
    return checks


def _attention_check(choice: KernelChoice, device: torch.device, dtype: torch.dtype, interpret: bool,
                     shapes: CheckShapes) -> list[_Check]:
    """The one-pass attention with eq. 4 against its torch implementation: (2, H, T, D) q, k, v in ``dtype`` at
    each T of ``shapes`` that the one-pass kernel takes (beyond it the torch implementation runs); with ``qk_alpha``,
    on normalised queries and keys as the model gives them (``models.attention.attend``: q^ alpha and k^, scale 1)."""
    plan = _cuda_plan(choice) if interpret else kernels_planned(choice, device)
    if plan["attention"] != "triton-one-pass":
        return []
    g = torch.Generator().manual_seed(1)
    fused = significance._joint_cuda if interpret else significance.attention_and_significance
    scale = shapes.head_dim ** -0.5 if shapes.qk_alpha is None else 1.0
    checks = []
    for t in shapes.tokens:
        q, k, v = (torch.randn(2, shapes.heads, t, shapes.head_dim, generator=g).to(device, dtype) for _ in range(3))
        if shapes.qk_alpha is not None:
            q, k = F.normalize(q, dim=-1) * shapes.qk_alpha, F.normalize(k, dim=-1)
        if not one_pass_fits(q):
            continue
        checks.append(_Check("attention", plan["attention"], dtype,
                             lambda q=q, k=k, v=v: fused(q, k, v, None, scale),
                             lambda q=q, k=k, v=v: attention_and_significance_torch(q, k, v, None, scale),
                             _float_error, TOLERANCE[str(dtype).removeprefix("torch.")],
                             f"B=2 H={shapes.heads} T={t} D={shapes.head_dim}"
                             + ("" if shapes.qk_alpha is None else " qk-norm")))
    return checks


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
               repeats: int = 0, interpret: bool = False, shapes: CheckShapes = SMALL) -> list[CheckResult]:
    """Every fused kernel ``choice`` selects on ``device`` against the torch path, at ``shapes``; the attention in
    ``dtype`` (the clustering kernels always work in float32). ``repeats`` timed calls of each side (0: no
    timing). The checks' calls are left out of the record of what ran (``runtime.dispatched``)."""
    device = torch.device(device)
    results = []
    with torch.no_grad(), unrecorded_dispatches():
        checks = (_clustering_checks(choice, device, interpret, shapes)
                  + _attention_check(choice, device, dtype, interpret, shapes))
        for check in checks:
            got, fused_ms = _timed(check.fused, device, repeats)
            want, torch_ms = _timed(check.reference, device, repeats)
            results.append(CheckResult(check.kernel, check.implementation, str(device), str(check.dtype)
                                       .removeprefix("torch."), check.error(got, want), check.tolerance,
                                       fused_ms, torch_ms, check.shape))
    return results


def mismatch_message(result: CheckResult) -> str:
    """What failed, where, by how much, and the config value that runs the torch path instead."""
    fix = f"kernels.{result.kernel}: {TORCH_PATH[result.kernel]}"
    if result.implementation == "native-c":
        fix += " (or kernels.native: torch)"
    what = "the fraction of tokens assigned differently" if result.kernel in ("kmedoids", "kmeans") \
        else "the largest relative error"
    torch_path = f"kernels.{result.kernel}={TORCH_PATH[result.kernel]}"
    return (f"the {result.implementation} kernel of {result.kernel} disagrees with the torch path on {result.device} "
            f"({result.dtype}, {result.shape}): {what} is {result.error:.3g}, tolerance {result.tolerance:g}; "
            f"set {fix} in the config (--set {torch_path}) to run the torch path, and report it")


_CHECKED: dict[tuple, list[CheckResult]] = {}


def self_check(choice: KernelChoice, device: torch.device | str, dtype: torch.dtype = torch.float32,
               shapes: CheckShapes = SMALL) -> list[CheckResult]:
    """``run_checks`` once per process for each (device, dtype, choice, shapes, torch and Triton versions); raises
    ``KernelMismatchError`` (``mismatch_message``) for the first kernel beyond its tolerance."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype, choice, shapes, torch.__version__, triton_version())
    if key not in _CHECKED:
        results = run_checks(choice, device, dtype, shapes=shapes)
        for result in results:
            if not result.ok:
                raise KernelMismatchError(mismatch_message(result))
        _CHECKED[key] = results
    return _CHECKED[key]


def check_model(model: nn.Module, device: torch.device | str, dtype: torch.dtype = torch.float32
                ) -> list[CheckResult]:
    """``self_check`` for the kernels ``model`` runs (its ``set_kernels`` choice) at its shapes (``model_shapes``);
    nothing for a model that runs no fused step (an unmodified timm model, or one inside DDP or
    ``torch.compile`` likewise)."""
    shapes = model_shapes(model)
    if shapes is None:
        return []
    inner = getattr(model, "_orig_mod", model)
    inner = inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else inner
    return self_check(inner.blocks.kernels, device, dtype, shapes)


def _skipped(choice: KernelChoice, device: torch.device, interpret: bool, results: list[CheckResult],
             shapes: CheckShapes) -> list[str]:
    """A line for every step that ``doctor`` did not check against the torch path, saying why."""
    checked = {(r.kernel, r.implementation) for r in results}
    lines = []
    if not shapes.pools:
        lines.append("kmedoids, kmeans, merge: the model pools in no block (no keep list below its tokens)")
    long = [t for t in shapes.tokens if t > significance.FUSED_MAX_TOKENS]
    if long and (device.type == "cuda" or interpret) and choice.attention == "auto":
        lines.append(f"attention at T={', '.join(map(str, long))}: over the one-pass kernel's "
                     f"{significance.FUSED_MAX_TOKENS} tokens, the torch implementation runs there")
    for kernel, value in choice.as_dict().items():
        if kernel in TORCH_PATH and value == TORCH_PATH[kernel]:
            lines.append(f"{kernel}: kernels.{kernel} is {value}, the torch path itself")
    if device.type == "cpu":
        if not any(impl == "native-c" for _, impl in checked):
            lines.append("native C kernels: none at hand (kernels.native: torch, or no C compiler); the torch "
                         "iterations run")
        lines.append("merge, attention: no fused kernel runs on the CPU (the torch path does)"
                     + (", normalised queries and keys included" if shapes.qk_alpha is not None else ""))
        if not interpret:
            lines.append("Triton kernels (kmedoids fused and tiled, kmeans, merge, one-pass attention): they need "
                         "CUDA; `TRITON_INTERPRET=1 python -m pipeline doctor` runs their code under Triton's "
                         "interpreter")
    elif device.type == "cuda" and triton is None:
        lines.append("Triton kernels: Triton is not installed; the torch path runs")
    if device.type == "cuda" and shapes.qk_alpha is not None:
        lines.append("attention's eq. 4 beside cuDNN or flash attention: normalised queries and keys are not laid "
                     "out as those kernels take them, so SDPA and the torch scores run for them (the one-pass kernel "
                     "takes them: checked above where it runs)")
    return lines


def _untimed(result: CheckResult) -> CheckResult:
    """A check run under Triton's interpreter: its times mean nothing."""
    return replace(result, implementation=f"{result.implementation} (interpreted)", fused_ms=float("nan"),
                   torch_ms=float("nan"))


def doctor(choice: KernelChoice, device: torch.device | str, *, interpret: bool = False, repeats: int = 5,
           shapes: CheckShapes = SMALL) -> tuple[list[CheckResult], list[str]]:
    """Every self-check on ``device`` at ``shapes`` (timed over ``repeats`` calls), and what was skipped and why. On
    CUDA the attention in float32 and bfloat16; on the CPU with ``interpret`` also the Triton kernels' code under
    Triton's interpreter (untimed: interpreted times mean nothing)."""
    device = torch.device(device)
    results = run_checks(choice, device, torch.float32, repeats=repeats, shapes=shapes)
    if device.type == "cuda":
        results += [r for r in run_checks(choice, device, torch.bfloat16, repeats=repeats, shapes=shapes)
                    if r.kernel == "attention"]
    interpreted = interpret and device.type == "cpu"
    if interpreted:
        results += [_untimed(r) for r in run_checks(choice, device, torch.float32, interpret=True, shapes=shapes)]
    if choice.kmedoids == "auto" and (device.type == "cuda" or interpreted):  # the alternative kept for timing
        tiled = run_checks(replace(choice, kmedoids="tiled"), device, torch.float32,
                           repeats=0 if interpreted else repeats, interpret=interpreted, shapes=shapes)
        results += [_untimed(r) if interpreted else r for r in tiled if r.implementation == "triton-tiled"]
    return results, _skipped(choice, device, interpret, results, shapes)


def doctor_table(results: list[CheckResult], skipped: list[str], record: dict[str, str],
                 shapes: CheckShapes | None = None) -> str:
    """The doctor's report: the shapes checked, one row a check, then what was skipped and the kernels ``auto``
    resolves to."""
    rows = ["| kernel | implementation | device | dtype | shape | max error | tolerance | fused ms | torch ms "
            "| result |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms = ("-", "-") if r.fused_ms != r.fused_ms else (f"{r.fused_ms:.3f}", f"{r.torch_ms:.3f}")  # NaN: untimed
        rows.append(f"| {r.kernel} | {r.implementation} | {r.device} | {r.dtype} | {r.shape} | {r.error:.3g} | "
                    f"{r.tolerance:g} | {ms[0]} | {ms[1]} | {'ok' if r.ok else 'MISMATCH'} |")
    lines = [] if shapes is None else [f"shapes checked: {shapes.describe()}", ""]
    lines += ["\n".join(rows), ""]
    lines += [f"skipped: {line}" for line in skipped]
    lines.append("kernels (auto resolved, where the shape allows): "
                 + ", ".join(f"{key}={value}" for key, value in record.items()))
    return "\n".join(lines)
