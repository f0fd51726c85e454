"""``bench onnx``: exported picks against the exported unmodified model in ONNX Runtime, with torch eager beside them.

Each method is exported once (dynamic batch, ``pipeline.export``) and timed at every batch size against the
unmodified model's export, paired and interleaved (``bench.paired``), then the same two networks in torch eager, in
the same process. ONNX Runtime runs on one intra-op thread, on the calling thread (checked: its thread CPU time
equals its wall time on an idle core), so both runtimes are timed on that thread's CPU clock at one thread, as the
evaluate stage times torch. The realised fraction is the speed-up over the GFLOPs ratio (fvcore's counts): 1 where
the time falls as the multiply-adds do.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.bench.paired import SpeedRatio, SpeedSettings, paired_ratio, sample_timer
from pipeline.export import export_onnx, session

RUNTIMES = ("onnxruntime", "torch")


@dataclass(frozen=True)
class OnnxSpeed:
    """One method at one batch size in one runtime: its time over the unmodified model's (``ratio`` with its 95%
    interval), the GFLOPs of both, and the realised fraction of the GFLOPs ratio with its interval. ``profile``: the
    pick's ``op_profile`` in ONNX Runtime where one was asked for."""

    method: str
    batch: int
    runtime: str
    ratio: SpeedRatio
    gflops: float
    reference_gflops: float
    profile: tuple[tuple[str, float], ...] = ()

    @property
    def gflops_ratio(self) -> float:
        """The unmodified model's GFLOPs over the pick's: the speed-up the multiply-adds promise."""
        return self.reference_gflops / self.gflops

    def realised(self, ratio: float) -> float:
        """The speed-up ``1 / ratio`` as a fraction of the GFLOPs ratio."""
        return 1.0 / ratio / self.gflops_ratio

    def row(self) -> dict[str, object]:
        r = self.ratio
        return {"method": self.method, "batch": self.batch, "runtime": self.runtime,
                "speed_ratio": round(r.ratio, 4), "speed_ratio_low": round(r.low, 4),
                "speed_ratio_high": round(r.high, 4),
                "speedup": round(1 / r.ratio, 3), "gflops": round(self.gflops, 4),
                "gflops_ratio": round(self.gflops_ratio, 3), "realised": round(self.realised(r.ratio), 3),
                "realised_low": round(self.realised(r.high), 3), "realised_high": round(self.realised(r.low), 3),
                "blocks": r.blocks, "stop": r.stop}


def _ort_call(sess, images: np.ndarray) -> Callable[[], object]:
    feed = {"images": images}
    return lambda: sess.run(None, feed)


def _torch_call(model: nn.Module, images: torch.Tensor) -> Callable[[], object]:
    def call() -> object:
        with torch.inference_mode():
            return model(images)
    return call


def onnx_speeds(models: dict[str, nn.Module], reference: nn.Module, *, batches: Sequence[int],
                settings: SpeedSettings, profile: bool = False, log: Callable[[str], None] = print) -> list[OnnxSpeed]:
    """Every model in ``models`` (method -> network in eval mode) against ``reference`` (the unmodified network), at
    every batch size, in ONNX Runtime and then torch eager, on one thread; exported to a temporary folder first.
    ``profile``: each pick's ONNX Runtime rows carry its ``op_profile`` at that batch size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch eager on the one thread the runtime's session has
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return _measure(models, reference, Path(tmp), batches, settings, profile, log)
    finally:
        torch.set_num_threads(threads)


def _measure(models: dict[str, nn.Module], reference: nn.Module, folder: Path, batches: Sequence[int],
             settings: SpeedSettings, profile: bool, log: Callable[[str], None]) -> list[OnnxSpeed]:
    from pipeline.flops import count_flops

    size, reference_gflops = reference.patch_embed.img_size, count_flops(reference).total
    log("exporting the unmodified model")
    base = session(export_onnx(reference, folder / "none.onnx", label="the unmodified model"))
    timer = sample_timer(torch.device("cpu"), clock="cpu")
    rows: list[OnnxSpeed] = []
    for method, model in models.items():
        log(f"exporting {method}")
        path = export_onnx(model, folder / f"{method}.onnx", label=method)
        pick, gflops = session(path), count_flops(model).total
        for batch in batches:
            images = torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(batch))
            calls = {"onnxruntime": (_ort_call(pick, images.numpy()), _ort_call(base, images.numpy())),
                     "torch": (_torch_call(model, images), _torch_call(reference, images))}
            for runtime in RUNTIMES:
                ratio = paired_ratio(*calls[runtime], timer=timer, settings=settings)
                ops = tuple(op_profile(path, images)) if profile and runtime == "onnxruntime" else ()
                done = OnnxSpeed(method, batch, runtime, ratio, gflops, reference_gflops, ops)
                rows.append(done)
                log(f"{method} batch {batch} {runtime}: {ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}] of "
                    f"the unmodified model, realised {done.realised(ratio.ratio):.2f} of {done.gflops_ratio:.2f}x")
    return rows


def op_profile(path: str | Path, images: torch.Tensor, *, calls: int = 3, top: int = 8) -> list[tuple[str, float]]:
    """Where the runtime's time goes in the file's graph on ``images``: the ``top`` op types by their share of the
    node time of ``calls`` calls after one warm-up call (ONNX Runtime's own profile, one thread), the rest summed
    as ``other``. -> [(op type, share)], largest first."""
    with tempfile.TemporaryDirectory() as tmp:
        sess = session(path, profile=Path(tmp) / "profile")
        feed = {"images": images.numpy()}
        sess.run(None, feed)
        for _ in range(calls):
            sess.run(None, feed)
        events = json.loads(Path(sess.end_profiling()).read_text())
    totals: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            totals[op] = totals.get(op, 0.0) + float(event.get("dur", 0))
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    shares = [(op, t / whole) for op, t in ranked[:top]]
    rest = sum(t for _, t in ranked[top:]) / whole
    return shares + ([("other", rest)] if rest > 0 else [])
