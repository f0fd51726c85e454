"""Inputs a new user gets wrong, each refused with a message that says what and how to fix it, and
nothing written or created on the way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

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


@pytest.mark.beton
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
    (["config", "show", E, "--set", "experiment.levels=[1]"],
     "give experiment.lambdas and/or experiment.ksearch_targets"),
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


# ---- what a new user's probe found (each with its fix) ----

@pytest.mark.beton
def test_a_rerun_under_the_same_name_with_another_config_is_refused(synthetic_data, tmp_path):
    """`pipeline train` reruns a run folder only under the config that made it: another learning rate,
    seed, dataset or width is refused with the keys that differ, as are fewer epochs than done; more epochs
    continue it, and --restart sets the earlier run aside and starts over."""
    from pipeline.config import ConfigError, load_config
    from pipeline.train import run_training

    data = synthetic_data(64, 32)
    tiny = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_synthetic.yaml"

    def config(*extra: str):
        return load_config(tiny, [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
                                  "train.workers=0", f"train.storage_path={tmp_path / 'ray'}",
                                  f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "train.name=same",
                                  f"train.artifact_root={tmp_path / 'art'}", "recipe.epochs=1", *extra])

    first = run_training(config())
    for change, says in ((["recipe.lr=0.1", "seed=3"], "recipe.lr: 0.002 -> 0.1; seed: 0 -> 3"),
                         ([f"data.train={data / 'val.beton'}"], "data.train: "),
                         (["model.embed_dim=32"], "model.embed_dim: 24 -> 32")):
        with pytest.raises(ConfigError, match="names a run of another config") as refused:
            run_training(config(*change))
        assert says in str(refused.value) and "--restart" in str(refused.value)
    more = run_training(config("recipe.epochs=2"))
    assert more.summary["epoch"] == 2 and more.run_id == first.run_id
    with pytest.raises(ConfigError, match=r"recipe.epochs=1, but the run 'same' has done 2 epochs"):
        run_training(config())
    fresh = run_training(config("recipe.lr=0.1"), restart=True)
    assert fresh.summary["epoch"] == 1 and list((tmp_path / "ray").glob("same.restarted-*"))


def test_a_directory_link_back_into_the_tree_is_not_followed(tmp_path):
    from pipeline.data import open_source

    for name in ("class_a", "class_b"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / name / "one.png")
    (tmp_path / "class_a" / "up").symlink_to("..")
    (tmp_path / "class_a" / "self").symlink_to(".")
    source = open_source(f"imagefolder:{tmp_path}")
    assert len(source) == 2 and sorted(source.labels.tolist()) == [0, 1]
    assert sorted(Path(p).name for p in source.skipped_links) == ["self", "up"]


@pytest.mark.beton
def test_data_check_refuses_labels_beyond_the_classes(tmp_path, capsys):
    import json

    from pipeline.data import WriteSettings, open_source, write_beton

    out = tmp_path / "x.beton"
    write_beton(open_source("synthetic:classes=4,count=8,size=8"), out, WriteSettings(mode="raw", max_res=None),
                log=lambda _: None)
    meta_path = tmp_path / "x.beton.json"
    meta = json.loads(meta_path.read_text())
    meta.update(num_classes=3, classes=meta["classes"][:3])
    meta_path.write_text(json.dumps(meta))
    code, _, err = run(capsys, "data", "check", str(out))
    assert code == 2 and "its labels run from 0 to 3, but its metadata says num_classes=3" in err, err


@pytest.mark.beton
def test_thin_images_keep_a_pixel_a_side_and_the_write_ends(tmp_path):
    """2000 x 2 at --max-res 256 became 256 x 0 in FFCV's resize, which failed in a writer process while
    the parent waited forever."""
    from ffcv.reader import Reader

    from pipeline.data import WriteSettings, open_source, write_beton

    for name, size in (("wide", (2000, 2)), ("tall", (2, 2000))):
        (tmp_path / "src" / name).mkdir(parents=True)
        Image.new("RGB", size, (100, 50, 0)).save(tmp_path / "src" / name / "x.png")
    write_beton(open_source(f"imagefolder:{tmp_path / 'src'}"), tmp_path / "thin.beton",
                WriteSettings(mode="jpg", max_res=256), log=lambda _: None)
    stored = Reader(str(tmp_path / "thin.beton")).metadata["f0"]
    assert sorted(zip(stored["width"].tolist(), stored["height"].tolist())) == [(1, 256), (256, 1)]


WRITER_FAILS = """
import sys
from pipeline.data import WriteSettings, open_source, write
from pipeline.errors import PipelineError

def broken(self, index):
    raise RuntimeError("a writer process fails on its first image")

write._Samples.__getitem__ = broken
try:
    write.write_beton(open_source("synthetic:classes=2,count=50,size=8"), sys.argv[1], WriteSettings(mode="raw"),
                      log=lambda _: None)
except PipelineError as err:
    print("refused:", err)
"""


@pytest.mark.beton
@pytest.mark.alone  # a timing-sensitive process test: `make test` runs it after the parallel run, on an idle machine
def test_a_writer_process_that_fails_at_once_ends_the_write(tmp_path):
    """A writer process that dies before the watchdog first looks (it used to miss those) ends the write."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", WRITER_FAILS, str(tmp_path / "x.beton")], capture_output=True,
                          text=True, timeout=120)
    assert "refused: a writer process failed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert not (tmp_path / "x.beton").exists()


def beton_where_read(cases: list[tuple[list[str], str]]) -> list:
    """The cases whose command reads ``x.beton`` (the test writes it first) marked ``beton``."""
    return [pytest.param(*case, marks=pytest.mark.beton) if "x.beton" in case[0] else case for case in cases]


@pytest.mark.parametrize(("argv", "says"), beton_where_read([
    (["data", "write", "--source", "synthetic:classes=10,count=4", "--out", "a.beton"],
     "count=4 is below classes=10: 6 class(es) would have no image"),
    (["config", "show", "--set", "seed=-1"], "seed: Input should be greater than or equal to 0"),
    (["config", "show", "--set", "train.tracking_uri=http://bob:hunter2@localhost:5000"],
     "http://***@localhost:5000 holds a user and password"),
    (["analyze", "redundancy", "--model", "vit_tiny_patch16_224", "--data", "x.beton", "--batches", "0",
      "--out", "o"], "--batches 0 --batch-size 64: both must be >= 1"),
    (["select", "--experiment", "it's", "--max-gflops", "1", "--tracking-uri", "sqlite:///m.db"],
     "an experiment.name holds only letters"),
]))
def test_more_of_the_probes_inputs_get_one_line(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if "x.beton" in argv:
        from pipeline.data import WriteSettings, open_source, write_beton

        write_beton(open_source("synthetic:classes=2,count=4,size=8"), tmp_path / "x.beton",
                    WriteSettings(mode="raw", max_res=None), log=lambda _: None)
    if argv[0] == "select":
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri="sqlite:///m.db").search_experiments()
    code, _, err = run(capsys, *argv)
    assert code == 2 and says in err and "Traceback" not in err, err
    assert "hunter2" not in err


def test_config_show_refuses_a_binary_file_and_an_out_that_is_a_file(tmp_path, capsys):
    binary = tmp_path / "x.yaml"
    binary.write_bytes(bytes(range(256)))
    code, _, err = run(capsys, "config", "show", str(binary))
    assert code == 2 and "not a text file" in err
    taken = tmp_path / "taken"
    taken.write_text("")
    code, _, err = run(capsys, "config", "show", "--out", str(taken))
    assert code == 2 and "is a file; give the folder" in err
    code, _, err = run(capsys, "report", str(tmp_path), "--out", str(taken))
    assert code == 2 and ("is a file; give a folder" in err), err


def test_report_of_a_malformed_results_csv(tmp_path, capsys):
    (tmp_path / "results.csv").write_text("arch,level\nM16,lam0\n")
    code, _, err = run(capsys, "report", str(tmp_path))
    assert code == 2 and "lacks the column(s) method, keep, gflops, top1, images_per_s" in err, err
    from pipeline.report import COLUMNS

    header = ",".join(COLUMNS)
    cells = dict.fromkeys(COLUMNS, "") | {"arch": "M16", "level": "l", "method": "x", "keep": "[1]", "gflops": "1",
                                          "top1": "1", "images_per_s": "1"}
    (tmp_path / "results.csv").write_text(f"{header}\n{','.join((cells | {'gflops': 'cheap'}).values())}\n")
    code, _, err = run(capsys, "report", str(tmp_path))
    assert code == 2 and "line 2: a value that is not a number" in err, err


def test_report_of_a_results_csv_of_another_release_is_one_line_naming_the_column(tmp_path, capsys):
    """A results.csv without the speed columns (an older writer's, or edited) is refused naming them, not reported with
    a speed front that announces intervals above empty cells; a column this release does not write, or a row with a
    required cell empty, is refused the same way."""
    from pipeline.report import COLUMNS

    cells = dict.fromkeys(COLUMNS, "") | {"arch": "M16", "level": "l", "method": "x", "keep": "[1]", "gflops": "1",
                                          "top1": "1", "images_per_s": "1"}
    older = [c for c in COLUMNS if not c.startswith(("images_per_s_", "speed_"))]
    (tmp_path / "results.csv").write_text(f"{','.join(older)}\n{','.join(cells[c] for c in older)}\n")
    code, _, err = run(capsys, "report", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "report" / "report.md").exists(), err
    assert (f"{tmp_path / 'results.csv'} lacks the column(s) images_per_s_low, images_per_s_high, speed_ratio, "
            "speed_ratio_low, speed_ratio_high, speed_blocks, speed_stop, speed_half_width, speed_ties, speed_setting; "
            "it was not written by this release's `pipeline run`, or was edited; run `pipeline run` again") in err, err
    (tmp_path / "results.csv").write_text(f"{','.join(COLUMNS)},speed_clock\n{','.join(cells.values())},cpu\n")
    code, _, err = run(capsys, "report", str(tmp_path))
    assert code == 2 and "has the column(s) speed_clock, which this release does not write" in err, err
    (tmp_path / "results.csv").write_text(f"{','.join(COLUMNS)}\n{','.join((cells | {'top1': ''}).values())}\n")
    code, _, err = run(capsys, "report", str(tmp_path))
    assert code == 2 and "results.csv, line 2: top1: Input should be a valid number (got None); it was not" in err, err


def test_models_refuse_what_they_cannot_run_and_take_an_empty_batch():
    from pipeline.errors import InputError
    from pipeline.models import create_model

    with pytest.raises(InputError, match="alpha must be a finite number > 0"):
        create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, qk_norm="fixed", alpha=float("nan"))
    with pytest.raises(InputError, match=r"patches of \(32, 32\) do not fit in images of \(16, 16\)"):
        create_model("vit_tiny_patch16_224", img_size=16, patch_size=32, depth=2)
    net = create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=3, num_classes=5,
                       method="wkmedoids", keep=[12, 8, 4]).eval()
    with torch.no_grad():
        assert net(torch.randn(0, 3, 16, 16)).shape == (0, 5)  # as timm's unmodified model answers


def test_kmeans_refuses_tokens_whose_squares_overflow():
    from pipeline.errors import InputError

    with pytest.raises(InputError, match="squared norms overflow float32"):
        token_pool(torch.randn(2, 8, 4) * 1e20, 3, method="kmeans", init="random")
    token_pool(torch.randn(2, 8, 4) * 1e15, 3, method="kmeans", init="random")  # large but representable: fine


@pytest.mark.slow  # a CLI subprocess or two: over 5 s (tests/tiers.py)
def test_the_cli_turns_off_mlflows_telemetry_unless_the_user_set_it():
    import os
    import subprocess
    import sys

    code = "from pipeline.cli import main; main(['methods']); import os; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip().splitlines()[-1] == "true"
    env["MLFLOW_DISABLE_TELEMETRY"] = "false"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip().splitlines()[-1] == "false"


@pytest.mark.parametrize(("argv", "says"), [
    (["flops", "--embed-dim", "0"], "--embed-dim 0: a width is at least 1"),
    (["flops", "--model", "deit_tiny_patch16_224", "--method", "kmedoids", "--keep=-5,3,1,1,1,1,1,1,1,1,1,1"],
     "is -5: a number of tokens cannot be negative"),
])
def test_flops_arguments_get_one_line(argv, says, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 2 and says in err and "Traceback" not in err, err


SYNTHETIC = ["--source", "synthetic:classes=2,count=10,size=8"]


@pytest.mark.parametrize(("argv", "says"), [
    (["data", "write", *SYNTHETIC, "--out", "x.beton", "--limit", "-5"],
     "--limit -5: give the number of images to keep, 1 or more"),
    (["data", "folder", *SYNTHETIC, "--out", "x", "--limit", "-5"], "--limit -5: give the number of images"),
    (["data", "write", *SYNTHETIC, "--out", "x.beton", "--quality", "-5"], "--quality -5: JPEG quality runs from 1"),
    (["data", "write", *SYNTHETIC, "--out", "x.beton", "--compress-probability", "-0.5"],
     "--compress-probability -0.5: give a probability in [0, 1]"),
    (["flops", "--embed-dim", "-5"], "--embed-dim -5: a width is at least 1"),
    (["flops", "--model", "deit_tiny_patch16_224", "--method", "kmedoids", "--keep", "-5,3,1,1,1,1,1,1,1,1,1,1"],
     "is -5: a number of tokens cannot be negative"),
])
def test_a_negative_number_after_an_option_gets_that_options_message(argv, says, tmp_path, monkeypatch, capsys):
    """``--limit -5`` says what is wrong with -5, in the same words as ``--limit=-5`` (it used to say how
    argparse reads a leading '-'), and writes nothing."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    assert code == 2 and says in err and "Traceback" not in err and "reads as an option" not in err, err
    at = next(i for i, word in enumerate(argv) if word.startswith("-") and word[1:2].isdigit())
    joined = [*argv[:at - 1], f"{argv[at - 1]}={argv[at]}", *argv[at + 1:]]
    assert run(capsys, *joined) == (code, "", err)
    assert list(tmp_path.iterdir()) == []


def _tiny_training(tmp_path: Path, data: Path, *extra: str):
    from pipeline.config import load_config

    tiny = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_synthetic.yaml"
    return load_config(tiny, [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
                              "train.workers=0", f"train.storage_path={tmp_path / 'ray'}",
                              f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "train.name=damaged",
                              f"train.artifact_root={tmp_path / 'art'}", *extra])


@pytest.mark.beton
@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_an_unreadable_newest_checkpoint_is_passed_over_saying_so(damage, synthetic_data, tmp_path, capsys):
    """The newest checkpoint's file deleted or cut short: the rerun resumes from the one before and says
    which it passed over, where it used to stop on the missing file."""
    from pipeline.train import run_training

    data = synthetic_data(64, 32)
    run_training(_tiny_training(tmp_path, data, "recipe.epochs=2", "train.keep_checkpoints=2"))
    newest = tmp_path / "ray" / "damaged" / "local_checkpoints" / "epoch_00002" / "checkpoint.pt"
    if damage == "deleted":
        newest.unlink()
    else:
        newest.write_bytes(newest.read_bytes()[:1000])
    capsys.readouterr()
    result = run_training(_tiny_training(tmp_path, data, "recipe.epochs=3", "train.keep_checkpoints=3"))
    out = capsys.readouterr().out
    assert "resuming from epoch_00001: the newer epoch_00002" in out and "could not be read" in out, out
    assert "resuming from the checkpoint of epoch 1" in out and result.summary["epoch"] == 3


@pytest.mark.alone  # a timing-sensitive process test: `make test` runs it after the parallel run, on an idle machine
def test_ctrl_c_says_where_training_stopped(tmp_path):
    """Ctrl-C during `pipeline train` prints one line (where it stopped, that a rerun resumes), no traceback."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import write_synthetic_pair

    data = write_synthetic_pair(tmp_path, 256, 32)
    tiny = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_synthetic.yaml"
    command = [sys.executable, "-m", "pipeline", "train", str(tiny), "--set", f"data.train={data / 'train.beton'}",
               "--set", f"data.val={data / 'val.beton'}", "--set", "train.workers=0", "--set", "recipe.epochs=1000",
               "--set", f"train.storage_path={tmp_path / 'ray'}", "--set",
               f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
               "--set", f"train.artifact_root={tmp_path / 'a'}"]
    # SIGINT at its default in the child, whatever this process inherited: a shell's background job (`make test &`
    # in a script) ignores it, the child would inherit the ignore, and Python then installs no Ctrl-C handler. A
    # handled signal is reset to its default across exec, an ignored one is not: handled here while the child starts
    # (not preexec_fn, which is unsafe in a process with threads, and FFCV's writer has run in this one).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    deadline = time.monotonic() + 180
    # 1,000 epochs: the training still runs when the signal comes (fresh-clone runs started as background jobs, at
    # b5cc2a6 and at a8f97c2, ran to the end and exited 0: the ignored SIGINT above). Then any epoch's complete
    # checkpoint (its summary is written last: a folder alone is one being written): epoch 1's is pruned
    # (train.keep_checkpoints) once later ones exist, and a fast epoch can write and prune it between two looks
    while time.monotonic() < deadline and not list((tmp_path / "ray").glob("*/local_checkpoints/epoch_*/summary.json")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    assert proc.poll() is None, "the training ended before the signal: " + proc.communicate()[0][-500:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: tiny stopped after the checkpoint of epoch" in err and "run the same command again" in err
    assert "Traceback" not in err, err[-2000:]
