"""Cluster maps, redundancy and reconstruction error: against brute-force references and hand-built models."""

from __future__ import annotations

import csv
import itertools
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.analysis import (
    AnalysisError,
    block_records,
    clusters_needed,
    load_subject,
    mean_cosine,
    nn_error,
    patch_groups,
    read_images,
    with_method,
)
from pipeline.analysis.probe import _subject, normalise
from pipeline.analysis.reconstruction import default_methods
from pipeline.methods import build_downsampler
from tests import reference as ref
from tests.conftest import write_tiny_checkpoint

# ---- references ----------------------------------------------------------------------------------------------------

def test_nn_error_and_mean_cosine_match_brute_force():
    gen = torch.Generator().manual_seed(0)
    x, y, w = torch.randn(3, 7, 5, generator=gen), torch.randn(3, 4, 5, generator=gen), torch.rand(3, 7, generator=gen)
    for b in range(3):
        dists = [min(float(((x[b, i] - y[b, j]) ** 2).sum()) for j in range(4)) for i in range(7)]
        assert float(nn_error(x, y)[b]) == pytest.approx(sum(dists) / 7)
        assert float(nn_error(x, y, w)[b]) == pytest.approx(sum(d * float(w[b, i]) for i, d in enumerate(dists))
                                                            / float(w[b].sum()))
        pairs = [float(torch.nn.functional.cosine_similarity(x[b, i], x[b, j], dim=0))
                 for i, j in itertools.permutations(range(7), 2)]
        assert float(mean_cosine(x)[b]) == pytest.approx(sum(pairs) / len(pairs))


def test_patch_groups_follow_every_assignment_like_a_loop():
    from pipeline.models.downsampling import BlockRecord

    gen = torch.Generator().manual_seed(1)
    sizes = [12, 6, 6, 3]  # block 2 keeps all (assign None)
    assigns = [torch.randint(-1, 6, (2, 12), generator=gen), None, torch.randint(-1, 3, (2, 6), generator=gen)]
    empty = torch.zeros(2, 12, 1)
    records = [BlockRecord(i, empty, empty, empty, empty[..., 0], empty, a) for i, a in enumerate(assigns)]
    groups = patch_groups(records, 12)
    assert groups.shape == (3, 2, 12) and sizes[0] == 12
    for b, patch in itertools.product(range(2), range(12)):
        g = patch
        for layer, assign in enumerate(assigns):
            if assign is not None and g >= 0:
                g = int(assign[b, g])
            assert int(groups[layer, b, patch]) == g


def test_kmedoids_reconstructs_at_least_as_well_as_topk_and_random():
    """Eq. 2 on random tokens: K-Medoids starts from the top-K set and never raises the cost, and its
    outputs are cluster means (no worse than the medoids); random selection is beaten on every image."""
    gen = torch.Generator().manual_seed(2)
    x, scores = torch.randn(16, 64, 16, generator=gen), torch.rand(16, 64, generator=gen)
    errors = {}
    for method in ("kmedoids", "powerbert", "random"):
        y = build_downsampler(method)(x, 8, scores=scores, generator=torch.Generator().manual_seed(3)).tokens
        errors[method] = nn_error(x, y)
    assert bool((errors["kmedoids"] <= errors["powerbert"] + 1e-9).all())
    assert bool((errors["kmedoids"] <= errors["random"] + 1e-9).all())
    assert float(errors["kmedoids"].mean()) < 0.95 * float(errors["powerbert"].mean())
    for method in default_methods():  # K = N: every method returns the tokens themselves
        y = build_downsampler(method)(x, 64, scores=scores, metric=x[..., :4], generator=gen).tokens
        assert float(nn_error(x, y).max()) == 0.0, method


def test_clusters_needed_counts_distinct_token_values():
    centres = torch.tensor([[10.0, 0, 0], [0, 10.0, 0], [0, 0, 10.0]])
    x = centres[torch.tensor([0, 1, 2] * 5)].unsqueeze(0)  # 15 tokens, 3 distinct values, equidistant
    scores = torch.zeros(1, 15)
    scores[0, :3] = 1.0  # K-Means starts from one token of each value
    needed = clusters_needed(x, scores)
    assert float(needed[0.9][0]) == 3.0 and float(needed[0.99][0]) == 3.0  # 2 clusters keep only 50%


# ---- a hand-built model: the two flat regions ------------------------------------------------------------------------

def identity_like_subject():
    """A 16x16 ViT (4x4 patches, 16 tokens) whose token after block 1's attention is its patch's mean
    colour: patch embedding = per-channel mean, no positions, attention and MLP branches zeroed."""
    import timm

    net = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=12, depth=2, num_heads=1,
                            num_classes=2, pretrained_cfg_overlay={"mean": (0.0,) * 3, "std": (1.0,) * 3,
                                                                   "crop_pct": 1.0})
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        for c in range(3):
            net.patch_embed.proj.weight[c, c] = 1.0 / 16
        for block in net.blocks:
            block.norm1.weight.fill_(1.0)
            block.norm2.weight.fill_(1.0)
    return _subject(net, net.state_dict(), "identity-like")


def two_region_image() -> np.ndarray:
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    image[:, :8] = (200, 40, 40)
    image[:, 8:] = (30, 90, 220)
    return image


def test_kmedoids_k2_puts_each_flat_region_in_one_cluster():
    subject = identity_like_subject()
    net = with_method(subject, "kmedoids", [2, 2])
    groups = patch_groups(block_records(net, normalise(subject, two_region_image()[None])), 16)[0, 0].reshape(4, 4)
    left, right = groups[:, :2], groups[:, 2:]
    assert len(set(left.flatten().tolist())) == 1 and len(set(right.flatten().tolist())) == 1
    assert int(left[0, 0]) != int(right[0, 0])


# ---- files and the command line --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A `pipeline train`-format checkpoint of the tiny test model (finetuned-with-wkmedoids config) and data."""
    root = tmp_path_factory.mktemp("analysis")
    return write_tiny_checkpoint(root, "wkmedoids", [12, 6, 3], val=40), root


def run_cli(capsys, *args: str) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS`` in this process (the same ``main``; no interpreter start-up per call)."""
    from pipeline.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pipeline", *args], code, out, err)


def assert_picture(path: Path, size: tuple[int, int] | None = None) -> None:
    pixels = np.asarray(Image.open(path).convert("L"), dtype=np.float64)
    assert pixels.var() > 100.0, f"{path} looks blank"
    if size is not None:
        assert Image.open(path).size == size


@pytest.mark.beton
def test_viz_clusters_cli_writes_maps_and_sheets(tiny_checkpoint, tmp_path, capsys):
    ckpt, _ = tiny_checkpoint
    images = []
    for i, colour in enumerate(((250, 20, 20), (20, 250, 20))):
        picture = np.zeros((40, 32, 3), dtype=np.uint8)
        picture[:, 16:] = colour
        images.append(tmp_path / f"img{i}.png")
        Image.fromarray(picture).save(images[-1])
    proc = run_cli(capsys, "viz", "clusters", "--checkpoint", str(ckpt), "--images", *map(str, images),
                   "--method", "wkmedoids,powerbert,tome", "--layers", "1,3", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert written == sorted([f"img{i}_{m}.png" for i in range(2) for m in ("wkmedoids", "powerbert", "tome")]
                             + ["img0_sheet.png", "img1_sheet.png"])
    assert_picture(tmp_path / "out" / "img0_wkmedoids.png", size=(720, 290))  # 3 panels of 2.4 in at 100 dpi
    assert_picture(tmp_path / "out" / "img1_sheet.png", size=(960, 290))      # input + 3 methods
    # An unknown method anywhere in the list is refused before any picture is written.
    proc = run_cli(capsys, "viz", "clusters", "--checkpoint", str(ckpt), "--images", str(images[0]),
                   "--method", "wkmedoids,kmodes", "--layers", "1,3", "--out", str(tmp_path / "refused"))
    assert proc.returncode == 2 and "unknown downsampling method 'kmodes'" in proc.stderr
    assert not (tmp_path / "refused").exists()


@pytest.mark.beton
def test_analyze_cli_writes_plots_and_csvs(tiny_checkpoint, tmp_path, capsys):
    ckpt, root = tiny_checkpoint
    base = ["--checkpoint", str(ckpt), "--data", str(root / "val.beton"), "--batches", "2", "--batch-size", "16"]
    red = run_cli(capsys, "analyze", "redundancy", *base, "--qk-norm-alpha", "8", "--out", str(tmp_path))
    assert red.returncode == 0, red.stderr
    rec = run_cli(capsys, "analyze", "reconstruction", *base, "--k", "4,8", "--out", str(tmp_path))
    assert rec.returncode == 0, rec.stderr
    rows = list(csv.DictReader((tmp_path / "redundancy.csv").open()))
    assert list(rows[0]) == ["attention", "layer", "stage", "tokens", "images", "mean_cosine", "k90", "k99"]
    assert len(rows) == 2 * 3 * 3 and {r["images"] for r in rows} == {"32"}  # 2 attentions x 3 blocks x 3 stages
    assert all(1 <= float(r["k90"]) <= float(r["k99"]) <= 16 for r in rows)
    rows = list(csv.DictReader((tmp_path / "reconstruction.csv").open()))
    assert list(rows[0]) == ["setting", "layer", "method", "k", "tokens", "images", "error", "relative_error",
                             "weighted_error", "weighted_relative_error"]
    assert {(r["setting"], r["method"]) for r in rows} == {(f"K = {k}", m) for k in (4, 8) for m in default_methods()}
    assert all(float(r["error"]) >= 0 for r in rows)
    for name in ("redundancy.png", "reconstruction.png"):
        assert_picture(tmp_path / name)


@pytest.mark.beton
def test_bad_inputs_are_refused_with_a_clear_message(tiny_checkpoint, tmp_path, capsys):
    ckpt, root = tiny_checkpoint
    missing = run_cli(capsys, "viz", "clusters", "--checkpoint", str(ckpt), "--images",
                      str(tmp_path / "nope.png"), "--out", str(tmp_path))
    assert missing.returncode == 2 and "image not found" in missing.stderr and "nope.png" in missing.stderr
    deep = run_cli(capsys, "viz", "clusters", "--checkpoint", str(ckpt), "--data", str(root / "val.beton"),
                   "--count", "1", "--layers", "2,7", "--out", str(tmp_path))
    assert deep.returncode == 2 and "[7] out of range" in deep.stderr and "3 blocks" in deep.stderr
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    bad = run_cli(capsys, "analyze", "redundancy", "--checkpoint", str(junk), "--data", str(root / "val.beton"),
                  "--out", str(tmp_path))
    assert bad.returncode == 2 and "not a readable checkpoint" in bad.stderr and "junk.pt" in bad.stderr
    with pytest.raises(AnalysisError, match="not a readable image"):
        (tmp_path / "fake.png").write_text("text")
        read_images([tmp_path / "fake.png"], 16)
    with pytest.raises(AnalysisError, match="exactly one"):
        load_subject()


# ---- results without finetuning (`pipeline evaluate`, Appendix E) ----------------------------------------------------

def test_no_finetuning_at_every_token_is_the_unmodified_model():
    """K = N in every block with carry off gives the unmodified model's logits exactly (torch.equal) for every method
    the paper inserts; with carry on, every size is 1 and the logits agree to rounding."""
    from pipeline.analysis.offshelf import check_requests
    from pipeline.models import create_model

    torch.manual_seed(0)
    net = create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=16, num_heads=2,
                       num_classes=4).eval()
    subject = _subject(net, net.state_dict(), "tiny")
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        base = subject.model(x)
        for method in ("kmeans", "wkmeans", "kmedoids", "wkmedoids", "powerbert"):
            check_requests(subject, [method], [[16, 16]])
            assert torch.equal(with_method(subject, method, [16, 16], variant={"carry": False})(x), base), method
            carried = with_method(subject, method, [16, 16], variant={"carry": True})(x)
            assert torch.allclose(carried, base, atol=1e-5), method


def test_a_timm_model_with_a_local_weights_file_loads_its_weights(tmp_path):
    """``--model NAME --weights PATH``: timm's model of that name with the file's state dict, no hub access; its
    logits equal the model whose weights were written."""
    from pipeline.analysis import load_subject
    from pipeline.models import create_model

    torch.manual_seed(1)
    written = create_model("deit_tiny_patch16_224").eval()
    torch.save(written.state_dict(), tmp_path / "deit_tiny.pth")
    subject = load_subject(model="deit_tiny_patch16_224", weights=tmp_path / "deit_tiny.pth")
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(subject.model(x), written(x))


@pytest.mark.beton
@pytest.mark.slow
def test_evaluate_cli_gives_each_method_keep_list_and_carry_without_training(tiny_checkpoint, tmp_path, capsys):
    """One command on a trained checkpoint: top-1, top-5 and GFLOPs for each method, keep list and carry setting, as
    a table, a CSV, a plot and MLflow runs tagged as not finetuned; at every token each method is the unmodified
    model (the same top-1), and with pooling it costs fewer GFLOPs."""
    from mlflow.tracking import MlflowClient

    directory, _ = tiny_checkpoint
    _, root = tiny_checkpoint
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli(capsys, "evaluate", "--checkpoint", str(directory), "--data", str(root / "val.beton"),
                   "--keep", "16,16,16", "--keep", "12,6,3", "--method", "kmedoids,powerbert", "--out",
                   str(tmp_path / "out"), "--tracking-uri", uri, "--batch-size", "16")
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "out" / "offshelf.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 1 + 2 * 2 * 2 and rows[0]["method"] == "none" and rows[0]["keep"] == ""
    assert all(r["images"] == "40" for r in rows)
    full = [r for r in rows if r["keep"] == "16,16,16"]
    assert {r["top1"] for r in full} == {rows[0]["top1"]} and {r["gflops"] for r in full} == {rows[0]["gflops"]}
    pooled = [r for r in rows if r["keep"] == "12,6,3"]
    assert all(float(r["gflops"]) < float(rows[0]["gflops"]) for r in pooled)
    assert all(0 <= float(r["top1"]) <= float(r["top5"]) <= 100 for r in rows)
    assert "| kmedoids | 12,6,3 | yes |" in proc.stdout and "| none | every token | no |" in proc.stdout
    assert_picture(tmp_path / "out" / "offshelf.png")
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("offshelf").experiment_id])
    assert len(runs) == 9 and {r.data.tags["pipeline.finetuned"] for r in runs} == {"false"}


@pytest.mark.beton
@pytest.mark.parametrize(("args", "message"), [
    (["--keep", "16,16,16", "--method", "conv"], "--method conv: a learnable method's layers are random without "
                                                 "training"),
    (["--keep", "16,16,16,16"], "--keep 16,16,16,16: give 3 counts (one a block) between 0 and the model's 16 tokens"),
    (["--level", "3"], "--level: no sparsity levels for"),
    ([], "give --keep K_1,...,K_L (repeatable) or --level N (the paper's models), exactly one"),
    (["--keep", "16,16,16", "--batch-size", "0"], "--batch-size 0: give at least 1 image a batch"),
])
def test_evaluate_refuses_what_it_cannot_evaluate_in_one_line(tiny_checkpoint, tmp_path, capsys, args, message):
    """Nothing written: a learnable method, a keep list of another depth, a level of a model the paper gives none,
    no keep list; a missing weights file and weights of another architecture are refused where they load."""
    directory, root = tiny_checkpoint
    proc = run_cli(capsys, "evaluate", "--checkpoint", str(directory), "--data", str(root / "val.beton"),
                   "--out", str(tmp_path / "out"), *args)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr
    assert not (tmp_path / "out").exists()


def test_evaluate_refuses_missing_and_mismatched_weights_in_one_line(tmp_path, capsys):
    from pipeline.models import create_model

    torch.save(create_model("deit_tiny_patch16_224", embed_dim=96, num_heads=3).state_dict(), tmp_path / "other.pth")
    for weights, message in ((tmp_path / "none.pth", "weights file not found"),
                             (tmp_path / "other.pth", "other.pth: weights of another architecture (size mismatch for "
                                                      "cls_token: copying a param with shape torch.Size([1, 1, 96])")):
        proc = run_cli(capsys, "evaluate", "--model", "deit_tiny_patch16_224", "--weights", str(weights),
                       "--data", str(tmp_path / "x.beton"), "--keep", ",".join(["196"] * 12), "--out",
                       str(tmp_path / "out"))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "out").exists()


# ---- clustering convergence (`pipeline analyze convergence`, the paper's "less than 5 iterations") ------------------

def test_the_convergence_iteration_of_a_planted_case_is_known_by_construction():
    """Four 1-D tokens 0, 1, 10 and 11, K = 2, the two most significant (0 and 1) as the first medoids: iteration 1
    puts 1, 10 and 11 together, iteration 2 moves the medoid to 10 and splits {0, 1} from {10, 11}, and nothing moves
    after it, so the assignments stop changing at iteration 2, as the brute-force K-Medoids of tests/reference.py
    says too. An image still changing at the last iteration gets the iterations run + 1."""
    from pipeline.analysis.convergence import converged_at, objective
    from pipeline.methods import build_downsampler

    x = torch.tensor([[[0.0], [1.0], [10.0], [11.0]]])
    scores = torch.tensor([[1.0, 0.9, 0.1, 0.05]])
    results = [build_downsampler("kmedoids", iters=t)(x, 2, scores=scores) for t in range(1, 6)]
    assert [r.assign.tolist() for r in results[:2]] == [[[0, 1, 1, 1]], [[0, 0, 1, 1]]]
    for t, result in enumerate(results, 1):
        assert result.assign[0].tolist() == ref.kmedoids(x[0].double().numpy(), np.ones(4), [0, 1], t)[1]
    assert converged_at([r.assign for r in results]).tolist() == [2]
    a, b = torch.tensor([[0, 1]]), torch.tensor([[1, 1]])
    assert converged_at([a, b, b]).tolist() == [2] and converged_at([a, a, a]).tolist() == [1]
    assert converged_at([a, a, b]).tolist() == [4]  # changed at the last of 3: still changing
    # the objective: each token's squared distance to its cluster's output token, written out
    centres = torch.tensor([[[0.5], [10.5]]])
    assert objective(x, torch.tensor([[0, 0, 1, 1]]), centres, None).tolist() == [4 * 0.25]
    assert objective(x, torch.tensor([[0, 0, 1, 1]]), centres, scores).tolist() == pytest.approx(
        [0.25 * (1.0 + 0.9 + 0.1 + 0.05)])


@pytest.mark.beton
def test_analyze_convergence_cli_prints_each_blocks_iteration_beside_the_papers_claim(tiny_checkpoint, tmp_path,
                                                                                      capsys):
    directory, root = tiny_checkpoint
    proc = run_cli(capsys, "analyze", "convergence", "--checkpoint", str(directory), "--data", str(root / "val.beton"),
                   "--k", "4", "--method", "kmedoids", "--iters", "6", "--batches", "1", "--batch-size", "8",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "kmedoids" in line]
    assert len(table) == 3  # one row a block of the tiny model
    assert "the paper: K-Medoids requires less than 5 iterations to converge (Section 4)" in proc.stdout
    with (tmp_path / "convergence.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3 * 6 and all(1 <= float(r["median_converged_at"]) <= 7 for r in rows)
    assert all(float(r["relative_objective"]) == 1.0 for r in rows if r["iteration"] == "1")  # relative to its first
    assert all(0 <= float(r["converged"]) <= 1 for r in rows)
    assert_picture(tmp_path / "convergence.png")
    bad = run_cli(capsys, "analyze", "convergence", "--checkpoint", str(directory), "--data", str(root / "val.beton"),
                  "--method", "powerbert", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--method powerbert: it has no iterations" in bad.stderr
