"""FLOP counts against the paper's printed numbers (Table 1 and the Appendix G tables)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.flops import count_flops
from pipeline.methods import METHODS
from pipeline.models import create_model
from pipeline.sparsity import load_sparsity, sparsity_files

ROOT = Path(__file__).resolve().parents[1]

# Table 1: (softmax-attention, QKV, O projection, MLP, total), printed precision per column.
TABLE1 = {
    "vit_base_patch16_384": (6.18, 12.25, 4.08, 32.67, 55.5),
    "vit_base_patch16_224": (0.72, 4.18, 1.39, 11.15, 17.6),
    "deit_small_patch16_224": (0.36, 1.05, 0.35, 2.79, 4.6),
    "deit_tiny_patch16_224": (0.18, 0.26, 0.09, 0.70, 1.3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TABLE1))
def test_table1(name):
    attention, qkv, proj, mlp, total = TABLE1[name]
    report = count_flops(create_model(name))
    assert round(report.qkv, 2) == qkv
    assert round(report.proj, 2) == proj
    assert round(report.mlp, 2) == mlp
    assert round(report.total, 1) == total
    assert report.downsampling == 0
    # Independent analytic count of the attention matmuls: 2 L N^2 M (Q K^T and A V).
    model = create_model(name)
    n, m, depth = model.patch_embed.num_patches + 1, model.embed_dim, len(model.blocks)
    assert report.attention == pytest.approx(2 * depth * n * n * m / 1e9, rel=1e-9)
    if name == "vit_base_patch16_384":
        # The paper prints 6.18; 2 L N^2 M with N = 577 is 6.137 (6.18 would need N = 579).
        # See docs/flops.md.
        assert round(report.attention, 2) == 6.14
    else:
        assert round(report.attention, 2) == attention


def _rows():
    for path in sparsity_files():
        table = load_sparsity(path)
        for level, row in table.levels.items():
            yield pytest.param(table.model, row, id=f"{path.stem}-L{level}")


@pytest.mark.parametrize("model_name,row", list(_rows()))
def test_appendix_powerbert_within_005(model_name, row):
    report = count_flops(create_model(model_name, method="powerbert", keep=row.keep))
    assert abs(report.total - row.powerbert) <= 0.05


# Rows whose printed K-Medoids GFLOPs we miss by more than 0.05: the paper charges more clustering
# than the layers that downsample (docs/flops.md gives the arithmetic). Measured misses, for the record.
KMEDOIDS_MISSES = {("deit_e252_patch16_224", 0): -0.093, ("deit_e252_patch16_224", 1): -0.059,
                   ("deit_e252_patch16_224", 2): -0.065}


@pytest.mark.slow
@pytest.mark.parametrize("model_name,row", list(_rows()))
def test_appendix_kmedoids(model_name, row):
    model = create_model(model_name, method="kmedoids", keep=row.keep)
    report = count_flops(model)
    level = next(lv for lv, r in load_sparsity(
        next(p for p in sparsity_files() if load_sparsity(p).model == model_name)).levels.items() if r == row)
    miss = KMEDOIDS_MISSES.get((model_name, level))
    if miss is None:
        assert abs(report.total - row.kmedoids) <= 0.05
    else:
        assert report.total - row.kmedoids == pytest.approx(miss, abs=0.001)
    # The overhead is the Gram matrix of every layer that clusters: sum over them of n^2 M
    # (a layer keeping 0 tokens drops them without clustering).
    n, overhead = 196, 0
    for k in report.keep:
        if 0 < k < n:
            overhead += n * n * model.embed_dim
        n = min(n, k)
    assert report.downsampling == pytest.approx(overhead / 1e9, rel=1e-9)


@pytest.mark.slow
def test_kmeans_feature_form_reproduces_deit_s_column(monkeypatch):
    # The paper's count, 5 token-to-centre distance matrices a clustering layer, is the feature form of
    # the iterations: it reproduces the printed K-Means column of DeiT-S within 0.05 at levels 1-7.
    from pipeline.pooling import clustering

    monkeypatch.setattr(clustering, "_kmeans", functools.partial(clustering._kmeans, gram=False))
    table = load_sparsity(ROOT / "configs/sparsity/deit_small.yaml")
    for level, row in table.levels.items():
        report = count_flops(create_model(table.model, method="kmeans", keep=row.keep, options={"iters": 5}))
        if level == 0:
            assert report.total == pytest.approx(4.632, abs=0.001)  # printed 4.7; six iterations give 4.70
        else:
            assert abs(report.total - row.kmeans) <= 0.05


@pytest.mark.slow
def test_kmeans_gram_form_charges_its_products():
    # What the code runs at a ViT's N <= 2 M: per clustering layer the Gram matrix, n^2 M, and one
    # (k, n) x (n, n) product for each of the iters - 1 later assignments; fewer than the paper's count.
    table = load_sparsity(ROOT / "configs/sparsity/deit_small.yaml")
    dim = create_model(table.model).embed_dim
    for level, row in table.levels.items():
        report = count_flops(create_model(table.model, method="kmeans", keep=row.keep, options={"iters": 5}))
        n, overhead = 196, 0
        for k in report.keep:
            if 0 < k < n:
                overhead += n * n * dim + 4 * k * n * n
            n = min(n, k)
        assert report.downsampling == pytest.approx(overhead / 1e9, rel=1e-9)
        if level > 0:
            assert report.total < row.kmeans


def test_tome_charges_its_similarity_matrix():
    keep = [196, 98] + [98] * 10
    report = count_flops(create_model("deit_small_patch16_224", method="tome", keep=keep))
    # One round at block 2: the A x B cosine similarities of the keys (head_dim 64), 98 x 98 x 64.
    assert report.downsampling == pytest.approx(98 * 98 * 64 / 1e9, rel=1e-9)


@pytest.mark.slow
def test_flops_cli_json():
    proc = subprocess.run([sys.executable, "-m", "pipeline", "flops", "--model", "deit_small_patch16_224",
                           "--method", "kmedoids", "--keep", "196,195,193,188,169,140,121,110,73,38,7,0",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["gflops"] == pytest.approx(3.029, abs=0.001)
    assert set(report) == {"gflops", "patch_embed", "qkv", "attention", "proj", "mlp", "downsampling", "other",
                           "keep"}
    parts = sum(v for k, v in report.items() if k not in ("gflops", "keep"))
    assert parts == pytest.approx(report["gflops"], rel=1e-9)


@pytest.mark.slow
def test_flops_cli_level_and_bad_input(capsys):
    from pipeline.cli import main

    run = ["flops", "--model", "deit_e252_patch16_224", "--method", "powerbert"]
    proc = subprocess.run([sys.executable, "-m", "pipeline", *run, "--level", "4"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert "effective keep: 196,194,181,147,111,75,48,36,5,5,2,0" in proc.stdout
    assert main([*run, "--keep", "196,195"]) == 2  # the same entry point in this process: no start-up of its own
    assert "keep has 2 entries but the model has 12 blocks" in capsys.readouterr().err


def test_attention_counts_the_same_on_every_path():
    """The attention of a block that needs scores counts as one fused attention whichever op runs it:
    the CPU's joint op, or (the CUDA path) the flash kernel called for its row log-sum-exps; and it is
    2 T^2 M multiply-adds a block, what SDPA counts for T tokens."""
    from pipeline.pooling.common import dense_segments

    keep = [196, 150, 120] + [120] * 9
    model = create_model("deit_small_patch16_224", method="wkmedoids", keep=keep)
    cpu = count_flops(model)
    with dense_segments(True):
        cuda = count_flops(model)
    assert cuda.attention == pytest.approx(cpu.attention, rel=1e-12)
    # Q K^T and A V of every block at its token count (+1 CLS): sum of 2 T^2 M
    tokens = [197, 197, 151] + [121] * 9
    assert cpu.attention == pytest.approx(sum(2 * t * t * 384 for t in tokens) / 1e9, rel=1e-9)


@pytest.mark.slow
def test_importing_the_flop_counter_prints_no_deprecation_warning():
    """fvcore.nn calls torch.jit.script at import, which torch deprecates with a FutureWarning; every process
    that counts FLOPs (the evaluate stage's Ray tasks among them) printed it. A fresh interpreter that turns
    FutureWarnings into errors imports the counter."""
    done = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", "import pipeline.flops"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(("method", "name"), [(m, o) for m, spec in sorted(METHODS.items()) if not spec.learnable
                                              for o in sorted(spec.options)])
def test_an_options_counted_flag_is_what_fvcore_counts(method, name):
    """Each option of each method at two values on a small pooling model: fvcore's count (the independent reference)
    changes exactly where the method declares the option ``counted`` (``pipeline methods`` and the GFLOPs targets
    read the flag). A keep list that pools in both blocks, 49 tokens to 20 to 9."""
    spec = METHODS[method]
    assert len(spec.options[name].samples()) == 2, "every built-in option has a second value to count"
    counts = [count_flops(create_model("deit_tiny_patch16_224", method=method, keep=[20, 9], img_size=28,
                                       patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=4,
                                       options=spec.resolve(method, {name: value}))).total
              for value in spec.options[name].samples()]
    assert (counts[0] != counts[1]) == spec.options[name].counted, (method, name, counts)
