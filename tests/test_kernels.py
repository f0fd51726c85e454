"""The kernel choice (``kernels:``, ``runtime.KernelChoice``) and the device self-check (``models.selfcheck``,
``pipeline doctor``): a typed value that reaches the ops through compiled graphs and the records, and a check
that catches a wrong kernel by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.config.identity import identity_content
from pipeline.models import create_model, selfcheck, set_kernels, significance
from pipeline.models.selfcheck import KernelMismatchError, check_model, kernels_planned, kernels_ran
from pipeline.pooling import clustering, native
from pipeline.runtime import KernelChoice, dispatched, forget_dispatches

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "experiments" / "tiny.yaml"
KEEP = [8, 4]  # of 16 tokens: both blocks pool


@pytest.fixture
def fresh_checks(monkeypatch):
    """No self-check result cached from earlier tests (the cache lives for the process)."""
    monkeypatch.setattr(selfcheck, "_CHECKED", {})


@pytest.fixture
def wrong_native_kmedoids(monkeypatch):
    """A planted wrong kernel: the native K-Medoids returns every token one cluster further on."""
    real = native.kmedoids

    def shifted(*args, **kwargs):
        med, assign = real(*args, **kwargs)
        return med, (assign + 1) % med.shape[1]

    monkeypatch.setattr(native, "kmedoids", shifted)


def tiny(method: str = "kmedoids", kernels: KernelChoice | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                        num_classes=3, method=method, keep=KEEP if method != "none" else None, kernels=kernels).eval()


def test_config_show_prints_the_kernels_section(capsys):
    assert main(["config", "show", "--set", "kernels.kmedoids=torch"]) == 0
    shown = capsys.readouterr().out
    section = shown[shown.index("kernels:"):]
    values = r"kmedoids: torch\n\s+kmeans: auto\n\s+merge: auto\n\s+attention: auto\n\s+native: auto"
    assert re.search(values, section), shown


def test_training_identities_leave_the_kernels_out_and_evaluations_name_them():
    """At any kernel choice a training stage keeps its id; two evaluations that differ only in a kernel
    choice are two stages, each naming every choice."""
    from pipeline.dag.plan import Stage, dag_id, evaluate_stage
    from pipeline.dag.types import StageMeta

    default, torch_path = load_config(TINY), load_config(TINY, ["kernels.kmedoids=torch", "kernels.native=torch"])
    assert identity_content(default) == identity_content(torch_path) and "kernels" not in identity_content(default)
    trained = Stage("finetune", "tiny-ft-M16-L3-kmedoids", default, [], "M16", StageMeta(method="kmedoids", level="L3"))
    plain, chosen = evaluate_stage(default, trained), evaluate_stage(torch_path, trained)
    assert plain.id != chosen.id
    assert plain.meta.identity()["kernels"] == {"kmedoids": "auto", "kmeans": "auto", "merge": "auto",
                                                "attention": "auto", "native": "auto"}
    assert chosen.meta.kernels == {"kmedoids": "torch", "kmeans": "auto", "merge": "auto", "attention": "auto",
                                   "native": "torch"}
    assert dag_id(default) != dag_id(torch_path)


@pytest.mark.compile
def test_a_compiled_graph_runs_the_choice_of_the_config_it_was_built_from(monkeypatch):
    """The ops take the choice as an argument: a model compiled with ``kmedoids: torch`` never calls the
    native kernel, where the same model with ``auto`` calls it once a pooling block; nothing reads the
    environment."""
    calls = []
    real = native.kmedoids
    monkeypatch.setattr(native, "kmedoids", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model = tiny(kernels=KernelChoice(kmedoids="torch"))
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        assert calls == []
        eager = set_kernels(model, KernelChoice())(x)
    assert len(calls) == len(KEEP)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)  # the native kernel is bit-identical


def test_the_plan_resolves_auto_from_each_steps_own_kernel(monkeypatch):
    """``kernels_planned``: what ``auto`` resolves to on a device, each step from its own Triton kernel's import (not
    K-Medoids' as a stand-in for the others); the old name still answers, with a DeprecationWarning."""
    record = kernels_planned(KernelChoice(), "cpu")
    assert record | {"torch": "", "triton": ""} == {"kmedoids": "native-c", "kmeans": "native-c",
                                                    "merge": "native-c", "attention": "torch", "torch": "",
                                                    "triton": ""}
    assert record["torch"] == torch.__version__
    off = kernels_planned(KernelChoice(native="torch"), "cpu")
    assert off["kmedoids"] == off["kmeans"] == off["merge"] == "torch"
    assert kernels_planned(KernelChoice(merge="torch"), "cpu")["merge"] == "torch"
    cuda = kernels_planned(KernelChoice(kmedoids="tiled", attention="sdpa", merge="torch"), "cuda")
    assert (cuda["kmedoids"], cuda["kmeans"], cuda["merge"], cuda["attention"]) == \
        ("triton-tiled", "triton-fused", "torch", "sdpa+eq4")
    monkeypatch.setattr(significance, "attention_with_columns_triton", None)  # no one-pass kernel, K-Medoids' at hand
    monkeypatch.setattr(clustering, "kmeans_fused_triton", None)
    cuda = kernels_planned(KernelChoice(), "cuda")
    assert (cuda["kmedoids"], cuda["kmeans"], cuda["attention"]) == ("triton-fused", "torch", "torch"), cuda


@pytest.mark.compile
def test_the_record_names_the_path_each_dispatch_took_at_each_shape():
    """``kernels_ran``: what the dispatches noted while the model ran, per kernel and token count (16 tokens pooled
    to 8, then 4; the attention sees the class token too); a step the method does not run is "none noted"; the
    self-check's own calls are not the model's; a compiled graph's traced path (K-Means' torch iterations) is
    noted when it is traced, without a recompile."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    forget_dispatches()
    with torch.no_grad():
        tiny()(x)
    assert kernels_ran() | {"torch": "", "triton": ""} == {
        "kmedoids": "native-c (N=16, 8)", "kmeans": "none noted", "merge": "native-c (N=16, 8)",
        "attention": "torch (T=17, 9)", "torch": "", "triton": ""}
    forget_dispatches()
    with torch.no_grad():
        tiny(kernels=KernelChoice(native="torch"))(x)
    assert kernels_ran()["kmedoids"] == kernels_ran()["merge"] == "torch (N=16, 8)"
    forget_dispatches()
    selfcheck.run_checks(KernelChoice(), "cpu")  # native kernels at the small shape
    assert dispatched() == frozenset()
    from torch._dynamo.utils import counters

    model = tiny("wkmeans", KernelChoice(kmeans="torch"))
    forget_dispatches()
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        compiled(x)
        graphs = counters["stats"]["unique_graphs"]
        compiled(x)
    assert counters["stats"]["unique_graphs"] == graphs  # the note added no guard
    assert kernels_ran()["kmeans"] == "torch (N=16, 8)" and kernels_ran()["attention"] == "torch (T=17, 9)"


RECORD_UNDER_THE_INTERPRETER = """
import torch
from pipeline.models import create_model, significance
from pipeline.models.selfcheck import kernels_ran
from pipeline.runtime import forget_dispatches
# The joint op's CUDA kernel takes CPU tensors here: its Triton kernel runs under the interpreter.
significance._joint_op.register_kernel("cpu")(significance._joint_cuda)
for img in (96, 56):  # 24 x 24 = 576 patch tokens, then 14 x 14 = 196 (DeiT-S's N)
    torch.manual_seed(0)
    model = create_model("deit_tiny_patch16_224", img_size=img, patch_size=4, embed_dim=32, depth=1, num_heads=2,
                         num_classes=3, method="powerbert", keep=[64]).eval()
    forget_dispatches()
    with torch.no_grad():
        model(torch.randn(1, 3, img, img))
    print(img, kernels_ran()["attention"])
"""


@pytest.mark.slow
def test_under_the_interpreter_the_record_says_where_the_one_pass_attention_fell_back():
    """The CUDA dispatch of the joint attention op, run under Triton's interpreter: at 577 tokens (576 patches and
    the class token) it falls back to torch and the record says torch; at DeiT-S's 197 it runs the one-pass
    kernel and says so (``auto`` resolves to triton-one-pass either way: what could run is not what ran)."""
    pytest.importorskip("triton")
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", RECORD_UNDER_THE_INTERPRETER], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["96 torch (T=577)", "56 triton-one-pass (T=197)"], proc.stdout


@pytest.mark.slow
def test_the_doctor_checks_the_one_pass_attention_on_normalised_queries_and_keys():
    """model.qk_norm (Appendix F): the doctor checks the attention kernels on queries and keys as the model gives them
    (normalised, the queries times alpha, scale 1), here under Triton's interpreter, and says the CPU runs the torch
    path for them."""
    pytest.importorskip("triton")
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "doctor", "--device", "cpu", *TINY_MODEL, "--set",
                           "model.qk_norm=learned", "--set", "model.alpha=4"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attention T=17, 13, 9 with 3 heads of 64, normalised queries and keys (alpha 4)" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| attention |")]
    assert [row.split(" | ")[4] for row in rows] == [f"B=2 H=3 T={t} D=64 qk-norm" for t in (17, 13, 9)], rows
    assert all(row.endswith("| ok |") for row in rows)
    assert "skipped: merge, attention: no fused kernel runs on the CPU (the torch path does), normalised queries and " \
           "keys included" in proc.stdout


def test_the_self_check_passes_on_the_cpu_and_is_cached(fresh_checks, monkeypatch):
    """At the model's shapes: each block that pools, 16 tokens to 8, then 8 to 4, at its width 32."""
    model = tiny()
    results = check_model(model, "cpu")
    assert [(r.kernel, r.implementation, r.shape) for r in results] == [
        (kernel, "native-c", shape) for shape in ("B=2 N=16 K=8 M=32", "B=2 N=8 K=4 M=32")
        for kernel in ("kmedoids", "kmeans", "merge")]
    # the clustering kernels give the torch path's assignments; the merge its means within float32's rounding
    assert [r.error for r in results if r.kernel != "merge"] == [0.0] * 4
    assert all(0 <= r.error < 1e-6 for r in results if r.kernel == "merge")
    monkeypatch.setattr(selfcheck, "run_checks", lambda *a, **k: pytest.fail("checked twice"))
    assert check_model(model, "cpu") == results  # once per process for a device, dtype, choice and shapes
    assert check_model(tiny("none"), "cpu") == []  # the unmodified model runs no fused step


def test_the_model_shapes_are_read_from_the_model():
    """DeiT-S at the paper's level 3 (keep 196, 194, 187, 163, 118, 85, 58, 47, 20, 12, 2, 0): the blocks that pool,
    written out, and each block's attention at its tokens and the class token (the last keeps none: no step)."""
    from pipeline.sparsity import level_keep

    shapes = selfcheck.model_shapes(create_model("deit_small_patch16_224", method="wkmedoids",
                                                 keep=level_keep("deit_small_patch16_224", 3)))
    assert shapes.pools == ((196, 194), (194, 187), (187, 163), (163, 118), (118, 85), (85, 58), (58, 47), (47, 20),
                            (20, 12), (12, 2))
    assert shapes.tokens == (197, 195, 188, 164, 119, 86, 59, 48, 21, 13, 3)
    assert (shapes.width, shapes.heads, shapes.head_dim) == (384, 6, 64)
    assert selfcheck.model_shapes(create_model("deit_small_patch16_224")) is None


def test_a_planted_wrong_kernel_fails_the_check_by_name(fresh_checks, wrong_native_kmedoids):
    """The error names the kernel, the device, the shape, the error found and the config value that runs the
    torch path; that value does run it (the check then passes), and the model kept its choice until set."""
    model = tiny()
    with pytest.raises(KernelMismatchError, match=r"the native-c kernel of kmedoids disagrees with the torch path on "
                       r"cpu \(float32, B=2 N=16 K=8 M=32\): the fraction of tokens assigned differently is 1, "
                       r"tolerance 0.01; set kernels.kmedoids: torch \(or kernels.native: torch\)"):
        check_model(model, "cpu")
    results = check_model(set_kernels(model, KernelChoice(kmedoids="torch")), "cpu")
    assert [r.kernel for r in results] == ["kmeans", "merge"] * 2 and all(r.ok for r in results)


TINY_MODEL = ["--set", "model.name=vit_tiny_patch16_224", "--set", "model.img_size=16", "--set", "model.patch_size=4",
              "--set", "model.depth=3"]


def test_doctor_checks_at_the_config_models_shapes_and_fails_on_a_planted_wrong_kernel(capsys, monkeypatch,
                                                                                      wrong_native_kmedoids):
    """At the shapes of the config's model, which it prints: its keep list's (N, K) where given, else a keep list
    that pools in every block (DeiT-S by default: 196 tokens, then fewer in each of its 12 blocks)."""
    from pipeline.cli.doctor import config_shapes

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["doctor", "--device", "cpu", "--set", "pooling.keep=[12,12,6]", *TINY_MODEL]) == 1
    captured = capsys.readouterr()
    assert "shapes checked: pooling N->K 16->12, 12->6 at M=192; attention T=17, 13 with 3 heads of 64" in captured.out
    rows = [line for line in captured.out.splitlines() if line.startswith("| km")]
    assert len(rows) == 4, rows  # two kernels at each of the two (N, K)
    assert re.search(r"^\| kmedoids \| native-c \| cpu \| float32 \| B=2 N=16 K=12 M=192 \| 1 \| 0.01 \| [\d.]+ \| "
                     r"[\d.]+ \| MISMATCH \|$", rows[0]), rows
    assert re.search(r"^\| kmeans \| native-c \| cpu \| float32 \| B=2 N=16 K=12 M=192 \| 0 \| 0 \| [\d.]+ \| "
                     r"[\d.]+ \| ok \|$", rows[1]), rows
    assert "skipped: Triton kernels" in captured.out and "skipped: merge, attention" in captured.out
    assert "error: the native-c kernel of kmedoids disagrees" in captured.err
    assert main(["doctor", "--device", "cpu", "--set", "kernels.kmedoids=torch", *TINY_MODEL]) == 0
    out = capsys.readouterr().out
    assert "shapes checked: pooling N->K 16->12, 12->8, 8->4 at M=192" in out, out  # no keep list: every block pools
    assert "skipped: kmedoids: kernels.kmedoids is torch, the torch path itself" in out
    # the doctor names the instruction set the native kernels run at (tests/test_native.py checks it against the CPU's
    # flags), the sets the library holds and where it is
    assert re.search(rf"native C kernels: K-Medoids and the means running the (x86-64|baseline)\S* .*code of a "
                     rf"library built for "
                     rf"{native.built_for()}, K-Means the baseline's: \S+\.so$", out, re.M), out
    default = config_shapes(load_config(None))
    assert default.pools[0] == (196, 181) and len(default.pools) == 12 and default.tokens[0] == 197


def test_a_training_run_records_the_choice_and_the_kernels_that_ran(tmp_path):
    """MLflow params: the config's ``kernels.*`` when the job opens its run, and ``kernels_run.*`` when it finishes:
    what the dispatches noted since it opened, not what ``auto`` could resolve to (K-Means is the torch path by
    choice, and this model's method runs no K-Means at all)."""
    from mlflow.tracking import MlflowClient

    from pipeline.train.run_tracking import JobTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(None, [f"train.tracking_uri={uri}", f"train.storage_path={tmp_path}", "train.name=k",
                                f"train.artifact_root={tmp_path / 'artifacts'}", "kernels.kmeans=torch"])
    client = MlflowClient(tracking_uri=uri)
    with torch.no_grad():
        tiny()(torch.randn(1, 3, 32, 32))  # before the job: not its record
    tracker = JobTracker.open(config)
    params = client.get_run(tracker.run_id).data.params
    assert {key: params[key] for key in params if key.startswith("kernels")} == {
        "kernels.kmedoids": "auto", "kernels.kmeans": "torch", "kernels.merge": "auto", "kernels.attention": "auto",
        "kernels.native": "auto"}
    model = tiny("powerbert", config.kernels.choice())
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    tracker.finish(model, KEEP)
    params = client.get_run(tracker.run_id).data.params
    assert {key: params[key] for key in params if key.startswith("kernels_run")} == {
        "kernels_run.kmedoids": "none noted", "kernels_run.kmeans": "none noted", "kernels_run.merge": "none noted",
        "kernels_run.attention": "torch (T=17, 9)", "kernels_run.torch": torch.__version__,
        "kernels_run.triton": selfcheck.triton_version()}


def test_the_kernel_values_are_defined_once():
    """The config's ``kernels:`` keys and ``runtime.KernelChoice`` take exactly ``kernel_choices.KERNEL_CHOICES``."""
    from pydantic import ValidationError

    from pipeline.config.kernels import KernelsConfig
    from pipeline.errors import InputError
    from pipeline.kernel_choices import KERNEL_CHOICES

    assert list(KERNEL_CHOICES) == list(KernelsConfig.model_fields) == list(KernelChoice().as_dict())
    for name, values in KERNEL_CHOICES.items():
        for value in values:
            assert getattr(KernelsConfig(**{name: value}).choice(), name) == value
        with pytest.raises(ValidationError):
            KernelsConfig(**{name: "fastest"})
        with pytest.raises(InputError, match=f"kernels.{name} must be one of {', '.join(values)}"):
            KernelChoice(**{name: "fastest"})
