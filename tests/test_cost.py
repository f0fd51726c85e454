"""pipeline.cost: the piecewise-linear cost model against numpy's interpolation and a brute-force sum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cost import CostModel, Curve, PoolSurface, load_cost_model, save_cost_model
from pipeline.errors import InputError


def _model() -> CostModel:
    attn = Curve((0, 8, 16), (1.0, 3.0, 7.0))
    mlp = Curve((0, 8, 16), (0.5, 2.5, 4.5))
    pool = PoolSurface((8, 16), (Curve((0, 8), (0.2, 0.6)), Curve((0, 8, 16), (0.4, 1.0, 2.0))))
    return CostModel("ms", num_tokens=16, prefix=1, depth=3, fixed=0.25, attn=attn, mlp=mlp, pool=pool)


def test_curve_equals_numpy_interp_inside_and_holds_its_ends_outside():
    curve = Curve((4, 8, 16, 40), (3.0, 1.0, 7.0, 2.0))  # falling at both ends: a line extended past them goes below 0
    xs = np.linspace(-8, 64, 145)
    for x in xs:
        assert curve(x) == pytest.approx(np.interp(x, curve.xs, curve.ys))
    at = curve.at(torch.tensor(xs, dtype=torch.float64))
    assert at.tolist() == pytest.approx(np.interp(xs, curve.xs, curve.ys).tolist())
    assert curve(-100) == 3.0 and curve(1000) == 2.0
    single = Curve((5,), (0.7,))
    assert single(0) == single(9) == 0.7 and single.at(torch.tensor([0.0, 9.0])).tolist() == pytest.approx([0.7, 0.7])


def test_pool_surface_equals_interpolation_written_out_inside_and_outside():
    """Each measured n's curve at k (ends held), then linear in n between the two nearest n (ends held)."""
    surface = PoolSurface((8, 16, 24), (Curve((2, 6), (0.8, 0.2)), Curve((4, 8, 16), (0.4, 1.0, 0.5)),
                                        Curve((8, 20), (2.0, 0.1))))

    def by_hand(n: float, k: float) -> float:
        at_k = [np.interp(k, c.xs, c.ys) for c in surface.curves]
        return float(np.interp(n, surface.ns, at_k))

    cells = [(n, k) for n in np.linspace(0, 40, 21) for k in np.linspace(0, n, 9)]
    ns = torch.tensor([n for n, _ in cells], dtype=torch.float64)
    ks = torch.tensor([k for _, k in cells], dtype=torch.float64)
    assert surface.at(ns, ks).tolist() == pytest.approx([by_hand(n, k) for n, k in cells])
    for n, k in cells:
        assert surface(n, k) == pytest.approx(by_hand(n, k)) and surface(n, k) >= 0


def test_predict_is_the_sum_of_blocks_written_out():
    m = _model()
    # block 1: 16 -> 12 pools; block 2: 12 -> 12 keeps all (no step); block 3: 12 -> 0 slices (no step).
    pool_16_12 = 1.0 + (2.0 - 1.0) * 4 / 8
    by_hand = 0.25 + (7.0 + pool_16_12 + m.mlp(12)) + (m.attn(12) + m.mlp(12)) + (m.attn(12) + 0.5)
    assert m.predict([12, 12, 0]) == pytest.approx(by_hand)
    assert m.unmodified() == pytest.approx(0.25 + 3 * (7.0 + 4.5))


def test_expected_equals_predict_on_integers_and_its_gradient_is_the_slope():
    m = _model()
    for keep in ([16, 16, 16], [12, 12, 0], [15, 9, 3]):
        soft = torch.tensor(keep, dtype=torch.float64, requires_grad=True)
        value = m.expected(soft)
        assert float(value) == pytest.approx(m.predict(keep))
    soft = torch.tensor([16.0, 16.0, 10.0], dtype=torch.float64, requires_grad=True)
    m.expected(soft).backward()
    # The last block's count moves its MLP (slope 0.25 on [8, 16]) and its pooling step at n = 16
    # (slope (2.0 - 1.0) / 8 on the n = 16 curve's [8, 16] segment).
    assert float(soft.grad[2]) == pytest.approx(0.25 + 0.125)


def test_expected_holds_the_ends_past_a_tables_points():
    """A table whose points start at 8 tokens: the soft list's cost below them is the held value, its slope 0."""
    m = CostModel("ms", num_tokens=16, prefix=1, depth=2, fixed=0.1, attn=Curve((8, 16), (2.0, 6.0)),
                  mlp=Curve((8, 16), (1.0, 3.0)), pool=PoolSurface((16,), (Curve((8, 12), (0.4, 0.2)),)))
    soft = torch.tensor([4.0, 2.0], dtype=torch.float64, requires_grad=True)
    value = m.expected(soft)
    # block 1: attn(16) 6 + pool(16, 4) held at 0.4 + mlp(4) held at 1; block 2: attn(4) held at 2 + pool(4, 2) 0.4 + 1
    assert float(value) == pytest.approx(0.1 + (6.0 + 0.4 + 1.0) + (2.0 + 0.4 + 1.0)) == m.predict([4, 2])
    value.backward()
    assert soft.grad.tolist() == [0.0, 0.0]


def test_round_trip_and_refusals(tmp_path):
    m = _model()
    assert load_cost_model(save_cost_model(m, tmp_path / "t.json")) == m
    keyed = CostModel("ms", 16, 1, 3, 0.25, m.attn, m.mlp, m.pool, key={"device": "a CPU", "threads": 1},
                      predicted=True)
    again = load_cost_model(save_cost_model(keyed, tmp_path / "keyed.json"))
    assert again.key == {"device": "a CPU", "threads": 1} and again.predicted is True
    with pytest.raises(InputError, match="non-increasing"):
        m.predict([12, 14, 0])
    with pytest.raises(InputError, match="no cost table"):
        load_cost_model(tmp_path / "missing.json")
    with pytest.raises(InputError, match="increase strictly"):
        Curve((0, 0), (1.0, 2.0))


def _shipped_tables() -> list[Path]:
    return sorted((Path(__file__).resolve().parents[1] / "configs" / "latency").rglob("*.json"))


@pytest.mark.parametrize("path", _shipped_tables(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_table_costs_at_least_zero_wherever_the_rounding_reaches(path):
    """Every block and every pooling step the rounding can choose (``candidates``: n received, k kept <= n) costs
    at least 0, so that dropping a partial list over the limit (``round_keep``) is exact."""
    from pipeline.targets import candidates

    table = load_cost_model(path)
    counts = candidates(table)
    assert min(table.block(n, k) for n in counts for k in counts if k <= n) >= 0
    assert min(table.pool(n, k) for n in counts for k in counts if 0 < k < n) >= 0
