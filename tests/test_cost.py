"""pipeline.cost: the piecewise-linear cost model against numpy's interpolation and a brute-force sum."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cost import (
    MACHINE_FIELDS,
    CostModel,
    Curve,
    PoolSurface,
    check_key,
    key_differences,
    load_cost_model,
    save_cost_model,
)
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


def test_the_tensor_forms_keep_the_inputs_dtype_and_float64_precision():
    """A K search evaluates the cost in float64 (``TargetSearch.ratio``): the curves' figures enter it at full
    precision, not rounded to float32 on the way; float32 counts give float32 costs."""
    curve = Curve((0, 3), (0.1, 0.1 + 3e-9))  # float32 cannot tell the two costs apart
    at = curve.at(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert at.dtype == torch.float64 and at.tolist() == pytest.approx([0.1 + 1e-9, 0.1 + 2e-9], rel=1e-12, abs=0)
    surface = PoolSurface((4, 8), (Curve((0, 3), (0.1, 0.1 + 3e-9)), Curve((0, 3), (0.3, 0.3 + 3e-9))))
    at = surface.at(torch.tensor([6.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))
    assert at.dtype == torch.float64 and float(at) == pytest.approx(0.2 + 1e-9, rel=1e-12, abs=0)
    single = surface.at(torch.tensor([6.0]), torch.tensor([1.0]))
    assert single.dtype == torch.float32 and float(single) == pytest.approx(0.2, rel=1e-6)
    assert curve.at(torch.tensor([1.0])).dtype == torch.float32


def test_a_surface_of_one_point_curves_is_linear_in_n_and_flat_in_k():
    """Every measured n with one pooling cost (at k = 4): each curve is that cost at any k, and between the ns the
    surface is linear in n, for a batch of (n, k) pairs."""
    surface = PoolSurface((8, 16, 24), (Curve((4,), (0.5,)), Curve((4,), (1.5,)), Curve((4,), (1.0,))))
    ns = torch.tensor([[4.0, 8.0, 12.0], [16.0, 20.0, 30.0]], dtype=torch.float64)
    ks = torch.tensor([[1.0, 2.0, 6.0], [9.0, 3.0, 1.0]], dtype=torch.float64)
    assert surface.at(ns, ks).flatten().tolist() == pytest.approx([0.5, 0.5, 1.0, 1.5, 1.25, 1.0])
    assert surface.at(ns, ks).shape == (2, 3)
    assert [surface(n, k) for n, k in ((4, 1), (12, 6), (20, 3), (30, 1))] == pytest.approx([0.5, 1.0, 1.25, 1.0])


def test_curves_and_surfaces_that_cannot_be_costs_are_refused_naming_the_problem():
    with pytest.raises(InputError, match=r"as many costs as token counts, at least one \(2 counts, 1 costs\)"):
        Curve((0, 1), (1.0,))
    with pytest.raises(InputError, match=r"at least one \(0 counts, 0 costs\)"):
        Curve((), ())
    with pytest.raises(InputError, match=r"token counts must increase strictly, got \[4, 2\]"):
        Curve((4, 2), (1.0, 2.0))
    one = Curve((0, 4), (0.1, 0.2))
    with pytest.raises(InputError, match="^a pooling surface needs one curve in k per token count n, at least one$"):
        PoolSurface((8, 16), (one,))
    with pytest.raises(InputError, match="^a pooling surface needs one curve in k per token count n, at least one$"):
        PoolSurface((), ())
    for ns in ((8, 8), (16, 8), (8, 16, 12)):
        with pytest.raises(InputError, match=rf"token counts n must increase strictly, got \{list(ns)}"):
            PoolSurface(ns, (one,) * len(ns))
    with pytest.raises(InputError, match=r"the pooling curve at n=8 has a point at k=12 > n"):
        PoolSurface((8,), (Curve((2, 4, 12), (0.1, 0.2, 0.3)),))


def test_predict_is_the_sum_of_blocks_written_out():
    m = _model()
    # block 1: 16 -> 12 pools; block 2: 12 -> 12 keeps all (no step); block 3: 12 -> 0 slices (no step).
    pool_16_12 = 1.0 + (2.0 - 1.0) * 4 / 8
    by_hand = 0.25 + (7.0 + pool_16_12 + m.mlp(12)) + (m.attn(12) + m.mlp(12)) + (m.attn(12) + 0.5)
    assert m.predict([12, 12, 0]) == pytest.approx(by_hand)
    assert m.unmodified() == pytest.approx(0.25 + 3 * (7.0 + 4.5))


def test_a_block_that_keeps_one_token_pays_its_pooling_step_and_one_that_keeps_none_does_not():
    """k = 1 of n = 16 pools (the step at (16, 1) read off the n = 16 curve by hand); k = 0 slices to the prefix and
    k = n keeps every token: neither pays a step."""
    m = _model()
    assert m.block(16, 1) == pytest.approx(7.0 + (0.4 + 0.6 * 1 / 8) + (0.5 + 0.25 * 1))
    assert m.block(16, 0) == pytest.approx(7.0 + 0.5)
    assert m.block(16, 16) == pytest.approx(7.0 + 4.5)
    assert m.block(8, 1) == pytest.approx(3.0 + (0.2 + 0.4 / 8) + 0.75)  # n = 8: the first curve
    assert m.predict([1, 1, 0]) == pytest.approx(0.25 + 8.225 + (1.25 + 0.75) + (1.25 + 0.5))


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


def test_a_soft_count_under_one_token_still_pays_the_pooling_step():
    """0.5 of 16 tokens kept: the step at (16, 0.5) is paid (read off the n = 16 curve by hand); exactly 0 is the
    slice to the prefix, which pays none."""
    m = _model()
    soft = torch.tensor([16.0, 16.0, 0.5], dtype=torch.float64)
    by_hand = 0.25 + 2 * (7.0 + 4.5) + 7.0 + (0.4 + 0.6 * 0.5 / 8) + (0.5 + 0.25 * 0.5)
    assert float(m.expected(soft)) == pytest.approx(by_hand)
    assert float(m.expected(torch.tensor([16.0, 16.0, 0.0], dtype=torch.float64))) == pytest.approx(
        0.25 + 2 * (7.0 + 4.5) + 7.0 + 0.5)
    with pytest.raises(InputError, match=r"one count per block: expected \(3,\), got \(2,\)"):
        m.expected(torch.tensor([16.0, 8.0]))


def test_the_cheapest_list_is_the_cheapest_of_every_list_written_out():
    """``cheapest`` against every non-increasing list over the counts, each costed by ``reference.table_cost``."""
    from tests.reference import table_cost

    m = _model()
    for counts in ([0, 4, 8, 12, 16], [2, 9, 16], [16]):
        lists = [list(keep) for keep in itertools.product(counts, repeat=m.depth)
                 if all(b <= a for a, b in zip(keep, keep[1:]))]
        costs = {tuple(keep): table_cost(m.to_json(), keep) for keep in lists}
        cost, keep = m.cheapest(counts)
        assert cost == pytest.approx(min(costs.values())) and costs[tuple(keep)] == pytest.approx(cost)
    # A table where pooling costs more than it saves: the cheapest list keeps every token, and a slice to the
    # prefix is cheaper still.
    dear = CostModel("ms", 8, 1, 2, 0.0, Curve((0, 8), (1.0, 2.0)), Curve((0, 8), (1.0, 2.0)),
                     PoolSurface((8,), (Curve((0, 8), (9.0, 9.0)),)))
    assert dear.cheapest([4, 8]) == (pytest.approx(8.0), [8, 8])
    assert dear.cheapest([0, 4, 8]) == (pytest.approx(2.0 + 1.0 + 1.0 + 1.0), [0, 0])


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
    with pytest.raises(InputError, match=r"keep\[1\] is 14: an effective keep list is non-increasing and in "
                                         r"\[0, 16\] \(block 2 receives 12 tokens\)"):
        m.predict([12, 14, 0])
    with pytest.raises(InputError, match=r"the keep list \[12, 12\] has 2 entries; the model has 3 blocks"):
        m.predict([12, 12])
    with pytest.raises(InputError, match="no cost table"):
        load_cost_model(tmp_path / "missing.json")
    with pytest.raises(InputError, match="increase strictly"):
        Curve((0, 0), (1.0, 2.0))


def test_a_tables_key_survives_a_save_and_a_load_field_by_field(tmp_path):
    """Every field of a measured table's key, nested ones too, and its ``predicted`` mark come back from the file as
    they were written (the file read as plain JSON, not through ``load_cost_model``), and so does every curve."""
    m = _model()
    key = {"device": "a CPU", "threads": 2, "kernel_choice": {"native": "torch"}, "batch": 64, "method": "kmedoids"}
    table = CostModel("ms", 16, 1, 3, 0.25, m.attn, m.mlp, m.pool, key=key, predicted=True)
    path = save_cost_model(table, tmp_path / "t.json")
    written = json.loads(path.read_text())
    assert written["key"] == key and written["predicted"] is True and written["schema_version"] == 1
    loaded = load_cost_model(path)
    assert loaded.key == key and loaded.predicted is True and loaded == table
    assert (loaded.unit, loaded.num_tokens, loaded.prefix, loaded.depth, loaded.fixed) == ("ms", 16, 1, 3, 0.25)
    assert loaded.pool.ns == (8, 16) and loaded.pool.curves[1].ys == (0.4, 1.0, 2.0)
    unkeyed = load_cost_model(save_cost_model(m, tmp_path / "u.json"))
    assert unkeyed.key == {} and unkeyed.predicted is False
    older = {k: v for k, v in written.items() if k not in ("key", "predicted")}  # a file without either field
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert load_cost_model(tmp_path / "older.json") == m


def test_a_saved_table_is_the_shipped_files_bytes(tmp_path):
    """A table saved again is its file byte for byte (one value a line, keys sorted), so that a table measured
    again diffs line by line against the committed one; the folders on the way are made."""
    path = Path(__file__).resolve().parents[1] / DEMO_TABLE
    saved = save_cost_model(load_cost_model(path), tmp_path / "new" / "folder" / path.name)
    assert saved.read_bytes() == path.read_bytes()


def test_a_table_file_that_is_not_a_table_is_refused_naming_it(tmp_path):
    m = _model()
    data = m.to_json()
    with pytest.raises(InputError, match=r"^the cost table has schema_version 2; this release reads 1; measure it "
                                         r"again with `pipeline bench blocks` \(it replaces a table that does not "
                                         r"load\)$"):
        CostModel.from_json({**data, "schema_version": 2})
    for broken, why in (({**data, "schema_version": 0}, "schema_version 0; this release reads 1"),
                        ({k: v for k, v in data.items() if k != "mlp"}, r"not a cost table \(KeyError"),
                        ({**data, "depth": "three"}, r"not a cost table \(ValueError")):
        path = tmp_path / "t.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(InputError, match=f"{path}.*{why}.*; measure it again with `pipeline bench blocks --out "
                                             f"{path}`"):
            load_cost_model(path)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="bad.json is not valid JSON"):
        load_cost_model(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(InputError, match=r"list.json is not a cost table \(a JSON list\); measure it again"):
        load_cost_model(tmp_path / "list.json")


def test_a_table_write_cut_short_leaves_the_table_it_replaced(tmp_path, monkeypatch):
    """A process killed while it writes a table (here: after half of the text) leaves the table that was there, whole,
    and no other file beside it: the next run reads the old table, not half a new one it cannot parse."""
    import io

    path = save_cost_model(_model(), tmp_path / "t.json")
    before = path.read_bytes()
    real_open = io.open

    class CutShort:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text):
            self.handle.write(text[: len(text) // 2])
            self.handle.flush()
            raise KeyboardInterrupt  # killed mid-write

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def cut_short(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        return CutShort(handle) if "w" in mode else handle

    monkeypatch.setattr(io, "open", cut_short)
    wider = CostModel("ms", 16, 1, 3, 9.0, _model().attn, _model().mlp, _model().pool, key={"batch": 8})
    with pytest.raises(KeyboardInterrupt):
        save_cost_model(wider, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and load_cost_model(path) == _model()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]
    assert load_cost_model(save_cost_model(wider, path)) == wider  # and written whole, it replaces it
    assert oct(path.stat().st_mode & 0o777) == "0o644"  # readable by every user of a shared folder


def test_key_differences_name_each_differing_field_including_one_side_only():
    assert key_differences({"a": 1, "b": 2}, {"a": 1, "b": 2}) == []
    assert key_differences({"a": 1, "b": 2}, {"a": 1, "b": 3}) == ["b: 2 != 3"]
    assert key_differences({"a": 1}, {"a": 1, "c": "x"}) == ["c: None != 'x'"]  # only the current key has c
    assert key_differences({"a": 1, "d": 4}, {"a": 1}) == ["d: 4 != None"]  # only the recorded key has d
    assert key_differences({}, {"z": 1, "y": 2}) == ["y: None != 2", "z: None != 1"]  # by name


def test_check_key_passes_an_equal_key_predicts_another_machine_only_when_asked_and_never_another_setting():
    m = _model()
    recorded = {"device": "AMD EPYC", "threads": 1, "batch": 64, "method": "kmedoids"}
    table = CostModel("ms", 16, 1, 3, 0.25, m.attn, m.mlp, m.pool, key=recorded)
    assert check_key(table, dict(recorded)) is table  # the same key: the table as it is, not predicted
    assert "device" in MACHINE_FIELDS and "batch" not in MACHINE_FIELDS
    elsewhere = {**recorded, "device": "Intel Xeon", "threads": 2}
    with pytest.raises(InputError, match="the table was measured under another key") as refused:
        check_key(table, elsewhere)  # another machine without --other-device: refused, naming each field
    assert str(refused.value) == (
        "the table was measured under another key (recorded != here):\n  device: 'AMD EPYC' != 'Intel Xeon'\n  "
        "threads: 1 != 2\nmeasure a table on this machine with `pipeline bench blocks`, or pass --other-device to use "
        "it as a prediction for this machine (marked predicted)")
    predicted = check_key(table, elsewhere, other_device=True)
    assert predicted.predicted is True and predicted.key == recorded and not table.predicted
    assert predicted.predict([8, 8, 0]) == table.predict([8, 8, 0])  # the same figures, marked
    other_batch = {**elsewhere, "batch": 32}  # another setting: refused even as a prediction, naming only it
    with pytest.raises(InputError, match=r"t.json was measured under another key") as refused:
        check_key(table, other_batch, other_device=True, where="t.json")
    assert str(refused.value) == (
        "t.json was measured under another key (recorded != here):\n  batch: 64 != 32\nthese fields say what the "
        "table measured; measure a table for this setting with `pipeline bench blocks`")
    # A machine field whose values hold colons (a kernel choice) is still a machine field.
    kernels = CostModel("ms", 16, 1, 3, 0.25, m.attn, m.mlp, m.pool, key={**recorded, "kernels": {"native": "auto"}})
    assert check_key(kernels, {**recorded, "kernels": {"native": "torch"}}, other_device=True).predicted is True
    with pytest.raises(InputError, match="batch: 64 != 32"):
        check_key(table, {**recorded, "batch": 32}, other_device=False)


DEMO_TABLE = "configs/latency/amd-epyc/deit_tiny_patch16_224-m32-d4-28px-p4/wkmedoids-b64-fp32-none-t1-cpuclock.json"


def _shipped_tables() -> list[Path]:
    """The tables under configs/latency, not the ``.partial.json`` files that a measurement writes as it goes."""
    return sorted(p for p in (Path(__file__).resolve().parents[1] / "configs" / "latency").rglob("*.json")
                  if not p.name.endswith(".partial.json"))


@pytest.mark.parametrize("path", _shipped_tables(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_table_costs_at_least_zero_wherever_the_rounding_reaches(path):
    """Every block and every pooling step the rounding can choose (``candidates``: n received, k kept <= n) costs
    at least 0, so that dropping a partial list over the limit (``round_keep``) is exact."""
    from pipeline.targets import candidates

    table = load_cost_model(path)
    counts = candidates(table)
    assert min(table.block(n, k) for n in counts for k in counts if k <= n) >= 0
    assert min(table.pool(n, k) for n in counts for k in counts if 0 < k < n) >= 0
