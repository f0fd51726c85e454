"""The stage DAG without running it: config expansion, stage identities, refusals before anything runs, the
rehearsal's report and the projected GPU-hours. No test here starts Ray, so this file runs beside the Ray files
(tests/test_dag.py runs the DAG for real)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.config import ConfigError, load_config
from pipeline.dag.plan import count_plan
from pipeline.dag.runner import run_experiment
from pipeline.tracking import TrackingError
from tests.conftest import plugins_from, write_plugin
from tests.processes import ROOT
from tests.tiny_dag import REHEARSED, TARGET, TINY, rehearsal_rows, tiny_overrides


@pytest.fixture(scope="module")
def data(synthetic_data) -> Path:
    return synthetic_data(192, 48)


def test_paper_config_expands_without_running():
    config = load_config(ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml")
    # 4 DeiTs; 8 lambdas -> 8 levels; 8 methods per level, plus one no-downsampling finetune per DeiT, plus DeiT-S's
    # 91 conv placements (Appendix D; counted by hand in test_conv_placements_are_the_papers_constraints); evaluated,
    # and beside them each DeiT unmodified and the 4 clustering methods at the 8 levels with and without carry,
    # untrained (Appendix E).
    assert count_plan(config).as_dict() == {"base": 4, "ksearch": 32, "finetune": 4 * (8 * 8 + 1) + 91,
                                            "evaluate": 4 * (8 * 8 + 1) + 91 + 4 * (1 + 8 * 4 * 2)}
    from pipeline.dag.plan import archs, base_stage, finetune_stage, ksearch_stages

    stages = [base_stage(config, arch) for arch in archs(config)]
    assert [s.config.model.name for s in stages] == config.experiment.models
    assert len({s.id for s in stages}) == 4
    ks = ksearch_stages(config, archs(config)[3], stages[3])
    assert len(ks) == 8 and all(s.config.recipe.epochs == 30 and s.config.train.workers == 8 for s in ks)
    ft = finetune_stage(config, archs(config)[3], stages[3], "wkmedoids", "lam1e-05", [196] * 12, [ks[0].id])
    assert ft.config.recipe.epochs == 300 and ft.config.train.mode == "finetune"


@pytest.mark.beton
def test_stage_ids_change_downstream_of_any_change(data, tmp_path):
    from pipeline.dag.plan import archs, base_stage, ksearch_stages

    a = load_config(TINY, tiny_overrides(tmp_path, data))
    b = load_config(TINY, [*tiny_overrides(tmp_path, data), "recipe.lr=0.01"])
    base_a, base_b = base_stage(a, archs(a)[0]), base_stage(b, archs(b)[0])
    assert base_a.id != base_b.id
    assert ksearch_stages(a, archs(a)[0], base_a)[0].id != ksearch_stages(b, archs(b)[0], base_b)[0].id
    moved = load_config(TINY, [*tiny_overrides(tmp_path, data), "experiment.runs_dir=/elsewhere"])
    assert base_stage(moved, archs(moved)[0]).id == base_a.id  # where results go is not part of the identity
    # nor how the same function runs: compilation, and the patch embedding as a convolution or a matmul
    fast = load_config(TINY, [*tiny_overrides(tmp_path, data), "train.compile=default", "model.patch_embed=matmul"])
    assert base_stage(fast, archs(fast)[0]).id == base_a.id
    assert ksearch_stages(fast, archs(fast)[0], base_a)[0].id == ksearch_stages(a, archs(a)[0], base_a)[0].id


def tiny_ids(config) -> list[str]:
    """The ids of the tiny DAG's first width: its base, its two K searches, a WK-Medoids finetune at lam0.05, the
    baseline, that finetune's evaluation, and the DAG."""
    from pipeline.dag.plan import archs, base_stage, dag_id, evaluate_stage, finetune_stage, ksearch_stages

    arch = archs(config)[0]
    base = base_stage(config, arch)
    ks = ksearch_stages(config, arch, base)
    ft = finetune_stage(config, arch, base, "wkmedoids", "lam0.05", [12, 8, 4], [ks[1].id])
    full = finetune_stage(config, arch, base, "none", "full", None, [])
    return [base.id, ks[0].id, ks[1].id, ft.id, full.id, evaluate_stage(config, ft).id, dag_id(config)]


def test_the_ids_are_pinned_and_change_with_the_identity_version(monkeypatch):
    """The ids of tiny.yaml's stages, pinned: a change that moves one without bumping ``IDENTITY_VERSION`` fails
    here (docs/design.md lists each version's ids of the first stage); bumping it moves every one. A change to
    tiny.yaml moves the ids of what it reaches (its evaluation cap from 3 to 300 s: the evaluation's and the DAG's)."""
    from pipeline.config import identity
    from pipeline.dag import plan
    from pipeline.dag.plan import archs, base_stage, dag_id, ksearch_stages

    config = load_config(TINY)
    assert tiny_ids(config) == ["b6d65810254668ab", "22f922e70d56a766", "e9633713e482a150", "10a1b69f3308dfb6",
                           "8f888036fac81bcf", "4698b6cc58ed1efe", "8c1832143b66f1ee"]  # identity version 2
    monkeypatch.setattr(identity, "IDENTITY_VERSION", 3)
    monkeypatch.setattr(plan, "IDENTITY_VERSION", 3)
    moved = tiny_ids(config)
    assert len(set(moved)) == 7
    assert not set(moved) & {"b6d65810254668ab", "22f922e70d56a766", "e9633713e482a150", "10a1b69f3308dfb6",
                             "8f888036fac81bcf", "4698b6cc58ed1efe", "8c1832143b66f1ee"}
    monkeypatch.undo()
    arch = archs(config)[0]
    base = base_stage(config, arch)
    ks = ksearch_stages(config, arch, base)
    # A target is a K search of its own, beside the lambdas, with its own identity.
    both = ksearch_stages(load_config(TINY, [TARGET]), arch, base)
    assert [s.id for s in both[:2]] == [ks[0].id, ks[1].id] and both[2].label == "tiny-ksearch-M16-gf0.6"
    assert both[2].config.train.ksearch_target.fraction == 0.6 and both[2].id not in {ks[0].id, ks[1].id}
    assert both[2].id == "139df6fee288fbb3"  # its id names the rounding's rule (targets.ROUNDING) too
    assert dag_id(load_config(TINY, [TARGET, "experiment.search.max_concurrent=null"])) == "916277a0aae2ee13"
    assert both[2].config.train.ksearch_target.methods is None  # the finetunes' concern: not the search's identity
    # Two targets at one figure, each with its own name (as each method's own table needs): two searches, two
    # levels; the same figure without names is refused.
    named = ksearch_stages(load_config(TINY, ["experiment.ksearch_targets=[{cost: gflops, fraction: 0.6, name: a-1}, "
                                              "{cost: gflops, fraction: 0.6, name: b-1}]"]), arch, base)
    assert [s.label for s in named[2:]] == ["tiny-ksearch-M16-a-1", "tiny-ksearch-M16-b-1"]
    assert [s.meta.target for s in named[2:]] == ["a-1", "b-1"] and named[2].id != named[3].id  # the name alone
    for clash, says in (("[{cost: gflops, fraction: 0.6, name: lam0.05}]", "looks like another kind of level"),
                        ("[{cost: gflops, fraction: 0.6, name: full}]", "looks like another kind of level"),
                        ("[{cost: gflops, fraction: 0.6, name: a.1}, {cost: gflops, fraction: 0.5, name: a_1}]",
                         "give the same registry alias")):
        with pytest.raises(ValueError, match=says):
            load_config(TINY, [f"experiment.ksearch_targets={clash}"])
    with pytest.raises(ValueError, match=r"two targets give the same level name \(\['gf0.6', 'gf0.6'\]\)"):
        load_config(TINY, ["experiment.ksearch_targets=[{cost: gflops, fraction: 0.6}, "
                           "{cost: gflops, fraction: 0.6, method: tome}]"])
    # A target of one width only: the other width has no such search, and the plan counts one search, one finetune.
    narrow = load_config(TINY, ["experiment.ksearch_targets=[{cost: gflops, fraction: 0.6, methods: [powerbert], "
                                "archs: [M24]}]"])
    assert len(ksearch_stages(narrow, arch, base)) == 2 and len(ksearch_stages(narrow, archs(narrow)[1], base)) == 3
    assert count_plan(narrow).as_dict() == {"base": 2, "ksearch": 5, "finetune": 11, "evaluate": 11}
    with pytest.raises(ValueError, match=r"archs \['M32'\] are not among the experiment's \['M16', 'M24'\]"):
        archs(load_config(TINY, ["experiment.ksearch_targets=[{cost: gflops, fraction: 0.6, archs: [M32]}]"]))


@pytest.mark.beton
def test_the_fixed_keep_lists_are_checked_on_the_models_the_finetunes_build(data, tmp_path):
    """Before any training, each conv placement (and each method at a paper level, the same ``builds``) is built as its
    finetune builds it: with model.qk_norm too (normalised queries and keys are part of every stage's model), which the
    check once applied a second downsampling to and refused ("this model already downsamples"). The paper levels'
    branch, which needs a named model, is refused by ``test_bad_experiments_are_refused_before_anything_runs``."""
    from pipeline.dag.runner import check_experiment

    base = [*tiny_overrides(tmp_path, data)[:2], f"train.storage_path={tmp_path / 'ray'}",
            f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"experiment.runs_dir={tmp_path}",
            "experiment.conv={layers: [1, 2]}"]
    for qk in ([], ["model.qk_norm=learned"]):
        check_experiment(load_config(TINY, [*base, *qk]))  # nothing refused


@pytest.mark.beton
def test_bad_experiments_are_refused_before_anything_runs(data, tmp_path):
    base = [*tiny_overrides(tmp_path, data)[:2], f"train.storage_path={tmp_path / 'ray'}",
            f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"experiment.runs_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="experiment.methods"):
        load_config(TINY, [*base, "experiment.methods=[kmedians]"])
    with pytest.raises(ConfigError, match="zero trials"):
        load_config(TINY, [*base, "experiment.lambdas=[]"])
    with pytest.raises(ConfigError, match="unknown timm model"):
        run_experiment(load_config(TINY, [*base, "model.name=vit_nonexistent"]), log=lambda _: None)
    with pytest.raises(ConfigError, match=r"level L1 with wkmedoids: .*pooling.keep has 12 entries \[196, .*\] but "
                                          "model.depth is 3"):
        run_experiment(load_config(TINY, [*base, "model.name=deit_small_patch16_224",
                                          "model.img_size=null", "model.patch_size=null", "experiment.lambdas=null",
                                          "experiment.levels=[1]", "experiment.embed_dims=null",
                                          "experiment.models=[deit_small_patch16_224]"]), log=lambda _: None)
    with pytest.raises(TrackingError, match="not reachable"):
        run_experiment(load_config(TINY, [*base, "train.tracking_uri=http://127.0.0.1:9"]),
                       log=lambda _: None)
    assert not (tmp_path / "ray").exists()  # nothing trained
    with pytest.raises(ConfigError, match="--force"):
        from pipeline.dag.runner import force_kinds

        force_kinds("everything")


@pytest.mark.slow
def test_cli_plan_prints_counts():
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "configs/experiments/demo.yaml", "--plan"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # two widths, two lambdas each, and a latency target of the 32-wide model; six methods and the baseline at a
    # lambda, one at the target
    assert json.loads(proc.stdout) == {"base": 2, "ksearch": 5, "finetune": 27, "evaluate": 27}


def test_a_method_option_reaches_the_finetunes_of_that_method_only():
    """``pooling.options.powerbert.significance: cls`` in a sweep changes PoWER-BERT's finetune and no other (ToMe,
    which has no such option, keeps its id); the option set at its default is the default's identity."""
    from pipeline.dag.plan import archs, base_stage, finetune_stage

    paper = ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml"
    methods = "experiment.methods=[tome, powerbert]"
    ids = {}
    for significance in (None, "eq4", "cls"):
        extra = [] if significance is None else [f"pooling.options.powerbert.significance={significance}"]
        config = load_config(paper, [methods, *extra])
        arch = archs(config)[0]
        base = base_stage(config, arch)
        tome, powerbert = (finetune_stage(config, arch, base, m, "L3", [196] * 12, []) for m in ("tome", "powerbert"))
        assert tome.config.pooling.method_options() == {"cluster_on": "metric"}
        assert powerbert.config.pooling.method_options() == {"significance": significance or "eq4"}
        ids[significance] = (tome.id, powerbert.id)
    assert ids[None] == ids["eq4"]
    assert ids["cls"][0] == ids[None][0] and ids["cls"][1] != ids[None][1]
    with pytest.raises(ConfigError, match=r"pooling.options.tome: method 'tome' has no option 'significance'"):
        load_config(paper, ["experiment.methods=[tome, random]", "pooling.options.tome.significance=cls"])


def test_the_shared_pooling_settings_are_part_of_the_experiment():
    """Two sweeps that differ only in a pooling setting their finetunes share (every method's options among them)
    are two experiments (two parent runs; ``--force`` on one retires nothing of the other); the method and keep
    list, which the sweep sets per stage, are not part of it."""
    from pipeline.dag.plan import dag_id

    paper = ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml"
    default = dag_id(load_config(paper, ["experiment.methods=[wkmedoids, powerbert]"]))
    same = [["pooling.method=kmeans"], ["pooling.level=3"]]
    for extra in same:
        assert dag_id(load_config(paper, ["experiment.methods=[wkmedoids, powerbert]", *extra])) == default, extra
    other = [["pooling.options.powerbert.significance=cls"], ["pooling.carry=true"],
             ["pooling.options.wkmedoids.iters=3"], ["pooling.options.wkmedoids.init=random"],
             ["pooling.options.wkmedoids.cluster_on=metric"], ["model.qk_norm=fixed"],
             ["model.qk_norm=fixed", "model.alpha=2.0"],
             ["kernels.kmedoids=torch"]]
    ids = {dag_id(load_config(paper, ["experiment.methods=[wkmedoids, powerbert]", *extra])) for extra in other}
    assert len(ids) == len(other) and default not in ids


def test_a_plugins_package_and_version_are_part_of_its_stages_identity(tmp_path):
    """Another release of a plugin, or another value of its option, is another result: its finetune and
    evaluation get new ids. The built-in methods' stages keep the ids pinned below, whatever plugin is
    installed or configured; a built-in method's option set away from its default gives another id."""
    from pipeline.config.identity import identity_content
    from pipeline.dag.plan import archs, base_stage, evaluate_stage, finetune_stage

    paper = ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml"
    recorded = ("c014d894cee3faa5", "bd0d9cfae59f14da", "bcb39f610117aeaa")  # base, wkmedoids L3, its evaluation
    plugin_ids = []
    for version in ("0.1", "0.2"):
        with plugins_from(write_plugin(tmp_path / version, version=version)):
            for extra in ([], ["pooling.options.firstk.offset=3"]):
                config = load_config(paper, ["experiment.methods=[firstk, wkmedoids]", *extra])
                arch = archs(config)[0]
                base = base_stage(config, arch)
                ft = {m: finetune_stage(config, arch, base, m, "L3", [196] * 12, []) for m in ("firstk", "wkmedoids")}
                assert (base.id, ft["wkmedoids"].id, evaluate_stage(config, ft["wkmedoids"]).id) == recorded
                assert identity_content(ft["firstk"].config)["pooling"]["plugin"] == {"distribution": "tp-plugin",
                                                                                      "version": version}
                assert "plugin" not in identity_content(ft["wkmedoids"].config)["pooling"]
                plugin_ids += [ft["firstk"].id, evaluate_stage(config, ft["firstk"]).id]
    assert len(set(plugin_ids)) == len(plugin_ids) == 8
    # A built-in method's option counts by its value: at its default it is the default's identity.
    for extra, same in ((["pooling.options.wkmedoids.iters=5"], True), (["pooling.options.wkmedoids.iters=3"], False),
                        (["pooling.options.wkmedoids.init=random"], False), (["pooling.options.kmeans.iters=3"], True),
                        (["pooling.options.wkmedoids.cluster_on=metric"], False),
                        (["pooling.options.wkmedoids.significance=eq4"], True)):
        config = load_config(paper, ["experiment.methods=[wkmedoids]", *extra])
        arch = archs(config)[0]
        assert (finetune_stage(config, arch, base_stage(config, arch), "wkmedoids", "L3", [196] * 12, []).id
                == recorded[1]) is same, extra


@pytest.mark.beton
def test_the_rehearsal_report_says_reused_and_not_run_and_register_models_false_exits_0(tmp_path, monkeypatch):
    """The table's status of each stage: "reused" for a record left before this rehearsal (nothing ran: never
    "pass"), "pass" for one it made; and with ``experiment.register_models: false`` the serve row is "not run",
    which is not a failure: the rehearsal exits 0 (the DAG itself stubbed, with the summary its select stage gives
    without registering)."""
    import time as clock

    from pipeline.dag import rehearse, runner
    from pipeline.dag.plan import Stage
    from pipeline.dag.records import mark_done, open_child
    from pipeline.dag.types import StageMeta
    from pipeline.tracking import experiment_id

    config = rehearse.rehearsal_config(load_config(TINY, [*tiny_overrides(tmp_path, tmp_path), *REHEARSED]),
                                       rehearse.RehearsalSettings(root=tmp_path / "r"), tmp_path, tmp_path)
    client = MlflowClient(tracking_uri=config.train.tracking_uri)
    exp_id = experiment_id(client, config.train.experiment, config.train.artifact_root)
    stage = Stage("finetune", "tiny-rehearsal-ft-M16-lam0.05-powerbert", None, [], "M16", StageMeta(method="powerbert"))
    before = int(clock.time() * 1000) - 1
    run_id = open_child(client, exp_id, "parent", name=stage.label, kind="finetune", stage_id=stage.id, dag_id="d")
    mark_done(client, run_id, stage_id=stage.id, kind="finetune", result={"seconds": 3.0})
    summary = {"planned": [stage], "failures": {}}
    (reused,) = rehearse.stage_reports(config, summary, started_ms=int(clock.time() * 1000) + 1)
    assert reused.status == "reused" and f"done in MLflow run {run_id} before this rehearsal" in reused.error
    (ran,) = rehearse.stage_reports(config, summary, started_ms=before)
    assert ran.status == "pass" and ran.seconds == 3.0
    assert rehearse.exit_status([ran]) == 0 and rehearse.exit_status([ran, reused]) == 1
    assert "; reused, not run: tiny-rehearsal-ft-M16-lam0.05-powerbert" in rehearse.count_line([ran, reused], 1.0)

    unregistered = load_config(TINY, [*tiny_overrides(tmp_path, tmp_path), *REHEARSED,
                                      "experiment.register_models=false"])
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: {"rows": [{}], "failures": {}, "planned": []})
    lines: list[str] = []
    assert rehearse.run_rehearsal(unregistered, rehearse.RehearsalSettings(root=tmp_path / "r2", steps=1),
                                  log=lines.append) == 0
    rows = rehearsal_rows("\n".join(lines))
    assert rows["one request"][2] == "not run" and "register_models is false" in rows["one request"][6], rows
    assert lines[-1].startswith("1 of 1 passed in ") and lines[-1].endswith(
        "; not run (the config turns them off): serve (one request)"), lines[-1]


def test_with_no_evaluated_model_select_and_register_are_skipped_not_failed_nor_passed():
    """Every finetune failed (keep-going): the DAG's summary has no rows; the rehearsal's select and register
    rows say skipped, with why, and a failed select says FAIL with its error and skips register."""
    from pipeline.dag import rehearse

    config = load_config(TINY, REHEARSED)
    served = rehearse.not_served(config)
    select, register, serve = rehearse.tail_reports(config, {"failures": {}, "planned": []}, served)
    assert (select.status, select.error) == ("skipped", "no evaluated model")
    assert (register.status, register.error) == ("skipped", "select did not run") and serve is served
    failed = {"failures": {"tiny-select": "ValueError: broken"}, "planned": []}
    select, register, _ = rehearse.tail_reports(config, failed, served)
    assert (select.status, select.error, register.status) == ("FAIL", "ValueError: broken", "skipped")
    chose = {"rows": [{}], "aliases": ["token-pooling-tiny@best"], "failures": {}, "planned": []}
    select, register, _ = rehearse.tail_reports(config, chose, served)
    assert (select.status, register.status, register.error) == ("pass", "pass", "1 alias(es): best")
    assert rehearse.exit_status([select, register, rehearse.not_served(config)]) == 1  # a skipped serve counts


def test_the_projected_gpu_hours_are_the_cluster_budgets():
    """DeiT-S alone under the paper's protocol: the rehearsal's projection, which counts the config's own levels,
    methods and epochs, is the cluster budget's "DeiT-S alone" row (docs/cluster.md), written out from the
    protocol: the base's 300 epochs, 8 K searches of 30, 8 levels of each method's 300-epoch finetune at its
    measured speed-up, and the baseline's 300, over ImageNet's images at the records' H200 step rate and loop
    efficiency; with its 91 conv placements, 91 finetunes of 300 epochs more at no speed-up. The high end takes each
    width at DeiT-S's cost; the low end scales it by fvcore's GFLOPs count over the budget's DeiT-S figure, which
    agree to 1e-4."""
    from pipeline.bench.gpu_budget import IMAGENET_TRAIN, loop_input, step_inputs
    from pipeline.bench.records import MEASURED
    from pipeline.dag.projection import projected_gpu_hours

    paper = ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml"
    alone = ["experiment.models=[deit_small_patch16_224]"]
    rate, speedups = step_inputs(MEASURED, "H200")
    methods = ("kmeans", "kmedoids", "wkmeans", "wkmedoids", "powerbert", "random", "importance", "tome")
    epochs = 300 + 8 * 30 + 8 * 300 * sum(1 / speedups[m].value for m in methods) + 300
    epoch_h = IMAGENET_TRAIN / (rate.value * loop_input(MEASURED, "H200").value) / 3600
    for conv, more in (("experiment.conv=null", 0), ("experiment.conv={layers: [1, 2, 3]}", 91 * 300)):
        projection = projected_gpu_hours(load_config(paper, [*alone, conv]))
        hours = (epochs + more) * epoch_h
        assert projection.high == pytest.approx(hours, rel=1e-9) and projection.low == pytest.approx(hours, rel=1e-4)
        assert "speed-ups assumed for" in projection.note  # the note names what was assumed
        assert ("conv placements 27,300 epochs more" in projection.note) == bool(more)


@pytest.mark.slow
def test_bad_rehearsals_are_refused_before_anything_runs(tmp_path):
    from pipeline.dag.rehearse import RehearsalSettings, run_rehearsal
    from pipeline.errors import InputError

    with pytest.raises(InputError, match="an even batch"):
        RehearsalSettings(batch=3)
    config = load_config(TINY)
    with pytest.raises(InputError, match="--rehearse-fail 'tome': not one of experiment.methods"):
        run_rehearsal(config, RehearsalSettings(root=tmp_path, fail_method="tome"), log=lambda _: None)
    assert not any(tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", str(TINY), "--rehearse-fail", "powerbert"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "belong to --rehearse; add it" in proc.stderr, proc.stderr
    from pipeline.cli import main

    for flags in (["--rehearse-dir", str(tmp_path / "r")], ["--rehearse-steps", "2"]):  # the default, given
        assert main(["run", str(TINY), *flags]) == 2
    assert not any(tmp_path.iterdir())
    # A folder that holds anything but a rehearsal's own entries is not emptied: it may be an experiment's store.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "mlflow.db").write_text("a store")
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"holds mlflow.db, notes.txt and no rehearsal.json, so it is not a "
                                         r"rehearsal's folder"):
        run_rehearsal(config, RehearsalSettings(root=tmp_path / "mine"), log=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["mlflow.db", "notes.txt"]


def test_a_store_recorded_under_another_identity_version_is_refused_in_one_line(tmp_path):
    """A DAG parent run without the identity-version tag (version 1) or with another one makes ``open_parent``
    refuse the experiment, naming both versions and the way out; a store of this version opens, twice."""
    from pipeline.config.identity import IDENTITY_VERSION
    from pipeline.dag.records import DAG, IDENTITY_TAG, STAGE_KIND, open_parent
    from pipeline.errors import InputError

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client, exp_id, run = open_parent(uri, "current", None, "abc", "tiny")
    assert client.get_run(run).data.tags[IDENTITY_TAG] == str(IDENTITY_VERSION)
    assert open_parent(uri, "current", None, "abc", "tiny")[2] == run  # reused, not refused
    old = client.create_experiment("old")
    client.create_run(old, tags={DAG: "abc", STAGE_KIND: "dag"})
    with pytest.raises(InputError, match=rf"^train.experiment 'old' in {uri} holds stages recorded under identity "
                                         rf"version 1; this pipeline's is {IDENTITY_VERSION}, whose stage ids differ, "
                                         r"so none of them would be reused: give a new train.experiment \(or "
                                         r"train.tracking_uri\) and rerun$"):
        open_parent(uri, "old", None, "abc", "tiny")
    assert len(client.search_runs([old])) == 1  # nothing added


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "experiments").glob("*.yaml")))
def test_every_shipped_experiments_rehearsal_copy_validates_and_keeps_a_warmup_inside_its_epoch(name, tmp_path):
    """``--rehearse`` runs one epoch a stage: the copy of every shipped experiment validates (the config refuses a
    warm-up as long as its stage: the paper config's 5 epochs), each warm-up is shorter than its one epoch, and one
    the experiment has is still there (above 0); each width's base stage config validates."""
    from pipeline.dag import rehearse
    from pipeline.dag.plan import archs, base_stage

    original = load_config(ROOT / "configs" / "experiments" / name)
    copy = rehearse.rehearsal_config(original, rehearse.RehearsalSettings(root=tmp_path), tmp_path, tmp_path)
    assert copy.recipe.epochs == 1
    pairs = [(original.recipe.warmup_epochs, copy.recipe.warmup_epochs)] + [
        (getattr(original.experiment, stage).warmup_epochs, getattr(copy.experiment, stage).warmup_epochs)
        for stage in ("base", "ksearch", "finetune")]
    for before, after in pairs:
        assert (before is None) == (after is None) and (before is None or 0 <= after < 1)
        assert before is None or (after > 0) == (before > 0), (before, after)
    assert all(base_stage(copy, arch).config.recipe.epochs == 1 for arch in archs(copy))
    if name == "fmnist_hpo.yaml":  # its base sweep draws warm-ups of 0.5, 1 and 2 epochs: 0.5 is left
        assert copy.experiment.base.sweep.space["recipe.warmup_epochs"].choice == [0.5]


@pytest.mark.parametrize(("swept", "cut"), [
    ({"choice": [0.0, 0.25, 1.0, 2.0]}, {"choice": [0.0, 0.25, 0.5]}),
    ({"uniform": [0.0, 2.0]}, {"choice": [0.5]}),         # reaches past the one epoch: a warm-up that runs
    ({"loguniform": [0.1, 0.4]}, {"loguniform": [0.1, 0.4]}),  # inside it already
    ({"randint": [0, 3]}, {"choice": [0.5]}),
])
def test_a_swept_warmup_is_cut_inside_the_rehearsals_one_epoch(swept, cut):
    from pipeline.dag.rehearse import _short_warmups

    full = {"uniform": None, "loguniform": None, "randint": None, "choice": None}
    assert {k: v for k, v in _short_warmups(full | swept).items() if v is not None} == cut


def test_a_rehearsal_copy_that_does_not_validate_is_one_config_error(tmp_path, monkeypatch):
    from pipeline.dag import rehearse

    monkeypatch.setattr(rehearse, "WARMUP", 7)  # a scaling fault: a warm-up longer than the one-epoch stage
    paper = load_config(ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml")
    with pytest.raises(ConfigError) as refused:
        rehearse.rehearsal_config(paper, rehearse.RehearsalSettings(root=tmp_path), tmp_path, tmp_path)
    said = str(refused.value)
    assert said.startswith("--rehearse scaled the config to one epoch a stage, and the copy does not validate (the "
                           "base stage: recipe.warmup_epochs 5 is not below "), said
    assert "Value error" not in said and said.endswith(
        "the config itself is valid: run it without --rehearse, and report this fault of the rehearsal's scaling "
        "(pipeline/dag/rehearse.py)")


@pytest.mark.parametrize(("configured", "rehearsed"), [(None, 60.0), (300.0, 300.0)])
def test_the_rehearsal_keeps_a_speed_cap_the_config_raised(configured, rehearsed, tmp_path):
    """``--rehearse`` caps each evaluation's speed at its own 60 s, or at the config's ``experiment.eval.speed_cap_s``
    where that is larger: on a machine too slow for 60 s, the capped measurement's error says to raise it, and
    an override of it must reach the rehearsal (the paper config's own cap, 20 s, is below 60)."""
    from pipeline.dag import rehearse

    overrides = [] if configured is None else [f"experiment.eval.speed_cap_s={configured}"]
    paper = load_config(ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml", overrides)
    assert paper.experiment.eval.speed_cap_s == (configured or 20.0)
    copy = rehearse.rehearsal_config(paper, rehearse.RehearsalSettings(root=tmp_path), tmp_path, tmp_path)
    assert copy.experiment.eval.speed_cap_s == rehearsed


@pytest.mark.parametrize("bad", [{"steps": 0}, {"batch": 3}, {"workers": -1}, {"cpus": 0.0}, {"speed_cap_s": 0.0},
                                 {"speed_cap_s": float("nan")}])
def test_rehearsal_settings_out_of_range_are_refused_in_one_line(bad):
    from pipeline.dag.rehearse import RehearsalSettings
    from pipeline.errors import InputError

    with pytest.raises(InputError, match=r"^rehearsal: steps .*: give steps >= 1, an even batch >= 2, workers >= 0, "
                                         r"cpus > 0 and speed_cap_s > 0$"):
        RehearsalSettings(**bad)
    RehearsalSettings()  # the defaults are fine


def _brute_force_placements(tokens: int, side: int, depth: int) -> set[tuple[int, ...]]:
    """Every subset of the blocks 1 ... depth - 1 (written out as bit masks), kept where the paper's constraints hold:
    1 to 3 layers, each quartering the grid (an odd side padded), while more than one token is left after the last;
    three layers equally spaced."""
    kept = set()
    for mask in range(1, 2 ** (depth - 1)):
        blocks = tuple(b for b in range(1, depth) if mask >> (b - 1) & 1)
        h = side
        for _ in blocks:
            h = (h + 1) // 2
        if len(blocks) > 3 or h * h <= 1:
            continue
        if len(blocks) == 3 and blocks[1] - blocks[0] != blocks[2] - blocks[1]:
            continue
        kept.add(blocks)
    assert tokens == side * side
    return kept


@pytest.mark.parametrize(("side", "depth", "count"), [(14, 12, 91), (7, 4, 6)])
def test_conv_placements_are_the_papers_constraints(side, depth, count):
    """DeiT-S (14 x 14 tokens, 12 blocks): 11 single layers, C(11, 2) = 55 pairs and 9 + 7 + 5 + 3 + 1 = 25 equally
    spaced triples, 91 placements; the demo's 7 x 7 grid in 4 blocks takes 2 layers (a third leaves one token): 3 + 3.
    Against a brute-force enumeration of the constraints; each placement's keep list quarters the grid in the block
    the layer follows."""
    from pipeline.dag.plan import conv_layers_allowed, conv_placements, placement_keep

    found = conv_placements((side, side), depth, [1, 2, 3])
    assert len(found) == len(set(found)) == count
    assert set(found) == _brute_force_placements(side * side, side, depth)
    assert conv_layers_allowed((side, side)) == (3 if side == 14 else 2)
    assert conv_placements((side, side), depth, [2]) == [p for p in found if len(p) == 2]
    if side == 14:
        assert placement_keep((14, 14), 12, (2, 5, 8)) == [196, 49, 49, 49, 16, 16, 16, 4, 4, 4, 4, 4]
    else:
        assert placement_keep((7, 7), 4, (1, 3)) == [16, 16, 4, 4]


def test_conv_placements_are_planned_per_model_and_conv_on_searched_lists_is_refused(capsys):
    """fmnist_full plans its 6 placements a width beside the K-search methods (`run --plan` names them); the demo with
    conv among its methods, which K searches give keep lists, is refused in one line naming experiment.conv."""
    from pipeline.cli import main

    full = ROOT / "configs" / "experiments" / "fmnist_full.yaml"
    assert count_plan(load_config(full)).finetune == 3 * (4 * 8 + 1 + 6)
    assert main(["run", str(full), "--plan"]) == 0
    err = capsys.readouterr().err
    assert "[plan] experiment.conv: 6 placement(s) for M32 (conv1, conv2, conv3, conv1-2, conv1-3, conv2-3)" in err
    assert main(["run", str(ROOT / "configs" / "experiments" / "demo.yaml"), "--plan",
                 "--set", "experiment.methods=[conv]"]) == 2
    err = capsys.readouterr().err
    assert "experiment.methods: 'conv' downsamples on fixed grid placements, not on the keep lists a K search or a " \
           "paper level gives; set experiment.conv: {layers: [1, 2, 3]}" in err


def test_evaluations_without_finetuning_are_planned_from_the_bases_levels(capsys):
    """experiment.no_finetune: each base unmodified, then each method at each level and carry setting, each a model
    built on the base's weights (train.mode finetune, the method at the level's keep list), its id apart from every
    other; the finetunes' ids and (unset) the experiment's id are what they were without it."""
    from pipeline.cli import main
    from pipeline.dag.plan import archs, base_stage, dag_id, finetune_stage, no_finetune_stages, paper_levels

    paper = ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml"
    small = ["experiment.models=[deit_small_patch16_224]", "experiment.lambdas=null", "experiment.levels=[2, 6]",
             "experiment.conv=null", "experiment.methods=[kmedoids]"]
    off = load_config(paper, [*small, "experiment.no_finetune=null"])
    on = load_config(paper, [*small, "experiment.no_finetune={methods: [kmedoids, wkmeans], carry: [false, true]}"])
    arch = archs(on)[0]
    base = base_stage(on, arch)
    levels = {name: (keep, []) for name, keep in paper_levels(on, arch).items()}
    stages = no_finetune_stages(on, arch, base, levels)
    assert no_finetune_stages(off, arch, base, levels) == []
    assert [s.label.split("noft-deit_small_patch16_224-")[1] for s in stages] == [
        "full-none", "L2-kmedoids", "L2-kmedoids-carry", "L2-wkmeans", "L2-wkmeans-carry", "L6-kmedoids",
        "L6-kmedoids-carry", "L6-wkmeans", "L6-wkmeans-carry"]
    assert count_plan(on).evaluate - count_plan(on).finetune == len(stages)
    assert len({s.id for s in stages}) == len(stages) and all(s.kind == "evaluate" for s in stages)
    assert all(s.upstream == [base.id] and not s.meta.finetuned for s in stages)
    assert stages[0].config.train.mode == "base"
    for stage in stages[1:]:
        pool = stage.config.pooling
        assert stage.config.train.mode == "finetune" and pool.method == stage.meta.method
        assert pool.keep == levels[stage.meta.level][0] and pool.carry == stage.meta.carry
    finetune = finetune_stage(on, arch, base, "kmedoids", "L2", levels["L2"][0], [])
    assert finetune.id == finetune_stage(off, arch, base, "kmedoids", "L2", levels["L2"][0], []).id
    assert finetune.id not in {s.id for s in stages}
    assert dag_id(off) != dag_id(on)  # unset, it leaves the id as it was (the pinned ids above)
    # `run --plan` names them: the demo's 2 widths unmodified, and at its 5 levels (2 lambdas a width, 1 target)
    # K-Medoids and WK-Means with and without carry
    demo = str(ROOT / "configs" / "experiments" / "demo.yaml")
    assert main(["run", demo, "--plan", "--set", "experiment.no_finetune={methods: [kmedoids, wkmeans], "
                 "carry: [false, true]}"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["evaluate"] == 27 + 2 + 5 * 2 * 2
    assert "model.qk_norm" not in err
    qk = ["--set", "model.qk_norm=learned", "--set", "model.alpha=8"]
    assert main(["run", demo, "--plan", *qk, "--set", "experiment.ksearch_targets=null"]) == 0
    assert "[plan] model.qk_norm: learned (alpha 8) in every stage: the bases, K searches, finetunes and " \
           "evaluations (Appendix F)" in capsys.readouterr().err
    # the demo's latency target reads a table timed with timm's attention: refused in one line
    assert main(["run", demo, "--plan", *qk]) == 2
    assert capsys.readouterr().err.strip() == "error: experiment.ksearch_targets lat0.8: cost: latency reads a table " \
        "of blocks timed with timm's attention, and model.qk_norm is learned; give the target cost: gflops, or leave " \
        "model.qk_norm unset"
    assert "[plan] experiment.no_finetune: 22 evaluation(s) without training (each base unmodified, then kmedoids, " \
           "wkmeans at each level, carry off/on); in the report, in no front" in err


@pytest.mark.parametrize("setting, message", [
    ("{methods: [conv]}", "experiment.no_finetune: methods: 'conv' learns its own layers, which are random without "
                          "training; finetune it (experiment.conv or experiment.methods) instead"),
    ("{methods: [none]}", "experiment.no_finetune: methods: 'none' keeps every token; each base's unmodified model is "
                          "evaluated anyway"),
    ("{methods: [kmeans, kmeans]}", "experiment.no_finetune: methods: ['kmeans', 'kmeans'] lists a value twice"),
    ("{methods: [kmeans], carry: [true, true]}", "experiment.no_finetune: carry: [True, True] lists a value twice"),
    ("{methods: []}", "experiment.no_finetune.methods: List should have at least 1 item"),
])
def test_an_impossible_no_finetune_setting_is_refused_in_one_line(capsys, setting, message):
    from pipeline.cli import main

    demo = str(ROOT / "configs" / "experiments" / "demo.yaml")
    assert main(["run", demo, "--plan", "--set", f"experiment.no_finetune={setting}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid config:\n") and message in err and len(err.strip().splitlines()) == 2, err


def test_a_finetune_seed_reruns_the_finetunes_alone():
    """experiment.finetune.seed: the finetunes (and the baseline) train again with that seed from the same bases and K
    searches, whose ids stay; the evaluations follow their finetunes. A base or K-search seed is refused in one line."""
    from pipeline.dag.plan import archs, base_stage, finetune_stage

    plain, reseeded = load_config(TINY), load_config(TINY, ["experiment.finetune.seed=1"])
    first, second = tiny_ids(plain), tiny_ids(reseeded)
    assert first[:3] == second[:3]  # the base and the K searches
    assert not set(first[3:6]) & set(second[3:6])  # the finetune, the baseline and the evaluation
    arch = archs(reseeded)[0]
    assert finetune_stage(reseeded, arch, base_stage(reseeded, arch), "none", "full", None, []).config.seed == 1
    for stage in ("base", "ksearch"):
        with pytest.raises(ConfigError, match=r"experiment.base.seed / experiment.ksearch.seed: set the config's "
                                              "`seed` for the bases and K searches"):
            load_config(TINY, [f"experiment.{stage}.seed=1"])


def test_the_evaluations_runtime_is_part_of_their_identity_and_the_onnx_registration_is_not():
    """Timed in onnxruntime, an evaluation is another result than torch's (another id: a torch timing is never
    reused for it); ``runtime: torch`` and ``register_onnx``, what the register step logs beside each pick, leave
    every id as pinned above."""
    from pipeline.dag.plan import dag_id

    ids = tiny_ids(load_config(TINY))
    assert tiny_ids(load_config(TINY, ["experiment.eval.runtime=torch", "experiment.register_onnx=false"])) == ids
    onnx = tiny_ids(load_config(TINY, ["experiment.eval.runtime=onnxruntime"]))
    assert onnx[:5] == ids[:5] and onnx[5] != ids[5] and onnx[6] != ids[6]  # the trainings' ids stay
    assert dag_id(load_config(TINY, ["experiment.register_onnx=false"])) == ids[6]
