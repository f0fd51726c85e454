"""The method registry is the one place a method is known: a method registered only here goes through
config validation, `pipeline flops`, `bench ops` and training; and ToMe is the same ToMe everywhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.methods import (
    METHODS,
    MethodSpec,
    Option,
    Plugin,
    PluginWarning,
    method_spec,
    plugin_of,
    register_method,
)
from pipeline.pooling import PoolResult
from tests.conftest import plugins_from, write_plugin

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_synthetic.yaml"


def firstk(*, offset: int):
    """A toy method: keep K tokens starting at ``offset`` (wrapping), in order."""

    def step(tokens, k, *, sizes=None, **_):
        b, n, m = tokens.shape
        if k >= n:
            return PoolResult(tokens, torch.ones(b, n), torch.arange(n).expand(b, n))
        index = (torch.arange(k, device=tokens.device) + offset) % n
        return PoolResult(tokens[:, index], torch.ones(b, k), lambda: torch.full((b, n), -1))

    return step


@pytest.fixture
def toy():
    register_method("firstk", MethodSpec(firstk, "keep K tokens from an offset", options={"offset": 0}))
    yield "firstk"
    del METHODS["firstk"]


def test_a_registered_method_is_validated_by_the_config(toy):
    config = load_config(None, ["pooling.method=firstk", "pooling.keep=[12, 8, 4]"])
    assert config.pooling.method_options() == {"offset": 0}
    with pytest.raises(ConfigError, match=r"pooling.options.firstk: method 'firstk' has no option 'cluster_on'; "
                                          r"it takes: offset"):
        load_config(None, ["pooling.method=firstk", "pooling.options.firstk.cluster_on=metric"])
    with pytest.raises(ConfigError, match=r"pooling.cluster_on is a method's option, and 'firstk' does not take it"):
        load_config(None, ["pooling.method=firstk", "pooling.cluster_on=metric"])
    del METHODS["firstk"]
    with pytest.raises(ConfigError, match="unknown downsampling method 'firstk'"):
        load_config(None, ["pooling.method=firstk"])
    register_method("firstk", MethodSpec(firstk, "again", options={"offset": 0}))


def test_a_step_written_without_the_kernels_argument_still_runs_in_a_model():
    """Steps of other packages keep the signature they were written against: the models pass ``kernels`` to the
    built-in steps only, so a step with no ``**`` catch-all runs (the plugin contract of docs/architecture.md)."""
    from pipeline.models import create_model

    def strict(*, offset: int):
        def step(tokens, k, *, scores=None, sizes=None, metric=None, generator=None, validate=True):
            return firstk(offset=offset)(tokens, k, sizes=sizes)
        return step

    register_method("strictk", MethodSpec(strict, "firstk without a catch-all", options={"offset": 0}))
    try:
        model = create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, method="strictk",
                             keep=[8, 4]).eval()
        with torch.no_grad():
            assert model(torch.randn(2, 3, 32, 32)).shape == (2, 1000)
    finally:
        del METHODS["strictk"]


def test_a_registered_method_counts_flops_and_benchmarks(toy, capsys):
    from pipeline.cli import main

    assert main(["flops", "--model", "deit_tiny_patch16_224", "--method", "firstk",
                 "--keep", "196,98,98,49,49,49,20,20,20,10,10,0", "--json"]) == 0
    gflops = float(capsys.readouterr().out.split('"gflops": ')[1].split(",")[0])
    assert 0.2 < gflops < 1.258 * 0.6  # DeiT-Ti is 1.258; the keep list drops most tokens early
    assert main(["bench", "ops", "--set", "bench.model=deit_tiny_patch16_224", "--set", "bench.batch=2",
                 "--set", "bench.warmup=0", "--set", "bench.repeats=2", "--set", "bench.keep=[98]",
                 "--set", "bench.methods=[firstk]"]) == 0
    assert "| firstk | 98 |" in capsys.readouterr().out


@pytest.mark.beton
def test_a_registered_method_trains(toy, synthetic_data, tmp_path):
    from pipeline.train import run_training
    from pipeline.train.checkpoint import load_checkpoint

    data = synthetic_data(64, 32)
    where = [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}", "train.workers=0",
             f"train.storage_path={tmp_path / 'ray'}", f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
             f"train.artifact_root={tmp_path / 'artifacts'}", "recipe.epochs=1"]
    base = run_training(load_config(TINY, [*where, "train.name=base"]))
    tuned = run_training(load_config(TINY, [*where, "train.name=firstk", "train.mode=finetune",
                                            f"train.init={base.checkpoint}", "pooling.method=firstk",
                                            "pooling.keep=[12, 8, 4]"]))
    state = load_checkpoint(tuned.checkpoint)
    assert state["config"]["pooling"]["method"] == "firstk" and state["keep"] == [12, 8, 4]
    assert tuned.summary["epoch"] == 1


def test_tome_matches_on_keys_in_training_and_in_the_benchmarks():
    """One ToMe: the model a training run builds and `bench ops` both match on the mean keys."""
    from pipeline.bench.ops import method_rows
    from pipeline.config import BenchOpsConfig
    from pipeline.train.build import build_model

    config = load_config(TINY, ["train.mode=finetune", "pooling.method=tome", "pooling.keep=[12, 8, 4]"])
    trained = build_model(config).blocks
    assert trained.config.options == {"cluster_on": "metric"} and trained.needs_keys
    bench = BenchOpsConfig(methods=["tome"], keep=[8])
    assert config.pooling.method_options("tome") == trained.config.options  # what method_rows builds its rows with
    # Side by side on the same tokens: the training model's step and the bench row give the same merge.
    gen = torch.Generator().manual_seed(0)
    tokens, keys = torch.randn(2, 16, 24, generator=gen), torch.randn(2, 16, 12, generator=gen)
    from pipeline.bench.ops import BlockInputs

    inputs = BlockInputs(x=tokens, tokens=tokens, scores=torch.rand(2, 16, generator=gen), keys=keys)
    (label, k, call), *others = method_rows(bench, config.pooling, inputs)
    assert (label, k) == ("tome", 8) and [row[0] for row in others] == ["tome on tokens"]
    assert torch.equal(call().tokens, trained.step(tokens, 8, metric=keys, validate=False).tokens)
    assert not torch.equal(call().tokens, trained.step(tokens, 8, metric=tokens, validate=False).tokens)
    # Matching on the tokens is still there, on request.
    tokens_config = load_config(TINY, ["train.mode=finetune", "pooling.method=tome", "pooling.keep=[12, 8, 4]",
                                       "pooling.options.tome.cluster_on=tokens"])
    assert not build_model(tokens_config).blocks.needs_keys


def test_the_class_token_scores_reach_the_model_a_finetune_builds():
    """``pooling.options.wkmedoids.significance: cls`` in a finetune config gives the model it trains class-token
    scores; the default builds eq. 4's."""
    from pipeline.train.build import build_model

    base = ["train.mode=finetune", "pooling.method=wkmedoids", "pooling.keep=[12, 8, 4]"]
    cls = build_model(load_config(TINY, [*base, "pooling.options.wkmedoids.significance=cls"])).blocks
    eq4 = build_model(load_config(TINY, base)).blocks
    assert (cls.significance, eq4.significance) == ("cls", "eq4")
    assert cls.config.options["significance"] == "cls" and eq4.config.options["significance"] == "eq4"


def _with_plugin(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_a_plugins_entry_point_registers_its_method(tmp_path):
    """The method of an installed package (a .dist-info on the path) is listed with its package and version,
    validated by the config with its own option and counted by `pipeline flops`; nothing of it is in this
    repository."""
    plugin = write_plugin(tmp_path / "site")
    listed = _with_plugin(plugin, "methods")
    assert listed.returncode == 0 and re.search(r"^firstk\s+keep K tokens from an offset \(a plugin\).*from tp-plugin "
                                                r"0\.1$", listed.stdout, flags=re.M), listed.stdout + listed.stderr
    shown = _with_plugin(plugin, "config", "show", "--set", "pooling.method=firstk", "--set", "pooling.keep=[4]",
                         "--set", "pooling.options.firstk.offset=3")
    assert shown.returncode == 0 and "method: firstk" in shown.stdout, shown.stderr
    assert "options:\n    firstk:\n      offset: 3\n" in shown.stdout, shown.stdout
    flops = _with_plugin(plugin, "flops", "--model", "deit_tiny_patch16_224", "--method", "firstk",
                         "--keep", "98,98,98,49,49,49,20,20,20,10,10,0", "--json")
    assert flops.returncode == 0 and 0.2 < json.loads(flops.stdout)["gflops"] < 1.258 * 0.6, flops.stderr


# Entry points of one package, the good one last: a loader that stopped at the first bad one would miss it.
BROKEN_BESIDE_GOOD = {"lastk": "tp_plugin:MISSING", "midk": "tp_plugin:NOT_A_SPEC", "kmedoids": "tp_plugin:SPEC",
                      "firstk": "tp_plugin:SPEC"}


@pytest.mark.slow
def test_a_broken_plugin_is_named_in_one_line_and_the_others_load(tmp_path):
    """`pipeline methods` lists the good plugin and the built-in K-Medoids under its own name, names each entry
    point it left out in one line, and exits 2."""
    from tests.conftest import PLUGIN_MODULE, write_package

    site = write_package(tmp_path / "site", "tp_plugin", "0.1", BROKEN_BESIDE_GOOD, PLUGIN_MODULE)
    proc = _with_plugin(site, "methods")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    where = "of tp-plugin (group pipeline.methods)"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: entry point lastk = 'tp_plugin:MISSING' {where} does not load: AttributeError: module 'tp_plugin' "
        "has no attribute 'MISSING'; fix or uninstall that package",
        f"error: entry point midk = 'tp_plugin:NOT_A_SPEC' {where} names a str, not a pipeline.methods.MethodSpec",
        "error: entry point kmedoids = 'tp_plugin:SPEC' of tp-plugin (tp-plugin 0.1, group pipeline.methods) takes "
        "the name of the built-in method 'kmedoids', which a plugin may not replace; it is not loaded: rename the "
        "entry point"], proc.stderr
    assert re.search(r"^firstk\s+keep K tokens from an offset \(a plugin\).*from tp-plugin 0\.1$", proc.stdout,
                     flags=re.M), proc.stdout
    assert re.search(r"^kmedoids\s+Token Pooling by K-Medoids \(eq\. 8\).*built-in$", proc.stdout,
                     flags=re.M), proc.stdout
    assert not re.search(r"^(lastk|midk)\s", proc.stdout, flags=re.M), proc.stdout


def test_the_plugins_beside_a_broken_one_work_in_this_process(tmp_path):
    """Reading the registry warns once for each entry point it leaves out and loads the rest; a later read
    has them all; the broken method's name says why it is missing."""
    from tests.conftest import PLUGIN_MODULE, write_package

    site = write_package(tmp_path / "site", "tp_plugin", "0.1", BROKEN_BESIDE_GOOD, PLUGIN_MODULE)
    with plugins_from(site):
        with pytest.warns(PluginWarning) as warned:
            names = list(METHODS)
        assert [str(w.message).split(" = ")[0] for w in warned] == ["entry point lastk", "entry point midk",
                                                                     "entry point kmedoids"]
        assert "firstk" in names and list(METHODS) == names  # read again: the same, and no second warning
        assert plugin_of("firstk") == Plugin("tp-plugin", "0.1", "firstk = tp_plugin:SPEC")
        assert METHODS["kmedoids"].summary == "Token Pooling by K-Medoids (eq. 8), top-K initialisation"
        assert plugin_of("kmedoids") is None
        with pytest.raises(ValueError, match=r"method 'lastk' is not registered: entry point lastk = 'tp_plugin:"
                                             r"MISSING' of tp-plugin \(group pipeline.methods\) does not load"):
            method_spec("lastk")
        with pytest.raises(ValueError, match="'kmedoids' is a built-in method, which register_method may not replace"):
            register_method("kmedoids", METHODS["firstk"])
        config = load_config(None, ["pooling.method=firstk", "pooling.keep=[4]"])
        assert config.pooling.method_options() == {"offset": 1, "iters": 1}


def test_a_plugins_options_come_from_pooling_options_against_its_spec(tmp_path):
    """`pooling.options.firstk` sets the plugin's options, typed by its MethodSpec's defaults; a name it shares
    with the built-in methods (iters) takes the plugin's default, not theirs; errors name the method,
    its package and the key. The options reach the operator: it keeps the tokens a brute-force index picks."""
    from pipeline.methods import build_downsampler

    with plugins_from(write_plugin(tmp_path / "site")):
        base = ["pooling.method=firstk", "pooling.keep=[4]"]
        assert load_config(None, base).pooling.method_options() == {"offset": 1, "iters": 1}  # not pooling.iters=5
        config = load_config(None, [*base, "pooling.options={firstk: {offset: 3, iters: 2}}"])
        assert config.pooling.method_options() == {"offset": 3, "iters": 2}
        assert load_config(None, [*base, "pooling.options.firstk.iters=4"]).pooling.method_options()["iters"] == 4
        tokens = torch.randn(2, 10, 5)
        kept = build_downsampler("firstk", **config.pooling.method_options())(tokens, 3).tokens
        assert torch.equal(kept, tokens[:, [3, 5, 7]])
        refusals = {
            "pooling.options.firstk.phase=0.5": r"pooling.options: .*method 'firstk' \(from tp-plugin 0.1\) has no "
                                                r"option 'phase'; it takes: iters, offset",
            "pooling.options.firstk.offset=a": r"pooling.options.firstk.offset \(from tp-plugin 0.1\) takes a "
                                               r"value of type int \(its default is 1\), got 'a'",
            "pooling.options.firstk.offset=true": r"takes a value of type int .*got True",
            "pooling.options.kmedoids.iters=0": r"pooling.options.kmedoids.iters is at least 1, got 0",
            "pooling.options.lastk.offset=3": r"unknown downsampling method 'lastk'",
            "pooling.iters=3": r"pooling.iters is a method's option: use pooling.options.firstk.iters",
        }
        for override, says in refusals.items():
            with pytest.raises(ConfigError, match=says):
                load_config(None, [*base, override])


def test_a_method_registered_in_code_is_refused_for_ray_runs(toy, tmp_path):
    """Ray workers validate the config again from their own registry, which has no method registered in this
    process: a Ray Train job or a DAG that names one is refused before anything starts."""
    from pipeline.dag.runner import run_experiment
    from pipeline.train import run_training

    where = [f"train.storage_path={tmp_path / 'ray'}", f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    job = load_config(TINY, [*where, "train.workers=1", "train.mode=finetune", "pooling.method=firstk",
                             "pooling.keep=[12, 8, 4]"])
    says = r"method\(s\) 'firstk' were registered in this process \(register_method\), which Ray workers do not see"
    with pytest.raises(ConfigError, match=says):
        run_training(job)
    dag = load_config(ROOT / "configs" / "experiments" / "tiny.yaml", [*where, "experiment.methods=[firstk]"])
    with pytest.raises(ConfigError, match=says):
        run_experiment(dag, log=lambda _: None)
    assert not (tmp_path / "ray").exists() and not (tmp_path / "mlflow.db").exists()


POOLING_ALONE = """
import sys
import pipeline.pooling
assert "pipeline.methods" not in sys.modules, "importing pipeline.pooling loaded the registry"
try:
    from pipeline.pooling import build_downsampler
except ImportError as err:
    print(err)
"""


def test_the_operators_package_does_not_load_the_registry_nor_name_its_builder():
    """``pipeline.pooling`` holds the operators only: importing it loads no registry, and ``build_downsampler``
    is ``pipeline.methods``' alone (one place for a name)."""
    proc = subprocess.run([sys.executable, "-c", POOLING_ALONE], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "cannot import name 'build_downsampler' from 'pipeline.pooling'" in proc.stdout


def test_a_spec_with_a_new_option_is_seen_by_the_config_the_gflops_the_identity_and_pipeline_methods(capsys):
    """One declaration: a method registered with an ``Option`` of its own is validated from YAML (a wrong type is
    one clear error), counted in the GFLOPs its ``flops`` declares (against the sum written out here), part of
    its finetune's identity and of a GFLOPs K search's, and listed by ``pipeline methods``."""
    from pipeline.cli import main
    from pipeline.config.identity import identity_content
    from pipeline.flops import gflops_cost_model
    from pipeline.methods import Option
    from pipeline.models import create_model

    def passes_flops(n: int, k: int, width: int, options) -> int:
        return options["passes"] * n * n * width

    def passk(*, offset: int, passes: int):  # the operator takes every option its spec declares (models.probe)
        return firstk(offset=offset)

    spec = MethodSpec(passk, "firstk that pays for its passes", options={
        "offset": 0, "passes": Option(1, minimum=1, counted=True, doc="Gram passes it pays for")}, flops=passes_flops)
    register_method("passk", spec)
    try:
        base = ["pooling.method=passk", "pooling.keep=[12, 8, 4]", "train.mode=finetune"]
        config = load_config(TINY, [*base, "pooling.options.passk.passes=3"])
        assert config.pooling.method_options() == {"offset": 0, "passes": 3}
        with pytest.raises(ConfigError, match=r"pooling.options.passk.passes takes a value of type int \(its default "
                                              r"is 1\), got 'two'"):
            load_config(TINY, [*base, "pooling.options.passk.passes=two"])
        with pytest.raises(ConfigError, match=r"pooling.options.passk.passes is at least 1, got 0"):
            load_config(TINY, [*base, "pooling.options.passk.passes=0"])
        # GFLOPs: each block that pools pays passes * n^2 * M, n the tokens it receives (written out for this keep)
        model = create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2)
        keep, n_in, width = [12, 8, 4], [16, 12, 8], 32
        one = gflops_cost_model(model, "passk", options={"passes": 1}).predict(keep)
        three = gflops_cost_model(model, "passk", options={"passes": 3}).predict(keep)
        assert three - one == pytest.approx(2 * sum(n * n * width for n in n_in) / 1e9, rel=1e-9)
        assert gflops_cost_model(model, "passk", options={"passes": 3}).key["options"] == {"passes": 3}
        # the identity: of its finetune, and of a K search toward its GFLOPs
        assert identity_content(config)["pooling"]["options"] == {"offset": 0, "passes": 3}
        assert identity_content(config) != identity_content(load_config(TINY, base))
        search = ["train.mode=ksearch", "train.ksearch_target={cost: gflops, fraction: 0.5, method: passk}"]
        assert identity_content(load_config(TINY, [*search, "pooling.options.passk.passes=3"]))["pooling"] == {
            "counted": {"passes": 3}}
        assert main(["methods"]) == 0
        listed = capsys.readouterr().out.splitlines()
        assert "    pooling.options.passk.passes = 1 (>= 1; counted in GFLOPs): Gram passes it pays for" in listed
        assert any(line.startswith("passk ") and line.endswith("registered in code") for line in listed)
    finally:
        del METHODS["passk"]


# A spec for the in-process entry points below (``tests.test_registry:PLUGIN_SPEC``).
PLUGIN_SPEC = MethodSpec(firstk, "keep K tokens from an offset", options={"offset": 0})
NOT_A_SPEC = "firstk"


def test_each_built_in_method_says_what_it_is():
    """The registry's answers for the built-in methods, written out from the paper's methods and the experiment's
    default list."""
    from pipeline.methods import (
        build_downsampler,
        downsamples,
        downsampling_methods,
        is_builtin,
        keeps_all,
        registered_in_code,
        swept_methods,
    )
    from pipeline.pooling import factories

    assert downsampling_methods() == ["kmeans", "wkmeans", "wkmedoids", "kmedoids", "powerbert", "random", "importance",
                                      "tome", "conv"]
    assert swept_methods() == ["wkmedoids", "kmedoids", "powerbert", "random", "importance", "tome"]
    assert not downsamples("none") and downsamples("kmedoids") and keeps_all("none")
    assert not keeps_all("kmedoids") and not keeps_all("no_such_method")  # a name nobody registered keeps nothing
    assert is_builtin("tome") and not registered_in_code("tome") and plugin_of("tome") is None
    with pytest.raises(ValueError, match=r"^unknown downsampling method 'nope'; choose one of \['conv', 'importance'"):
        method_spec("nope")
    with pytest.raises(ValueError, match="unknown downsampling method 'nope'"):
        downsamples("nope")
    spec = method_spec("kmedoids")
    assert spec.factory() is factories.kmedoids and spec.needs_scores and not spec.learnable
    assert spec.resolve("kmedoids", {"iters": 2}) == {"iters": 2, "init": "topk", "cluster_on": "tokens",
                                                      "significance": "eq4"}
    with pytest.raises(ValueError, match=r"^pooling.options.kmedoids: method 'kmedoids' has no option 'alpha', 'beta'; "
                                         r"it takes: cluster_on, init, iters, significance$"):
        spec.resolve("kmedoids", {"beta": 1, "alpha": 2, "iters": 3})
    with pytest.raises(ValueError, match=r"^pooling.options.random: method 'random' has no option 'iters'; it takes: "
                                         r"none$"):
        method_spec("random").resolve("random", {"iters": 3})
    assert spec.needs_metric({"cluster_on": "metric"}) and not spec.needs_metric({"cluster_on": "tokens"})
    assert not spec.needs_metric({})
    assert (spec.significance({}), spec.significance({"significance": "cls"})) == ("eq4", "cls")
    assert method_spec("tome").resolve("tome", {}) == {"cluster_on": "metric"}  # ToMe matches on the keys
    assert method_spec("conv").learnable and not method_spec("conv").reconstructs
    with pytest.raises(ValueError, match=r"^method 'conv' has learnable weights and needs dim \(the token width M\)$"):
        build_downsampler("conv", grid=(4, 4), k=4)
    conv = build_downsampler("conv", dim=8, grid=(4, 4), k=4)
    assert conv(torch.randn(2, 16, 8), 4).tokens.shape == (2, 4, 8)
    with pytest.raises(ValueError, match="method 'kmedoids' has no option 'bogus'"):
        build_downsampler("kmedoids", bogus=1)
    out = build_downsampler("kmedoids", iters=1)(torch.randn(2, 10, 4), 3, scores=torch.rand(2, 10))
    assert out.tokens.shape == (2, 3, 4)


def test_a_method_registered_in_code_is_known_until_deleted_and_a_bad_name_is_refused():
    from pipeline.methods import registered_in_code

    with pytest.raises(ValueError, match=r"^method name must be letters, digits and underscores, got 'first-k'$"):
        register_method("first-k", PLUGIN_SPEC)
    with pytest.raises(ValueError, match=r"^'tome' is a built-in method, which register_method may not replace; give "
                                         r"your method a name of its own$"):
        register_method("tome", PLUGIN_SPEC)
    for bad in ("_", "__", ""):
        with pytest.raises(ValueError, match="method name must be letters, digits and underscores"):
            register_method(bad, PLUGIN_SPEC)
    register_method("first_k2", PLUGIN_SPEC)
    try:
        assert "first_k2" in METHODS and method_spec("first_k2") is PLUGIN_SPEC and registered_in_code("first_k2")
        assert method_spec("first_k2").factory() is firstk  # a callable build is the factory itself
        assert list(METHODS)[-1] == "first_k2" and len(METHODS) == len(set(METHODS))
    finally:
        del METHODS["first_k2"]
    assert "first_k2" not in METHODS and not registered_in_code("first_k2")


def test_entry_points_load_in_this_process_each_refusal_named(monkeypatch):
    """Entry points (as importlib.metadata gives them) read in this process: a good one loads with its package, and
    each one left out is warned about once, named with why, and remembered under its name; a reload reads them
    again and keeps a method registered in code."""
    from importlib.metadata import EntryPoint

    import pipeline.methods as methods

    class Dist:
        name, version = "tp-plugin", "0.3"

    def point(name: str, value: str, dist: object | None = Dist) -> EntryPoint:
        found = EntryPoint(name, value, methods.PLUGIN_GROUP)
        return found._for(dist) if dist is not None else found

    here = "tests.test_registry"
    points = [point("good", f"{here}:PLUGIN_SPEC"), point("tome", f"{here}:PLUGIN_SPEC"),
              point("bad-name", f"{here}:PLUGIN_SPEC"), point("missing", f"{here}:NOTHING"),
              point("astring", f"{here}:NOT_A_SPEC"), point("good", f"{here}:PLUGIN_SPEC"),
              point("anon", f"{here}:PLUGIN_SPEC", dist=None), point("coded", f"{here}:PLUGIN_SPEC"),
              point("anon-bad", f"{here}:PLUGIN_SPEC", dist=None)]
    asked = []

    def entry_points(*, group: str) -> list[EntryPoint]:
        asked.append(group)
        return points

    monkeypatch.setattr(methods, "entry_points", entry_points)
    register_method("coded", PLUGIN_SPEC)
    METHODS.reload_plugins()
    try:
        with pytest.warns(PluginWarning) as warned:
            assert "good" in METHODS
        assert asked == ["pipeline.methods"] and "good" in METHODS and asked == ["pipeline.methods"]  # read once
        where = "entry point {} = '{}' of tp-plugin"
        assert [str(w.message) for w in warned] == [
            f"{where.format('tome', here + ':PLUGIN_SPEC')} (tp-plugin 0.3, group pipeline.methods) takes the name "
            "of the built-in method 'tome', which a plugin may not replace; it is not loaded: rename the entry point",
            f"{where.format('bad-name', here + ':PLUGIN_SPEC')} (group pipeline.methods): a method name is letters, "
            "digits and underscores",
            f"{where.format('missing', here + ':NOTHING')} (group pipeline.methods) does not load: AttributeError: "
            f"module '{here}' has no attribute 'NOTHING'; fix or uninstall that package",
            f"{where.format('astring', here + ':NOT_A_SPEC')} (group pipeline.methods) names a str, not a "
            "pipeline.methods.MethodSpec",
            f"{where.format('good', here + ':PLUGIN_SPEC')} (tp-plugin 0.3, group pipeline.methods) takes the name "
            "'good' of tp-plugin 0.3's method; it is not loaded: rename one of them",
            f"{where.format('coded', here + ':PLUGIN_SPEC')} (tp-plugin 0.3, group pipeline.methods) takes the name "
            "'coded' of a method registered in code; it is not loaded: rename one of them",
            f"entry point anon-bad = '{here}:PLUGIN_SPEC' of a package (group pipeline.methods): a method name is "
            "letters, digits and underscores"]
        good = Plugin("tp-plugin", "0.3", f"good = {here}:PLUGIN_SPEC")
        assert plugin_of("good") == good and good.tags() == {"pipeline.plugin": "tp-plugin",
                                                             "pipeline.plugin_version": "0.3"}
        assert str(good) == "tp-plugin 0.3" and method_spec("good") is PLUGIN_SPEC
        assert plugin_of("anon") == Plugin("an unnamed package", "unknown", f"anon = {here}:PLUGIN_SPEC")
        assert sorted(METHODS.problems) == ["anon-bad", "astring", "bad-name", "coded", "good", "missing", "tome"]
        from pipeline.methods import registered_in_code

        assert not registered_in_code("good") and registered_in_code("coded")  # a plugin's is not code's
        with pytest.raises(ValueError, match=r"^method 'astring' is not registered: entry point astring = "):
            method_spec("astring")
        assert METHODS["tome"].summary == "ToMe bipartite soft matching, size-weighted merge"  # the built-in one stays
        del METHODS["anon"]  # a plugin's method taken out: no longer listed, nor its package
        assert "anon" not in METHODS and plugin_of("anon") is None
        points[:] = [point("other", f"{here}:PLUGIN_SPEC")]
        METHODS.reload_plugins()
        assert "good" not in METHODS.plugins and METHODS.problems == {}  # forgotten until read again
        assert "other" in METHODS and "good" not in METHODS and "coded" in METHODS and len(asked) == 2
        register_method("other", PLUGIN_SPEC)  # registered in code over a plugin's: no longer the plugin's
        assert plugin_of("other") is None
    finally:
        monkeypatch.undo()
        METHODS.pop("coded", None)
        METHODS.pop("other", None)
        METHODS.reload_plugins()
    assert "good" not in METHODS


def test_a_registry_read_that_is_interrupted_is_read_again(monkeypatch):
    import pipeline.methods as methods

    calls = []

    def interrupted(*, group: str):
        calls.append(group)
        raise KeyboardInterrupt

    monkeypatch.setattr(methods, "entry_points", interrupted)
    METHODS.reload_plugins()
    try:
        for _ in range(2):
            with pytest.raises(KeyboardInterrupt):
                list(METHODS)
        assert len(calls) == 2  # not marked as read after the first interruption
    finally:
        monkeypatch.undo()
        METHODS.reload_plugins()
    assert "kmedoids" in METHODS


def test_a_fresh_registry_lists_its_built_in_methods_then_reads_the_entry_points_once(monkeypatch):
    """A registry made from a dict of built-in methods (as ``METHODS`` is at import): those methods, nothing else
    recorded, and the entry points read on the first lookup and not again."""
    from importlib.metadata import EntryPoint

    import pipeline.methods as methods

    reads = []

    def entry_points(*, group: str) -> list[EntryPoint]:
        reads.append(group)
        return [EntryPoint("extra", "tests.test_registry:PLUGIN_SPEC", group)]

    monkeypatch.setattr(methods, "entry_points", entry_points)
    spec = MethodSpec(firstk, "keep K tokens from an offset")
    registry = methods._Registry({"mine": spec})
    assert registry.builtin == frozenset({"mine"}) and registry.plugins == {} and registry.problems == {}
    assert reads == []  # nothing read until asked
    assert list(registry) == ["mine", "extra"] and registry["mine"] is spec and len(registry) == 2
    assert reads == ["pipeline.methods"] and registry.plugins["extra"].distribution == "an unnamed package"
    registry["other"] = spec
    assert "other" in registry and reads == ["pipeline.methods"]


def test_a_learnable_method_is_built_with_the_width_grid_k_and_its_options():
    from pipeline.methods import build_downsampler

    def learnable(dim: int, *, grid: tuple[int, int] | None, k: int | None, scale: int) -> tuple:
        return dim, grid, k, scale

    register_method("learnt", MethodSpec(learnable, "a learnable toy", options={"scale": 2}, learnable=True))
    try:
        assert build_downsampler("learnt", dim=8, grid=(4, 6), k=6, scale=3) == (8, (4, 6), 6, 3)
        assert build_downsampler("learnt", dim=8) == (8, None, None, 2)
    finally:
        del METHODS["learnt"]


def test_an_option_checks_its_type_choices_and_minimum_and_says_what_it_allows():
    """``Option.check`` against values written out: the default's type (an int where a float is; no bool for an
    int), a default of None takes any YAML value, the choices and the minimum; ``describe`` as ``pipeline methods``
    prints it."""
    from pipeline.errors import InputError
    from pipeline.methods import CLUSTER_ON, ITERS, Option

    where = "pooling.options.m.k"
    assert ITERS.check(where, 3) == 3 and ITERS.check(where, 1) == 1
    with pytest.raises(InputError, match=r"^pooling.options.m.k is at least 1, got 0$"):
        ITERS.check(where, 0)
    with pytest.raises(InputError, match=r"^pooling.options.m.k takes a value of type int \(its default is 5\), "
                                         r"got True$"):
        ITERS.check(where, True)
    with pytest.raises(InputError, match=r"takes a value of type int \(its default is 5\), got 2.5$"):
        ITERS.check(where, 2.5)
    scale = Option(1.0, minimum=0.5)
    assert scale.check(where, 2) == 2.0 and isinstance(scale.check(where, 2), float)
    assert scale.check(where, 0.5) == 0.5
    with pytest.raises(InputError, match=r"is at least 0.5, got 0.25$"):
        scale.check(where, 0.25)
    assert CLUSTER_ON.check(where, "metric") == "metric"
    with pytest.raises(InputError, match=r"^pooling.options.m.k is one of 'tokens', 'metric', got 'keys'$"):
        CLUSTER_ON.check(where, "keys")
    anything = Option(None)
    assert [anything.check(where, v) for v in (None, 1, "a", [1], {"a": 1}, True)] == [None, 1, "a", [1], {"a": 1},
                                                                                        True]
    with pytest.raises(InputError, match=r"^pooling.options.m.k takes a YAML value, got object$"):
        anything.check(where, object())
    with pytest.raises(InputError, match=r"takes a value of type list \(its default is \[1\]\), got 'x'$"):
        Option([1]).check(where, "x")
    assert ITERS.describe() == "5 (>= 1)"
    assert CLUSTER_ON.describe() == "'tokens' (tokens, metric; counted in GFLOPs)"
    assert Option("a").describe() == "'a'" and Option(2, counted=True).describe() == "2 (counted in GFLOPs)"


def test_the_built_in_steps_flops_are_the_gram_matrix_or_nothing():
    """K-Medoids' step multiplies the n x n Gram matrix of what it clusters (n^2 width); a selection multiplies
    nothing; the methods without a closed form have none."""
    assert method_spec("kmedoids").flops(7, 3, 5, {}) == 7 * 7 * 5 == method_spec("wkmedoids").flops(7, 3, 5, {})
    assert {name: method_spec(name).flops(7, 3, 5, {}) for name in ("powerbert", "random", "importance")} == {
        "powerbert": 0, "random": 0, "importance": 0}
    assert [name for name in ("kmeans", "wkmeans", "tome", "conv", "none") if method_spec(name).flops] == []


def modes(*, offset: int, mode: str):
    """firstk whose ``mode`` knows one value: a spec may declare another its operator cannot run."""
    if mode != "first":
        raise ValueError(f"unknown mode {mode!r}")
    return firstk(offset=offset)


@pytest.mark.parametrize(("build", "declared"), [
    (firstk, {"offset": 0, "stride": 2}),
    (modes, {"offset": 0, "mode": Option("first", choices=("first", "last"))}),
])
def test_a_spec_that_disagrees_with_its_operator_is_one_line_from_methods_and_run_plan(build, declared, capsys):
    """An option the operator does not take (``stride``: ``build(**options)`` forwards it, and the factory refuses
    it), or a value it cannot run (``mode: last``, declared as a choice): `pipeline methods` and `run --plan` each
    say so in one line before any work, instead of the first forward failing inside a Ray worker. An operator that
    fails at its own defaults is no disagreement with its spec: the probe leaves it to its stages (a rehearsal names
    it per stage)."""
    from pipeline.cli import main
    from pipeline.models.probe import probe_method

    register_method("badk", MethodSpec(build, "firstk, declared wrong", options=declared))
    try:
        assert main(["methods"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "badk" in line]
        assert len(err) == 1 and err[0].startswith("error: method 'badk': its operator fails with offset=") \
            and "make the two agree" in err[0], err
        demo = ROOT / "configs" / "experiments" / "demo.yaml"
        plan = ["run", str(demo), "--plan", "--set", "experiment.methods=[badk]"]
        if "mode" in declared:  # the config's own value: run --plan probes what the finetunes will run
            assert main(plan) == 0
            capsys.readouterr()
            plan += ["--set", "pooling.options.badk.mode=last"]
        assert main(plan) == 2
        line = capsys.readouterr().err.strip()
        assert "experiment.methods: method 'badk': its operator fails with offset=" in line and "\n" not in line, line
        if "mode" in declared:
            probe_method("badk", {"mode": "first"})  # the value it runs passes
    finally:
        del METHODS["badk"]

    def broken(*, offset: int):
        def step(tokens, k, **_):
            raise RuntimeError("a fault of the operator itself")
        return step

    register_method("brokenk", MethodSpec(broken, "fails at its defaults", options={"offset": 0}))
    try:
        probe_method("brokenk")  # its own fault, for its stages to report, not the probe's
    finally:
        del METHODS["brokenk"]
    assert main(["methods"]) == 0  # the built-in methods' specs and operators agree at every option's two values


def test_the_operator_probe_leaves_the_callers_random_state_as_it_was():
    """`run --plan` and the `run` driver probe each method on a seeded tiny model: the caller's global generator goes
    on as if no probe had drawn from it (the probe used to reseed it to 0)."""
    from pipeline.models.probe import probe_method

    torch.manual_seed(123)
    torch.rand(2)
    expected = torch.rand(4)  # what the generator gives next, without a probe
    torch.manual_seed(123)
    torch.rand(2)
    probe_method("powerbert")
    assert torch.equal(torch.rand(4), expected)
