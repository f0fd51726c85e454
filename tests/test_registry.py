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
from pipeline.methods import METHODS, MethodSpec, register_method
from pipeline.pooling import PoolResult
from tests.conftest import write_plugin, write_synthetic_pair

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
    with pytest.raises(ConfigError, match=r"pooling.cluster_on applies to kmeans, kmedoids, tome, wkmeans"):
        load_config(None, ["pooling.method=firstk", "pooling.cluster_on=metric"])
    del METHODS["firstk"]
    with pytest.raises(ConfigError, match="unknown downsampling method 'firstk'"):
        load_config(None, ["pooling.method=firstk"])
    register_method("firstk", MethodSpec(firstk, "again", options={"offset": 0}))


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


def test_a_registered_method_trains(toy, tmp_path):
    from pipeline.train import run_training
    from pipeline.train.checkpoint import load_checkpoint

    data = write_synthetic_pair(tmp_path, train=64, val=32)
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
                                       "pooling.cluster_on=tokens"])
    assert not build_model(tokens_config).blocks.needs_keys


def test_the_class_token_scores_reach_the_model_a_finetune_builds():
    """``pooling.significance: cls`` in a finetune config gives the model it trains class-token scores;
    the default builds eq. 4's."""
    from pipeline.train.build import build_model

    base = ["train.mode=finetune", "pooling.method=wkmedoids", "pooling.keep=[12, 8, 4]"]
    cls = build_model(load_config(TINY, [*base, "pooling.significance=cls"])).blocks
    eq4 = build_model(load_config(TINY, base)).blocks
    assert (cls.significance, eq4.significance) == ("cls", "eq4")
    assert cls.config.options["significance"] == "cls" and eq4.config.options["significance"] == "eq4"


def _with_plugin(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_plugins_entry_point_registers_its_method(tmp_path):
    """The method of an installed package (a .dist-info on the path) is listed, validated by the config
    and counted by `pipeline flops`; nothing of it is in this repository."""
    plugin = write_plugin(tmp_path / "site")
    listed = _with_plugin(plugin, "methods")
    assert listed.returncode == 0 and re.search(r"^firstk\s+keep K tokens from an offset \(a plugin\)",
                                                listed.stdout, flags=re.M), listed.stdout + listed.stderr
    shown = _with_plugin(plugin, "config", "show", "--set", "pooling.method=firstk", "--set", "pooling.keep=[4]")
    assert shown.returncode == 0 and "method: firstk" in shown.stdout, shown.stderr
    flops = _with_plugin(plugin, "flops", "--model", "deit_tiny_patch16_224", "--method", "firstk",
                         "--keep", "98,98,98,49,49,49,20,20,20,10,10,0", "--json")
    assert flops.returncode == 0 and 0.2 < json.loads(flops.stdout)["gflops"] < 1.258 * 0.6, flops.stderr


def test_a_broken_plugin_is_named_in_one_line(tmp_path):
    for value, says in (("tp_plugin:NOT_A_SPEC", "names a str, not a pipeline.methods.MethodSpec"),
                        ("tp_plugin:MISSING", "does not load: AttributeError")):
        plugin = write_plugin(tmp_path / value.split(":")[1], value)
        proc = _with_plugin(plugin, "methods")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"error: entry point firstk = '{value}' of tp-plugin (group pipeline.methods) {says}" in proc.stderr
