"""pipeline.bench.blocks and pipeline.bench.latency: latency tables measured at a tiny size, checked against
brute-force sums, numpy's interpolation and scipy's Kendall tau (never their own output); no timing asserted."""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import replace

import numpy as np
import pytest
import scipy.stats
import torch

from pipeline.bench.blocks import (
    BlocksSettings,
    ModelSpec,
    anchor_cell,
    anchor_names,
    assemble,
    cell_names,
    measure_table,
    partial_path,
    pool_cells,
    replace_key,
    setup,
    table_key,
    token_grid,
)
from pipeline.bench.latency import CheckRow, held_out_lists, kendall_tau, measure_lists, run_check, summarize
from pipeline.bench.paired import STOPS, SpeedRatio, SpeedSettings
from pipeline.cost import Curve, PoolSurface, check_key, load_cost_model, save_cost_model
from pipeline.errors import InputError
from pipeline.methods import method_spec
from tests.conftest import HANG_S, LOOSE_TOLERANCE

# A pilot and the few blocks it plans: these tests check what is measured, not how well (HANG_S in tests/conftest.py).
QUICK = SpeedSettings(tolerance=LOOSE_TOLERANCE, cap_s=HANG_S, warmup=1)
TINY = ModelSpec("deit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=4)


# The measurements set torch's threads (the table's setting); later tests get theirs back.
pytestmark = [pytest.mark.usefixtures("restore_threads"), pytest.mark.speed]


def settings(method: str = "wkmedoids", batch: int = 2, **more) -> BlocksSettings:
    return BlocksSettings(TINY, method, method_spec(method).resolve(method, {}), batch=batch, step=8, warmup=1,
                          repeats=2, min_sample_s=0.0,
                          **({"threads": 1, "anchor_tolerance": LOOSE_TOLERANCE, "anchor_cap_s": HANG_S} | more))


def brute_force(data: dict, keep: list[int]) -> float:
    """A keep list's ms from the table's JSON alone: numpy's interpolation of each curve, summed by hand."""
    attn = lambda x: np.interp(x, data["attn"]["xs"], data["attn"]["ys"])  # noqa: E731
    mlp = lambda x: np.interp(x, data["mlp"]["xs"], data["mlp"]["ys"])  # noqa: E731
    ns, curves = data["pool"]["ns"], data["pool"]["curves"]

    def pool(n: int, k: int) -> float:
        row = curves[ns.index(n)]  # the tiny grid's n are all measured rows
        return float(np.interp(k, row["xs"], row["ys"])) if len(row["xs"]) > 1 else row["ys"][0]

    total, n = data["fixed"], data["num_tokens"]
    for k in keep:
        total += attn(n) + (pool(n, k) if 0 < k < n else 0.0) + mlp(k)
        n = k
    return total


def test_a_measured_table_predicts_the_brute_force_sum_of_its_parts(tmp_path):
    table, out = measure_table(settings(), tmp_path / "t.json", log=lambda line: None)
    data = json.loads(out.read_text())
    loaded = load_cost_model(out)
    assert loaded == table and not partial_path(out).exists()
    # the grid: 0 (a prefix rides along), the powers of two below the step of 8, its multiples, N = 16
    assert data["attn"]["xs"] == [0, 1, 2, 4, 8, 16] and data["pool"]["ns"] == [2, 4, 8, 16]
    assert data["pool"]["curves"][0]["xs"] == [1] and data["pool"]["curves"][-1]["xs"] == [1, 2, 4, 8]
    for keep in ([16, 16], [16, 8], [8, 8], [8, 0], [16, 0], [16, 4], [4, 1], [16, 2]):
        assert loaded.predict(keep) == pytest.approx(brute_force(data, keep))
    key = data["key"]
    assert key["device"] != "x86_64" and key["method"] == "wkmedoids" and key["batch"] == 2 and key["threads"] == 1
    assert key["options"]["iters"] == 5 and key["kernels"] and key["embed_dim"] == 16 and key["num_tokens"] == 16
    assert key["clock"] == "wall"


def test_the_grid_without_its_fine_points_is_the_step_multiples():
    assert token_grid(196, 48, 1, fine=False) == [0, 48, 96, 144, 192, 196]
    assert token_grid(196, 48, 1) == [0, 1, 2, 4, 8, 16, 32, 48, 96, 144, 192, 196]
    assert pool_cells(16, 8, fine=False) == [(16, 8)] and len(cell_names(196, 48, 1, fine=False)) == 1 + 2 * 6 + 10


def test_the_cpu_clock_needs_one_thread_and_is_recorded(tmp_path):
    with pytest.raises(InputError, match="--threads 1"):
        measure_table(settings(threads=2, clock="cpu"), tmp_path / "t.json", log=lambda line: None)
    table, out = measure_table(settings(clock="cpu"), tmp_path / "t.json", log=lambda line: None)
    assert table.key["clock"] == "cpu" and table.attn(16) > 0


def test_assemble_converts_planted_ratios_as_documented():
    """Planted cell ratios against a 10 ms reference block: curves are ratio x 10 ms, the step is the pooled
    block's ms less its halves, the fixed part is the model's ms less its blocks."""
    names = cell_names(16, 8, 1)
    cells = {name: {"ratio": 0.5, "iqr": 0.0, "base_ms": 10.0, "calls": 1} for name in names}
    cells["attn/16"]["ratio"], cells["mlp/16"]["ratio"], cells["mlp/8"]["ratio"] = 0.4, 0.6, 0.3
    cells["model"]["ratio"], cells["pool/16/8"] = 2.5, {"ratio": 1.2, "iqr": 0.0, "base_ms": 3.0, "calls": 1}
    table = assemble({}, cells, num_tokens=16, prefix=1, depth=2, step=8)
    assert table.attn(16) == pytest.approx(4.0) and table.mlp(8) == pytest.approx(3.0)
    assert table.pool(16, 8) == pytest.approx(1.2 * (4.0 + 6.0) - 4.0 - 3.0)
    assert table.fixed == pytest.approx(25.0 - 2 * 10.0)
    assert table.key["reference_ms"] == 10.0  # the pooling cells' own references are not the block at N


def stopped_before_the_last_cell(tmp_path) -> tuple:
    """A tiny table's measurement interrupted after all but its last cell: (out, the cell count, the lines logged);
    the partial file holds every other cell."""
    out, total = tmp_path / "t.json", len(cell_names(16, 8, 1))
    lines: list[str] = []

    def stop_before_the_last(line: str) -> None:
        lines.append(line)
        if len(lines) == total - 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_table(settings(), out, log=stop_before_the_last)
    return out, total, lines


def test_a_stopped_measurement_resumes_from_its_partial_file(tmp_path):
    out, lines = tmp_path / "t.json", []

    def stop_after_three(line: str) -> None:
        lines.append(line)
        if len(lines) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_table(settings(), out, log=stop_after_three)
    assert len(json.loads(partial_path(out).read_text())["cells"]) == 3 and not out.exists()
    again: list[str] = []
    measure_table(settings(), out, log=again.append)
    total = len(cell_names(16, 8, 1))
    assert again[0].startswith(f"[blocks] resuming {partial_path(out)}: 3/{total} cells measured")
    progress = [line for line in again if re.match(r"\[blocks\] \d+/", line)]  # (a closure re-measure may log too)
    assert re.match(rf"\[blocks\] 4/{total} ", again[1]) and len(progress) == total - 3
    assert out.is_file() and not partial_path(out).exists()


def test_the_fixed_parts_cells_are_measured_to_an_interval_and_the_others_in_pairs(tmp_path):
    """The model and the halves at N (``anchor_names``) go through bench.paired's ABBA blocks (their figures carry
    the blocks measured); every other cell is the median of its timed pairs."""
    out, total, lines = stopped_before_the_last_cell(tmp_path)
    cells = json.loads(partial_path(out).read_text())["cells"]
    anchors = set(anchor_names(16))
    assert anchors == {"model", "attn/16", "mlp/16"} and anchors <= set(cells)
    assert all(cells[name]["low"] <= cells[name]["ratio"] <= cells[name]["high"] for name in anchors), cells
    assert [name for name in cells if "blocks" in cells[name]] == [n for n in cells if n in anchors]
    # The progress: the model cell first, its interval's width, and no time left guessed from its pace; the cells
    # after it, their IQR and the time left at their own pace.
    assert re.fullmatch(r"\[blocks\] 1/\d+ the unmodified model against the reference block: [\d.]+x "
                        r"\(95% interval width [\d.]+\)", lines[0]), lines[0]
    assert re.search(r"\(IQR [\d.]+\), about \d+ s left$", lines[1]), lines[1]


def test_the_tables_key_records_its_anchors_interval_and_a_check_of_the_key_leaves_them_out(tmp_path):
    """A table resumed from its partial file: the key records the anchors' tolerance, cap and each one's interval
    and stop, and a check of the key leaves those out."""
    out, total, lines = stopped_before_the_last_cell(tmp_path)
    table, _ = measure_table(settings(), out, log=lambda _: None)
    anchors = table.key["anchors"]
    assert set(anchors) == {"model", "attn/16", "mlp/16"} and table.key["anchor_cap_s"] == HANG_S
    assert all(a["low"] <= a["ratio"] <= a["high"] and a["stop"] in STOPS
               for a in anchors.values()), anchors
    assert anchors["model"]["ratio"] > 1  # the whole model, in blocks at N (scaled as its ratio is)
    assert not {"anchors", "anchor_tolerance", "anchor_cap_s"} & set(replace_key(table).key)


def test_the_time_left_counts_each_kind_of_cell_at_its_own_pace():
    from pipeline.bench.blocks import _seconds_left

    spent = {True: (60.0, 2), False: (10.0, 5)}  # anchors 30 s each so far, other cells 2 s
    assert _seconds_left(spent, [True, False, False], 99.0) == pytest.approx(34.0)
    assert _seconds_left({True: (0.0, 0), False: (4.0, 2)}, [True, True, False], 25.0) == pytest.approx(52.0)
    assert _seconds_left({True: (30.0, 1), False: (0.0, 0)}, [False], 25.0) is None  # no pace for them yet
    assert _seconds_left({True: (30.0, 1), False: (0.0, 0)}, [True], 25.0) == pytest.approx(30.0)
    assert _seconds_left(spent, [], 25.0) == 0.0


def _spin(seconds: float):
    def run() -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
    return run


def test_an_anchor_cell_finds_a_known_ratio_within_its_interval():
    """Two busy loops of 2 ms and 1 ms of CPU: the ratio 2 on the CPU clock, inside the interval, whose width is
    the cell's spread."""
    s = settings(clock="cpu", anchor_tolerance=0.05)
    found = anchor_cell(_spin(0.002), _spin(0.001), s, torch.device("cpu"))
    assert found["ratio"] == pytest.approx(2.0, rel=0.1) and found["low"] <= found["ratio"] <= found["high"]
    assert found["iqr"] == pytest.approx(found["high"] - found["low"]) and found["stop"] in STOPS
    assert found["base_ms"] == pytest.approx(1.0, rel=0.2)  # a call of the reference, not a sample of them


def test_halves_at_n_that_do_not_make_up_their_block_are_measured_again(tmp_path):
    """A disturbed MLP half at N (planted in the partial file) is measured again before the table is assembled."""
    out, total, lines = stopped_before_the_last_cell(tmp_path)
    partial = json.loads(partial_path(out).read_text())
    partial["cells"]["mlp/16"]["ratio"] = 0.01  # far from 1 - attn/16's share of the block
    partial_path(out).write_text(json.dumps(partial))
    again: list[str] = []
    table, _ = measure_table(settings(), out, log=again.append)
    remeasured = [line for line in again if "the halves at 16 tokens sum to" in line]
    assert remeasured and "measuring them again (1/2)" in remeasured[0]
    assert table.mlp(16) != pytest.approx(0.01 * table.key["reference_ms"])
    assert table.key["halves_closure"] == pytest.approx((table.attn(16) + table.mlp(16)) / table.key["reference_ms"])


def test_a_table_under_another_key_is_refused_naming_the_field_and_accepted_as_predicted(tmp_path):
    table, out = measure_table(settings(), tmp_path / "t.json", log=lambda line: None)
    with pytest.raises(InputError, match=r"batch: 2 != 3"):  # measuring into it at another batch
        measure_table(settings(batch=3), out, log=lambda line: None)
    s = settings()
    device, model = setup(s)
    here = table_key(s, model, device)
    other = replace(table, key={**here, "device": "Some Other CPU", "threads": 64})
    with pytest.raises(InputError, match=r"(?s)device: 'Some Other CPU' != .*\n  threads: 64 != 1\n.*--other-device"):
        check_key(other, here)
    accepted = check_key(other, here, other_device=True)
    assert accepted.predicted and not other.predicted
    with pytest.raises(InputError, match=r"method: 'tome' != 'wkmedoids'") as refused:
        check_key(replace(other, key={**other.key, "method": "tome"}), here, other_device=True)
    assert "device" not in str(refused.value)  # the override covers the machine, never what was measured


def test_kendall_tau_and_the_errors_against_scipy_and_by_hand():
    rng = random.Random(3)
    for _ in range(20):
        a = [rng.choice([0.1, 0.2, 0.3, 0.4, 0.5]) for _ in range(9)]  # ties on both sides
        b = [rng.choice([1.0, 2.0, 3.0, 4.0]) for _ in range(9)]
        assert kendall_tau(a, b) == pytest.approx(scipy.stats.kendalltau(a, b).statistic)
    def measured(ratio: float) -> SpeedRatio:
        return SpeedRatio(ratio, ratio, ratio, 8, "tolerance", 0.0, 0.0)

    rows = [CheckRow("a", [], 0.5, measured(0.5)), CheckRow("b", [], 0.66, measured(0.6)),
            CheckRow("c", [], 0.76, measured(0.8)), CheckRow("d", [], 0.9, measured(0.75))]
    s = summarize(rows)
    assert s.median_abs_error == pytest.approx((0.05 + 0.1) / 2)  # |errors| 0, 0.1, 0.05, 0.2
    assert s.worst_abs_error == pytest.approx(0.2)
    assert s.tau == pytest.approx((5 - 1) / 6)  # one discordant pair (c, d) of six


@pytest.mark.slow
def test_the_check_measures_planted_lists_and_reports_the_planted_predictions(tmp_path):
    """The check's predicted ratio of each list it measures, against values written out by hand for written-out
    curves, then against the brute-force sum of the measured table's JSON (never against ``predict`` itself)."""
    s = settings("tome")
    device, model = setup(s)
    table, out = measure_table(s, tmp_path / "t.json", log=lambda line: None)
    # Written-out curves: 1 ms outside the blocks; a block's first half costs n for the n tokens it receives, its
    # second half k / 2 for the k it keeps, and pooling 2. Unmodified (16, 16): 1 + (16 + 8) + (16 + 8) = 49.
    # 16, 8: 1 + (16 + 8) + (16 + 2 + 4) = 47; 8, 4: 1 + (16 + 2 + 4) + (8 + 2 + 2) = 35; 4, 0 (the class token
    # alone after block 2, which pools nothing and keeps nothing): 1 + (16 + 2 + 2) + (4 + 0 + 0) = 25.
    planted = replace(table, fixed=1.0, attn=Curve((0, 16), (0.0, 16.0)), mlp=Curve((0, 16), (0.0, 8.0)),
                      pool=PoolSurface((16,), (Curve((1,), (2.0,)),)))
    rows = measure_lists(s, [("a", [16, 8]), ("b", [8, 4]), ("c", [4, 0])], planted, model, device,
                         log=lambda line: None, speed=QUICK)
    assert [row.predicted for row in rows] == pytest.approx([47 / 49, 35 / 49, 25 / 49], rel=1e-12)
    assert all(row.measured > 0 for row in rows)
    lists = held_out_lists(table, 4, seed=1, levels=True)
    assert len(lists) == 4 and all(label.startswith("random") for label, _ in lists)  # no paper levels at 16 px
    for _, keep in lists:
        assert all(b <= a for a, b in zip([16, *keep], keep)) and any(b < a for a, b in zip([16, *keep], keep))
    checked, rows = run_check(table, count=4, seed=1, levels=True, other_device=False, speed=QUICK,
                              log=lambda line: None)
    assert [row.keep for row in rows] == [keep for _, keep in lists]
    data = json.loads(out.read_text())
    for row in rows:
        assert row.predicted == pytest.approx(brute_force(data, row.keep) / brute_force(data, [16, 16]))
        assert row.measured > 0
    moved = replace(table, key={**table.key, "device": "Some Other CPU"})
    with pytest.raises(InputError, match="device: 'Some Other CPU'"):
        run_check(moved, count=2, seed=1, levels=False, other_device=False, speed=QUICK)
    assert not checked.predicted


def test_the_cli_measures_a_table_and_checks_it_as_a_prediction_for_another_device(tmp_path, capsys):
    """The real command line, in this process (``cli.main``: the parser, the error handling, the output)."""
    from pipeline.cli import main

    out = tmp_path / "t.json"
    assert main(["bench", "blocks", "--model", "deit_tiny_patch16_224", "--set", "model.img_size=16",
                 "--set", "model.patch_size=4", "--set", "model.depth=2", "--embed-dim", "16",
                 "--set", "model.num_heads=2", "--method", "powerbert", "--batch", "1", "--threads", "1",
                 "--step", "8", "--repeats", "1", "--anchor-tolerance", str(LOOSE_TOLERANCE),
                 "--anchor-cap-s", str(HANG_S), "--warmup", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "powerbert" in printed.out and "| 16 |" in printed.out and "[blocks] 1/" in printed.err
    data = json.loads(out.read_text())
    data["key"]["device"] = "Some Other CPU"
    save_cost_model(load_cost_model(out).__class__.from_json(data), out)
    check = ["bench", "latency-check", str(out), "--lists", "3", "--tolerance", str(LOOSE_TOLERANCE),
             "--cap-s", str(HANG_S), "--warmup", "1"]
    assert main(check) == 2
    assert "device: 'Some Other CPU' != " in capsys.readouterr().err
    assert main([*check, "--other-device"]) == 0
    printed = capsys.readouterr().out
    assert "(PREDICTED: the table was measured on another machine)" in printed
    assert re.search(r"^3 lists: median \|error\| [\d.]+%, worst [\d.]+%, Kendall tau (-?[\d.]+|nan)$", printed,
                     flags=re.M), printed


def test_a_table_is_logged_as_an_mlflow_artifact_with_its_key(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.bench.blocks import log_table_artifact

    table, out = measure_table(settings(), tmp_path / "t.json", log=lambda line: None)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = log_table_artifact(out, table, uri, "latency-tables", str(tmp_path / "artifacts"))
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(run_id).data.params["method"] == "wkmedoids"
    fetched = client.download_artifacts(run_id, "latency_table/t.json", str(tmp_path / "back"))
    assert load_cost_model(fetched) == table


def test_bench_blocks_measures_a_table_that_does_not_load_again_into_its_path(tmp_path):
    """A table file cut short (a write killed half-way) is what `pipeline bench blocks --out PATH`, the command its
    error names, measures again: it does not refuse on reading it first, as it would a whole table of another key."""
    out = tmp_path / "t.json"
    out.write_text('{"attn": {"xs": [0, 8')
    with pytest.raises(InputError, match=rf"{out} is not valid JSON .*; measure it again with `pipeline bench blocks "
                                         rf"--out {out}` \(it replaces a table that does not load\)$"):
        load_cost_model(out)
    lines: list[str] = []

    def stop_at_the_first_cell(line: str) -> None:
        lines.append(line)
        if line.startswith("[blocks] 1/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_table(settings(), out, log=stop_at_the_first_cell)
    assert lines[0] == (f"[blocks] {out} does not load as a cost table of this release: measuring it again (the new "
                        "table replaces it)")
    assert len(json.loads(partial_path(out).read_text())["cells"]) == 1
