"""A model to an ONNX file, and the file checked in ONNX Runtime against torch.

The export goes through ``torch.export`` and torch's ONNX translator (``torch.onnx.export(dynamo=True)``). Under
``torch.export`` every fused step traces as its torch reference instead of its custom op (``runtime.exporting``):
no ONNX function is registered for the project's ops, because each has a torch reference that the translator
turns into standard ONNX ops, and a hand-written ONNX function would be a second implementation to keep equal
to the first. The keep list is part of the graph (static token counts); the batch is static or dynamic, as asked.

A random method's graph draws its noise in the runtime (``RandomUniformLike``), so its logits cannot equal torch's;
``check_onnx`` exports it a second time with the noise a fixed function of position in both
(``pooling.common.derived_noise``) and compares that graph, and checks that the file's own graph draws.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.errors import InputError, PipelineError

RUNTIME_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
OPSET = 18  # torch 2.14's translator's default; onnxruntime 1.32 runs it
RANDOM_OPS = frozenset({"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Multinomial"})
# Logits of a float32 graph: the runtime sums in its own order (its matmuls, its softmax), so the two differ by a
# few units in the last place of every sum; over a dozen blocks that reaches about 1e-5 of logits of size ~10, and
# a difference of 1e-3 is two orders above it while far below what a wrong op gives (tenths, or NaN).
LOGIT_ATOL = 1e-3
# A discrete step (a top-K, an argmin, ToMe's matching) meets near ties: inputs where the two sides' last bits pick
# different tokens and the logits part by tenths. Of the demo's trained M32 models on 2,000 test images one image
# did so (ToMe; float64 torch agreed with the runtime, and 1e-5 of input noise moved float32 torch as far). A check
# passes with at most this share of its images over LOGIT_ATOL, and at least 1 - it of top-1 classes agreeing.
TIE_SHARE = 0.005


class ExportError(PipelineError, RuntimeError):
    """A model that cannot be exported, or an export that does not run or match."""


def require_runtime() -> None:
    """InputError in one line when the ONNX packages are not installed."""
    missing = [name for name in RUNTIME_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(f"the ONNX export needs {', '.join(missing)}, which is not installed here: run `make setup` "
                         "(or pip install -c constraints.txt onnx onnxscript onnxruntime)")


def export_onnx(model: nn.Module, path: str | Path, *, batch: int | None = None, label: str = "the model",
                check: Callable[[Path], None] | None = None) -> Path:
    """Writes ``model`` (in eval mode, on the CPU) to ``path`` as ONNX: input ``images`` (B, 3, H, W) float32,
    output ``logits`` (B, classes). ``batch``: a static batch size, or None for a dynamic one. The file is written
    under a temporary name beside ``path``, loaded in ONNX Runtime, given to ``check`` (which raises to refuse it)
    and only then renamed, so a failed export or check leaves no file and an old one intact. ``label`` names the
    model in the errors. The graph is one file: a model over ONNX's 2 GB protobuf limit is refused. Returns
    ``path``."""
    require_runtime()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    size = model.patch_embed.img_size
    example = torch.randn(batch or 2, 3, *size)
    dynamic = None if batch is not None else ({0: torch.export.Dim("batch", min=1, max=4096)},)
    with _quiet_exporter():
        try:
            with torch.no_grad():
                program = torch.onnx.export(model, (example,), dynamo=True, opset_version=OPSET,
                                            input_names=["images"], output_names=["logits"], dynamic_shapes=dynamic)
        except Exception as err:  # the exporter wraps every failure in its own class; the op is in the message
            raise ExportError(f"{label} cannot be exported to ONNX: {_failure(err)}") from None
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    partial = Path(name)
    try:
        try:
            program.save(partial, external_data=False)
        except ValueError as err:  # protobuf's 2 GB limit on one message
            raise ExportError(f"{label}: its ONNX graph does not fit in one file ({err}); pipeline export writes "
                              "no external data") from None
        os.chmod(partial, 0o666 & ~_umask())  # mkstemp's file is private; the ONNX file is not
        session(partial)  # a graph the runtime cannot load (an op it has no kernel for) is refused before it lands
        if check is not None:
            check(partial)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return path


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` would change it for every thread meanwhile)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    return 0o022


def _failure(err: BaseException) -> str:
    """One line from the exporter's report: the op without an ONNX function, or the first line of the cause."""
    text = str(err)
    missing = re.search(r"No ONNX function found for (\S+)", text)
    if missing:
        return f"no ONNX function for the op {missing.group(1).rstrip('.')}"
    cause = err.__cause__ or err
    first = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
    return re.sub(r"\x1b\[[0-9;]*m", "", first)[:300]


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's progress lines and deprecation warnings off: the command prints its own."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                yield
    finally:
        logger.setLevel(level)


def session(path: str | Path, threads: int = 1, profile: str | Path | None = None):
    """An ONNX Runtime CPU session of the file, on ``threads`` threads (intra-op; one inter-op). A graph the runtime
    cannot load is an ExportError naming the node it refused. ``profile``: a file name prefix for the runtime's
    profile of every node run (``sess.end_profiling()`` writes it)."""
    require_runtime()
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own pybind classes
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ExportError(f"ONNX Runtime cannot run {path}: {first}") from None


def graph_ops(path: str | Path) -> frozenset[str]:
    """The op types in the file's graph and its functions."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ops = {node.op_type for node in proto.graph.node}
    for function in proto.functions:
        ops.update(node.op_type for node in function.node)
    return frozenset(ops)


def run_session(sess, images: Tensor, batch: int | None = None, slice_size: int = 64) -> Tensor:
    """The session's logits for ``images`` (B, 3, H, W) -> (B, classes) float32: in slices of ``batch`` images for a
    static graph (the last one padded with copies of its last image, whose logits are dropped), of ``slice_size``
    for a dynamic one. An error of the runtime is an ExportError in one line."""
    if len(images) == 0:
        raise InputError("no images to run the ONNX graph on; give at least one")
    step, parts = batch or slice_size, []
    for start in range(0, len(images), step):
        part = images[start:start + step].float()
        count = len(part)
        if batch is not None and count < batch:
            part = torch.cat([part, part[-1:].expand(batch - count, *part.shape[1:])])
        try:
            parts.append(sess.run(None, {"images": part.contiguous().numpy()})[0][:count])
        except Exception as err:  # onnxruntime raises its own pybind classes
            raise ExportError(f"ONNX Runtime failed on images {start}-{start + count - 1}: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    return torch.from_numpy(np.concatenate(parts))


@dataclass(frozen=True)
class ExportCheck:
    """ONNX Runtime against torch on the same images: the largest logit difference (NaN where the runtime gave a
    non-finite logit), how many images differ by more than ``LOGIT_ATOL``, the share whose top-1 class agrees, and
    how many images. ``draws``: the file's graph has a random op (a random method); the logits compared are then
    those of its graph exported again with the noise a fixed function of position (``derived_noise``), in torch as in
    the runtime."""

    max_abs_diff: float
    over_tolerance: int
    top1_agreement: float
    images: int
    draws: bool

    def line(self) -> str:
        noise = " (the noise a fixed function of position in both; the file draws its own)" if self.draws else ""
        return (f"onnxruntime vs torch on {self.images} images: max |logit difference| {self.max_abs_diff:.2e}, "
                f"{self.over_tolerance} image(s) over {LOGIT_ATOL:g}, top-1 agreement {self.top1_agreement:.2%}{noise}")

    @property
    def passed(self) -> bool:
        """Every logit of both finite (else ``max_abs_diff`` is NaN), at most ``TIE_SHARE`` of the images over the
        tolerance (near ties of a discrete step), at least ``1 - TIE_SHARE`` of the top-1 classes agreeing."""
        return (not math.isnan(self.max_abs_diff) and self.over_tolerance <= TIE_SHARE * self.images
                and self.top1_agreement >= 1 - TIE_SHARE)


def check_onnx(model: nn.Module, path: str | Path, images: Tensor, *, batch: int | None = None,
               torch_batch: int = 64, label: str = "the model") -> ExportCheck:
    """Runs the file at ``path`` (``model``'s export) and ``model`` on ``images`` (B, 3, H, W) and compares their
    logits: the runtime in slices of ``batch`` images (all at once for a dynamic batch), torch in slices of
    ``torch_batch``. A graph that draws noise (random, importance, a random initialisation) is exported again, to a
    temporary file, inside ``derived_noise``, and that graph and torch are compared inside it."""
    from pipeline.pooling.common import derived_noise

    model = model.eval()
    draws = bool(RANDOM_OPS & graph_ops(path))
    with derived_noise() if draws else contextlib.nullcontext(), tempfile.TemporaryDirectory() as tmp:
        compared = export_onnx(model, Path(tmp) / "derived.onnx", batch=batch, label=label) if draws else path
        got = run_session(session(compared), images, batch)
        with torch.no_grad():
            want = torch.cat([model(images[i:i + torch_batch].float())
                              for i in range(0, len(images), torch_batch)])
    finite = bool(torch.isfinite(got).all() and torch.isfinite(want).all())
    per_image = (got - want).abs().amax(-1)  # (B,)
    diff = per_image.max().item() if finite else float("nan")
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return ExportCheck(max_abs_diff=diff, over_tolerance=int((per_image > LOGIT_ATOL).sum()), top1_agreement=agree,
                       images=len(images), draws=draws)

