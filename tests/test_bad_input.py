"""Inputs a new user gets wrong, each refused with a message that says what and how to fix it, and
nothing written or created on the way."""

from __future__ import annotations

import pytest
import torch

from pipeline.cli import main
from pipeline.methods import build_downsampler
from pipeline.pooling import token_pool


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_flops_level_with_a_custom_width_is_refused(capsys):
    # DeiT-S's level-1 list on a width-252 model would count 1.386 GFLOPs, e252's own list 1.441.
    code, _, err = run(capsys, "flops", "--embed-dim", "252", "--level", "1")
    assert code == 2 and "--level holds the paper's keep lists of its models" in err
    assert "--model deit_e252_patch16_224" in err
    code, out, _ = run(capsys, "flops", "--model", "deit_e252_patch16_224", "--method", "powerbert", "--level", "1")
    assert code == 0 and "effective keep" in out


def test_flops_keep_without_a_method_is_refused(capsys):
    code, _, err = run(capsys, "flops", "--keep", "196,195,193,188,169,140,121,110,73,38,7,0")
    assert code == 2 and "--keep without --method keeps every token" in err


def test_report_of_an_unknown_run_creates_no_store(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "nothing" / "mlflow.db"
    code, _, err = run(capsys, "report", "no-such-run", "--tracking-uri", f"sqlite:///{store}")
    assert code == 2 and "there is no MLflow store" in err
    assert not store.exists() and not store.parent.exists()


@pytest.mark.parametrize("method", ["kmeans", "kmedoids", "wkmedoids", "tome", "powerbert", "random", "importance"])
@pytest.mark.parametrize("init", ["random", "topk"])
def test_an_empty_batch_gives_empty_results(method, init):
    tokens, scores = torch.randn(0, 10, 4), torch.rand(0, 10)
    if method in ("kmeans", "kmedoids"):
        out = token_pool(tokens, 3, method=method, init=init, init_scores=scores)
    else:
        options = {"init": init} if method == "wkmedoids" else {}
        out = build_downsampler(method, **options)(tokens, 3, scores=scores, metric=tokens)
    assert out.tokens.shape == (0, 3, 4) and out.sizes.shape == (0, 3) and out.assign.shape == (0, 10)


def test_keep_lists_are_checked_when_the_config_loads():
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"pooling.keep.1: Input should be greater than or equal to 0 \(got -1\)"):
        load_config(None, ["pooling.keep=[4, -1, 2]"])
    with pytest.raises(ConfigError, match=r"pooling.keep has 2 entries \[4, 2\] but model.depth is 3"):
        load_config(None, ["model.depth=3", "pooling.keep=[4, 2]"])


def test_viz_on_a_truncated_beton_says_so(capsys, tmp_path):
    from pipeline.data import WriteSettings, open_source, write_beton

    beton = tmp_path / "val.beton"
    write_beton(open_source("synthetic:classes=4,count=16,size=16"), beton, WriteSettings(mode="raw", max_res=None),
                log=lambda _: None)
    beton.write_bytes(beton.read_bytes()[:-500])
    code, _, err = run(capsys, "viz", "clusters", "--model", "vit_tiny_patch16_224", "--data", str(beton),
                       "--count", "2", "--method", "tome", "--keep", "98,49,20,10,5,2,1,1,1,1,1,1",
                       "--out", str(tmp_path / "maps"))
    assert code == 2 and "only partly copied" in err
    assert not (tmp_path / "maps").exists()


T = "configs/train/tiny_synthetic.yaml"
E = "configs/experiments/tiny.yaml"
SYN = "synthetic:classes=4,count=16,size=8"
KEEP12 = "40,24,16,8,4,0,0,0,0,0,0,0"
# A catalogue of wrong inputs a new user types, each with the words its one-line error must contain.
# docs/reliability.md counts them. Paths are relative to a scratch folder holding only `fake.beton`.
CATALOGUE = [
    (["config", "show", T, "--set", "train.bogus=1"], "train.bogus: unknown key"),
    (["config", "show", "nope.yaml"], "config file not found: nope.yaml"),
    (["config", "show", T, "--set", "pooling.keep=[4,-1,2]"], "pooling.keep.1: Input should be greater than or equal"),
    (["config", "show", T, "--set", "pooling.keep=[4,2]"], "pooling.keep has 2 entries [4, 2] but model.depth is 3"),
    (["config", "show", T, "--set", "train.workers"], "expected KEY=VALUE"),
    (["config", "show", T, "--set", "train.workers=abc"], "train.workers: Input should be a valid integer"),
    (["config", "show", T, "--set", "pooling.method=kmeanz"], "unknown downsampling method 'kmeanz'"),
    (["config", "show", E, "--set", "experiment.methods=[]", "--set", "experiment.baseline=false"],
     "the sweep would have zero trials"),
    (["config", "show", E, "--set", "experiment.levels=[1]"], "give experiment.lambdas (K search) or"),
    (["flops", "--model", "nope_model"], "unknown timm model 'nope_model'"),
    (["flops", "--method", "nope"], "unknown downsampling method 'nope'"),
    (["flops", "--method", "powerbert", "--keep", "196,200,150,100,80,60,40,30,20,10,5,0"],
     "keep[1] (block 2) is 200, above the model's 196 patch tokens"),
    (["flops", "--method", "powerbert", "--keep", "100,50"], "keep has 2 entries but the model has 12 blocks"),
    (["data", "check", "missing.beton"], "dataset not found: missing.beton"),
    (["data", "check", "fake.beton"], "fake.beton has no metadata file"),
    (["data", "write", "--source", "nope:x", "--out", "a.beton"], "unknown source 'nope:x'"),
    (["data", "write", "--source", SYN, "--out", "fake.beton"], "--out fake.beton exists; pass --overwrite"),
    (["data", "write", "--source", SYN, "--out", "a.beton", "--limit", "2"], "--limit 2 is below the 4 classes"),
    (["train", T, "--set", "data.train=missing.beton", "--set", "data.val=missing.beton"], "dataset not found"),
    (["train", T, "--set", "data.train=fake.beton", "--set", "data.val=fake.beton"], "has no metadata file"),
    (["run", T], "`pipeline run` needs an experiment section"),
    (["run", E], "data.train is not set"),
    (["report", "no-run", "--tracking-uri", "sqlite:///none/m.db"], "there is no MLflow store"),
    (["viz", "clusters", "--model", "vit_tiny_patch16_224", "--images", "missing.png", "--method", "wkmedoids",
      "--keep", KEEP12, "--out", "maps"], "image not found: missing.png"),
    (["viz", "clusters", "--model", "vit_tiny_patch16_224", "--images", "fake.beton", "--out", "maps"],
     "--method and --keep are needed"),
    (["analyze", "redundancy", "--checkpoint", "missing.pt", "--data", "fake.beton", "--out", "x"],
     "checkpoint not found: missing.pt"),
    (["analyze", "reconstruction", "--checkpoint", "fake.beton", "--data", "fake.beton", "--k", "8", "--out", "x"],
     "not a readable checkpoint"),
    (["bench", "throughput", "--methods", "nope"], "unknown downsampling method 'nope'"),
    (["bench", "loader", "--folder", "missing"], "--folder missing: no such folder"),
    (["bench", "loader", "--imagenet-like", "--store", "jpeg:256"], "--store 'jpeg:256': give MODE:MAX_RES:QUALITY"),
    (["bench", "loader", "--imagenet-like", "--store", "png:256:90"], "MODE is one of jpg, raw, smart, proportion"),
    (["bench", "loader", "--imagenet-like", "--step-rates", "fast"], "give NAME=IMAGES_PER_S pairs"),
    (["data", "write", "--source", SYN, "--out", "a.beton", "--quality", "500"], "JPEG quality runs from 1 to 100"),
    (["data", "write", "--source", SYN, "--out", "a.beton", "--mode", "proportion", "--compress-probability", "2"],
     "give a probability in [0, 1]"),
]


@pytest.mark.parametrize(("argv", "says"), CATALOGUE, ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _) in
                                                         enumerate(CATALOGUE)])
def test_catalogue_of_wrong_inputs_gives_one_clear_line_and_writes_nothing(argv, says, tmp_path, monkeypatch, capsys):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "fake.beton").write_text("not a beton")
    monkeypatch.chdir(tmp_path)
    argv = [str(root / a) if a.startswith("configs/") else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["fake.beton"]  # no store, folder or partial file left behind
