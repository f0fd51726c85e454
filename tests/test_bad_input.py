"""Inputs a new user gets wrong, each refused with a message that says what and how to fix it, and
nothing written or created on the way."""

from __future__ import annotations

import pytest
import torch

from pipeline.cli import main
from pipeline.pooling import build_downsampler, token_pool


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
