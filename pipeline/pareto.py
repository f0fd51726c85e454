"""Pareto-front selection over (cost: lower is better, top-1: higher is better).

The cost is GFLOPs, or the measured time per image (``report.COSTS``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One evaluated model: its id (unique), its cost (GFLOPs, or seconds per image) and top-1."""

    id: str
    cost: float
    top1: float


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The non-dominated points, by increasing cost.

    Exact duplicates (same cost and top-1) dominate nothing and are not dominated by each other;
    only the one with the smallest id is kept, so a front never lists the same trade-off twice.
    Sort-and-sweep, O(n log n): by cost, the more accurate and then the smaller id first, a point joins the
    front only when it is more accurate than the last one kept, which no duplicate of that one is.
    """
    ordered = sorted(points, key=lambda p: (p.cost, -p.top1, p.id))
    front: list[Point] = []
    for point in ordered:
        if not front or point.top1 > front[-1].top1:
            front.append(point)
    return front


def best_at_budgets(points: Sequence[Point], budgets: Sequence[float]) -> list[tuple[float, Point | None]]:
    """For each cost budget, the most accurate point within it (ties: lower cost, then smaller id)."""
    table = []
    for budget in budgets:
        within = [p for p in points if p.cost <= budget]
        table.append((budget, min(within, key=lambda p: (-p.top1, p.cost, p.id)) if within else None))
    return table


def relative_half_width(ratio: float, low: float, high: float) -> float:
    """The half-width of ``ratio``'s interval ``[low, high]``, relative to the ratio: what a speed's tolerance
    bounds (``bench.paired``) and every speed label reports."""
    return (high - low) / 2 / ratio


@dataclass(frozen=True)
class Measured:
    """A model whose cost is a measured interval [low, high] (seconds per image: lower is better) with top-1."""

    id: str
    low: float
    high: float
    top1: float


def beats(a: Measured, b: Measured, margin: float = 0.0) -> bool:
    """``a`` beats ``b`` beyond the intervals: at least as accurate and faster beyond them by the relative
    ``margin`` (``a.high * (1 + margin) < b.low``; margin 0: beyond the intervals alone). A more accurate model whose
    interval overlaps ``b``'s does not: the measurement cannot say ``b`` is not the faster one, so ``b`` stays on the
    front as its tie. (Letting it beat ``b`` made the front hang on interval widths: one wide interval in one run
    took a model off that the other run kept.) The margin is the machine's run-to-run spread
    (``experiment.select.tie_margin``): times that differ by less than it are ties, whatever the intervals say."""
    return a.top1 >= b.top1 and a.high * (1 + margin) < b.low


def measured_front(models: Sequence[Measured], margin: float = 0.0) -> list[tuple[Measured, list[str]]]:
    """The models no other beats beyond the intervals and ``margin`` (``beats``), cheapest first by the interval's
    middle (its ends' sum sorts alike), then the more accurate, then by id, each with the ids of the other front
    models whose intervals, each widened upward by the margin, overlap its own: ties, which the measurement does
    not order (a tie may be less accurate: nothing says it is not the faster). O(n^2): a front of an experiment's
    models, not of millions."""
    front = [m for m in models if not any(beats(o, m, margin) for o in models if o.id != m.id)]
    front.sort(key=lambda m: (m.low + m.high, -m.top1, m.id))
    grow = 1 + margin
    return [(m, [o.id for o in front if o.id != m.id and o.low <= m.high * grow and m.low <= o.high * grow])
            for m in front]
