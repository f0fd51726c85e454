"""pipeline.sparsity: each model's keep lists are the paper's (written out here, and read from the YAML with plain
PyYAML), and a missing model, level or file is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.sparsity import SPARSITY_DIR, level_keep, load_sparsity, sparsity_files

# Level 3 of each model, from the paper's Appendix G tables.
LEVEL_3 = {
    "deit_small_patch16_224": [196, 194, 187, 163, 118, 85, 58, 47, 20, 12, 2, 0],
    "deit_e252_patch16_224": [196, 195, 188, 167, 131, 96, 63, 52, 13, 11, 2, 0],
    "deit_e318_patch16_224": [196, 195, 190, 165, 119, 84, 65, 50, 26, 14, 3, 0],
}


def test_each_models_level_is_its_own_list():
    for model, keep in LEVEL_3.items():
        assert level_keep(model, 3) == keep
    assert level_keep("deit_small_patch16_224", 7) == [162, 129, 66, 33, 4, 1, 1, 0, 0, 0, 0, 0]
    assert level_keep("deit_e318_patch16_224", 0) == [196, 196, 196, 194, 192, 184, 181, 181, 170, 170, 170, 170]


def test_every_level_of_every_file_is_the_list_the_yaml_holds():
    files = sorted(SPARSITY_DIR.glob("*.yaml"))
    assert sparsity_files() == files and len(files) == 3
    for path in files:
        raw = yaml.safe_load(path.read_text())
        assert sorted(raw["levels"]) == list(range(8))
        for level, row in raw["levels"].items():
            assert level_keep(raw["model"], level) == row["keep"]


def test_a_model_or_level_without_lists_is_named_with_the_ones_there_are():
    with pytest.raises(ConfigError, match=r"^no sparsity levels for 'vit_base_patch16_224'; the paper gives them for: "
                                          r"deit_e252_patch16_224, deit_e318_patch16_224, deit_small_patch16_224$"):
        level_keep("vit_base_patch16_224", 3)
    path = SPARSITY_DIR / "deit_small.yaml"
    with pytest.raises(ConfigError, match=rf"^{path}: no level 8; levels are \[0, 1, 2, 3, 4, 5, 6, 7\]$"):
        level_keep("deit_small_patch16_224", 8)


def test_a_missing_or_malformed_sparsity_file_is_named_with_the_key(tmp_path: Path):
    with pytest.raises(ConfigError, match=rf"^sparsity file not found: {tmp_path / 'x.yaml'}; the shipped ones are: "
                                          r"deit_e252, deit_e318, deit_small$"):
        load_sparsity(tmp_path / "x.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text("model: m\nlevels:\n  1: {keep: [4, 2], powerbert: 1.0, kmedoids: 1.0, extra: 3}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: levels\.1\.extra: Extra inputs are not permitted$"):
        load_sparsity(path)
    path.write_text("model: m\nlevels:\n  1: {keep: [], powerbert: 1.0, kmedoids: 1.0}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: levels\.1\.keep: List should have at least 1 item"):
        load_sparsity(path)
    path.write_text("model: m\nlevels:\n  1: {keep: [4, 2], powerbert: 1.0}\n  2: {keep: [4], kmedoids: 1.0}\n")
    with pytest.raises(ConfigError, match=r"levels\.1\.kmedoids: Field required; levels\.2\.powerbert: Field required"):
        load_sparsity(path)
    path.write_text("model: m\nlevels:\n  1: {keep: [4, 2]\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not valid YAML"):
        load_sparsity(path)
    path.write_text("model: m\nlevels:\n  1: {keep: [4, 2], powerbert: 1.0, kmedoids: 1.5}\n")
    loaded = load_sparsity(path)
    assert loaded.model == "m" and loaded.levels[1].keep == [4, 2] and loaded.levels[1].kmedoids == 1.5
    assert loaded.levels[1].kmeans is None
