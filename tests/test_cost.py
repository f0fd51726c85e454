"""pipeline.cost: the piecewise-linear cost model against numpy's interpolation and a brute-force sum."""

from __future__ import annotations

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


def test_curve_equals_numpy_interp_inside_the_range():
    curve = Curve((0, 8, 16, 40), (1.0, 3.0, 7.0, 8.0))
    for x in np.linspace(0, 40, 97):
        assert curve(x) == pytest.approx(np.interp(x, curve.xs, curve.ys))
        assert float(curve.at(torch.tensor(x, dtype=torch.float64))) == pytest.approx(np.interp(x, curve.xs, curve.ys))


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


def test_round_trip_and_refusals(tmp_path):
    m = _model()
    assert load_cost_model(save_cost_model(m, tmp_path / "t.json")) == m
    with pytest.raises(InputError, match="non-increasing"):
        m.predict([12, 14, 0])
    with pytest.raises(InputError, match="no cost table"):
        load_cost_model(tmp_path / "missing.json")
    with pytest.raises(InputError, match="increase strictly"):
        Curve((0, 0), (1.0, 2.0))
