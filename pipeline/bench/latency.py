"""``pipeline bench latency-check``: a latency table's predictions against whole-model measurements.

The held-out keep lists are the paper's sparsity levels for the model (where it has them) and seeded
random non-increasing lists, some with no pooling step in some blocks (K_l = K_{l-1}), picked so that
their predicted time spreads over ``SPREAD`` of the unmodified model's. Each list's model (the table's
method and options) is timed paired against the unmodified timm model at the table's setting
(``bench.paired``: ABBA blocks, the median's 95% interval), and the prediction is judged on that ratio,
since absolute milliseconds drift on a loaded machine: the relative error ``predicted ratio / measured ratio - 1``
per list, its median and worst absolute value, and Kendall's tau between predicted and measured ratios.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pipeline.bench.blocks import BlocksSettings, replace_key, settings_from_key, setup, table_key
from pipeline.bench.paired import SpeedRatio, SpeedSettings, paired_ratio, sample_timer
from pipeline.bench.timing import default_calls
from pipeline.config import ConfigError
from pipeline.cost import CostModel, check_key
from pipeline.errors import InputError
from pipeline.models.keep import effective_keep
from pipeline.runtime import compile_model, cuda_settings, inference
from pipeline.sparsity import level_keep

SPREAD = (0.3, 1.0)  # the predicted fractions of the unmodified model's time the random lists cover


@dataclass(frozen=True)
class CheckRow:
    label: str
    keep: list[int]
    predicted: float  # predicted time / predicted unmodified time
    speed: SpeedRatio  # this model's time over the unmodified model's, paired (``bench.paired``)

    @property
    def measured(self) -> float:
        return self.speed.ratio

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


@dataclass(frozen=True)
class CheckSummary:
    median_abs_error: float
    worst_abs_error: float
    tau: float
    lists: int


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b of two equally long sequences, by comparing every pair (ties in either count as
    neither concordant nor discordant, and shrink the denominator)."""
    if len(a) != len(b) or len(a) < 2:
        raise InputError(f"Kendall's tau needs two sequences of one length >= 2, got {len(a)} and {len(b)}")
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denominator if denominator else float("nan")


def summarize(rows: Sequence[CheckRow]) -> CheckSummary:
    errors = [abs(row.error) for row in rows]
    return CheckSummary(median_abs_error=statistics.median(errors), worst_abs_error=max(errors),
                        tau=kendall_tau([r.predicted for r in rows], [r.measured for r in rows]), lists=len(rows))


def random_keep(rng: random.Random, num_tokens: int, depth: int, *, allow_zero: bool) -> list[int]:
    """A random non-increasing keep list with at least one pooling step; each block keeps every token it
    receives (no step) with probability 0.35; the last may keep only the prefix (0) with ``allow_zero``."""
    while True:
        shape = rng.uniform(0.3, 3.0)
        fractions = sorted((rng.random() ** shape for _ in range(depth)), reverse=True)
        keep, previous = [], num_tokens
        for f in fractions:
            k = previous if rng.random() < 0.35 else min(previous, max(1, round(f * num_tokens)))
            keep.append(k)
            previous = k
        if allow_zero and rng.random() < 0.2:
            keep[-1] = 0
        if any(k < n for k, n in zip(keep, [num_tokens, *keep])):
            return keep


def held_out_lists(table: CostModel, count: int, seed: int, levels: bool = True) -> list[tuple[str, list[int]]]:
    """The paper's levels for the table's model (with ``levels``), then random lists (``random_keep``) whose
    predicted ratios lie nearest ``count - levels`` targets evenly spread over ``SPREAD``."""

    n, depth = table.num_tokens, table.depth
    chosen: list[tuple[str, list[int]]] = []
    for level in range(8) if levels else ():
        try:
            keep = effective_keep(level_keep(table.key["model"], level), depth=depth, num_tokens=n)
        except (ConfigError, InputError):
            break
        chosen.append((f"level {level}", keep))
    rng = random.Random(seed)
    full = table.unmodified()
    pool = [random_keep(rng, n, depth, allow_zero=table.prefix > 0) for _ in range(3000)]
    ratios = [table.predict(k) / full for k in pool]
    remaining = max(count - len(chosen), 0)
    lo, hi = SPREAD
    for i in range(remaining):
        target = lo + (hi - lo) * (i + 0.5) / remaining
        best = min(range(len(pool)), key=lambda j: abs(ratios[j] - target))
        chosen.append((f"random {i + 1}", pool[best]))
        ratios[best] = math.inf  # each list once
    return chosen


def measure_lists(s: BlocksSettings, lists: list[tuple[str, list[int]]], table: CostModel, base: nn.Module,
                  device: torch.device, log: Callable[[str], None] = print, speed: SpeedSettings | None = None
                  ) -> list[CheckRow]:
    """Each list's model against the unmodified model ``base`` (on ``device``) at the setting ``s``: a paired ratio
    with its 95% interval (``bench.paired``, ``speed`` its tolerance, cap and warm-up)."""
    images = torch.randn(s.batch, 3, *base.patch_embed.img_size, generator=torch.Generator().manual_seed(0))
    images = images.to(device)
    run_base = compile_model(base, s.compile, device)
    timer = sample_timer(device, calls=default_calls(device), clock=s.clock)
    full, rows = table.unmodified(), []
    with cuda_settings(device), inference(device, s.dtype):
        for i, (label, keep) in enumerate(lists, 1):
            model = s.model.build(method=s.method, keep=keep, options=s.options, kernels=s.kernels)
            model.load_state_dict(base.state_dict(), strict=False)
            run = compile_model(model.to(device), s.compile, device)
            ratio = paired_ratio(partial(run, images), partial(run_base, images), timer=timer,
                                 settings=speed or SpeedSettings(warmup=s.warmup))
            rows.append(CheckRow(label, keep, table.predict(keep) / full, ratio))
            log(f"[latency-check] {i}/{len(lists)} {label}: predicted {rows[-1].predicted:.3f}, measured "
                f"{ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}] ({ratio.label()}), "
                f"error {rows[-1].error:+.1%}")
    return rows


def run_check(table: CostModel, *, count: int, seed: int, levels: bool, other_device: bool,
              speed: SpeedSettings | None = None, log: Callable[[str], None] = print, where: str = "the table"
              ) -> tuple[CostModel, list[CheckRow]]:
    """Checks the table's key against this machine (``cost.check_key``), then measures the held-out lists."""
    s = settings_from_key(table.key)
    device, base = setup(s)
    table = check_key(replace_key(table), table_key(s, base, device), other_device=other_device, where=where)
    lists = held_out_lists(table, count, seed, levels)
    return table, measure_lists(s, lists, table, base, device, log, speed)


def format_check(table: CostModel, rows: list[CheckRow], where: str) -> str:
    k, summary = table.key, summarize(rows)
    mark = " (PREDICTED: the table was measured on another machine)" if table.predicted else ""
    lines = [f"latency check of {where}{mark}",
             f"{k['model']} (M={k['embed_dim']}, L={k['depth']}), {k['method']}, batch {k['batch']}, {k['dtype']}, "
             f"compile {k['compile']}, {k['threads']} thread(s), {k.get('clock', 'wall')} clock, {k['device']}", "",
             "| list | keep | predicted ratio | measured ratio | 95% interval | error |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r.label} | {','.join(map(str, r.keep))} | {r.predicted:.3f} | {r.measured:.3f} | "
              f"[{r.speed.low:.3f}, {r.speed.high:.3f}] | {r.error:+.1%} |" for r in rows]
    lines += ["", f"{summary.lists} lists: median |error| {summary.median_abs_error:.1%}, worst "
              f"{summary.worst_abs_error:.1%}, Kendall tau {summary.tau:.3f}",
              "ratio: time / the unmodified model's time at the same setting (measured: the median of paired ABBA "
              "blocks, with its 95% interval; bench.paired)"]
    return "\n".join(lines)
