"""pipeline.targets: the GFLOPs cost model against fvcore, the rounding against brute force, the penalty's
gradient against the table's slopes, and the self-adjusting strength landing on its target."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipeline.bench.paired import SpeedRatio, SpeedSettings
from pipeline.config import CostTarget
from pipeline.cost import CostModel, Curve, PoolSurface
from pipeline.errors import InputError
from pipeline.flops import count_flops, gflops_cost_model
from pipeline.models import create_model, retention_penalty
from pipeline.targets import (
    TargetSearch,
    candidates,
    cheapest_fraction,
    repair_keep,
    round_keep,
    target_cost,
    target_cost_model,
)
from tests.conftest import HANG_S, LOOSE_TOLERANCE
from tests.reference import table_cost

ROOT = Path(__file__).resolve().parents[1]
# A keep list measured on a table: what it records, not how fast the machine is (docs/testing.md).
LOOSE = SpeedSettings(tolerance=LOOSE_TOLERANCE, cap_s=HANG_S)
DEMO = {"img_size": 28, "patch_size": 4, "depth": 4, "num_heads": 2, "num_classes": 10, "embed_dim": 32}


def _table(scale: float = 1.0) -> CostModel:
    """A hand-made table, N = 8, 3 blocks: attention steep above 4 tokens, a pooling step dearer with more tokens."""
    attn = Curve((0, 2, 4, 6, 8), tuple(scale * y for y in (1.0, 1.2, 1.4, 3.0, 4.6)))
    mlp = Curve((0, 2, 4, 6, 8), tuple(scale * y for y in (0.5, 1.0, 1.5, 2.0, 2.5)))
    pool = PoolSurface((2, 4, 6, 8), tuple(Curve(tuple(range(0, n + 1, 2)), tuple(scale * (0.1 * n + 0.05 * k)
                                                                                 for k in range(0, n + 1, 2)))
                                           for n in (2, 4, 6, 8)))
    return CostModel("ms", num_tokens=8, prefix=1, depth=3, fixed=scale * 0.3, attn=attn, mlp=mlp, pool=pool)


def _brute_force(weights: list[torch.Tensor], costs: CostModel, limit: float) -> tuple[float, list[int]]:
    """Every non-increasing list over the candidate counts, its cost written out (``reference.table_cost``, not
    ``CostModel.predict``): the most kept mass within ``limit`` and, of the lists keeping it, the one that costs
    most (the mass and the list)."""
    best, table = (float("-inf"), float("-inf"), []), costs.to_json()
    for keep in itertools.product(candidates(costs), repeat=costs.depth):
        cost = table_cost(table, list(keep))
        if any(b > a for a, b in zip(keep, keep[1:])) or cost > limit + 1e-12 * abs(limit):
            continue
        mass = sum(float(w[:k].sum()) for w, k in zip(weights, keep))
        best = max(best, (mass, cost, list(keep)), key=lambda b: (b[0], b[1]))
    return best[0], best[2]


def test_gflops_cost_model_equals_fvcore():
    for method, keep in (("powerbert", [10, 8, 8, 3]), ("wkmedoids", [40, 20, 20, 0])):
        model = create_model("deit_tiny_patch16_224", method=method, keep=keep, **DEMO)
        assert gflops_cost_model(model, method).predict(keep) == pytest.approx(count_flops(model).total, rel=1e-12)
    assert gflops_cost_model(model, method).unmodified() == pytest.approx(
        count_flops(create_model("deit_tiny_patch16_224", **DEMO)).total, rel=1e-12)
    with pytest.raises(InputError, match="no closed-form GFLOPs count of method 'tome'"):
        gflops_cost_model(model, "tome")


def test_rounding_equals_brute_force_on_small_cases():
    costs, generator = _table(), torch.Generator().manual_seed(0)
    for _ in range(12):
        weights = [torch.rand(8, generator=generator, dtype=torch.float64) for _ in range(3)]
        for fraction in (0.4, 0.5, 0.7, 0.9, 1.0):
            limit = fraction * costs.unmodified()
            keep = round_keep(weights, costs, limit)
            mass, _ = _brute_force(weights, costs, limit)
            assert table_cost(costs.to_json(), keep) <= limit
            assert sum(float(w[:k].sum()) for w, k in zip(weights, keep)) == pytest.approx(mass)
    with pytest.raises(InputError, match="no keep list costs at most"):
        round_keep(weights, costs, 0.1 * costs.unmodified())


def _curve(draw, lo: int, hi: int, most: int) -> Curve:
    """A curve with 1 to ``most`` points in [lo, hi] and costs in [0, 3]: often none at the ends, so that the
    rounding reaches counts outside its points, where a falling line extended would go below 0."""
    xs = sorted(draw(st.sets(st.integers(lo, hi), min_size=1, max_size=most)))
    return Curve(tuple(xs), tuple(draw(st.floats(0, 3, allow_nan=False)) for _ in xs))


@st.composite
def _tables(draw) -> CostModel:
    n_tokens = draw(st.integers(3, 7))
    ns = sorted(draw(st.sets(st.integers(1, n_tokens), min_size=1, max_size=3)))
    pool = PoolSurface(tuple(ns), tuple(_curve(draw, 0, n, 3) for n in ns))
    return CostModel("ms", num_tokens=n_tokens, prefix=draw(st.integers(0, 1)), depth=3,
                     fixed=draw(st.floats(-1, 1, allow_nan=False)), attn=_curve(draw, 0, n_tokens, 3),
                     mlp=_curve(draw, 0, n_tokens, 3), pool=pool)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(costs=_tables(), data=st.data())
def test_the_rounding_equals_brute_force_on_random_tables_with_tied_masses(costs, data):
    """Random tables (extrapolating ones among them) and weights from {0, 0.5, 1} (many lists keep equal mass):
    the dynamic program keeps the most mass any list within the limit keeps and, of the lists that keep it, spends
    the most of the limit."""
    weights = [torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=costs.num_tokens,
                                               max_size=costs.num_tokens)), dtype=torch.float64)
               for _ in range(costs.depth)]
    full = table_cost(costs.to_json(), [costs.num_tokens] * costs.depth)
    limit = data.draw(st.floats(0.2, 1.2)) * full
    mass, best = _brute_force(weights, costs, limit)
    if mass == float("-inf"):
        with pytest.raises(InputError, match="no keep list costs at most"):
            round_keep(weights, costs, limit)
        return
    keep = round_keep(weights, costs, limit)
    assert table_cost(costs.to_json(), keep) <= limit + 1e-9
    assert sum(float(w[:k].sum()) for w, k in zip(weights, keep)) == mass  # halves: exact sums
    # of the lists keeping that mass, the one spending the most of the limit
    assert table_cost(costs.to_json(), keep) == pytest.approx(table_cost(costs.to_json(), best), abs=1e-9)


def _brute_force_around(weights: list[torch.Tensor], costs: CostModel, limit: float,
                        around: list[float]) -> tuple[float, list[int], int]:
    """``round_keep(..., around=...)`` written out: for radius 1, 2, 4, ..., block l may take the candidates whose
    index is within ``radius - 1`` of the index range ``bisect`` gives for ``around[l]``; the first radius at which
    ``_brute_force`` over those lists finds one within ``limit`` (the mass, the list and the radius)."""
    import bisect

    counts, table = candidates(costs), costs.to_json()
    radius = 1
    while True:
        windows = []
        for count in around:
            low, high = bisect.bisect_right(counts, count) - 1, bisect.bisect_left(counts, count)
            windows.append([c for i, c in enumerate(counts) if low - radius < i < high + radius])
        best = (float("-inf"), float("-inf"), [])
        for keep in itertools.product(*windows):
            cost = table_cost(table, list(keep))
            if any(b > a for a, b in zip(keep, keep[1:])) or cost > limit + 1e-12 * abs(limit):
                continue
            mass = sum(float(w[:k].sum()) for w, k in zip(weights, keep))
            best = max(best, (mass, cost, list(keep)), key=lambda b: (b[0], b[1]))
        if best[2] or all(len(w) == len(counts) for w in windows):
            return best[0], best[2], radius
        radius *= 2


@settings(max_examples=120, deadline=None, derandomize=True)
@given(costs=_tables(), data=st.data())
def test_the_rounding_near_a_landing_equals_brute_force(costs, data):
    """Random tables, tied masses and landings anywhere in [0, N + 1]: block l's count stays among the candidates
    nearest the landing, the window widening (radius 1, 2, 4, ...) until a list fits; within it the most mass, and of
    equal masses the most cost, as over every list."""
    weights = [torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=costs.num_tokens,
                                               max_size=costs.num_tokens)), dtype=torch.float64)
               for _ in range(costs.depth)]
    around = [data.draw(st.floats(0, costs.num_tokens + 1)) for _ in range(costs.depth)]
    full = table_cost(costs.to_json(), [costs.num_tokens] * costs.depth)
    limit = data.draw(st.floats(0.2, 1.2)) * full
    mass, best, _ = _brute_force_around(weights, costs, limit, around)
    if not best:
        with pytest.raises(InputError, match="no keep list costs at most"):
            round_keep(weights, costs, limit, around=around)
        return
    keep = round_keep(weights, costs, limit, around=around)
    assert table_cost(costs.to_json(), keep) <= limit + 1e-9
    assert sum(float(w[:k].sum()) for w, k in zip(weights, keep)) == mass
    assert table_cost(costs.to_json(), keep) == pytest.approx(table_cost(costs.to_json(), best), abs=1e-9)


def test_the_window_around_a_landing_written_out():
    """Candidates 0, 4, 8, 12, 16: radius 1 is the last at or below the landing and the first at or above it (one
    candidate where the landing is one), radius r adds r - 1 beyond each; past either end, the end."""
    from pipeline.targets import _nearest

    counts = [0, 4, 8, 12, 16]
    assert _nearest(counts, 8, 1) == [8] and _nearest(counts, 8, 2) == [4, 8, 12]
    assert _nearest(counts, 9.5, 1) == [8, 12] and _nearest(counts, 9.5, 2) == [4, 8, 12, 16]
    assert _nearest(counts, 9.5, 4) == counts
    assert _nearest(counts, 20, 1) == [16] and _nearest(counts, 20, 2) == [12, 16]
    assert _nearest(counts, -1, 1) == [0] and _nearest(counts, -1, 2) == [0, 4]


def test_a_landing_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match=r"^around has 2 counts; the cost model has 3 blocks$"):
        round_keep([torch.ones(8)] * 3, _table(), 100.0, around=[4.0, 4.0])


def test_the_demos_search_rounds_near_where_it_landed_and_spends_its_target():
    """The demo's lat0.8 search on the shipped M32 WK-Medoids table, with its learned retention: weights equal
    within each block (0.408, 0.819, 0.773, 1.0), landing on about 20 tokens a block near 0.8 of the unmodified
    time (the demo's runs: 0.7996). Over every list the most mass is [49, 49, 0, 0], 9.4% under the target; near the
    landing, [20, 20, 20, 20], within 0.1% of it. A tighter limit (a repair's) widens the window until a list fits,
    and still spends it."""
    from pipeline.cost import load_cost_model
    from pipeline.targets import landing

    table = load_cost_model(ROOT / "configs/latency/amd-epyc/deit_tiny_patch16_224-m32-d4-28px-p4/"
                                   "wkmedoids-b64-fp32-none-t1-cpuclock.json")
    full = table.unmodified()
    weights = [torch.full((49,), w, dtype=torch.float64) for w in (0.408, 0.819, 0.773, 1.0)]
    assert landing(weights) == pytest.approx([49 * 0.408] * 4)
    assert round_keep(weights, table, 0.8 * full) == [49, 49, 0, 0]
    assert table.predict([49, 49, 0, 0]) / full < 0.8 * 0.91
    keep = round_keep(weights, table, 0.8 * full, around=landing(weights))
    assert keep == [20, 20, 20, 20] and 0.8 * 0.999 < table.predict(keep) / full <= 0.8
    tighter = round_keep(weights, table, 0.6 * full, around=landing(weights))
    assert table.predict([19] * 4) / full > 0.6  # nothing within radius 1 (19 or 20 tokens) fits
    assert 0.6 * 0.97 < table.predict(tighter) / full <= 0.6
    assert tighter == [6, 6, 6, 6]  # radius 16 (its brute force takes a minute)
    # The search rounds near its landing: a model with those weights gives the same list.
    model = _Searched(4, 49)
    with torch.no_grad():
        for block, w in zip(model.blocks, (0.408, 0.819, 0.773, 1.0)):
            block.retention.fill_(w)
    assert TargetSearch(table, fraction=0.8, dual_rate=1.0, quadratic=0.0).result(model)[0] == keep
    # So does a repair: measured at 0.85, it rounds again under 0.8 * 0.8 / 0.85 near the landing.
    repair = repair_keep(weights, table, 0.8, keep, _over(0.85, []), tries=1)
    limit = 0.8 * 0.8 / 0.85
    assert repair.keep == [17, 17, 17, 17]  # radius 4
    assert (repair.keep, 4) == _brute_force_around(weights, table, limit * full, landing(weights))[1:]
    assert limit * 0.97 < table.predict(repair.keep) / full <= limit


def test_the_cheapest_fraction_is_the_cheapest_list_written_out():
    costs = _table()
    lists = [keep for keep in itertools.product(candidates(costs), repeat=costs.depth)
             if all(b <= a for a, b in zip(keep, keep[1:]))]
    cheapest = min(table_cost(costs.to_json(), list(keep)) for keep in lists)
    assert cheapest_fraction(costs) == pytest.approx(cheapest / table_cost(costs.to_json(), [8, 8, 8]))
    with pytest.raises(InputError, match=rf"{cheapest / costs.unmodified():.3f} of the unmodified .*; raise the "
                                         r"target$"):
        round_keep([torch.ones(8, dtype=torch.float64)] * 3, costs, 0.99 * cheapest)


def test_the_rounding_can_take_counts_between_a_coarse_tables_points():
    """A DeiT-S-sized table with points every 48 tokens: the candidates are its points and every 4th count (196 / 48),
    written out here; a 49-token model's are every count."""
    coarse = Curve((0, 48, 96, 144, 192, 196), (1.0, 2.0, 3.0, 4.0, 5.0, 5.1))
    costs = CostModel("ms", num_tokens=196, prefix=1, depth=2, fixed=0.0, attn=coarse, mlp=coarse,
                      pool=PoolSurface((96, 196), (Curve((48,), (0.5,)), Curve((48, 96), (0.5, 0.6)))))
    assert candidates(costs) == sorted({*range(0, 196, 4), 196})
    small = CostModel("ms", num_tokens=49, prefix=1, depth=2, fixed=0.0, attn=Curve((0, 49), (1.0, 2.0)),
                      mlp=Curve((0, 49), (1.0, 2.0)), pool=PoolSurface((49,), (Curve((8,), (0.5,)),)))
    assert candidates(small) == list(range(50))


def test_a_different_retention_gives_a_different_list():
    costs = _table()
    early = [torch.tensor([1.0] * 8, dtype=torch.float64), torch.tensor([0.9] * 8, dtype=torch.float64),
             torch.tensor([0.0] * 8, dtype=torch.float64)]
    late = [torch.tensor([1.0] * 8, dtype=torch.float64), torch.tensor([0.1] * 8, dtype=torch.float64),
            torch.tensor([0.9] * 8, dtype=torch.float64)]
    limit = 0.6 * costs.unmodified()
    assert round_keep(early, costs, limit) != round_keep(late, costs, limit)
    assert round_keep(early, costs, limit) == _brute_force(early, costs, limit)[1]
    assert round_keep(late, costs, limit) == _brute_force(late, costs, limit)[1]


def test_a_table_proportional_to_flops_gives_the_gflops_targets_lists():
    model = create_model("deit_tiny_patch16_224", **DEMO)
    flops = gflops_cost_model(model, "wkmedoids", step=8)
    scale = 3.7  # ms per GFLOP
    table = CostModel("ms", flops.num_tokens, flops.prefix, flops.depth, scale * flops.fixed,
                      Curve(flops.attn.xs, tuple(scale * y for y in flops.attn.ys)),
                      Curve(flops.mlp.xs, tuple(scale * y for y in flops.mlp.ys)),
                      PoolSurface(flops.pool.ns, tuple(Curve(c.xs, tuple(scale * y for y in c.ys))
                                                       for c in flops.pool.curves)))
    generator = torch.Generator().manual_seed(1)
    lists = set()
    for _ in range(4):
        weights = [torch.rand(49, generator=generator, dtype=torch.float64).sort(descending=True).values
                   * torch.rand(1, generator=generator, dtype=torch.float64) for _ in range(4)]  # blocks differ
        for fraction in (0.4, 0.6, 0.8):
            keep = round_keep(weights, flops, fraction * flops.unmodified())
            assert keep == round_keep(weights, table, fraction * table.unmodified())
            lists.add(tuple(keep))
    assert len(lists) > 3  # the lists do depend on the retention and the target


class _Searched(nn.Module):
    """What the search reads of a model: blocks with soft-extract weights."""

    def __init__(self, depth: int, tokens: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in range(depth))
        for block in self.blocks:
            block.retention = nn.Parameter(torch.ones(tokens))


def test_the_penaltys_gradient_follows_the_tables_slope():
    costs, model = _table(), _Searched(3, 8)
    with torch.no_grad():  # expected counts 5, 3, 1: inside the segments (4, 6), (2, 4), (0, 2)
        for block, mass in zip(model.blocks, (5.0, 3.0, 1.0)):
            block.retention.fill_(mass / 8)
    search = TargetSearch(costs, fraction=0.5, dual_rate=1.0, quadratic=0.0, dual=1.0)  # the penalty is rho
    search.penalty(model).backward()
    unmodified = costs.unmodified()
    # d cost / d K_l: the MLP half's slope at K_l, the next block's attention slope at K_l, and the pooling
    # steps' slopes (this block's in k, the next one's in n), read off the points by hand.
    slope = {"mlp": 0.25, "attn_2_4": 0.1, "attn_0_2": 0.1, "pool_k": 0.05}
    pool_n = 0.1  # d pool(n, k) / dn at fixed k (0.1 n + 0.05 k)
    expected = [slope["mlp"] + slope["pool_k"] + slope["attn_2_4"] * 0 + 0.8 + pool_n,  # next attn at 5: (4,6)
                slope["mlp"] + slope["pool_k"] + slope["attn_2_4"] + pool_n,
                slope["mlp"] + slope["pool_k"]]
    for block, want in zip(model.blocks, expected):
        assert torch.allclose(block.retention.grad, torch.full((8,), want / unmodified, dtype=torch.float32))
    # PoWER-BERT's penalty weighs blocks by their index instead: 1, 2, 3.
    model.zero_grad()
    retention_penalty(model, 1.0).backward()
    assert [float(b.retention.grad[0]) for b in model.blocks] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("pull", [0.5, 0.005, -0.05])
def test_the_strength_adjusts_until_the_search_lands_on_the_target(pull):
    # A task loss that pulls every weight up (or down) with any strength: the search lands on the target anyway.
    costs, model, defaults = _table(), _Searched(3, 8), CostTarget(cost="gflops", fraction=0.55)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    search = TargetSearch(costs, fraction=0.55, dual_rate=defaults.dual_rate, quadratic=defaults.quadratic)
    for _ in range(200):
        loss = -pull * sum(b.retention.sum() for b in model.blocks) + search.penalty(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for block in model.blocks:
                block.retention.clamp_(0.0, 1.0)
        search.update()
    keep, landed = search.result(model)
    assert landed["target_landed"] == pytest.approx(0.55, abs=0.003)  # before any rounding
    assert landed["target_rounded"] <= 0.55 and costs.predict(keep) <= 0.55 * costs.unmodified()
    assert landed["target_rounded"] == pytest.approx(costs.predict(keep) / costs.unmodified())


def test_the_dual_grows_while_the_search_costs_more_than_the_target_and_shrinks_below_it():
    """mu moves by dual_rate * (rho - t) after each step: up while the soft list costs more than the target (every
    weight 1: rho = 1), down once it costs less (every weight 0: rho written out with ``reference.table_cost``); the
    penalty is mu * rho + w * (rho - t)^2 and ``result`` reports mu as ``target_dual``."""
    costs, model, table = _table(), _Searched(3, 8), _table().to_json()
    search = TargetSearch(costs, fraction=0.6, dual_rate=0.5, quadratic=3.0)
    search.update()  # no step measured yet: nothing moves
    assert search.dual_value() == 0.0
    for step in range(1, 4):
        penalty = search.penalty(model)
        assert float(penalty) == pytest.approx(0.5 * 0.4 * (step - 1) * 1.0 + 3.0 * 0.4 ** 2, rel=1e-6)
        search.update()
        assert search.dual_value() == pytest.approx(0.5 * 0.4 * step)  # grows by 0.5 * (1 - 0.6) a step
    assert search.result(model)[1]["target_dual"] == pytest.approx(0.6)
    with torch.no_grad():
        for block in model.blocks:
            block.retention.zero_()
    low = table_cost(table, [0, 0, 0]) / table_cost(table, [8, 8, 8])
    assert low < 0.6
    for step in range(1, 3):
        search.penalty(model)
        search.update()
        assert search.dual_value() == pytest.approx(0.6 + 0.5 * (low - 0.6) * step)  # shrinks below the target


def _over(ratio: float, calls: list[list[int]], reference_ms: float = 2.5):
    """A machine on which every list measures ``ratio`` of the unmodified model, which takes ``reference_ms``; it
    appends each list to ``calls``."""
    def measure(table: CostModel, keep: list[int]) -> tuple[SpeedRatio, str]:
        calls.append(list(keep))
        return SpeedRatio(ratio, ratio, ratio, 8, "tolerance", 0.0, 0.0, reference_s=reference_ms / 1e3), "measured"
    return measure


def test_a_repair_rounds_again_at_most_tries_times_and_says_it_is_still_over():
    costs = _table()
    weights = [torch.linspace(1.0, 0.2, 8, dtype=torch.float64) for _ in range(3)]
    keep = round_keep(weights, costs, 0.7 * costs.unmodified())
    for tries in (0, 1, 2, 3):
        calls: list[list[int]] = []
        repair = repair_keep(weights, costs, 0.7, keep, _over(0.75, calls), tries=tries)
        assert repair.tries == tries and len(calls) == 1 + tries and calls[0] == keep
        assert repair.measured == repair.first == 0.75 and repair.searched == keep
        assert repair.status == f"still over the target after {tries} repair(s): measured"
    calls = []
    assert repair_keep(weights, costs, 0.7, keep, _over(0.75, calls)).tries == 3 and len(calls) == 4  # the default
    # A list that measures under the target: no repair.
    calls = []
    fine = repair_keep(weights, costs, 0.7, keep, _over(0.65, calls))
    assert (fine.keep, fine.tries, fine.measured, fine.status, len(calls)) == (keep, 0, 0.65, "measured", 1)
    exactly = repair_keep(weights, costs, 0.7, keep, _over(0.7, []))  # on the target is not over it
    assert exactly.tries == 0 and exactly.status == "measured"


def test_a_repair_stops_at_the_first_list_under_the_target():
    costs = _table()
    weights = [torch.linspace(1.0, 0.2, 8, dtype=torch.float64) for _ in range(3)]
    keep = round_keep(weights, costs, 0.7 * costs.unmodified())
    ratios, calls = iter([0.9, 0.8, 0.68, 0.5]), []

    def improving(table: CostModel, keep: list[int]) -> tuple[float, str]:
        calls.append(list(keep))
        return next(ratios), "measured"

    repair = repair_keep(weights, costs, 0.7, keep, improving, tries=3)
    assert repair.tries == 2 and len(calls) == 3 and repair.measured == 0.68 and repair.first == 0.9
    assert repair.status == "measured" and repair.keep == calls[-1]
    # Each retry's limit is the last one times target / measured: 0.7 U * (0.7 / 0.9) * (0.7 / 0.8).
    limit = 0.7 * costs.unmodified() * (0.7 / 0.9) * (0.7 / 0.8)
    assert table_cost(costs.to_json(), repair.keep) <= limit + 1e-9


def test_a_tighter_limit_that_no_list_fits_is_reported_and_the_list_kept():
    costs = _table()
    weights = [torch.linspace(1.0, 0.2, 8, dtype=torch.float64) for _ in range(3)]
    keep = round_keep(weights, costs, 0.7 * costs.unmodified())
    calls: list[list[int]] = []
    # 0.7 * 0.7 / 5 = 0.098 of the unmodified model: below every list's cost (the cheapest is about 0.39)
    assert cheapest_fraction(costs) > 0.7 * 0.7 / 5
    repair = repair_keep(weights, costs, 0.7, keep, _over(5.0, calls))
    assert (repair.keep, repair.searched, repair.measured, repair.first, repair.tries) == (keep, keep, 5.0, 5.0, 1)
    assert repair.status == "over the target (5.000 > 0.700) and no list fits a tighter limit; measured"
    assert len(calls) == 1


# A key as `pipeline bench blocks` writes it (cost.TABLE_KEY_FIELDS), of PoWER-BERT on the DEMO model.
POWERBERT_KEY = {"model": "deit_tiny_patch16_224", "img_size": 28, "patch_size": 4, "embed_dim": 32, "depth": 4,
                 "num_heads": 2, "num_classes": 10, "patch_embed": "conv", "method": "powerbert",
                 "options": {"significance": "eq4"}, "batch": 1, "dtype": "fp32", "compile": "none", "threads": 1,
                 "device_type": "cpu", "clock": "cpu", "kernel_choice": {}}


def _latency_table(path: Path, key: dict) -> Path:
    """A hand-made table for the DEMO model (N = 49, 4 blocks, 1 prefix token), saved at ``path``."""
    from pipeline.cost import save_cost_model

    table = CostModel("ms", num_tokens=49, prefix=1, depth=4, fixed=0.5, attn=Curve((0, 49), (1.0, 3.0)),
                      mlp=Curve((0, 49), (0.5, 2.5)), pool=PoolSurface((49,), (Curve((0, 49), (0.2, 0.4)),)), key=key)
    return save_cost_model(table, path)


def test_a_latency_targets_cost_model_is_its_table_checked_against_the_model_and_its_hash(tmp_path):
    from pipeline.cost import file_sha256, load_cost_model

    model = create_model("deit_tiny_patch16_224", **DEMO)
    path = _latency_table(tmp_path / "t.json", POWERBERT_KEY)
    target = CostTarget(cost="latency", fraction=0.5, table=str(path))
    assert target_cost_model(target, model) == load_cost_model(path)
    digest = file_sha256(path)
    assert target_cost_model(target.model_copy(update={"table_sha256": digest}), model) == load_cost_model(path)
    changed = target.model_copy(update={"table_sha256": "0" * 64})
    with pytest.raises(InputError, match=rf"the cost table {path} changed since this K search was planned \(sha256 "
                                         r"000000000000\.\.\.\); rerun `pipeline run` so that the stage's "
                                         r"identity follows it$"):
        target_cost_model(changed, model)
    wide = _latency_table(tmp_path / "wide.json", {**POWERBERT_KEY, "embed_dim": 64})
    with pytest.raises(InputError, match=rf"the cost table {wide} times width 64; this model is 32 wide"):
        target_cost_model(CostTarget(cost="latency", fraction=0.5, table=str(wide)), model)
    unkeyed = _latency_table(tmp_path / "unkeyed.json", {k: v for k, v in POWERBERT_KEY.items() if k != "embed_dim"})
    with pytest.raises(InputError, match=rf"^the cost table {unkeyed}'s key: embed_dim: missing; measure it again "
                                         r"with `pipeline bench blocks`, which records them$"):
        target_cost_model(CostTarget(cost="latency", fraction=0.5, table=str(unkeyed)), model)
    for more, says in (({"depth": 3}, "depth 3"), ({"num_tokens": 48}, "N=48"), ({"prefix": 0}, "prefix 0")):
        other = tmp_path / "other.json"
        other.write_text(json.dumps({**json.loads(path.read_text()), **more}))
        if "num_tokens" in more:  # its curves' points must stay within N
            data = json.loads(other.read_text())
            data["pool"] = {"ns": [48], "curves": [{"xs": [0, 48], "ys": [0.2, 0.4]}]}
            other.write_text(json.dumps(data))
        with pytest.raises(InputError, match=rf"the cost table {other} is for .*{says}.*; this model has N=49, depth "
                                             r"4, prefix 1"):
            target_cost_model(CostTarget(cost="latency", fraction=0.5, table=str(other)), model)


def test_a_search_built_from_a_target_takes_its_cost_model_fraction_and_rates(tmp_path):
    from pipeline.config import PoolingConfig

    model = create_model("deit_tiny_patch16_224", **DEMO)
    flops = count_flops(create_model("deit_tiny_patch16_224", **DEMO)).total
    search = TargetSearch.build(CostTarget(cost="gflops", fraction=0.5, dual_rate=2.0, quadratic=7.0), model)
    assert (search.fraction, search.dual_rate, search.quadratic, search.dual) == (0.5, 2.0, 7.0, 0.0)
    assert search.costs.unit == "gflops" and search.costs.unmodified() == pytest.approx(flops, rel=1e-12)
    by_value = TargetSearch.build(CostTarget(cost="gflops", value=flops / 4), model)
    assert by_value.fraction == pytest.approx(0.25)
    # The config's pooling options reach the count: K-Medoids on the keys (16 wide), not on the tokens (32).
    keep = [40, 20, 20, 0]
    metric = TargetSearch.build(CostTarget(cost="gflops", fraction=0.5, method="kmedoids"), model,
                                PoolingConfig(options={"kmedoids": {"cluster_on": "metric"}})).costs.predict(keep)
    counted = count_flops(create_model("deit_tiny_patch16_224", method="kmedoids", keep=keep,
                                       options={"cluster_on": "metric"}, **DEMO)).total
    assert metric == pytest.approx(counted, rel=1e-12)
    path = _latency_table(tmp_path / "t.json", POWERBERT_KEY)
    latency = TargetSearch.build(CostTarget(cost="latency", value=6.0, table=str(path)), model)
    assert latency.costs.unit == "ms" and latency.fraction == pytest.approx(
        6.0 / table_cost(json.loads(path.read_text()), [49] * 4))


def test_a_finetunes_target_cost_is_predicted_for_its_own_method_and_measured_where_it_can_be(tmp_path):
    model = create_model("deit_tiny_patch16_224", **DEMO)
    unmodified = count_flops(model).total
    keep = [40, 20, 20, 0]
    target = CostTarget(cost="gflops", fraction=0.5, method="powerbert")
    counted = count_flops(create_model("deit_tiny_patch16_224", method="kmedoids", keep=keep, **DEMO)).total
    row = target_cost(target, model, "kmedoids", keep, gflops=1.25)
    assert (row.target, row.unit, row.measured, row.status) == ("gf0.5", "gflops", 1.25, "measured (fvcore count)")
    assert row.target_cost == pytest.approx(0.5 * unmodified, rel=1e-12)
    assert row.predicted == pytest.approx(counted, rel=1e-12)  # the finetune's own method's pooling step counted
    assert target_cost(target, model, "tome", keep, gflops=1.0).predicted is None  # no closed form for ToMe

    table = json.loads(_latency_table(tmp_path / "t.json", POWERBERT_KEY).read_text())
    latency = CostTarget(cost="latency", fraction=0.8, table=str(tmp_path / "t.json"), name="lat-pb")
    full, predicted = table_cost(table, [49] * 4), table_cost(table, keep)
    other = target_cost(latency, model, "kmedoids", keep, gflops=0.0, measure=_over(0.4, []))
    assert (other.target, other.unit, other.measured) == ("lat-pb", "ms", None)
    assert other.status == "predicted (the table times powerbert, not kmedoids)"
    assert other.target_cost == pytest.approx(0.8 * full) and other.predicted == pytest.approx(predicted)
    unmeasured = target_cost(latency, model, "powerbert", keep, gflops=0.0)
    assert (unmeasured.measured, unmeasured.status) == (None, "predicted (not measured)")
    assert unmeasured.predicted == pytest.approx(predicted)
    calls: list[list[int]] = []
    measured = target_cost(latency, model, "powerbert", keep, gflops=0.0, measure=_over(0.4, calls))
    # the measured ratio times the measured unmodified model's 2.5 ms, not the table's prediction of it
    assert measured.measured == pytest.approx(0.4 * 2.5) and measured.status == "measured" and calls == [keep]
    assert full != pytest.approx(2.5) and (measured.speed_blocks, measured.speed_stop) == (8, "tolerance")
    elsewhere = target_cost(latency, model, "powerbert", keep, gflops=0.0, measure=lambda t, k: (None, "predicted"))
    assert (elsewhere.measured, elsewhere.status) == (None, "predicted")
    # a table of the finetune's method timed with other options prices it only as a prediction (run --plan refuses it)
    cls = {**POWERBERT_KEY, "options": {"significance": "cls"}}
    other = CostTarget(cost="latency", fraction=0.8, table=str(_latency_table(tmp_path / "cls.json", cls)))
    row = target_cost(other, model, "powerbert", keep, gflops=0.0, measure=_over(0.5, []))
    assert (row.measured, row.status) == (None, "predicted (the table times other options: significance='cls' != "
                                                "'eq4')")


def test_targets_are_checked_when_loaded():
    with pytest.raises(ValueError, match="fraction .* or value .* exactly one"):
        CostTarget(cost="gflops")
    with pytest.raises(ValueError, match="a latency target needs table"):
        CostTarget(cost="latency", fraction=0.5)
    with pytest.raises(ValueError, match="takes none"):
        CostTarget(cost="gflops", fraction=0.5, table="t.json")
    assert CostTarget(cost="latency", value=12, table="t.json").label == "lat12ms"
    assert CostTarget(cost="gflops", fraction=0.5).label == "gf0.5"
    assert CostTarget(cost="gflops", fraction=0.5, name="gf0.5-tome").label == "gf0.5-tome"
    with pytest.raises(ValueError, match="name"):  # it becomes part of stage names and MLflow aliases
        CostTarget(cost="gflops", fraction=0.5, name="half of it")


@pytest.mark.slow
@pytest.mark.speed
def test_a_latency_target_is_measured_only_where_the_machine_is_the_tables_key(tmp_path):
    from dataclasses import replace

    from pipeline.bench.blocks import BlocksSettings, ModelSpec, measure_table
    from pipeline.dag.latency import measure_on_table
    from pipeline.methods import method_spec

    threads = torch.get_num_threads()
    spec = ModelSpec("deit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                     num_classes=4)
    settings = BlocksSettings(spec, "powerbert", method_spec("powerbert").resolve("powerbert", {}), batch=2, step=8,
                              warmup=1, repeats=2, min_sample_s=0.0, threads=1,
                              anchor_tolerance=LOOSE_TOLERANCE, anchor_cap_s=HANG_S)
    table, _ = measure_table(settings, tmp_path / "table.json", log=lambda _: None)
    torch.set_num_threads(threads)
    ratio, status = measure_on_table(table, [8, 8], log=lambda _: None, speed=LOOSE)
    assert ratio is not None and 0 < ratio.low <= ratio.ratio <= ratio.high and status.startswith("measured (paired")
    assert ratio.blocks >= 8 and f"{ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]" in status
    assert torch.get_num_threads() == threads  # the table's threads for the measurement only
    elsewhere = replace(table, key={**table.key, "device": "another CPU"})
    ratio, status = measure_on_table(elsewhere, [8, 8], log=lambda _: None)
    assert ratio is None and "device: 'another CPU' != " in status and status.startswith("predicted")


def test_a_list_that_measures_over_the_target_is_repaired():
    costs = _table()
    weights = [torch.linspace(1.0, 0.2, 8, dtype=torch.float64) for _ in range(3)]
    keep = round_keep(weights, costs, 0.7 * costs.unmodified())

    def slower_pooling(table: CostModel, keep: list[int]) -> tuple[float, str]:
        """A machine whose pooling steps take 6x the table's time (written out, not the table's predict)."""
        total, n = table.fixed, table.num_tokens
        for k in keep:
            total += table.attn(n) + table.mlp(k) + (6 * table.pool(n, k) if 0 < k < n else 0.0)
            n = k
        return total / table.unmodified(), "measured"

    assert slower_pooling(costs, keep)[0] > 0.7  # the rounding's list misses the target on this machine
    repair = repair_keep(weights, costs, 0.7, keep, slower_pooling)
    assert repair.searched == keep and repair.keep != keep and repair.tries >= 1 and repair.first > 0.7
    assert repair.measured == slower_pooling(costs, repair.keep)[0] <= 0.7
    unmeasured = repair_keep(weights, costs, 0.7, keep, lambda table, keep: (None, "predicted (another machine)"))
    assert unmeasured.keep == keep and unmeasured.measured is None and unmeasured.status.startswith("predicted")


def test_the_retention_weights_come_back_from_a_checkpoint_in_block_order(tmp_path):
    from pipeline.dag.latency import retention_weights

    weights = {f"blocks.blocks.{i}.retention": torch.full((4,), i / 12) for i in range(12)}  # 10 sorts before 2 as text
    torch.save({"model": {"pos_embed": torch.zeros(1), **dict(reversed(list(weights.items())))}},
               tmp_path / "checkpoint.pt")
    assert [float(w[0]) for w in retention_weights(str(tmp_path))] == pytest.approx([i / 12 for i in range(12)])


def test_the_gflops_of_clustering_on_the_metric_equal_fvcores_count():
    """``cluster_on: metric`` builds K-Medoids' Gram matrix on the keys averaged over heads (DeiT-S: 64 wide, not
    384): the count follows the option, as fvcore counts the model that runs it."""
    keep = [196, 152, 152, 120, 88, 88, 64, 40, 40, 24, 8, 0]  # on the model's points (every 8th count, and N)
    for options in ({"cluster_on": "metric"}, {"cluster_on": "tokens"}):
        model = create_model("deit_small_patch16_224", method="kmedoids", keep=keep, options=options)
        counted = count_flops(model).total
        assert gflops_cost_model(model, "kmedoids", options=options).predict(keep) == pytest.approx(counted, rel=1e-9)
    metric = gflops_cost_model(model, "kmedoids", options={"cluster_on": "metric"}).predict(keep)
    assert metric < counted  # the tokens' Gram matrices cost more


def test_the_options_that_change_a_gflops_count_enter_the_k_searchs_identity():
    from pipeline.config import load_config
    from pipeline.config.identity import identity_content

    def search(*more: str) -> dict:
        config = load_config(ROOT / "configs" / "train" / "tiny_synthetic.yaml",
                             ["train.mode=ksearch", "train.ksearch_target={cost: gflops, fraction: 0.5, method: "
                              "kmedoids}", *more])
        return identity_content(config)

    tokens, metric = search(), search("pooling.options.kmedoids.cluster_on=metric")
    assert tokens["pooling"] == {"counted": {"cluster_on": "tokens"}}
    assert metric["pooling"] == {"counted": {"cluster_on": "metric"}} and metric != tokens
    # an option that does not change the count does not enter it, nor does another method's
    assert search("pooling.options.kmedoids.iters=9") == tokens
    assert search("pooling.options.wkmedoids.cluster_on=metric") == tokens


@pytest.mark.slow
def test_run_plan_refuses_a_target_below_the_cheapest_list_naming_its_fraction(tmp_path):
    import subprocess
    import sys

    from pipeline.cost import load_cost_model
    from pipeline.targets import cheapest_fraction

    table = ("configs/latency/amd-epyc/deit_tiny_patch16_224-m32-d4-28px-p4/"
             "wkmedoids-b64-fp32-none-t1-cpuclock.json")  # the demo's latency target's table
    cheapest = cheapest_fraction(load_cost_model(ROOT / table))
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "configs/experiments/demo.yaml", "--plan",
                           "--set", f"experiment.ksearch_targets=[{{cost: latency, fraction: 0.02, table: {table}, "
                           "methods: [wkmedoids], archs: [M32]}]", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert (f"lat0.02 (M32): 0.02 of the unmodified model is below the cheapest keep list the cost table {table} "
            f"allows, {cheapest:.4f}") in lines[0]
    assert 0.02 < cheapest < 0.8 and not (tmp_path / "m.db").exists()  # nothing ran, no store was made


def test_a_list_is_repaired_only_when_its_interval_is_over_the_target():
    """A paired measurement's lower end decides: a list whose ratio is over the target but whose interval reaches under
    it is kept; one whose interval is wholly over it is repaired."""
    from types import SimpleNamespace

    costs = _table()
    weights = [torch.linspace(1.0, 0.2, 8, dtype=torch.float64) for _ in range(3)]
    keep = round_keep(weights, costs, 0.7 * costs.unmodified())
    doubtful = repair_keep(weights, costs, 0.7, keep, lambda t, k: (SimpleNamespace(ratio=0.72, low=0.69, high=0.75),
                                                                    "measured"))
    assert doubtful.keep == keep and doubtful.tries == 0 and (doubtful.low, doubtful.high) == (0.69, 0.75)
    calls = []

    def over(table: CostModel, k: list[int]) -> tuple[SimpleNamespace, str]:
        calls.append(k)
        return SimpleNamespace(ratio=0.74, low=0.71, high=0.77), "measured"

    repaired = repair_keep(weights, costs, 0.7, keep, over, tries=2)
    assert repaired.tries == 2 and len(calls) == 3 and repaired.keep != keep  # at most `tries` roundings
    assert repaired.status.startswith("still over the target after 2 repair(s)")


def test_the_gflops_model_takes_its_points_key_and_head_from_the_model():
    """Points at every count up to 64 tokens and every 8th beyond (and N); a model without a head counts none; the
    key names the model, its width, the method and only the options that change the count; all against fvcore."""
    from pipeline.flops import grid

    assert grid(20, 8) == [0, 8, 16, 20] and grid(16, 8) == [0, 8, 16] and grid(3, 1) == [0, 1, 2, 3]
    tiny = {**DEMO, "depth": 2}
    for img, points in ((28, list(range(50))), (32, list(range(65))), (36, [*range(0, 81, 8), 81])):
        model = create_model("deit_tiny_patch16_224", **{**tiny, "img_size": img})
        costs = gflops_cost_model(model, "powerbert")
        assert list(costs.attn.xs) == list(costs.mlp.xs) == list(costs.pool.ns) == points
    keep = [40, 20]
    for head in (10, 0):
        model = create_model("deit_tiny_patch16_224", method="kmedoids", keep=keep, **{**tiny, "num_classes": head})
        counted = count_flops(model).total
        assert gflops_cost_model(model, "kmedoids").predict(keep) == pytest.approx(counted, rel=1e-12, abs=0)
    costs = gflops_cost_model(model, "kmedoids", options={"cluster_on": "metric", "iters": 3})
    assert costs.key == {"model": "VisionTransformer", "embed_dim": 32, "method": "kmedoids",
                         "options": {"cluster_on": "metric"}}
    assert gflops_cost_model(model, "powerbert").key["options"] == {}
    assert gflops_cost_model(model, "kmedoids").key["options"] == {"cluster_on": "tokens"}
    with pytest.raises(InputError, match=r"^no closed-form GFLOPs count of method 'tome''s pooling step \(its "
                                         r"MethodSpec has no flops\); give a latency target with a cost table, "
                                         r"or one of importance, kmedoids, "
                                         r"powerbert, random, wkmedoids$"):
        gflops_cost_model(model, "tome")


def test_the_config_options_of_the_targets_own_method_reach_its_count_and_the_prediction():
    """The pooling section's options are taken for the method named, not for the section's own method: with
    ``pooling.method: tome`` (which matches on the keys by default) K-Medoids still clusters the tokens."""
    from pipeline.config import PoolingConfig

    model = create_model("deit_tiny_patch16_224", **DEMO)
    keep = [40, 20, 20, 0]
    tokens = count_flops(create_model("deit_tiny_patch16_224", method="kmedoids", keep=keep, **DEMO)).total
    metric = count_flops(create_model("deit_tiny_patch16_224", method="kmedoids", keep=keep,
                                      options={"cluster_on": "metric"}, **DEMO)).total
    target = CostTarget(cost="gflops", fraction=0.5, method="kmedoids")
    for pooling, want in ((PoolingConfig(method="tome"), tokens),
                          (PoolingConfig(options={"kmedoids": {"cluster_on": "metric"}}), metric)):
        assert target_cost_model(target, model, pooling).predict(keep) == pytest.approx(want, rel=1e-12, abs=0)
        assert TargetSearch.build(target, model, pooling).costs.predict(keep) == pytest.approx(want, rel=1e-12, abs=0)
        row = target_cost(target, model, "kmedoids", keep, gflops=1.0, pooling=pooling)
        assert row.predicted == pytest.approx(want, rel=1e-12, abs=0)
    unmodified = count_flops(model).total
    by_value = target_cost(CostTarget(cost="gflops", value=0.002), model, "powerbert", keep, gflops=1.0)
    assert by_value.target_cost == pytest.approx(0.002) and by_value.target == "gf0.002g" and unmodified > 0.002


def test_a_latency_targets_row_carries_the_measured_interval_and_the_measure_gets_the_table(tmp_path):
    from types import SimpleNamespace

    from pipeline.cost import load_cost_model

    model = create_model("deit_tiny_patch16_224", **DEMO)
    keep = [40, 20, 20, 0]
    path = _latency_table(tmp_path / "t.json", POWERBERT_KEY)
    table = json.loads(path.read_text())
    full = table_cost(table, [49] * 4)
    seen = []

    def paired(costs: CostModel, keep: list[int]) -> tuple[SimpleNamespace, str]:
        seen.append((costs, list(keep)))
        return SpeedRatio(0.4, 0.35, 0.45, 40, "wider", 0.0, 1.0, reference_s=0.003), "measured (paired)"

    row = target_cost(CostTarget(cost="latency", value=6.0, table=str(path)), model, "powerbert", keep, gflops=0.0,
                      measure=paired)
    assert seen == [(load_cost_model(path), keep)]
    assert (row.target, row.unit, row.status) == ("lat6ms", "ms", "measured (paired)")
    assert row.target_cost == pytest.approx(6.0) and row.predicted == pytest.approx(table_cost(table, keep))
    assert (row.measured, row.measured_low, row.measured_high) == (pytest.approx(0.4 * 3.0), pytest.approx(0.35 * 3.0),
                                                                   pytest.approx(0.45 * 3.0))  # of the measured 3 ms
    assert (row.speed_blocks, row.speed_stop, row.speed_half_width) == (40, "wider", pytest.approx(0.05 / 0.4))
    assert full != pytest.approx(3.0)


def test_a_repair_that_no_tighter_limit_fits_reports_the_measured_interval():
    from types import SimpleNamespace

    costs = _table()
    weights = [torch.linspace(1.0, 0.2, 8, dtype=torch.float64) for _ in range(3)]
    keep = round_keep(weights, costs, 0.7 * costs.unmodified())
    repair = repair_keep(weights, costs, 0.7, keep, lambda t, k: (SimpleNamespace(ratio=5.0, low=4.5, high=5.5), "m"))
    assert (repair.keep, repair.tries, repair.measured, repair.first, repair.low, repair.high) == (
        keep, 1, 5.0, 5.0, 4.5, 5.5)
    assert repair.status == "over the target (5.000 > 0.700) and no list fits a tighter limit; m"


def test_the_soft_keep_list_is_the_running_minimum_of_the_retained_masses():
    """Each block's expected count is its retained mass, but never above the block before it (a block cannot keep
    tokens the one before dropped): masses 3, 5, 2, 4 give 3, 3, 2, 2."""
    from pipeline.targets import retentions, soft_keep

    masses = (3.0, 5.0, 2.0, 4.0)
    weights = [torch.full((8,), m / 8, dtype=torch.float64) for m in masses]
    assert soft_keep(weights).tolist() == pytest.approx([3.0, 3.0, 2.0, 2.0])
    with pytest.raises(InputError, match=r"^the model has no soft-extract layers; apply_downsampling\(\.\.\., "
                                         r"soft_extract=True\)$"):
        retentions(create_model("deit_tiny_patch16_224", **DEMO))
    model = _Searched(2, 4)
    with torch.no_grad():
        model.blocks[0].retention.copy_(torch.tensor([1.5, 0.5, -0.5, 1.0]))  # clamped to [0, 1]
    assert [w.tolist() for w in retentions(model)] == [[1.0, 0.5, 0.0, 1.0], [1.0] * 4]


def test_the_search_result_names_its_target_and_the_candidates_start_at_one_without_prefix_tokens():
    costs, model = _table(), _Searched(3, 8)
    search = TargetSearch(costs, fraction=0.9, dual_rate=1.0, quadratic=0.0)
    keep, landed = search.result(model)
    assert sorted(landed) == ["target", "target_dual", "target_landed", "target_rounded"]
    assert landed["target"] == 0.9 and landed["target_landed"] == pytest.approx(1.0) and landed["target_dual"] == 0
    no_prefix = CostModel("ms", num_tokens=6, prefix=0, depth=2, fixed=0.0, attn=Curve((0, 6), (1.0, 2.0)),
                          mlp=Curve((0, 6), (1.0, 2.0)), pool=PoolSurface((6,), (Curve((0, 6), (0.1, 0.2)),)))
    assert candidates(no_prefix) == [1, 2, 3, 4, 5, 6]  # no token left at all is no model
    assert candidates(replace(no_prefix, prefix=2)) == [0, 1, 2, 3, 4, 5, 6]  # the prefix tokens go on alone


def test_the_rounding_keeps_the_most_mass_whatever_the_tables_unit():
    """The same table in ms and in ns (1e6 times the figures): the rounding keeps the brute force's most mass in
    both, so the tie rule's share of the cost never outweighs a mass."""
    generator = torch.Generator().manual_seed(5)
    for scale in (1e-6, 1.0, 1e6):
        costs = _table(scale)
        for _ in range(4):
            weights = [torch.rand(8, generator=generator, dtype=torch.float64) for _ in range(3)]
            for fraction in (0.5, 0.8):
                limit = fraction * costs.unmodified()
                keep = round_keep(weights, costs, limit)
                mass, _ = _brute_force(weights, costs, limit)
                assert sum(float(w[:k].sum()) for w, k in zip(weights, keep)) == pytest.approx(mass, rel=1e-9)


@pytest.mark.parametrize(("option", "value", "differs"), [("iters", 10, "iters=5 != 10"),
                                                          ("significance", "cls", "significance='eq4' != 'cls'")])
def test_run_plan_refuses_a_latency_target_priced_on_a_table_of_other_options(tmp_path, capsys, option, value, differs):
    """A shipped table timed WK-Medoids at its defaults; a finetune with other options (``iters`` and ``significance``
    change latency where they do not change GFLOPs) is not priced by it: `run --plan` refuses in one line naming the
    option and the table."""
    from pipeline.cli import main
    from pipeline.config import load_config
    from pipeline.cost import load_cost_model
    from pipeline.targets import option_differences

    table = ("configs/latency/amd-epyc/deit_tiny_patch16_224-m32-d4-28px-p4/"
             "wkmedoids-b64-fp32-none-t1-cpuclock.json")
    setting = f"pooling.options.wkmedoids.{option}={value}"
    shipped = (f"experiment.ksearch_targets=[{{cost: latency, fraction: 0.8, table: {table}, methods: [wkmedoids], "
               "archs: [M32]}]")
    assert main(["run", "configs/experiments/demo.yaml", "--plan", "--set", setting, "--set", shipped,
                 "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"the cost table {table} timed wkmedoids with other options than its finetunes run (table's != config's: " \
           f"{differs})" in line, line
    assert not (tmp_path / "m.db").exists()
    pooling = load_config(ROOT / "configs" / "experiments" / "demo.yaml", [setting]).pooling
    costs = load_cost_model(ROOT / table)
    assert option_differences(costs, "wkmedoids", pooling) == [differs]
    assert option_differences(costs, "wkmedoids", None) == []
    assert option_differences(costs, "powerbert", pooling) == ["method='wkmedoids' != 'powerbert'"]


@pytest.mark.parametrize("setting", ["pooling.options.wkmedoids.iters=10", "pooling.options.wkmedoids.iters=5"])
def test_run_plan_refuses_a_latency_target_whose_finetunes_run_another_method_than_its_table(tmp_path, capsys,
                                                                                               setting):
    """A PoWER-BERT table times none of WK-Medoids' pooling step, at ``iters=10`` or at its default: a target whose
    finetunes run WK-Medoids on it is refused as one on a WK-Medoids table of other options is, naming both methods."""
    from pipeline.cli import main

    table = _latency_table(tmp_path / "powerbert.json", POWERBERT_KEY)
    target = (f"experiment.ksearch_targets=[{{cost: latency, fraction: 0.8, table: {table}, methods: [wkmedoids], "
              "archs: [M32]}]")
    assert main(["run", "configs/experiments/demo.yaml", "--plan", "--set", setting, "--set", target,
                 "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: experiment.ksearch_targets lat0.8 (M32): the cost table {table} timed powerbert, not "
                    "wkmedoids, which the target's finetunes run (table's != config's: method='powerbert' != "
                    "'wkmedoids'); give the target methods: [powerbert], or measure a table of wkmedoids (`pipeline "
                    "bench blocks`) for a target of its own"), line


@pytest.mark.slow
@pytest.mark.speed
def test_a_latency_target_of_table_auto_measures_this_machines_table_before_the_k_search(tmp_path, restore_threads):
    """``table: auto``: `run --plan` plans the K search without the table (no content for its id yet); `pipeline run`'s
    prepare step measures this machine's table of the target's method in the evaluate stage's setting, under the runs
    folder by its key, once; the K search's id then follows its content, and a keep list is measured on it (this
    machine is its key), not only predicted."""
    from pipeline.bench.blocks import device_name
    from pipeline.config import load_config
    from pipeline.cost import file_sha256, load_cost_model
    from pipeline.dag.latency import measure_on_table, prepare_tables
    from pipeline.dag.plan import archs, base_stage, ksearch_stages

    tiny = ROOT / "configs" / "experiments" / "tiny.yaml"
    auto = ["experiment.embed_dims=[16]", f"experiment.runs_dir={tmp_path}",
            "experiment.ksearch_targets=[{cost: latency, fraction: 0.9, table: auto, methods: [powerbert]}]"]
    config = load_config(tiny, auto)
    arch = archs(config)[0]

    def target():
        return ksearch_stages(config, arch, base_stage(config, arch))[-1].config.train.ksearch_target

    planned = target()
    path = Path(planned.table)
    assert planned.table_sha256 is None and path.parent == tmp_path / "latency-tables" and not path.exists()
    assert path.name.startswith("M16-powerbert-") and path.is_absolute()  # Tune trials run in folders of their own
    relative = load_config(tiny, [*auto[:1], "experiment.runs_dir=runs/x", auto[2]])
    assert Path(ksearch_stages(relative, arch, base_stage(relative, arch))[-1].config.train.ksearch_target.table) \
        .is_relative_to(Path.cwd() / "runs" / "x")
    lines: list[str] = []
    prepare_tables(config, log=lines.append)
    assert lines[0] == (f"[latency] lat0.9 (M16): measuring this machine's table of powerbert (table: auto) into "
                        f"{path}") and any(line.startswith("[blocks] ") for line in lines)
    table = load_cost_model(path)
    key = table.key
    assert (key["device"], key["method"], key["batch"], key["threads"], key["clock"], key["embed_dim"]) == (
        device_name(torch.device("cpu")), "powerbert", 8, 1, "cpu", 16)  # tiny.yaml's evaluation setting
    assert target().table_sha256 == file_sha256(path)
    again: list[str] = []
    prepare_tables(config, log=again.append)
    assert again == []  # measured once, kept under its key
    ratio, status = measure_on_table(table, [12, 8, 4], speed=LOOSE)
    assert ratio is not None and status.startswith("measured (paired"), status
    from pipeline.dag.checks import check_auto_tables

    with pytest.raises(InputError, match=r"^experiment.ksearch_targets lat0.9: table: auto measures the driver's own "
                                         r"device, but this run uses the Ray cluster at ray://head:10001"):
        check_auto_tables(config, "ray://head:10001")
    check_auto_tables(config, None)
    with pytest.raises(InputError, match=r"lat0.9: table: auto measures one table, of the method its finetunes run; "
                                         r"give methods: \[METHOD\]"):
        ksearch_stages(load_config(tiny, [*auto[:2], "experiment.ksearch_targets=[{cost: latency, fraction: 0.9, "
                                          "table: auto}]"]), arch, base_stage(config, arch))


def test_a_damaged_table_auto_is_planned_as_not_measured_and_measured_again_by_run(tmp_path, monkeypatch):
    """A ``table: auto`` file that does not load (a write cut short) blocks no run: `run --plan` plans the K search as
    for a table not measured yet (no content for its id), the target checks skip it, and `pipeline run`'s prepare
    step measures it again into its path, saying so."""
    import pipeline.bench.blocks as blocks
    from pipeline.config import load_config
    from pipeline.dag.latency import prepare_tables
    from pipeline.dag.plan import archs, base_stage, check_targets, ksearch_stages

    config = load_config(ROOT / "configs" / "experiments" / "tiny.yaml", [
        "experiment.embed_dims=[16]", f"experiment.runs_dir={tmp_path}",
        "experiment.ksearch_targets=[{cost: latency, fraction: 0.9, table: auto, methods: [powerbert]}]"])
    arch = archs(config)[0]
    path = Path(ksearch_stages(config, arch, base_stage(config, arch))[-1].config.train.ksearch_target.table)
    path.parent.mkdir(parents=True)
    path.write_text('{"attn": {"xs": [0, 8')  # half a table
    assert ksearch_stages(config, arch, base_stage(config, arch))[-1].config.train.ksearch_target.table_sha256 is None
    check_targets(config)  # not refused on reading it
    measured: list[Path] = []
    monkeypatch.setattr(blocks, "measure_table", lambda settings, out, log: measured.append(out))
    lines: list[str] = []
    prepare_tables(config, log=lines.append)
    assert measured == [path]
    assert lines == [f"[latency] lat0.9 (M16): measuring this machine's table of powerbert (table: auto) into {path} "
                     "again: the file there does not load as a table of this release"]


@pytest.mark.parametrize("field, value, says", [
    ("options", None, r"options: Input should be a valid dictionary \(got None\)"),
    ("options", ["iters", 5], r"options: Input should be a valid dictionary \(got \['iters', 5\]\)"),
    ("options", "iters=5", r"options: Input should be a valid dictionary \(got 'iters=5'\)"),
    ("method", None, r"method: Input should be a valid string \(got None\)"),
    ("method", "powerbrt", r"method: unknown downsampling method 'powerbrt'; choose one of .*"),
    ("embed_dim", "32", r"embed_dim: Input should be a valid integer \(got '32'\)"),
    ("batch", True, r"batch: Input should be a valid integer \(got True\)"),
    ("kernel_choice", None, r"kernel_choice: Input should be a valid dictionary \(got None\)"),
])
def test_a_latency_tables_key_field_of_another_type_is_one_error_naming_the_file_and_field(tmp_path, field, value,
                                                                                            says):
    """What `run --plan` reads of a table's key (``cost.TableKey``) is typed: a null, list or string where the options
    go, a null or unknown method, a width given as text, are each one InputError naming the table and the field and
    saying to measure it again, never a traceback or a message that reads "times width 32; this model is 32 wide"."""
    model = create_model("deit_tiny_patch16_224", **DEMO)
    path = _latency_table(tmp_path / "t.json", {**POWERBERT_KEY, field: value})
    with pytest.raises(InputError, match=rf"^the cost table {path}'s key: {says}; measure it again with `pipeline "
                                         r"bench blocks`, which records them$"):
        target_cost_model(CostTarget(cost="latency", fraction=0.5, table=str(path)), model)


@pytest.mark.slow  # `run --plan` of the demo, its operators probed: seconds
def test_run_plan_says_a_table_auto_target_is_checked_once_its_table_is_measured_and_run_refuses_it_then(
        tmp_path, capsys, monkeypatch):
    """`run --plan` cannot check a ``table: auto`` target against a table not measured yet: it says so, and that
    `pipeline run` checks it once it has measured the table; there, an impossible target (0.02) is refused before any K
    search (``check_targets`` after the tables are prepared), as for a table given by path."""
    from pipeline.cli import main
    from pipeline.config import load_config
    from pipeline.cost import save_cost_model
    from pipeline.dag.plan import archs, base_stage, check_targets, ksearch_stages
    from pipeline.flops import gflops_cost_model
    from pipeline.methods import method_spec
    from pipeline.train.build import build_model

    monkeypatch.chdir(ROOT)
    demo = "configs/experiments/demo.yaml"  # its lat0.8 target is table: auto, of wkmedoids on M32
    auto = [f"experiment.runs_dir={tmp_path}", "experiment.ksearch_targets=[{cost: latency, fraction: 0.02, "
            "table: auto, methods: [wkmedoids], archs: [M32]}]"]
    assert main(["run", demo, "--plan", *(f"--set={o}" for o in auto),
                 "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 0
    config = load_config(demo, auto)
    arch = next(a for a in archs(config) if a.label == "M32")
    stage = ksearch_stages(config, arch, base_stage(config, arch))[-1]
    path = Path(stage.config.train.ksearch_target.table)
    said = [line for line in capsys.readouterr().err.splitlines() if "lat0.02" in line]
    assert said == [f"[plan] experiment.ksearch_targets lat0.02 (M32): table: auto is not measured on this machine yet "
                    f"({path}): `pipeline run` measures it first, then checks the target against it (one below the "
                    "cheapest keep list the table allows is refused then, before any K search starts)"], said
    with torch.device("meta"):
        model = build_model(stage.config)
    measured = gflops_cost_model(model, "wkmedoids", step=4)  # a table of the model's shape, in place of measuring
    options = method_spec("wkmedoids").resolve("wkmedoids", config.pooling.method_options("wkmedoids") or {})
    save_cost_model(replace(measured, unit="ms", key={**POWERBERT_KEY, "method": "wkmedoids", "options": options}),
                    path)
    with pytest.raises(InputError, match=r"^experiment.ksearch_targets lat0.02 \(M32\): 0.02 of the unmodified model "
                                         r"is below the cheapest keep list the cost table .* allows"):
        check_targets(config)


def test_the_k_search_checks_speed_cap_is_a_setting_its_error_names_that_leaves_the_dag_id(tmp_path):
    """``experiment.select.check_cap_s``: the cap of a keep list's paired measurement against its table (the K-search
    check and the select stage's target rows), named where a measurement stops at it; it changes how long a check
    may take, not what the DAG is (a checked list is recorded and read back), so the DAG's id stays."""
    from pipeline.config import ConfigError, load_config
    from pipeline.dag.latency import CHECK_SPEED, check_speed
    from pipeline.dag.plan import dag_id

    tiny = ROOT / "configs" / "experiments" / "tiny.yaml"
    longer = load_config(tiny, ["experiment.select.check_cap_s=240"])
    speed = check_speed(longer.experiment.select.check_cap_s)
    assert (speed.cap_s, speed.cap_key, speed.tolerance) == (240.0, "experiment.select.check_cap_s", 0.02)
    assert (CHECK_SPEED.cap_s, CHECK_SPEED.cap_key) == (60.0, "experiment.select.check_cap_s")  # the default
    assert dag_id(longer) == dag_id(load_config(tiny))
    with pytest.raises(ConfigError, match=r"experiment.select.check_cap_s: Input should be greater than 0"):
        load_config(tiny, ["experiment.select.check_cap_s=0"])
