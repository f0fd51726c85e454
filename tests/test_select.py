"""`pipeline select` against a hand-built MLflow store: a DAG parent run, its evaluate runs, one registered model."""

from __future__ import annotations

import re
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.select_model import candidates
from tests.conftest import dag_parent, finished_evaluation, one_evaluation_store

# (method, level, top1, gflops, images/s, device): the models the hand-built experiment evaluated.
MODELS = [
    ("none", "full", 80.0, 4.6, 1000.0, "cuda"),
    ("wkmedoids", "L3", 79.5, 2.3, 1500.0, "cuda"),
    ("powerbert", "L3", 78.0, 2.2, 1900.0, "cuda"),
    ("powerbert", "L6", 70.0, 1.1, 2600.0, "cuda"),
    ("kmedoids", "L3", 79.0, 2.3, 40.0, "cpu"),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """The store's URI and {method/level/device: the finetune run id} of each model."""
    root = tmp_path_factory.mktemp("select")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("token-pooling", artifact_location=(root / "artifacts").as_uri())
    dag_parent(client, exp, "other")  # another experiment's DAG
    parent = dag_parent(client, exp, "hand")
    trained = {}
    for method, level, top1, gflops, speed, device in MODELS:
        finetune = client.create_run(exp, run_name=f"ft-{method}-{level}").info.run_id
        trained[f"{method}/{level}/{device}"] = finetune
        finished_evaluation(client, exp, parent, {"top1": top1, "gflops": gflops, "images_per_s": speed},
                            tags={"pipeline.trained_run": finetune}, method=method, level=level, eval_device=device)
    unfinished = client.create_run(exp, tags={"mlflow.parentRunId": parent, "pipeline.stage": "evaluate"})
    client.log_metric(unfinished.info.run_id, "top1", 99.0)  # not done: never a candidate
    # a base with K-Medoids inserted, untrained (experiment.no_finetune): a measurement on no scale, never a candidate
    finished_evaluation(client, exp, parent, {"top1": 99.0, "gflops": 0.5, "images_per_s": 9000.0}, scaled=False,
                        tags={"pipeline.finetuned": "false"}, method="kmedoids", level="L3")
    # The wkmedoids model (timed on the GPU) is registered as an MLflow model.
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)  # the registry looks the logged model up through the global tracking URI
    try:
        model = client.create_logged_model(exp, name="model", source_run_id=trained["wkmedoids/L3/cuda"])
        client.create_registered_model("token-pooling-hand")
        client.create_model_version("token-pooling-hand", f"models:/{model.model_id}",
                                    run_id=trained["wkmedoids/L3/cuda"], model_id=model.model_id)
    finally:
        mlflow.set_tracking_uri(previous)
    return uri, trained


def select(capsys, uri: str, *budget: str) -> tuple[int, str, str]:
    code = main(["select", "--experiment", "hand", "--tracking-uri", uri, *budget])
    out = capsys.readouterr()
    return code, out.out, out.err


def field(out: str, name: str) -> str:
    return next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(f"{name}: "))


def test_gflops_budget_picks_the_best_top1_that_fits(store, capsys):
    uri, trained = store
    code, out, _ = select(capsys, uri, "--max-gflops", "2.5")
    assert code == 0 and field(out, "model") == "models:/token-pooling-hand/1"  # wkmedoids L3, registered
    assert field(out, "top1") == "79.50" and field(out, "gflops") == "2.3000"
    code, out, _ = select(capsys, uri, "--max-gflops", "2.25")
    assert code == 0 and field(out, "model") == f"runs:/{trained['powerbert/L3/cuda']}/checkpoint"  # not registered
    code, out, _ = select(capsys, uri, "--max-gflops", "100")
    assert field(out, "method") == "none" and field(out, "top1") == "80.00"


def test_speed_budget_counts_only_the_device_asked_for(store, capsys):
    uri, _ = store
    code, out, _ = select(capsys, uri, "--min-images-per-s", "1800", "--device", "cuda")
    assert code == 0 and field(out, "method") == "powerbert" and field(out, "level") == "L3"
    code, out, _ = select(capsys, uri, "--min-images-per-s", "30", "--device", "cpu")
    assert code == 0 and field(out, "images_per_s") == "40.0 [40.0, 40.0] (at least 90%, within this run) (cpu)"


def test_nothing_fits_names_the_cheapest_model(store, capsys):
    uri, trained = store
    code, _, err = select(capsys, uri, "--max-gflops", "1.0")
    assert code == 2 and "no model fits the budget of 1 GFLOPs" in err
    assert f"runs:/{trained['powerbert/L6/cuda']}/checkpoint" in err and "1.1000 GFLOPs" in err
    code, _, err = select(capsys, uri, "--min-images-per-s", "5000", "--device", "cuda")
    assert code == 2 and "2600 [2600, 2600] (at least 90%, within this run) img/s" in err


def test_unknown_experiment_store_or_device_is_refused(store, capsys, tmp_path):
    uri, _ = store
    code = main(["select", "--experiment", "nope", "--tracking-uri", uri, "--max-gflops", "1"])
    assert code == 2 and "no experiment 'nope' in this MLflow store" in capsys.readouterr().err
    missing = tmp_path / "none" / "mlflow.db"
    code = main(["select", "--experiment", "hand", "--tracking-uri", f"sqlite:///{missing}", "--max-gflops", "1"])
    assert code == 2 and "there is no MLflow store" in capsys.readouterr().err and not missing.parent.exists()
    from pipeline.select_model import best_under_budget, candidates

    models = candidates(MlflowClient(tracking_uri=uri), "hand")
    assert len(models) == len(MODELS)  # the unfinished evaluation and the untrained one are not candidates
    with pytest.raises(ValueError, match="no model of this experiment was timed on 'cuda'"):
        best_under_budget([m for m in models if m.device == "cpu"], max_gflops=9, device="cuda")


def test_select_needs_exactly_one_budget(store, capsys):
    uri, _ = store
    with pytest.raises(SystemExit):
        main(["select", "--experiment", "hand", "--tracking-uri", uri])
    assert Path(uri.removeprefix("sqlite:///")).is_file()


def test_the_dag_is_found_in_any_mlflow_experiment(tmp_path, capsys):
    # configs/experiments/demo.yaml records under train.experiment: demo, not token-pooling
    uri = one_evaluation_store(tmp_path, "demo", "demo", "/ckpt/a",
                               {"top1": 70.0, "gflops": 0.002, "images_per_s": 500.0})
    assert main(["select", "--experiment", "demo", "--tracking-uri", uri, "--max-gflops", "0.005"]) == 0
    assert "model: /ckpt/a" in capsys.readouterr().out


def test_select_by_latency_measured_against_a_table(store, tmp_path, capsys):
    """``--max-latency-ms X --table T``: the most accurate model measured within X against that very table; models
    measured against another table, or not measured, are not candidates."""
    uri, _ = store
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("token-pooling").experiment_id
    parent = dag_parent(client, exp, "lat")
    table, other = tmp_path / "table.json", tmp_path / "other.json"
    table.write_text('{"a": 1}\n')
    other.write_text('{"b": 2}\n')
    from pipeline.cost import file_sha256
    from pipeline.dag.records import LATENCY_METRIC, LATENCY_TABLE_TAG

    for name, top1, ms, against in (("fast", 70.0, 3.0, table), ("slow", 80.0, 6.0, table),
                                    ("elsewhere", 90.0, 1.0, other), ("unmeasured", 95.0, None, None)):
        run = finished_evaluation(client, exp, parent, {"top1": top1, "gflops": 0.002, "images_per_s": 500.0},
                                  checkpoint=f"/ckpt/{name}")
        if ms is not None:
            client.log_metric(run, LATENCY_METRIC, ms)
            client.set_tag(run, LATENCY_TABLE_TAG, file_sha256(against))
    assert main(["select", "--experiment", "lat", "--tracking-uri", uri, "--max-latency-ms", "4",
                 "--table", str(table)]) == 0
    assert "model: /ckpt/fast" in capsys.readouterr().out
    assert main(["select", "--experiment", "lat", "--tracking-uri", uri, "--max-latency-ms", "7",
                 "--table", str(table)]) == 0
    assert "model: /ckpt/slow" in capsys.readouterr().out
    assert main(["select", "--experiment", "lat", "--tracking-uri", uri, "--max-latency-ms", "2",
                 "--table", str(table)]) == 2
    assert "no model measured within 2 ms; the fastest is /ckpt/fast" in capsys.readouterr().err
    assert main(["select", "--experiment", "lat", "--tracking-uri", uri, "--max-latency-ms", "2"]) == 2
    assert "--max-latency-ms X goes with --table PATH" in capsys.readouterr().err


@pytest.mark.slow
def test_speed_budgets_hold_by_the_intervals_end(tmp_path, capsys):
    """The select stage's images/s on one scale with its interval: ``--min-images-per-s`` by the lower end,
    ``--max-latency-ms`` by the upper end; the evaluate stage's own figure is never read."""
    from pipeline.cost import file_sha256
    from pipeline.dag.records import LATENCY_HIGH, LATENCY_METRIC, LATENCY_TABLE_TAG, RATE_HIGH, RATE_LOW, SCALED_RATE

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("x", artifact_location=(tmp_path / "a").as_uri())
    parent = dag_parent(client, exp, "scaled")
    table = tmp_path / "table.json"
    table.write_text('{"a": 1}\n')
    # name, top1, evaluate's own images/s, (scaled, low, high), (latency ms, its upper end)
    for name, top1, own, scaled, ms in (("wide", 80.0, 9000.0, (2000.0, 1700.0, 2300.0), (3.0, 3.6)),
                                        ("tight", 78.0, 10.0, (1950.0, 1900.0, 2000.0), (3.2, 3.3))):
        run = finished_evaluation(client, exp, parent, {
            "top1": top1, "gflops": 0.002, "images_per_s": own, **dict(zip((SCALED_RATE, RATE_LOW, RATE_HIGH), scaled)),
            LATENCY_METRIC: ms[0], LATENCY_HIGH: ms[1]}, checkpoint=f"/ckpt/{name}")
        client.set_tag(run, LATENCY_TABLE_TAG, file_sha256(table))
    args = ["select", "--experiment", "scaled", "--tracking-uri", uri]
    assert main([*args, "--min-images-per-s", "1800"]) == 0  # wide's 2000 may be 1700: only tight holds 1800
    out = capsys.readouterr().out
    assert "model: /ckpt/tight" in out
    assert "images_per_s: 1950.0 [1900.0, 2000.0] (at least 90%, within this run) (cpu)" in out
    assert main([*args, "--min-images-per-s", "1600"]) == 0
    assert "model: /ckpt/wide" in capsys.readouterr().out
    assert main([*args, "--max-latency-ms", "3.5", "--table", str(table)]) == 0  # wide's 3.0 ms may be 3.6
    assert "model: /ckpt/tight" in capsys.readouterr().out


def test_the_fastest_alias_goes_to_the_most_accurate_model_the_intervals_cannot_tell_from_the_fastest():
    from pipeline.dag.select import fastest

    rows = [{"name": "fastest", "images_per_s": 2000.0, "images_per_s_low": 1900.0, "images_per_s_high": 2100.0,
             "top1": 70.0},
            {"name": "overlapping", "images_per_s": 1850.0, "images_per_s_low": 1700.0, "images_per_s_high": 1950.0,
             "top1": 75.0},
            {"name": "slower", "images_per_s": 1500.0, "images_per_s_low": 1400.0, "images_per_s_high": 1600.0,
             "top1": 90.0}]
    assert fastest(rows)["name"] == "overlapping"
    assert fastest([{**r, "images_per_s_low": None, "images_per_s_high": None} for r in rows])["name"] == "fastest"


def test_the_reports_speed_front_goes_by_the_intervals_and_names_ties(tmp_path):
    """Rows with images/s intervals: the front leaves out only what another model beats beyond the intervals, and
    the report's tables carry the ratio with its interval and the ties; rows without intervals (records from
    before the paired timing) keep the point front."""
    from pipeline.report import _line, fronts, read_csv, write_report

    def row(name: str, rate: float, low: float, high: float, top1: float) -> dict:
        return {"arch": "M32", "level": name, "method": "powerbert", "keep": [8], "gflops": 0.001, "top1": top1,
                "images_per_s": rate, "images_per_s_low": low, "images_per_s_high": high, "speed_ratio": 1000 / rate,
                "speed_ratio_low": 1000 / high, "speed_ratio_high": 1000 / low, "stage_id": name, "run_id": "",
                "checkpoint": "", "train_top1": top1}

    rows = [row("fast", 2000.0, 1900.0, 2100.0, 60.0), row("tied", 1950.0, 1850.0, 2050.0, 60.0),
            row("accurate", 1000.0, 950.0, 1050.0, 70.0), row("beaten", 900.0, 850.0, 940.0, 65.0),
            row("less", 990.0, 940.0, 1040.0, 65.0)]  # less accurate than "accurate", not slower beyond the intervals
    front = fronts(rows, "images_per_s")["all"]
    assert [(r["level"], r["speed_ties"]) for r in front] == [
        ("fast", "M32/tied/powerbert"), ("tied", "M32/fast/powerbert"), ("accurate", "M32/less/powerbert"),
        ("less", "M32/accurate/powerbert")]
    # the plot's line: the front's models that none of them beats on the point figures (no zigzag to the ties)
    assert [r["level"] for r in _line(front, "images_per_s")] == ["fast", "accurate"]
    files = write_report(rows, tmp_path)
    again = read_csv(files["pareto_speed"])
    assert {r["level"] for r in again} == {"fast", "tied", "accurate", "less"}
    accurate = next(r for r in again if r["level"] == "accurate")
    assert accurate["images_per_s_low"] == pytest.approx(950.0) and accurate["speed_ratio_high"] == pytest.approx(
        1000 / 950)
    assert "| M32 | fast | powerbert | 0.0010 | 60.00 | 2000.00 | 0.500 [0.476, 0.526] | M32/tied/powerbert |" in \
        files["report"].read_text()
    bare = [{k: v for k, v in r.items() if not k.startswith(("images_per_s_", "speed_"))} for r in rows]
    # by the points alone, "tied" is slower than "fast" at equal top-1, and "less" than "accurate": both left out
    assert [r["level"] for r in fronts(bare, "images_per_s")["all"]] == ["fast", "accurate"]


@pytest.mark.ray
def test_a_cluster_without_the_timing_resource_is_warned_about_before_any_stage(monkeypatch):
    """Not refused: an autoscaling worker group at zero nodes starts one when an evaluation asks for the resource."""
    import ray

    from pipeline.dag.runner import check_timing

    said = []
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    check_timing(said.append)
    assert len(said) == 1 and "no running node of the Ray cluster has the 'timing' resource" in said[0]
    assert """ray start --resources='{"timing": 1}'""" in said[0]
    said.clear()
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "timing": 2.0})
    check_timing(said.append)
    assert said == []


def test_pipeline_report_rebuilds_the_report_the_select_stage_wrote(tmp_path, capsys):
    """`pipeline report FOLDER --out OTHER` writes the same report.md as the select stage's ``write_report``: its
    bases, K-search targets, speed warning, tie margin and machine spread come from report.json beside
    results.csv, not only the rows. A report.json that is not the pipeline's is refused in one line; without one,
    the report holds what results.csv gives."""
    from pipeline.report import REPORT_INPUTS, write_report
    from pipeline.spread import SpreadRecord

    row = {"arch": "M32", "level": "lam0.1", "method": "powerbert", "keep": [8, 6], "gflops": 0.002, "top1": 61.5,
           "images_per_s": 2000.0, "images_per_s_low": 1900.0, "images_per_s_high": 2100.0, "speed_ratio": 0.5,
           "speed_ratio_low": 0.48, "speed_ratio_high": 0.52, "speed_blocks": 31, "speed_stop": "wider",
           "speed_half_width": 0.04, "stage_id": "s1", "run_id": "r1", "checkpoint": "c", "train_top1": 60.0}
    import numpy as np

    # a numpy scalar and a path, as a cost model or a table's place could leave them: numbers and text in report.json
    target = row | {"target_unit": "ms", "target_cost": np.float32(0.8), "searched": 0.79, "predicted": 0.81,
                    "spent": 1.01, "measured": 0.83, "cost_status": "measured", "table": Path("configs/t.json")}
    spread = SpreadRecord(device="Test CPU", threads=1, setting="cpu fp32", torch="t", timm="m", date="2026-12-06",
                          over_s=180.0, seconds=190.0, pair={}, processes=[{"ratio": 0.64}, {"ratio": 0.66}],
                          between=0.021, within=0.017, max_over_min=1.03, path="runs/machine/x.json")
    untrained = {"arch": "M32", "level": "lam0.1", "method": "kmedoids", "carry": True, "keep": "8,6", "gflops": 0.0021,
                 "top1": 40.25, "speed_ratio": None, "speed_ratio_low": None, "speed_ratio_high": None,
                 "speed_blocks": 0, "speed_stop": None, "speed_half_width": None, "run_id": "n1"}
    first = tmp_path / "run"
    write_report([row], first, [0.003], title="Experiment demo", bases=[{"arch": "M32", "val_top1": 70.0,
                 "test_top1": None, "run_id": "b1"}], targets=[target], speed_warning="the self-check excluded 1",
                 tie_margin=0.021, spread=spread,
                 no_finetune=[untrained | {"method": "none", "keep": "", "level": "full"}, untrained])
    written = (first / "report.md").read_text()
    assert "## DeiT against DeiT-2x" not in written  # the run has no baseline finetune to compare the base with
    for part in ("# Experiment demo", "## Base models", "## K-search targets", "Tie margin 2.1%",
                 "**Warning: the self-check excluded 1.**", "spread 2.1% (sd/mean; 0.640 to 0.660)",
                 "## Without finetuning (Appendix E)", "| M32 | lam0.1 | kmedoids | True | 0.0021 | 40.25 |"):
        assert part in written, part
    # the intervals' scope, and the speed front's interval widened by the device's spread, each side apart: 1.96
    # times 2.1% of 2000 img/s in quadrature with the 100 img/s on each side, written out
    wide = (100.0 ** 2 + (1.959964 * 0.021 * 2000.0) ** 2) ** 0.5
    assert "95% interval that holds within this run" in written and "(2 processes over 180 s, 2026-12-06)" in written
    assert f"| 2000.00 | [{2000 - wide:.0f}, {2000 + wide:.0f}] | 0.500 [0.480, 0.520]" in written, written
    every = written.split("## All models", 1)[1]  # the speed of every model, not only the speed front's
    assert "| M32 | lam0.1 | powerbert | 0.0020 | 61.50 | 2000.00 | 0.500 [0.480, 0.520] (31 blocks, wider, +-4.0%) |" \
        in every, every
    assert main(["report", str(first), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text() == written
    assert (tmp_path / "again" / "no_finetune_M32.png").is_file()
    assert (tmp_path / "again" / "no_finetune.csv").read_text() == (first / "no_finetune.csv").read_text()
    # a model whose unmodified evaluation is missing (it failed with keep-going, or a rehearsal left it out) is
    # plotted without its star
    write_report([row], tmp_path / "partial", no_finetune=[untrained, untrained | {"arch": "M64"}])
    assert (tmp_path / "partial" / "no_finetune_M64.png").is_file()
    (first / REPORT_INPUTS).write_text('{"title": "x"}')
    assert main(["report", str(first), "--out", str(tmp_path / "bad")]) == 2
    assert f"{first / REPORT_INPUTS}: not what `pipeline run` writes (KeyError" in capsys.readouterr().err
    (first / "results.csv").write_text("arch,level\n")  # a fault of results.csv is not blamed on report.json
    assert main(["report", str(first), "--out", str(tmp_path / "bad")]) == 2
    assert "results.csv lacks the column(s) method" in capsys.readouterr().err
    write_report([row], first)
    (first / REPORT_INPUTS).unlink()
    assert main(["report", str(first), "--out", str(tmp_path / "rows")]) == 0
    assert f"warning: no {first / REPORT_INPUTS}: the report holds the rows of results.csv alone" in \
        capsys.readouterr().err
    rows_only = (tmp_path / "rows" / "report.md").read_text()
    assert rows_only.startswith("# Experiment run\n") and "## Base models" not in rows_only
    assert "images_per_s_across_runs" not in rows_only  # no spread record: no widened interval
    assert not (tmp_path / "rows" / REPORT_INPUTS).exists()  # nothing claims the run had no bases or targets


def test_a_candidates_line_says_its_interval_is_chained_and_within_one_run():
    """The interval of a candidate's images/s is a 95% interval chained with its reference's (at least 90%), and it
    holds within the run that measured it; the line that an over-budget error quotes says both."""
    from pipeline.select_model import Candidate

    line = Candidate("/ckpt/m", "powerbert", "lam0.05", 70.0, 0.002, 2000.0, "cpu", images_per_s_low=1950.0,
                     images_per_s_high=2050.0).line()
    assert "2000 [1950, 2050] (at least 90%, within this run) img/s (cpu)" in line, line
    assert "within this run" not in Candidate("/ckpt/m", "none", "full", 70.0, 0.002, 2000.0, "cpu").line()


def test_the_select_stage_refuses_speeds_timed_on_different_clocks():
    """One thread's CPU time and the wall clock (``experiment.eval.threads`` 1 and 2), or a record that did not say
    its clock: ratios that do not compare, refused in one line that counts each clock; one clock passes."""
    from pipeline.dag.select import check_one_clock
    from pipeline.dag.types import EvalResult
    from pipeline.errors import InputError

    def evaluation(clock):
        return EvalResult("r", "/ckpt", 70.0, 0.002, 2000.0, 10.0, 100, clock=clock)

    check_one_clock({"a": evaluation("cpu"), "b": evaluation("cpu")})
    with pytest.raises(InputError, match=r"^the evaluations' speeds were timed on different clocks \(cpu: 2 "
                                         r"model\(s\), wall: 1 model\(s\)\), which do not compare: "
                                         r".*--force evaluate`$"):
        check_one_clock({"a": evaluation("cpu"), "b": evaluation("wall"), "c": evaluation("cpu")})
    with pytest.raises(InputError, match=r"\(cuda: 1 model\(s\), not recorded: 1 model\(s\)\)"):
        check_one_clock({"a": evaluation("cuda"), "b": evaluation(None)})


def test_the_select_stage_refuses_a_scale_timed_on_another_clock_than_its_evaluations():
    """The scale is timed on whatever device the select stage's task gets: CUDA evaluations (reused from a GPU node)
    scaled on a CPU-only node's clock, or CPU ones on another clock, are refused in one line naming both clocks and
    devices; the evaluations' own clock passes."""
    from pipeline.bench.paired import SpeedRatio
    from pipeline.dag.select import check_scale_clock
    from pipeline.dag.types import EvalResult
    from pipeline.evaluate import Scale

    one = SpeedRatio(1.0, 1.0, 1.0, 0, "anchor", 0.0, 0.0)

    def scale(clock: str, name: str) -> Scale:
        return Scale("M32", 1000.0, {"M32": one}, one, clock, name)

    gpu = {"a": EvalResult("r", "/ckpt", 70.0, 0.002, 2000.0, 10.0, 100, device="cuda", clock="cuda",
                           device_name="NVIDIA H200")}
    check_scale_clock(gpu, scale("cuda", "NVIDIA H200"))
    with pytest.raises(InputError, match=r"^the select stage's speed scale was timed on the cpu clock \(AMD EPYC\), "
                                         r"the evaluations on the cuda clock \(NVIDIA H200\): their ratios do not "
                                         r"chain into one scale; .*--force evaluate`$"):
        check_scale_clock(gpu, scale("cpu", "AMD EPYC"))
    cpu = {"a": EvalResult("r", "/ckpt", 70.0, 0.002, 2000.0, 10.0, 100, clock="cpu", device_name="AMD EPYC")}
    with pytest.raises(InputError, match=r"timed on the wall clock \(AMD EPYC\), the evaluations on the cpu clock"):
        check_scale_clock(cpu, scale("wall", "AMD EPYC"))


@pytest.mark.parametrize("version", [None, 1])
def test_select_refuses_a_store_of_another_identity_version_with_runs_line(tmp_path, capsys, version):
    """A DAG parent recorded under identity version 1 (untagged: the only version before the tag, or tagged 1):
    `pipeline select` refuses it in the very line `pipeline run` gives (``records.check_identity_version``), instead of
    picking from stages whose ids this version does not share."""
    from pipeline.dag.records import IDENTITY_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("old", artifact_location=(tmp_path / "a").as_uri())
    parent = dag_parent(client, exp, "old", version=1)
    if version is None:
        client.delete_tag(parent, IDENTITY_TAG)
    finished_evaluation(client, exp, parent, {"top1": 70.0, "gflops": 0.002, "images_per_s": 500.0})
    assert main(["select", "--experiment", "old", "--tracking-uri", uri, "--max-gflops", "1"]) == 2
    err = capsys.readouterr().err
    from pipeline.config.identity import IDENTITY_VERSION
    from pipeline.dag.records import check_identity_version
    from pipeline.errors import InputError

    with pytest.raises(InputError) as run_says:
        check_identity_version(client, exp, uri, "old")
    assert str(run_says.value) in err and f"recorded under identity version 1; this pipeline's is {IDENTITY_VERSION}" \
        in err, err


def test_select_refuses_an_evaluation_the_select_stage_has_not_scaled(tmp_path, capsys):
    """An evaluation without the select stage's images/s (a DAG stopped between its evaluate and select stages) is no
    candidate to read a speed from (the evaluate stage's own figure is on no common scale): one line says what to
    run."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("x", artifact_location=(tmp_path / "a").as_uri())
    run = finished_evaluation(client, exp, dag_parent(client, exp, "half"),
                              {"top1": 70.0, "gflops": 0.002, "images_per_s": 500.0}, scaled=False)
    assert main(["select", "--experiment", "half", "--tracking-uri", uri, "--max-gflops", "1"]) == 2
    assert (f"experiment 'half': evaluation run {run} has no images/s on the select stage's scale "
            "(images_per_s_scaled): the DAG's select stage has not finished") in capsys.readouterr().err


def test_the_report_sets_each_base_beside_its_deit_2x_baseline():
    """Appendix C's comparison: each base's top-1 on data.val (test_top1 where a held-out split ranked it, else
    val_top1) beside its baseline finetune's (as many epochs again, no downsampling), and the difference, written
    out; a base without a baseline row has none."""
    from pipeline.report import deit_2x_rows

    bases = [{"arch": "M32", "val_top1": 69.65, "test_top1": None},
             {"arch": "M64", "val_top1": 70.0, "test_top1": 71.7}, {"arch": "M48", "val_top1": 1.0}]
    rows = [{"arch": "M32", "method": "none", "top1": 71.25}, {"arch": "M64", "method": "none", "top1": 74.3},
            {"arch": "M32", "method": "kmedoids", "top1": 99.0}]
    assert deit_2x_rows(bases, rows) == [
        {"arch": "M32", "base_top1": 69.65, "deit_2x_top1": 71.25, "gain": pytest.approx(1.6)},
        {"arch": "M64", "base_top1": 71.7, "deit_2x_top1": 74.3, "gain": pytest.approx(2.6)}]


@pytest.mark.slow  # an MLflow store of four DAGs: seconds
def test_select_refuses_an_evaluation_without_a_field_it_reads_in_one_line(tmp_path):
    """An evaluate run without the timed device's name (a KeyError before), or without its interval's ends (a budget
    held by the point value before, with no scope printed), or with threads that are no number, is one line naming
    the run and the field and saying what to run: never a traceback, never a pick by a figure the budget does not hold
    by. One store, a DAG a case."""
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("x", artifact_location=(tmp_path / "a").as_uri())
    params = {"checkpoint": "/ckpt/m", "method": "none", "level": "full", "eval_device": "cpu", "eval_threads": "1",
              "eval_device_name": "Test CPU", "eval_dtype": "fp32", "eval_compile": "none", "eval_batch": "64"}
    metrics = {"top1": 70.0, "gflops": 0.002, "images_per_s": 500.0, "images_per_s_scaled": 500.0,
               "images_per_s_low": 450.0, "images_per_s_high": 550.0}
    for dag, (drop, says) in enumerate((
            ("eval_device_name", "'s params: eval_device_name: missing"),
            ("images_per_s_low", "'s metrics: images_per_s_low: missing"),
            ("images_per_s_high", "'s metrics: images_per_s_high: missing"),
            ("eval_threads", r"'s params: eval_threads: String should match pattern .* \(got 'one'\)"))):
        run = client.create_run(exp, tags={"mlflow.parentRunId": dag_parent(client, exp, f"old{dag}"),
                                           "pipeline.stage": "evaluate", "pipeline.done": "1"}).info.run_id
        logged = {key: value for key, value in params.items() if key != drop} | (
            {"eval_threads": "one"} if drop == "eval_threads" else {})
        client.log_batch(run, params=[Param(key, value) for key, value in logged.items()],
                         metrics=[Metric(key, value, 0, 0) for key, value in metrics.items() if key != drop])
        with pytest.raises(InputError) as refused:  # `pipeline select` prints it as one line
            candidates(client, f"old{dag}")
        assert re.match(rf"experiment 'old{dag}': evaluation run {run}{says}; it was recorded by another release, or "
                        r"its DAG stopped before the select stage: run `pipeline run` with its config to the end",
                        str(refused.value)), refused.value
