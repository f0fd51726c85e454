"""The stage DAG for real on tiny synthetic data: interrupted, resumed, rerun, rehearsed, a plugin method on Ray's
workers. Its expansion, identities and refusals, which run nothing: tests/test_dag_plan.py."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from pipeline.bench.blocks import device_name
from pipeline.config import load_config
from pipeline.dag.plan import count_plan
from pipeline.dag.records import DONE, STAGE_KIND
from pipeline.dag.runner import run_experiment
from pipeline.train.checkpoint import model_from_checkpoint
from tests.conftest import write_plugin
from tests.processes import ROOT
from tests.tiny_dag import REHEARSED, TARGET, TINY, rehearsal_rows, tiny_overrides


@pytest.fixture(scope="module")
def data(synthetic_data) -> Path:
    return synthetic_data(192, 48)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The killed-driver DAG's runs and stores, which later tests of this file read."""
    return tmp_path_factory.mktemp("dag")


def runs_by_kind(root: Path) -> dict[str, list]:
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("token-pooling")
    if experiment is None:
        return {}
    out: dict[str, list] = {}
    for run in client.search_runs([experiment.experiment_id], max_results=1000):
        out.setdefault(run.data.tags.get(STAGE_KIND, "?"), []).append(run)
    return out


def start(root: Path, data: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline", "run", str(TINY)]
    for item in [*tiny_overrides(root, data), TARGET]:
        command += ["--set", item]
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.ray
@pytest.mark.beton
def test_dag_survives_a_killed_driver_then_reruns_without_training(root, data):
    # 1. Start the whole DAG and kill the driver (and its local Ray) once the finetune sweep has results.
    MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").search_experiments()  # schema first: no race
    first = start(root, data, root / "first.log")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and first.poll() is None:
        done = [r for r in runs_by_kind(root).get("finetune", []) if r.data.tags.get(DONE) == "1"]
        if done:
            break
        time.sleep(2)
    assert first.poll() is None, (root / "first.log").read_text()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    finished_before = {r.data.tags["pipeline.stage_id"] for r in runs_by_kind(root)["finetune"]
                       if r.data.tags.get(DONE) == "1"}
    assert finished_before

    # 2. The same command resumes: finished stages are skipped, the rest run, nothing is counted twice.
    log = root / "second.log"
    second = start(root, data, log)
    assert second.wait(timeout=1200) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "Pareto front" in text and "registry: token-pooling-tiny@pareto-1" in text
    # Ray Train's preemption watcher is off on a local Ray, and MLflow's pickle warning (once per registered
    # model) is said once, in the registry line.
    assert "PreemptionWatcher" not in text and "Saving pytorch model by Pickle" not in text
    assert "pickled modules: load them only from a store you trust" in text
    by_kind = runs_by_kind(root)
    plan = count_plan(load_config(TINY, [*tiny_overrides(root, data), TARGET]))
    # The driver skips what MLflow records done before it starts a trial: the K search had finished.
    assert f"[skip] tiny-ksearch: {plan.ksearch} of {plan.ksearch} stage(s) done in MLflow" in text
    assert "[sweep] tiny-ksearch" not in text
    skipped = int(re.search(rf"\[skip\] tiny-finetune: (\d+) of {plan.finetune} stage", text).group(1))
    assert skipped >= len(finished_before)
    if skipped < plan.finetune:  # the kill came between two finetunes (all twelve may finish within a poll)
        left = plan.finetune - skipped
        assert f"[sweep] tiny-finetune: {left} trial(s)" in text
        # Tune runs silent; the sweep's callback counts the finished trials instead of a table per trial.
        assert f"[sweep] tiny-finetune: {left} of {left} trial(s) finished" in text
        assert "started with configuration" not in text and "completed after" not in text
    for kind in ("base", "ksearch", "finetune", "evaluate"):
        done_ids = [r.data.tags["pipeline.stage_id"] for r in by_kind[kind] if r.data.tags.get(DONE) == "1"]
        assert len(done_ids) == len(set(done_ids)), f"{kind}: a stage was recorded twice"
    assert len([r for r in by_kind["finetune"] if r.data.tags.get(DONE) == "1"]) <= plan.finetune
    results = (root / "experiments" / "tiny" / "results.csv").read_text().strip().splitlines()
    finetunes = [r for r in by_kind["finetune"] if r.data.tags.get(DONE) == "1"]
    assert len(results) - 1 == len(finetunes)  # one row per finetuned model, no duplicates
    assert finished_before <= {r.data.tags["pipeline.stage_id"] for r in finetunes}

    # 3. MLflow: one parent run; every stage run is its child; the report and K lists are artifacts.
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (parent,) = by_kind["dag"]
    # the select stage tags the parent with experiment.select.tie_margin (tiny.yaml's: none) and the margin it used
    assert (parent.data.tags["pipeline.tie_margin_choice"], parent.data.tags["pipeline.tie_margin"]) == ("none", "0")
    for kind in ("base", "ksearch", "finetune", "evaluate"):
        assert all(r.data.tags.get("mlflow.parentRunId") == parent.info.run_id for r in by_kind[kind]), kind
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/results.csv", "report/pareto.csv", "report/pareto_speed.csv", "report/budgets.csv",
            "report/report.md", "report/tradeoff.png", "report/tradeoff_speed.png", "report/widths.png",
            "report/keep_lists.png"} <= artifacts
    ksearch = [r for r in by_kind["ksearch"] if r.data.tags.get(DONE) == "1"]
    assert all("keep.json" in {a.path for a in client.list_artifacts(r.info.run_id)} for r in ksearch)
    from pipeline.report import read_csv

    rows = read_csv(root / "experiments" / "tiny" / "results.csv")
    # Every evaluation names the kernel choice and what its dispatches ran: the CPU's native K-Medoids at the N of
    # each block its keep list pools in, for WK-Medoids alone (PoWER-BERT and the baseline run none).
    for row in rows:
        evaluation = client.get_run(row["analysis"].rsplit("/artifacts/analysis", 1)[0].rsplit("/", 1)[1]).data
        ran = evaluation.params
        assert ran["kernels.kmedoids"] == "auto" and "kernels_run.attention" in ran and "kernels_run.torch" in ran
        # the clock its speed was timed on (one thread: the thread's CPU time), and the interval's half-width as
        # results.csv has it (half the interval's width over the ratio, written out)
        assert ran["eval_clock"] == "cpu", ran
        low, ratio, high = row["speed_ratio_low"], row["speed_ratio"], row["speed_ratio_high"]
        assert evaluation.metrics["speed_half_width"] == pytest.approx((high - low) / 2 / ratio)
        n, pooled = 16, []  # the tokens entering each block, and those of the blocks that pool
        for k in row["keep"] or []:
            pooled += [n] if 0 < k < n and n not in pooled else []
            n = min(n, k)
        want = "none noted"
        if row["method"] == "wkmedoids" and pooled:
            want = f"native-c (N={', '.join(map(str, pooled))})"
        assert ran["kernels_run.kmedoids"] == want, (row["method"], row["keep"], ran)
    # Each evaluated model carries its analyses (linked from results.csv): maps for a downsampling model,
    # the reconstruction error where its keep list downsamples at some block, the redundancy always.
    for row in rows:
        run_id = row["analysis"].rsplit("/artifacts/analysis", 1)[0].rsplit("/", 1)[1]
        files = {a.path for a in client.list_artifacts(run_id, "analysis")}
        maps = {a.path for a in client.list_artifacts(run_id, "analysis/maps")}
        assert {"analysis/redundancy.csv", "analysis/redundancy.png"} <= files, files
        assert len(maps) == (0 if row["method"] == "none" else 4), maps  # 2 images x (own method + sheet)
        downsamples = row["keep"] is not None and any(0 < k < 16 for k in row["keep"])
        assert ("analysis/reconstruction.csv" in files) == downsamples, (row["keep"], files)
    assert any(0 < k < 16 for row in rows if row["keep"] for k in row["keep"])  # the check above bites somewhere
    report = (root / "experiments" / "tiny" / "report.md").read_text()
    assert "## Analysis artifacts" in report
    # Deployment-aware selection: the speed front, measured in the setting the evaluate stage resolved.
    heading = ("## Pareto front by measured speed (images/s higher, top-1 higher) (measured cpu fp32 compile:none "
               "clock:cpu)")
    assert heading in report
    assert {row["speed_setting"] for row in rows} == {"cpu fp32 compile:none clock:cpu"}
    version = client.get_model_version_by_alias("token-pooling-tiny", "best")
    assert version.run_id in {r.info.run_id for r in finetunes}

    # 4. A third run, with another tie margin (not part of the DAG's id), trains nothing, records nothing new and
    # starts no Tune sweep or evaluation task; its select stage retags the same parent run with the new margin.
    counts = {kind: len(runs) for kind, runs in by_kind.items()}
    sweeps = sorted(p.name for p in (root / "ray").iterdir())
    lines: list[str] = []
    margin = "experiment.select.tie_margin=0.02"
    third = run_experiment(load_config(TINY, [*tiny_overrides(root, data), TARGET, margin]), log=lines.append)
    assert {kind: len(runs) for kind, runs in runs_by_kind(root).items()} == counts
    tags = client.get_run(parent.info.run_id).data.tags
    assert (tags["pipeline.tie_margin_choice"], tags["pipeline.tie_margin"]) == ("0.02", "0.02")
    assert len(third["rows"]) == len(finetunes)
    assert sorted(p.name for p in (root / "ray").iterdir()) == sweeps
    assert not [line for line in lines if line.startswith(("[sweep]", "[evaluate]", "[run]"))], lines
    for name, total in (("ksearch", plan.ksearch), ("finetune", plan.finetune), ("evaluate", plan.evaluate)):
        assert f"[skip] tiny-{name}: {total} of {total} stage(s) done in MLflow" in lines, lines

    # 5. The K search toward 0.6 of the unmodified GFLOPs: each width's search reports how it landed, its
    # PoWER-BERT finetune is under the target by the evaluate stage's count, and the report, the printed front and
    # the registry show it.
    searches = [r for r in by_kind["ksearch"]
                if r.data.tags.get(DONE) == "1" and "-gf0.6-" in r.data.tags["mlflow.runName"]]
    assert len(searches) == 2  # one per width
    for search in searches:
        metrics = client.get_run(search.info.run_id).data.metrics
        assert metrics["target"] == 0.6 and 0 < metrics["target_rounded"] <= 0.6 and metrics["target_landed"] > 0
    targets = list(csv.DictReader((root / "experiments" / "tiny" / "targets.csv").open()))
    assert sorted(r["arch"] for r in targets) == ["M16", "M24"] and {r["method"] for r in targets} == {"powerbert"}
    for row in targets:
        assert row["level"] == "gf0.6" and row["cost_status"].startswith("measured")
        assert 0 < float(row["searched"]) <= 1  # where the search landed before rounding, from its run
        # the closed forms equal the evaluate stage's fvcore count, and the rounded keep list is under the target
        assert float(row["predicted"]) == pytest.approx(float(row["measured"]), rel=1e-9)
        assert float(row["measured"]) <= float(row["target_cost"]) * (1 + 1e-9)
    assert {r["level"] for r in rows} >= {"gf0.6"}
    assert "## K-search targets" in report
    assert "target_cost" in text  # the printed Pareto front carries the columns
    assert client.get_model_version_by_alias("token-pooling-tiny", "target-gf0_6").tags["level"] == "gf0.6"


LOAD_AND_PREDICT = """
import json, sys
import mlflow
import numpy as np
import pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
pixels = np.load(sys.argv[2])
answers = model.predict(pd.DataFrame({"image": list(pixels)}), params={"top_k": 2})
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "ray" or m.startswith(("pipeline.train", "pipeline.dag")))
print(json.dumps({"training_code": loaded, "metadata": model.metadata.metadata,
                  "answers": answers.to_dict(orient="records")}))
"""


@pytest.mark.ray
@pytest.mark.beton
def test_registered_best_model_loads_in_a_fresh_process_and_names_classes(root, data, tmp_path):
    """The select stage registers image classifiers; one loads in an interpreter outside the checkout (its
    code travels with it) and answers uint8 images with the dataset's class names, as the model here does."""
    from timm.data import create_transform, resolve_model_data_config

    uri = f"sqlite:///{root / 'mlflow.db'}"
    config = load_config(TINY, tiny_overrides(root, data))
    run_experiment(config, log=lambda _: None)  # finishes the DAG if it is not (finished stages are skipped)
    client = MlflowClient(tracking_uri=uri)
    versions = sorted((v.version, v.source) for v in client.search_model_versions("name = 'token-pooling-tiny'"))
    summary = run_experiment(config, log=lambda _: None)
    assert sorted((v.version, v.source) for v in client.search_model_versions("name = 'token-pooling-tiny'")) \
        == versions  # registering again adds nothing
    assert {"token-pooling-tiny@best", "token-pooling-tiny@pareto-1"} <= set(summary["aliases"])
    assert any("@fastest-under-" in alias for alias in summary["aliases"])
    best = client.get_model_version_by_alias("token-pooling-tiny", "best")
    assert best.source.startswith("models:/") and best.tags["pipeline.serving"] == "image-classifier"
    row = next(r for r in summary["rows"] if r["run_id"] == best.run_id)
    model, _, _ = model_from_checkpoint(row["checkpoint"])
    pixels = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    transform = create_transform(**resolve_model_data_config(model), is_training=False)
    from PIL import Image

    with torch.no_grad():
        probs = model(torch.stack([transform(Image.fromarray(p)) for p in pixels])).softmax(-1)
    np.save(tmp_path / "pixels.npy", pixels)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MLFLOW_TRACKING_URI": uri}
    loaded = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, "models:/token-pooling-tiny@best",
                             str(tmp_path / "pixels.npy")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    facts = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert facts["training_code"] == []
    assert facts["metadata"]["method"] == row["method"] and facts["metadata"]["keep"] == row["keep"]
    values, indices = probs.topk(2, dim=-1)
    for answer, value, index in zip(facts["answers"], values.tolist(), indices.tolist()):
        assert [c["label"] for c in answer["top_k"]] == [f"class_{i:03d}" for i in index]
        np.testing.assert_allclose([c["probability"] for c in answer["top_k"]], value, rtol=1e-5, atol=1e-6)


@pytest.mark.ray
@pytest.mark.beton
def test_models_without_finetuning_are_evaluated_beside_the_finetunes_and_kept_out_of_the_fronts(root, data):
    """experiment.no_finetune on the killed-driver DAG's stores (one width, one lambda): only the new evaluations run
    (every trained stage is found done). Each evaluates the base's weights with K-Medoids inserted at the level's keep
    list, with and without carry, as `pipeline evaluate` does off the shelf (an independent path: the analysis
    loader and classifier); they are in MLflow tagged not finetuned, in the report's own section, table and figure,
    and in no front."""
    from pipeline.analysis.offshelf import offshelf_rows
    from pipeline.analysis.probe import load_subject
    from pipeline.dag.records import FINETUNED, TRAINED_RUN

    lines: list[str] = []
    overrides = [*tiny_overrides(root, data), "experiment.embed_dims=[16]", "experiment.lambdas=[0.05]",
                 "experiment.register_models=false", "experiment.name=tiny-noft",
                 "experiment.no_finetune={methods: [kmedoids], carry: [false, true]}"]
    summary = run_experiment(load_config(TINY, overrides), log=lines.append)
    assert not [line for line in lines if line.startswith(("[sweep]", "[run]"))], lines  # nothing trained
    assert "[evaluate] 3 model(s) without finetuning: top-1, GFLOPs, images/s at batch 8" in lines
    rows = summary["no_finetune"]
    assert [(r["method"], r["level"], r["carry"]) for r in rows] == [
        ("none", "full", False), ("kmedoids", "lam0.05", False), ("kmedoids", "lam0.05", True)]
    untrained = {r["run_id"] for r in rows}  # their evaluation runs
    # every row of the report's fronts is a finetuned model (the level's two finetunes and the baseline, as before)
    assert sorted((r["method"], r["level"]) for r in summary["rows"]) == [
        ("none", "full"), ("powerbert", "lam0.05"), ("wkmedoids", "lam0.05")]
    assert all(r["train_top1"] is not None for r in summary["front"])
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    runs = {run_id: client.get_run(run_id).data for run_id in untrained}
    assert {run.tags[FINETUNED] for run in runs.values()} == {"false"}
    (checkpoint,) = {run.params["checkpoint"] for run in runs.values()}  # the base's, for all three
    (base_run,) = {run.tags[TRAINED_RUN] for run in runs.values()}
    assert client.get_run(base_run).data.tags[STAGE_KIND] == "base"
    keep = [int(k) for k in rows[1]["keep"].split(",")]
    offshelf = offshelf_rows(load_subject(checkpoint), data / "val.beton", ["kmedoids"], [keep], [False, True],
                             log=lambda _: None)
    for row, reference in zip(rows, offshelf):
        assert (row["method"], row["carry"]) == (reference["method"], reference["carry"])
        assert row["top1"] == pytest.approx(reference["top1"], abs=1e-9), (row, reference)
        assert row["gflops"] == pytest.approx(reference["gflops"], rel=1e-9)
    out = root / "experiments" / "tiny-noft"
    report = (out / "report.md").read_text()
    assert "## Without finetuning (Appendix E)" in report and "![M16 without finetuning](no_finetune_M16.png)" in report
    assert [(r["method"], r["carry"]) for r in csv.DictReader((out / "no_finetune.csv").open())] == [
        ("none", "False"), ("kmedoids", "False"), ("kmedoids", "True")]
    assert (out / "no_finetune_M16.png").stat().st_size > 0


@pytest.mark.ray
def test_sweep_progress_counts_finished_trials_and_gives_a_failed_trials_error_file():
    from types import SimpleNamespace

    import cloudpickle

    from pipeline.dag.sweep import progress_callback

    lines: list[str] = []
    callback = progress_callback("demo-finetune", 3, lines.append)
    trial = SimpleNamespace(trial_id="_trial_00001", error_file="/runs/ray/t1/error.txt")
    callback.on_trial_complete(1, [], trial)
    callback.on_trial_error(1, [], trial)
    callback.on_trial_complete(2, [], trial)
    assert lines == ["[sweep] demo-finetune: 1 of 3 trial(s) finished",
                     "[sweep] demo-finetune: trial _trial_00001 failed (error file: /runs/ray/t1/error.txt)",
                     "[sweep] demo-finetune: 2 of 3 trial(s) finished"]
    cloudpickle.loads(cloudpickle.dumps(callback))  # Tune stores its run config with the experiment


@pytest.mark.ray
@pytest.mark.beton
@pytest.mark.speed  # the DAG run of `make test-under-load`: its evaluate and select stages time models
def test_a_plugin_method_runs_through_the_dag_on_ray_workers(synthetic_data, tmp_path):
    """A method of another installed package (entry point group pipeline.methods) goes through the whole
    DAG: config validation in the driver, Ray Train workers for the K search and the finetune (trial_workers 1;
    the base, which does not run the plugin, trains in the driver), evaluation tasks, and the Pareto table. Its
    own option comes from the config (offset), a name it shares with the built-in methods keeps its own default
    (iters: 1, not the clustering methods' 5), and its package and version are tagged on its finetune and evaluation
    runs."""
    data = synthetic_data(64, 32)
    plugin = write_plugin(tmp_path / "site")
    overrides = [*tiny_overrides(tmp_path, data), "experiment.search.trial_workers=1",
                 "experiment.embed_dims=[16]", "experiment.lambdas=[0.05]", "experiment.methods=[firstk]",
                 "experiment.baseline=false", "experiment.ksearch.epochs=1", "experiment.eval.analysis_images=0",
                 "experiment.eval.analysis_batch=0", "experiment.register_models=false",
                 "pooling.options.firstk.offset=3"]
    command = [sys.executable, "-m", "pipeline", "run", str(TINY), *[a for item in overrides for a in ("--set", item)]]
    builds = tmp_path / "builds.log"  # the plugin notes each operator it builds, with its options and process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]), "TP_PLUGIN_LOG": str(builds)}
    driver = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = driver.communicate(timeout=900)
    proc = subprocess.CompletedProcess(command, driver.returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    built = [line.split(" ", 1) for line in builds.read_text().splitlines()]
    # built with the config's options in Ray's worker processes; the driver builds it too, for `run --plan`'s check
    # of its operator (at the config's options and at its defaults: offset 1)
    workers = {options for pid, options in built if pid != str(driver.pid)}
    assert workers == {"offset=3 iters=1"}, built
    assert {options for pid, options in built if pid == str(driver.pid)} == {"offset=3 iters=1", "offset=1 iters=1"}
    # Quiet by default: the stage, per-epoch progress, sweep counters, evaluations and the Pareto table, not
    # Ray Train's per-report and per-checkpoint lines nor numba's finalizer tracebacks.
    output = proc.stdout + proc.stderr
    for noise in ("Reporting training result", "Checkpoint successfully created", "Exception ignored",
                  "Configuration for experiment", "Setting up process group"):
        assert noise not in output, noise
    for line in ("[run] tiny-base-M16", "epoch 1/1 loss", "[sweep] tiny-finetune: 1 of 1", "[evaluate] 1/1",
                 "Pareto front"):
        assert line in output, line
    rows = (tmp_path / "experiments" / "tiny" / "results.csv").read_text().splitlines()
    assert len(rows) == 2 and ",firstk," in rows[1], rows
    runs = runs_by_kind(tmp_path)
    finetunes, evaluations = runs["finetune"], runs["evaluate"]
    assert [run.data.tags["method"] for run in finetunes] == ["firstk"]
    assert finetunes[0].data.params["pooling.options.firstk.offset"] == "3"
    for run in (*finetunes, *evaluations):
        assert (run.data.tags["pipeline.plugin"], run.data.tags["pipeline.plugin_version"]) == ("tp-plugin", "0.1")
    assert len(evaluations) == 1 and "pipeline.plugin" not in runs["base"][0].data.tags
    # the device it was timed on, by the name its spread record has (pipeline select looks the record up by it)
    assert evaluations[0].data.params["eval_device_name"] == device_name(torch.device("cpu"))


def resident_high_mark_mb() -> float:
    """This process's peak resident memory in MB, as Linux reports it in /proc/self/status (VmHWM, in kB)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, flags=re.M).group(1)) / 1024


def planted_checkout(where: Path) -> Path:
    """A copy of the package with a fault planted in PoWER-BERT's ``select_topk`` (it raises), as an edit to the
    code would; the config is untouched."""
    import shutil

    shutil.copytree(ROOT / "pipeline", where / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    with (where / "pipeline" / "pooling" / "selection.py").open("a") as module:
        module.write("\n\ndef select_topk(*args, **kwargs):\n"
                     "    raise RuntimeError('a fault planted in select_topk')\n")
    return where


@pytest.mark.ray
@pytest.mark.beton
def test_a_second_rehearsal_into_the_same_folder_runs_todays_code(root, data, tmp_path):
    """``pipeline run --rehearse`` on a slice of the tiny experiment passes every kind (base, K search, both
    finetunes, their evaluations, select, register, one served request) with its step times and memory, in its own
    folder and MLflow store. Then a fault is planted in the code (PoWER-BERT's ``select_topk`` raises), the config
    unchanged, and a failure in WK-Medoids' finetune (``--rehearse-fail``), and the rehearsal runs again into the
    same folder: it starts from a clean store (its data kept), so nothing is reused, both finetunes fail, each named
    with its own error, nothing is evaluated, and the exit status is 1."""
    from pipeline.dag.rehearse import RehearsalSettings, run_rehearsal

    before = {kind: len(runs) for kind, runs in runs_by_kind(root).items()}
    overrides = [*tiny_overrides(root, data), *REHEARSED]
    lines: list[str] = []
    folder = tmp_path / "rehearsal"
    high_before = resident_high_mark_mb()
    assert run_rehearsal(load_config(TINY, overrides), RehearsalSettings(root=folder, steps=1), log=lines.append) == 0
    high_after = resident_high_mark_mb()
    text = "\n".join(lines)
    rows = rehearsal_rows(text)
    assert {cells[2] for cells in rows.values()} == {"pass"}, rows
    assert sorted(cells[0].strip("| ") for cells in rows.values()) == [
        "base", "evaluate", "evaluate", "finetune", "finetune", "ksearch", "register", "select", "serve"], rows
    # A step time, and the memory high mark of the process that ran the stage, in MB: the base trained in this
    # process (train.workers 0), so its mark lies between this process's marks before and after the rehearsal, as
    # the kernel reports them (not KiB, not bytes, not another process's); the others, in Ray's processes, under
    # this machine's memory.
    ceiling = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    base = float(rows["tiny-rehearsal-base-M16"][4].replace(",", ""))
    assert high_before - 5 <= base <= high_after + 5, (high_before, high_after, rows)
    peaks = [cells[4] for cells in rows.values() if cells[0] in ("| ksearch", "| finetune", "| evaluate")]
    assert all(0 < float(peak.replace(",", "")) < ceiling for peak in peaks), (ceiling, peaks)
    assert all(float(cells[3]) > 0 for cells in rows.values() if cells[0] in ("| base", "| ksearch", "| finetune"))
    assert "answered 'class_" in rows["one request to token-pooling-tiny-rehearsal@best"][6]
    assert re.search(r"projected GPU-hours of the full experiment: \S+ to \S+ \(", text), text[-2000:]
    assert lines[-1].startswith("9 of 9 passed in ")
    # The finetunes pooled: a keep list below the 16 patch tokens somewhere (the rehearsal's own, when the
    # K search's single step kept every token).
    results = (folder / "experiments" / "tiny-rehearsal" / "results.csv").read_text()
    keep = json.loads(re.search(r'"(\[[\d, ]+\])"', results).group(1))
    assert len(keep) == 3 and min(keep) < 16, results
    # Its own store and experiment names: the experiment's store saw nothing.
    assert {kind: len(runs) for kind, runs in runs_by_kind(root).items()} == before
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("token-pooling-rehearsal")
    parents = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{STAGE_KIND}` = 'dag'")
    assert [run.info.run_name for run in parents] == ["tiny-rehearsal"]
    data = {p: p.stat().st_mtime_ns for p in (folder / "data").glob("*.beton")}

    # Today's code has a fault; the same config, the same folder.
    checkout = planted_checkout(tmp_path / "checkout")
    command = [sys.executable, "-m", "pipeline", "run", str(TINY), "--rehearse", "--rehearse-dir", str(folder),
               "--rehearse-steps", "1", "--rehearse-fail", "wkmedoids", *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.run(command, cwd=checkout, env=os.environ | {"PYTHONPATH": str(checkout)}, capture_output=True,
                          text=True, timeout=1200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    rows = rehearsal_rows(proc.stdout)
    powerbert, wkmedoids = (rows[f"tiny-rehearsal-ft-M16-lam0.05-{m}"] for m in ("powerbert", "wkmedoids"))
    assert powerbert[2] == "FAIL" and "RuntimeError: a fault planted in select_topk" in powerbert[6], powerbert
    assert wkmedoids[2] == "FAIL" and "debug_fail_at_step=1: injected failure" in wkmedoids[6], wkmedoids
    assert not [cells for cells in rows.values() if cells[0] == "| evaluate"], rows  # no model to evaluate
    select, register = rows["tiny-rehearsal-select"], rows["token-pooling-tiny-rehearsal"]  # not a select failure
    assert (select[2], select[6].rstrip(" |")) == ("skipped", "no evaluated model"), select
    assert (register[2], register[6].rstrip(" |")) == ("skipped", "select did not run"), register
    assert "[select] tiny-rehearsal: not run, no finetuned model was evaluated" in output
    assert {cells[0]: cells[2] for cells in rows.values() if cells[0] in ("| base", "| ksearch")} == {
        "| base": "pass", "| ksearch": "pass"}  # they ran again: nothing is reused
    assert "reused" not in {cells[2] for cells in rows.values()} and "[skip]" not in output
    assert "cleared the earlier rehearsal's experiments, mlartifacts, mlflow.db, ray, serve (data/ kept)" in output
    count = [line for line in proc.stdout.splitlines() if re.match(r"\d+ of \d+ passed in ", line)]
    assert count and "; failed: tiny-rehearsal-ft-M16-lam0.05-" in count[-1], proc.stdout[-2000:]
    assert {p: p.stat().st_mtime_ns for p in (folder / "data").glob("*.beton")} == data  # the data, kept


