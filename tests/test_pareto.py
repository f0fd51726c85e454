"""Pareto selection and the best-at-budget table against brute-force references."""

from __future__ import annotations

import random

import pytest

from pipeline.pareto import Point, best_at_budgets, pareto_front


def dominates(a: Point, b: Point) -> bool:
    """The definition, written out for the references: ``a`` is no worse than ``b`` in both objectives and
    strictly better in one."""
    return a.cost <= b.cost and a.top1 >= b.top1 and (a.cost < b.cost or a.top1 > b.top1)


def brute_front(points: list[Point]) -> set[str]:
    """Every point no other point dominates; of exact duplicates, the smallest id."""
    keep = set()
    for p in points:
        if any(dominates(q, p) for q in points):
            continue
        twins = [q.id for q in points if (q.cost, q.top1) == (p.cost, p.top1)]
        if p.id == min(twins):
            keep.add(p.id)
    return keep


def brute_budget(points: list[Point], budget: float) -> str | None:
    """Filter step by step: within the budget, then the best top-1, then the lowest cost, then the id."""
    within = [p for p in points if p.cost <= budget]
    if not within:
        return None
    best_top1 = max(p.top1 for p in within)
    tied = [p for p in within if p.top1 == best_top1]
    cheapest = min(p.cost for p in tied)
    return sorted(p.id for p in tied if p.cost == cheapest)[0]


@pytest.mark.parametrize("seed", range(30))
def test_front_matches_brute_force_with_ties_and_duplicates(seed):
    rng = random.Random(seed)
    # A coarse grid forces equal costs, equal top-1 and exact duplicates.
    points = [Point(f"m{i:02d}", rng.choice([0.5, 1.0, 1.5, 2.0]), rng.choice([70.0, 72.5, 75.0, 80.0]))
              for i in range(rng.randint(1, 25))]
    front = pareto_front(points)
    assert {p.id for p in front} == brute_front(points)
    assert [p.cost for p in front] == sorted(p.cost for p in front)


def test_hand_made_cases():
    a, b, c = Point("a", 1.0, 80.0), Point("b", 1.0, 80.0), Point("c", 1.0, 79.0)
    d, e = Point("d", 2.0, 80.0), Point("e", 0.5, 70.0)
    assert [p.id for p in pareto_front([d, c, b, a, e])] == ["e", "a"]  # b duplicates a; c and d are dominated
    assert pareto_front([]) == []


@pytest.mark.parametrize("seed", range(10))
def test_best_at_budget_matches_brute_force(seed):
    rng = random.Random(seed)
    points = [Point(f"m{i:02d}", rng.choice([0.5, 1.0, 1.5]), rng.choice([70.0, 75.0])) for i in range(12)]
    budgets = [0.25, 0.5, 0.75, 1.0, 1.5, 3.0]
    got = {b: (p.id if p else None) for b, p in best_at_budgets(points, budgets)}
    assert got == {b: brute_budget(points, b) for b in budgets}


def test_the_measured_front_keeps_what_the_intervals_cannot_order_and_marks_ties():
    """Seconds per image as 95% intervals: written-out cases, then random ones against the point front (the sweep
    tested above) of the case most favourable to each model: it at its interval's low end, every other model at its
    high end. Where no interval's end equals another's (as with these random floats), a model is beaten beyond the
    intervals exactly when it is dominated even there; ends that touch are the next test's."""
    from pipeline.pareto import Measured, measured_front

    models = [Measured("A", 1.0, 1.1, 70.0), Measured("B", 1.05, 1.2, 70.0),  # overlapping, equally accurate
              Measured("C", 2.0, 2.1, 75.0),  # slower beyond the intervals, more accurate: a real trade-off
              Measured("D", 1.0, 1.1, 65.0),  # as fast as A by the measurement, less accurate: a tie, kept
              Measured("E", 0.5, 0.6, 60.0),  # the fastest
              Measured("F", 2.05, 2.5, 74.0),  # C overlaps it and is more accurate: a tie, kept
              Measured("G", 1.15, 1.3, 65.0),  # A is faster beyond the intervals and more accurate
              Measured("H", 2.2, 2.6, 75.0)]  # C is faster beyond the intervals and as accurate
    front = measured_front(models)
    assert [(m.id, ties) for m, ties in front] == [("E", []), ("A", ["D", "B"]), ("D", ["A", "B"]),
                                                   ("B", ["A", "D"]), ("C", ["F"]), ("F", ["C"])]
    rng = random.Random(4)
    for _ in range(200):
        ms = []
        for i in range(8):
            low = rng.uniform(1, 3)
            ms.append(Measured(str(i), low, low + rng.uniform(0, 0.5), float(rng.choice([60, 65, 70, 75]))))
        front = measured_front(ms)
        kept = {m.id for m, _ in front}
        for m in ms:
            favourable = [Point(m.id, m.low, m.top1)] + [Point(o.id, o.high, o.top1) for o in ms if o is not m]
            assert (m.id in kept) == (m.id in {p.id for p in pareto_front(favourable)})
        for m, ties in front:  # the ties: the other front models whose intervals share a point with m's
            assert set(ties) == {o.id for o, _ in front if o is not m and max(o.low, m.low) <= min(o.high, m.high)}


def test_intervals_that_share_an_end_are_not_apart():
    """[1, 2] and [2, 3] s per image touch: neither is faster beyond the intervals, so two models with them are
    both on the front, each the other's tie, whichever is the more accurate; one apart from the faster by any
    margin is beaten, if it is not the more accurate."""
    from pipeline.pareto import Measured, beats, measured_front

    fast, slow = Measured("a", 1.0, 2.0, 70.0), Measured("b", 2.0, 3.0, 70.0)
    assert not beats(fast, slow) and not beats(slow, fast)
    assert measured_front([slow, fast]) == [(fast, ["b"]), (slow, ["a"])]
    accurate = Measured("c", 2.0, 3.0, 75.0)
    assert not beats(accurate, fast) and not beats(fast, accurate)
    assert measured_front([fast, accurate]) == [(fast, ["c"]), (accurate, ["a"])]
    apart = Measured("d", 2.0 + 1e-9, 3.0, 70.0)  # 2 < 2 + 1e-9: faster beyond the intervals
    assert beats(fast, apart) and measured_front([apart, fast]) == [(fast, [])]
    assert not beats(fast, Measured("e", 2.5, 3.0, 70.5))  # apart, but more accurate
    # one middle: the more accurate first, whatever the ids
    same = [Measured("x", 1.0, 3.0, 60.0), Measured("y", 1.5, 2.5, 65.0)]
    assert [m.id for m, _ in measured_front(same)] == ["y", "x"]


def test_a_relative_half_width_is_half_the_interval_over_the_ratio():
    from pipeline.pareto import relative_half_width

    assert relative_half_width(0.5, 0.48, 0.52) == pytest.approx(0.04)
    assert relative_half_width(2.0, 1.8, 2.4) == pytest.approx(0.15)  # an interval not centred on the ratio
    assert relative_half_width(1.0, 1.0, 1.0) == 0.0


def test_a_tie_margin_keeps_models_within_it_on_the_front_as_ties():
    """a: [1.0, 1.1] s, b: [1.15, 1.2] s, equally accurate. Apart beyond the intervals alone (1.1 < 1.15): b is
    beaten. With a 5% margin, a's upper end grows to 1.155, past b's lower end: no longer apart, so both stay on the
    front as each other's ties (each interval widened upward by the margin overlaps the other)."""
    from pipeline.pareto import Measured, beats, measured_front

    a, b = Measured("a", 1.0, 1.1, 70.0), Measured("b", 1.15, 1.2, 70.0)
    assert beats(a, b) and beats(a, b, 0.04) and not beats(a, b, 0.05)  # 1.1 x 1.04 = 1.144 < 1.15 <= 1.155
    assert [(m.id, ties) for m, ties in measured_front([a, b])] == [("a", [])]
    assert [(m.id, ties) for m, ties in measured_front([a, b], 0.05)] == [("a", ["b"]), ("b", ["a"])]
