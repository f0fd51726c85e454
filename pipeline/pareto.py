"""Pareto-front selection over (GFLOPs: lower is better, top-1: higher is better)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One evaluated model: its id (unique), GFLOPs and top-1."""

    id: str
    gflops: float
    top1: float


def dominates(a: Point, b: Point) -> bool:
    """``a`` is no worse than ``b`` in both objectives and strictly better in one."""
    return a.gflops <= b.gflops and a.top1 >= b.top1 and (a.gflops < b.gflops or a.top1 > b.top1)


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The non-dominated points, by increasing GFLOPs.

    Exact duplicates (same GFLOPs and top-1) dominate nothing and are not dominated by each other;
    only the one with the smallest id is kept, so a front never lists the same trade-off twice.
    Sort-and-sweep, O(n log n).
    """
    ordered = sorted(points, key=lambda p: (p.gflops, -p.top1, p.id))
    front: list[Point] = []
    for point in ordered:
        if front and front[-1].gflops == point.gflops and front[-1].top1 == point.top1:
            continue  # an exact duplicate of the point just kept (smaller id)
        if not front or point.top1 > front[-1].top1:
            front.append(point)
    return front


def best_at_budgets(points: Sequence[Point], budgets: Sequence[float]) -> list[tuple[float, Point | None]]:
    """For each GFLOPs budget, the most accurate point within it (ties: fewer GFLOPs, then smaller id)."""
    table = []
    for budget in budgets:
        within = [p for p in points if p.gflops <= budget]
        table.append((budget, min(within, key=lambda p: (-p.top1, p.gflops, p.id)) if within else None))
    return table
