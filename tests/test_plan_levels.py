"""``run --plan`` refuses what the run refuses: the paper's pinned levels (``experiment.levels``) for a model whose keep
lists the paper does not print (DeiT-Ti)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs/experiments/paper_deit_imagenet.yaml"


def levels_overrides(tmp_path: Path, model: str) -> list[str]:
    for split in ("train", "val"):
        (tmp_path / f"{split}.beton").touch()  # the plan reads no image of them: the cluster's paths, here
    return [f"data.train={tmp_path}/train.beton", f"data.val={tmp_path}/val.beton", "experiment.levels=[1, 3]",
            "experiment.lambdas=null", "experiment.conv=null", "experiment.no_finetune=null",
            f"experiment.models=[{model}]", "experiment.methods=[powerbert]"]


def planned_error(tmp_path: Path, model: str, capsys) -> str:
    from pipeline.cli import main

    overrides = levels_overrides(tmp_path, model)
    assert main(["run", str(PAPER), "--plan", *[arg for o in overrides for arg in ("--set", o)]]) == 2
    return capsys.readouterr().err.strip()


def test_the_plan_refuses_deit_ti_at_the_paper_levels(tmp_path, capsys):
    planned = planned_error(tmp_path, "deit_tiny_patch16_224", capsys)
    assert planned == ("error: no sparsity levels for 'deit_tiny_patch16_224'; the paper gives them for: "
                       "deit_e252_patch16_224, deit_e318_patch16_224, deit_small_patch16_224"), planned


@pytest.mark.slow  # imports the runner (torch, timm, MLflow): about 7 s in a fresh process here
def test_the_plan_refuses_it_in_the_runs_own_line(tmp_path, monkeypatch, capsys):
    import pipeline.dag.runner as runner
    from pipeline.config import ConfigError, load_config

    planned = planned_error(tmp_path, "deit_tiny_patch16_224", capsys)
    overrides = levels_overrides(tmp_path, "deit_tiny_patch16_224")
    # The run's check before its first stage, without the data and cluster checks that tiny empty betons fail first.
    monkeypatch.setattr(runner, "preflight", lambda config: None)
    with pytest.raises(ConfigError) as refused:
        runner.check_experiment(load_config(PAPER, overrides))
    assert planned == f"error: {refused.value}"


def test_the_plan_keeps_the_paper_levels_of_a_model_the_paper_prints(tmp_path):
    from pipeline.config import load_config
    from pipeline.dag.checks import check_paper_levels
    from pipeline.dag.plan import archs, paper_levels

    config = load_config(PAPER, levels_overrides(tmp_path, "deit_small_patch16_224"))
    check_paper_levels(config)
    (arch,) = archs(config)
    assert set(paper_levels(config, arch)) == {"L1", "L3"}
