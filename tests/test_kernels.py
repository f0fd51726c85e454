"""The kernel choice (``kernels:``, ``runtime.KernelChoice``) and the device self-check (``models.selfcheck``,
``pipeline doctor``): a typed value that reaches the ops through compiled graphs and the records, and a check
that catches a wrong kernel by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.config.identity import identity_content
from pipeline.models import create_model, selfcheck, set_kernels
from pipeline.models.selfcheck import KernelMismatchError, check_model, kernel_record
from pipeline.pooling import native
from pipeline.runtime import KernelChoice

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
    choice are two stages, and at the defaults an evaluation's id is the one recorded before the choice."""
    from pipeline.dag.plan import Stage, dag_id, evaluate_stage
    from pipeline.dag.types import StageMeta

    default, torch_path = load_config(TINY), load_config(TINY, ["kernels.kmedoids=torch", "kernels.native=torch"])
    assert identity_content(default) == identity_content(torch_path) and "kernels" not in identity_content(default)
    trained = Stage("finetune", "tiny-ft-M16-L3-kmedoids", default, [], "M16", StageMeta(method="kmedoids", level="L3"))
    plain, chosen = evaluate_stage(default, trained), evaluate_stage(torch_path, trained)
    assert plain.id != chosen.id and "kernels" not in plain.meta.identity()
    assert chosen.meta.kernels == {"kmedoids": "torch", "native": "torch"}
    recorded = Stage("evaluate", plain.label, None, [trained.id], "M16",
                     StageMeta(method="kmedoids", level="L3", eval=default.experiment.eval))
    assert plain.id == recorded.id
    assert dag_id(default) != dag_id(torch_path)


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


def test_the_kernel_record_names_what_runs_after_auto_resolves():
    record = kernel_record(KernelChoice(), "cpu")
    assert record | {"torch": "", "triton": ""} == {"kmedoids": "native-c", "kmeans": "native-c", "merge": "torch",
                                                    "attention": "torch", "torch": "", "triton": ""}
    assert record["torch"] == torch.__version__
    off = kernel_record(KernelChoice(native="torch"), "cpu")
    assert off["kmedoids"] == off["kmeans"] == "torch"
    cuda = kernel_record(KernelChoice(kmedoids="tiled", attention="sdpa", merge="torch"), "cuda")
    assert (cuda["kmedoids"], cuda["kmeans"], cuda["merge"], cuda["attention"]) == \
        ("triton-tiled", "triton-fused", "torch", "sdpa+eq4")


def test_the_self_check_passes_on_the_cpu_and_is_cached(fresh_checks, monkeypatch):
    model = tiny()
    results = check_model(model, "cpu")
    assert [(r.kernel, r.implementation, r.error) for r in results] == [("kmedoids", "native-c", 0.0),
                                                                         ("kmeans", "native-c", 0.0)]
    monkeypatch.setattr(selfcheck, "run_checks", lambda *a, **k: pytest.fail("checked twice"))
    assert check_model(model, "cpu") == results  # once per process for a device, dtype and choice
    assert check_model(tiny("none"), "cpu") == []  # the unmodified model runs no fused step


def test_a_planted_wrong_kernel_fails_the_check_by_name(fresh_checks, wrong_native_kmedoids):
    """The error names the kernel, the device, the error found and the config value that runs the torch
    path; that value does run it (the check then passes), and the model kept its choice until set."""
    model = tiny()
    with pytest.raises(KernelMismatchError, match=r"the native-c kernel of kmedoids disagrees with the torch path on "
                       r"cpu \(float32\): the fraction of tokens assigned differently is 1, tolerance 0; set "
                       r"kernels.kmedoids: torch \(or kernels.native: torch\)"):
        check_model(model, "cpu")
    results = check_model(set_kernels(model, KernelChoice(kmedoids="torch")), "cpu")
    assert [r.kernel for r in results] == ["kmeans"] and results[0].ok


def test_doctor_prints_the_table_and_fails_on_a_planted_wrong_kernel(capsys, monkeypatch, wrong_native_kmedoids):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["doctor", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    rows = {line.split(" | ")[0].strip("| "): line for line in captured.out.splitlines() if line.startswith("| k")}
    assert re.search(r"\| native-c \| cpu \| float32 \| 1 \| 0 \| [\d.]+ \| [\d.]+ \| MISMATCH \|$", rows["kmedoids"])
    assert re.search(r"\| native-c \| cpu \| float32 \| 0 \| 0 \| [\d.]+ \| [\d.]+ \| ok \|$", rows["kmeans"])
    assert "skipped: Triton kernels" in captured.out and "skipped: merge, attention" in captured.out
    assert "error: the native-c kernel of kmedoids disagrees" in captured.err
    assert main(["doctor", "--device", "cpu", "--set", "kernels.kmedoids=torch"]) == 0
    assert "skipped: kmedoids: kernels.kmedoids is torch, the torch path itself" in capsys.readouterr().out


def test_a_training_run_records_the_choice_and_the_kernels_that_run(tmp_path):
    """MLflow params: the config's ``kernels.*`` and, resolved on the run's device, ``kernels_run.*``."""
    from mlflow.tracking import MlflowClient

    from pipeline.train.run_tracking import JobTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(None, [f"train.tracking_uri={uri}", f"train.storage_path={tmp_path}", "train.name=k",
                                "kernels.kmeans=torch"])
    tracker = JobTracker.open(config, device="cpu")
    params = MlflowClient(tracking_uri=uri).get_run(tracker.run_id).data.params
    assert {key: params[key] for key in params if key.startswith("kernels")} == {
        "kernels.kmedoids": "auto", "kernels.kmeans": "torch", "kernels.merge": "auto", "kernels.attention": "auto",
        "kernels.native": "auto", "kernels_run.kmedoids": "native-c", "kernels_run.kmeans": "torch",
        "kernels_run.merge": "torch", "kernels_run.attention": "torch", "kernels_run.torch": torch.__version__,
        "kernels_run.triton": selfcheck.triton_version()}
