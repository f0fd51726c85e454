"""Results without finetuning (the paper's Appendix E): a trained model with a downsampling step inserted at given keep
lists and no training, top-1, top-5 and GFLOPs per method, keep list and carry setting (``pipeline evaluate``).

The model is a ``pipeline train`` checkpoint or a timm model with a local weights file (``analysis.load_subject``);
each method is put into it with ``analysis.with_method`` (carry on or off: cluster sizes carried into the next
blocks' softmax, Appendix E), and every image of the ``.beton`` is classified through the validation pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.analysis.probe import AnalysisError, Subject, normalise, with_method
from pipeline.bench.paired import SpeedSettings
from pipeline.data.loaders import check_dataset, read_labelled, read_metadata
from pipeline.evaluate import speed
from pipeline.flops import count_flops
from pipeline.methods import KEEP_ALL, method_spec

COLUMNS = ["method", "keep", "carry", "top1", "top5", "gflops", "images", "speed_ratio", "speed_ratio_low",
           "speed_ratio_high"]


def check_requests(subject: Subject, methods: Sequence[str], keeps: Sequence[Sequence[int]]) -> None:
    """AnalysisError in one line for what cannot be evaluated without training: a learnable method (its layers would
    be random), or a keep list with another length than the model's depth or a K above its tokens."""
    for method in methods:
        if method_spec(method).learnable:
            raise AnalysisError(f"--method {method}: a learnable method's layers are random without training; "
                                "evaluate a checkpoint that trained it instead")
    for keep in keeps:
        if len(keep) != subject.depth or not all(0 <= k <= subject.num_tokens for k in keep):
            raise AnalysisError(f"--keep {','.join(map(str, keep))}: give {subject.depth} counts (one a block) "
                                f"between 0 and the model's {subject.num_tokens} tokens")


def top_k(net: nn.Module, subject: Subject, beton: str | Path, *, batch: int = 64) -> tuple[float, float, int]:
    """Top-1 and top-5 (%) of ``net`` over every image of ``beton`` (the validation pipeline at the subject's
    resolution and normalisation), and the number of images."""
    total = int(read_metadata(beton)["num_images"])
    right1 = right5 = seen = 0
    with torch.no_grad():
        for images, labels in read_labelled(beton, subject.res, subject.crop_pct, total, batch):
            logits = net(normalise(subject, images))
            target = torch.from_numpy(labels)
            best = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
            right1 += int((best[:, 0] == target).sum())
            right5 += int((best == target[:, None]).any(dim=-1).sum())
            seen += len(labels)
    return 100.0 * right1 / seen, 100.0 * right5 / seen, seen


def offshelf_rows(subject: Subject, beton: str | Path, methods: Sequence[str], keeps: Sequence[Sequence[int]],
                  carries: Sequence[bool], *, batch: int = 64, speed: SpeedSettings | None = None,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row for the unmodified model, then one for each method, keep list and carry setting: top-1, top-5 and
    fvcore's GFLOPs, and with ``speed`` the paired time ratio against the unmodified model (``evaluate.speed``, one
    CPU thread) on a batch of the data."""
    check_requests(subject, methods, keeps)
    check_dataset(beton)  # one clear line for a missing or edited file, before anything runs
    settings = [(KEEP_ALL, None, False)] + [(m, list(k), c) for m in methods for k in keeps for c in carries]
    timed = _timed_batch(subject, beton, batch) if speed is not None else None
    rows = []
    for index, (method, keep, carry) in enumerate(settings, 1):
        net = subject.model if keep is None else with_method(subject, method, keep,
                                                            variant={**subject.variant, "carry": carry})
        top1, top5, images = top_k(net, subject, beton, batch=batch)
        row = {"method": method, "keep": "" if keep is None else ",".join(map(str, keep)), "carry": carry,
               "top1": top1, "top5": top5, "gflops": count_flops(net).total, "images": images}
        if timed is not None:
            row |= _speed(net, subject.model, timed, speed)
        rows.append(row)
        log(f"[evaluate] {index}/{len(settings)} {method} {row['keep'] or 'every token'}"
            f"{' carry' if carry else ''}: top-1 {top1:.2f}%, top-5 {top5:.2f}%, {row['gflops']:.4g} GFLOPs")
    return rows


def _timed_batch(subject: Subject, beton: str | Path, batch: int) -> torch.Tensor:
    images, _ = next(read_labelled(beton, subject.res, subject.crop_pct, batch, batch))
    return normalise(subject, images)


def _speed(net: nn.Module, reference: nn.Module, images: torch.Tensor, settings: SpeedSettings) -> dict[str, float]:
    ratio = speed(net, reference, images, device=torch.device("cpu"), dtype="fp32", threads=1, settings=settings)
    return {"speed_ratio": ratio.ratio, "speed_ratio_low": ratio.low, "speed_ratio_high": ratio.high}
