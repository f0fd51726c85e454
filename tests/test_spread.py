"""The machine's run-to-run spread (``pipeline.spread``, ``pipeline doctor --speed``) and the tie margin it gives the
front by measured speed (``experiment.select.tie_margin``)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.config import ConfigError, load_config
from pipeline.errors import InputError, MissingFileError
from pipeline.pareto import Measured, measured_front
from pipeline.report import fronts, machine_lines
from pipeline.spread import (
    PairSpec,
    check_tie_margin,
    machine_record,
    measure_spread,
    read_record,
    record_path,
    spread_statistics,
    tie_margin,
    timing_setting,
)
from tests.conftest import HANG_S, LOOSE_TOLERANCE, one_evaluation_store

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "experiments" / "demo.yaml"
# The demo's evaluation setting (batch 64, dtype and compile auto) as the evaluate stage resolves it on a CPU and a GPU.
CPU, GPU = "cpu fp32 compile:none batch:64", "cuda bf16 compile:default batch:64"
SPEC = PairSpec(name="deit_tiny_patch16_224", args={"embed_dim": 32}, method="wkmedoids", keep=[24] * 4,
                kernels={}, eval={"batch": 64})


def test_the_statistics_against_figures_worked_by_hand():
    # mean 0.67; deviations -0.03, -0.01, 0.01, 0.03: squares sum to 0.002, / 3 -> sd 0.0258199; / 0.67
    figures = spread_statistics([0.64, 0.66, 0.68, 0.70], [0.01, 0.02, 0.015, 0.03])
    assert figures["between"] == pytest.approx(0.0385371, rel=1e-5)
    assert figures["max_over_min"] == pytest.approx(0.70 / 0.64)  # 1.09375
    assert figures["within"] == pytest.approx(0.0175)  # the median of four: (0.015 + 0.02) / 2
    with pytest.raises(InputError, match="at least 2"):
        spread_statistics([0.64], [0.01])


def fake_processes(ratios: list[float], run_s: float):
    """A ``run_one`` that returns ``ratios`` in turn and takes ``run_s`` on a fake clock, which ``sleep`` advances;
    ``starts`` lists the clock at each start."""
    now, starts = [0.0], []

    def run_one(spec: PairSpec) -> dict:
        starts.append(now[0])
        now[0] += run_s
        ratio = ratios[len(starts) - 1]
        return {"ratio": ratio, "low": ratio * 0.99, "high": ratio * 1.01, "half_width": 0.01, "blocks": 20,
                "stop": "tolerance", "seconds": run_s, "device": "Test CPU (R)", "setting": CPU,
                "threads": 1, "torch": "t", "timm": "m"}

    def sleep(seconds: float) -> None:
        now[0] += seconds

    return run_one, lambda: now[0], sleep, starts


def test_the_processes_are_spread_over_the_span_and_recorded(tmp_path):
    run_one, clock, sleep, starts = fake_processes([0.64, 0.66, 0.68, 0.70], run_s=5.0)
    lines = []
    out = tmp_path / "speed.json"
    record = measure_spread(SPEC, 4, 30.0, out=out, log=lines.append, run_one=run_one, clock=clock, sleep=sleep)
    assert starts == [0.0, 10.0, 20.0, 30.0]  # i * 30 / 3 after the first
    assert lines[1] == "[speed] 2/4: 0.660 [0.653, 0.667] (20 blocks, tolerance, +-1.0%)"
    assert record.between == pytest.approx(0.0385371, rel=1e-5) and record.within == pytest.approx(0.01)
    again = read_record(out)
    assert again == record and again.k == 4 and again.pair == asdict(SPEC) and again.seconds == 35.0
    assert "ratio 0.640 to 0.700 over 4 processes in 30 s, spread 3.9% (sd/mean)" in record.summary()
    # a process that runs past the next one's start: the next starts at once
    run_one, clock, sleep, starts = fake_processes([0.64, 0.66, 0.68], run_s=15.0)
    measure_spread(SPEC, 3, 20.0, out=out, log=lines.append, run_one=run_one, clock=clock, sleep=sleep)
    assert starts == [0.0, 15.0, 30.0]


def test_the_default_file_is_named_by_the_device_threads_and_setting(tmp_path):
    assert timing_setting("cpu", "fp32", "none", 64) == CPU
    assert record_path("Intel(R) Xeon(R) Processor", 2, CPU, tmp_path) == \
        tmp_path / "speed-intel-r-xeon-r-processor-t2-cpu-fp32-compile-none-batch-64.json"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(InputError, match="doctor --speed"):
        read_record(tmp_path / "bad.json")


def test_the_tie_margin_comes_from_the_timed_devices_record(tmp_path):
    """The margin is the record of the device the models were timed on, by its name: a record of another device
    (another node's card) is not this one's; several devices take the widest spread; ``run --plan`` of a local run
    checks this machine's device."""
    from pipeline.bench.blocks import device_name

    here = device_name(torch.device("cpu"))
    card = ("NVIDIA H200", GPU)
    assert tie_margin("none", [(here, CPU)], 1, tmp_path) == (0.0, None)
    assert tie_margin(0.02, [(here, CPU)], 1, tmp_path) == (0.02, None)
    with pytest.raises(MissingFileError, match=f"recorded for {re.escape(here)} \\({CPU}\\) at 1 thread.*pipeline "
                                               "doctor --speed"):
        tie_margin("machine", [(here, CPU)], 1, tmp_path)
    config = load_config(DEMO, ["experiment.select.tie_margin=machine"])
    with pytest.raises(ConfigError, match="no run-to-run spread is recorded"):
        check_tie_margin(config, "cpu", True, tmp_path)
    run_one, clock, sleep, _ = fake_processes([0.64, 0.66], run_s=1.0)
    out = record_path(here, 1, CPU, tmp_path)
    measure_spread(SPEC, 2, 0.0, out=out, log=lambda _: None, run_one=run_one, clock=clock, sleep=sleep)
    # two ratios: sd = 0.01 * sqrt(2), mean 0.65
    margin, shown = tie_margin("machine", [(here, CPU), (here, CPU)], 1, tmp_path)
    assert margin == pytest.approx(0.0141421 / 0.65, rel=1e-5) and shown.path == str(out)
    assert tie_margin("none", [(here, CPU)], 1, tmp_path) == (0.0, shown)  # shown beside the speeds without a margin
    check_tie_margin(config, "cpu", True, tmp_path)
    assert machine_record(here, 2, CPU, tmp_path) is None  # another thread count: another record
    assert machine_record(card[0], 1, card[1], tmp_path) is None
    with pytest.raises(MissingFileError, match=r"recorded for NVIDIA H200 \(cuda bf16 .*\) at 1 thread"):
        tie_margin("machine", [(here, CPU), card], 1, tmp_path)  # every device the models were timed on
    with pytest.raises(MissingFileError, match=r"recorded for no evaluated device"):
        tie_margin("machine", [], 1, tmp_path)
    wide = json.loads(out.read_text()) | {"device": "NVIDIA H200", "setting": GPU, "between": 0.05}
    record_path(card[0], 1, card[1], tmp_path).write_text(json.dumps(wide))  # as doctor --speed wrote it on a GPU node
    margin, shown = tie_margin("machine", [(here, CPU), card], 1, tmp_path)
    assert (margin, shown.device) == (0.05, "NVIDIA H200")  # mixed devices: the least steady one's spread
    text = "\n".join(machine_lines(machine_record(here, 1, CPU, tmp_path), 0.0))
    assert "spread 2.2% (sd/mean; 0.640 to 0.660)" in text and str(out) in text
    assert machine_lines(None, 0.0) == []  # no record, no margin: the report as before


def test_the_plan_check_for_a_cluster_needs_a_record_of_the_evaluations_kind_of_device(tmp_path):
    """On a cluster the evaluations' node is known only when they log it: the plan wants a readable record of the
    kind of device they will use (its setting's first word), at the threads; a broken one is refused by name."""
    from pipeline.errors import InputError

    config = load_config(DEMO, ["experiment.select.tie_margin=machine"])
    with pytest.raises(ConfigError, match="no run-to-run spread of a cuda device at 1 thread.*on the cluster's nodes"):
        check_tie_margin(config, "cuda", False, tmp_path)
    run_one, clock, sleep, _ = fake_processes([0.64, 0.66], run_s=1.0)
    cpu = record_path("Some CPU", 1, CPU, tmp_path)
    measure_spread(SPEC, 2, 0.0, out=cpu, log=lambda _: None, run_one=run_one, clock=clock, sleep=sleep)
    check_tie_margin(config, "cpu", False, tmp_path)
    with pytest.raises(ConfigError, match="of a cuda device"):
        check_tie_margin(config, "cuda", False, tmp_path)  # a CPU's record is not a GPU's
    card = json.loads(cpu.read_text()) | {"device": "NVIDIA H200", "setting": GPU}
    record_path("NVIDIA H200", 2, GPU, tmp_path).write_text(json.dumps(card))
    with pytest.raises(ConfigError, match="of a cuda device at 1 thread"):
        check_tie_margin(config, "cuda", False, tmp_path)  # at other threads
    record_path("NVIDIA H200", 1, GPU, tmp_path).write_text(json.dumps(card))
    check_tie_margin(config, "cuda", False, tmp_path)
    record_path("Broken", 1, CPU, tmp_path).write_text("{}")
    with pytest.raises(InputError, match="speed-broken-t1-cpu-fp32-compile-none-batch-64.json: not a record of "
                                         "`pipeline doctor --speed`"):
        check_tie_margin(config, "cuda", False, tmp_path)


def test_run_plan_checks_the_margin_for_the_device_the_evaluations_will_use(tmp_path, monkeypatch):
    """``run --plan`` of a local run (``eval.device: auto``) on a machine without a GPU: this CPU's record, looked
    up under the working folder's runs/machine/, after the cluster's checks."""
    from pipeline.bench.blocks import device_name
    from pipeline.dag import checks

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(checks, "local_resources", lambda gpus: {"CPU": 2.0, "GPU": 0.0})
    # its latency targets' tables are read relative to the checkout: none here
    config = load_config(DEMO, ["experiment.select.tie_margin=machine", "experiment.ksearch_targets=null"])
    monkeypatch.chdir(tmp_path)
    here = device_name(torch.device("cpu"))
    with pytest.raises(ConfigError, match=f"recorded for {re.escape(here)} \\({CPU}\\) at 1 thread"):
        checks.plan_checks(config)
    run_one, clock, sleep, _ = fake_processes([0.64, 0.66], run_s=1.0)
    measure_spread(SPEC, 2, 0.0, out=record_path(here, 1, CPU), log=lambda _: None, run_one=run_one, clock=clock,
                   sleep=sleep)
    assert checks.plan_checks(config)


@pytest.mark.parametrize(("device", "address", "gpus", "checked"), [
    ("auto", None, 0.0, ("cpu", True)), ("auto", None, 1.0, ("cuda", True)), ("cpu", None, 1.0, ("cpu", True)),
    ("auto", "ray://head:10001", 0.0, ("cpu", False)), ("auto", "ray://head:10001", 4.0, ("cuda", False)),
    ("cuda", "ray://head:10001", 4.0, ("cuda", False)),
])
def test_the_plan_checks_the_margin_on_the_device_the_evaluate_stage_picks(device, address, gpus, checked,
                                                                           monkeypatch):
    """``eval.device`` resolved as ``dag.stages.eval_task`` resolves it: ``auto`` is a GPU where the cluster (or,
    for a local run, this machine) has one; a local run checks this machine's record, a cluster's run a record of
    the kind of device (``here`` False). Ray is faked: the cluster's resources are ``gpus``."""
    import types

    from pipeline.dag import checks

    seen = []
    fake_ray = types.SimpleNamespace(cluster_resources=lambda: {"CPU": 8.0, "GPU": gpus},
                                     nodes=lambda: [{"Alive": True}])
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(checks, "connect_ray", lambda where: None)
    monkeypatch.setattr(checks, "local_resources", lambda wanted: {"CPU": 8.0} | ({"GPU": gpus} if wanted else {}))
    monkeypatch.setattr(checks, "check_tie_margin", lambda config, kind, here: seen.append((kind, here)))
    config = load_config(DEMO, ["experiment.select.tie_margin=machine", f"experiment.eval.device={device}"])
    checks.check_cluster(config, [], address)
    assert seen == [checked]
    seen.clear()
    checks.check_cluster(load_config(DEMO, [f"experiment.eval.device={device}"]), [], address)
    assert seen == []  # no margin from a record: nothing to check


def test_a_model_one_percent_slower_is_a_tie_at_a_two_percent_margin():
    # seconds per image [low, high]: "slower" is 1% slower, its interval clear of "fast"'s, and less accurate
    fast, slower = Measured("fast", 1.000, 1.002, 70.0), Measured("slower", 1.010, 1.012, 69.0)
    assert measured_front([fast, slower]) == [(fast, [])]
    assert measured_front([fast, slower], 0.02) == [(fast, ["slower"]), (slower, ["fast"])]
    # 3% slower: off the front at 2% as well
    far = Measured("far", 1.030, 1.032, 69.0)
    assert measured_front([fast, far], 0.02) == [(fast, [])]


def test_the_reports_front_takes_the_margin():
    def row(name: str, rate: float, top1: float) -> dict:
        return {"arch": "M32", "level": name, "method": "random", "gflops": 0.001, "top1": top1, "stage_id": name,
                "images_per_s": rate, "images_per_s_low": rate * 0.999, "images_per_s_high": rate * 1.001}

    rows = [row("fast", 1000.0, 70.0), row("slower", 990.0, 69.0)]
    assert [r["level"] for r in fronts(rows, "images_per_s")["all"]] == ["fast"]
    front = fronts(rows, "images_per_s", 0.02)["all"]
    assert [(r["level"], r["speed_ties"]) for r in front] == [("fast", "M32/slower/random"),
                                                              ("slower", "M32/fast/random")]


@pytest.mark.parametrize(("flags", "message"), [
    (["--speed", "--processes", "1"], "--processes 1: a spread between processes needs at least 2"),
    (["--speed", "--over-s", "-5"], "--over-s -5: give the span"),
    (["--processes", "3"], "--processes, --over-s and --out go with --speed"),
])
def test_doctor_speed_refuses_bad_flags_in_one_line(flags, message, capsys):
    assert main(["doctor", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.speed
def test_doctor_speed_runs_two_processes_through_the_cli(tmp_path):
    out = tmp_path / "speed.json"
    done = subprocess.run([sys.executable, "-m", "pipeline", "doctor", "--speed", "--processes", "2", "--over-s", "0",
                           "--set", f"experiment.eval.speed_cap_s={HANG_S}",
                           "--set", f"experiment.eval.speed_tolerance={LOOSE_TOLERANCE}",
                           "--set", "experiment.eval.batch=8",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=2 * HANG_S)
    assert done.returncode == 0, done.stderr
    assert "[speed] 2/2: " in done.stderr
    assert done.stdout.startswith("between processes: ratio ") and f"recorded in {out}" in done.stdout
    record = json.loads(out.read_text())
    assert len(record["processes"]) == 2 and record["pair"]["eval"]["batch"] == 8 and record["threads"] == 1


def test_select_prints_the_timed_devices_spread_beside_the_interval(tmp_path, monkeypatch, capsys):
    """``pipeline select`` names the record (runs/machine/ under the working folder) of the device the pick was
    timed on, by the name its evaluation logged, whichever machine runs select; without one its output is as
    before."""

    from pipeline.dag.records import RATE_HIGH, RATE_LOW, SCALED_RATE

    monkeypatch.chdir(tmp_path)
    uri = one_evaluation_store(tmp_path, "x", "spread", "/ckpt/m", {
        "top1": 70.0, "gflops": 0.002, "images_per_s": 2000.0, SCALED_RATE: 2000.0, RATE_LOW: 1950.0,
        RATE_HIGH: 2050.0}, eval_device_name="Another Node's CPU")
    args = ["select", "--experiment", "spread", "--tracking-uri", uri, "--min-images-per-s", "1000"]
    run_one, clock, sleep, _ = fake_processes([0.64, 0.66], run_s=1.0)
    from pipeline.bench.blocks import device_name

    here = record_path(device_name(torch.device("cpu")), 1, CPU)  # this machine's: not where the pick was timed
    measure_spread(SPEC, 2, 0.0, out=here, log=lambda _: None, run_one=run_one, clock=clock, sleep=sleep)
    assert main(args) == 0
    assert "machine_spread" not in capsys.readouterr().out
    for other in ("cpu bf16 compile:none batch:64", "cpu fp32 compile:default batch:64",
                  "cpu fp32 compile:none batch:8"):
        record_path("Another Node's CPU", 1, other).write_text(here.read_text())  # its records of other settings
    assert main(args) == 0
    assert "machine_spread" not in capsys.readouterr().out  # widen nothing: the pick was timed in none of them
    there = record_path("Another Node's CPU", 1, CPU)
    there.write_text(here.read_text())
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    line = next(x for x in out if x.startswith("machine_spread: "))
    assert line.startswith("machine_spread: 2.2% between processes (sd/mean), median half-width 1.0% within one (")
    assert str(there) in line
    # [1950, 2050] widened by 1.96 times the record's spread at 2000 img/s, each side apart (written out)
    between = statistics.stdev([0.64, 0.66]) / 0.65
    wide = (50.0 ** 2 + (1.959964 * between * 2000.0) ** 2) ** 0.5
    across = next(x for x in out if x.startswith("images_per_s_across_runs: "))
    assert across.startswith(f"images_per_s_across_runs: [{2000 - wide:.1f}, {2000 + wide:.1f}] (the interval "
                             "widened by that spread, each side apart; measured with 2 processes over 0 s, "), across


def test_the_tie_margin_leaves_the_experiments_id_alone():
    """Another margin reads the same evaluations: the DAG's parent run (its id) is the same, and so is the id of
    a config that does not set it."""
    from pipeline.dag.plan import dag_id

    assert dag_id(load_config(DEMO)) == dag_id(load_config(DEMO, ["experiment.select.tie_margin=0.02"]))
