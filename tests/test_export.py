"""``pipeline export`` and ``bench onnx``: every built-in method to ONNX, run in ONNX Runtime against torch.

The reference is the torch model itself, eager, on this CPU: its clustering steps run the native C kernels and the
batched attention op, while the exported graph holds their torch references translated to standard ONNX ops, so
the two sides share no implementation of the fused steps. Exports of a 3-block DeiT on 32 px images (16 tokens)
take a few seconds each: the tests that export are marked slow.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import onnx
import pytest
import torch

from pipeline.errors import InputError
from pipeline.export import (
    RANDOM_OPS,
    ExportError,
    check_onnx,
    export_onnx,
    graph_ops,
    require_runtime,
    run_session,
    session,
)
from pipeline.methods import GRID_CONV, KEEP_ALL, METHODS, is_builtin
from pipeline.models.factory import create_model
from pipeline.pooling.common import derived_noise, hashed_noise, uniform_noise

TINY = dict(img_size=32, patch_size=8, depth=2)  # a 4 x 4 grid: 16 tokens and the class token
KEEP = [12, 5]
BUILTIN = sorted(m for m in METHODS if is_builtin(m))


def tiny(method: str = KEEP_ALL, keep: list[int] | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    if keep is None and method not in (KEEP_ALL, GRID_CONV):
        keep = KEEP
    return create_model("deit_tiny_patch16_224", method=method, keep=keep, **TINY).eval()


def images(count: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def torch_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


@pytest.mark.slow
@pytest.mark.parametrize("method", BUILTIN)
def test_every_builtin_method_exports_to_standard_ops_and_matches_torch(tmp_path, method):
    model = tiny(method)
    path = export_onnx(model, tmp_path / f"{method}.onnx", label=method)
    proto = onnx.load(str(path))
    assert {node.domain for node in proto.graph.node} == {""}  # standard ONNX ops only: no custom op left
    assert [i.name for i in proto.graph.input] == ["images"] and [o.name for o in proto.graph.output] == ["logits"]
    x = images(12)
    check = check_onnx(model, path, x, torch_batch=5, label=method)  # torch in slices of 5, the runtime all at once
    assert check.passed and check.max_abs_diff < 1e-4 and check.over_tolerance == 0, check.line()
    assert check.top1_agreement == 1.0 and check.draws == (method in ("random", "importance"))
    if not check.draws:  # the file itself, at a batch size it was not traced at (dynamic batch)
        got = run_session(session(path), x[:5])
        assert torch.allclose(got, torch_logits(model, x[:5]), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kmedoids"])
def test_keeping_every_token_exports_the_unmodified_models_logits(tmp_path, method):
    """At K = N the pooled export computes what the unmodified model's export computes, to 1e-5."""
    plain = tiny()
    pooled = tiny(method, keep=[16, 16])
    pooled.load_state_dict(plain.state_dict())
    x = images(6)
    got = run_session(session(export_onnx(pooled, tmp_path / "pooled.onnx")), x)
    want = run_session(session(export_onnx(plain, tmp_path / "plain.onnx")), x)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.slow
def test_a_random_methods_file_draws_in_the_runtime(tmp_path):
    """The file keeps the draw (no noise frozen into a constant at export): two runs of the same images differ,
    while the check compares a graph with derived noise exactly."""
    model = tiny("random", keep=[4, 2])
    path = export_onnx(model, tmp_path / "random.onnx")
    assert RANDOM_OPS & graph_ops(path)
    sess, x = session(path), images(8)
    assert not torch.equal(run_session(sess, x), run_session(sess, x))
    check = check_onnx(model, path, x)
    assert check.draws and check.passed, check.line()


@pytest.mark.slow
def test_a_static_batch_is_the_graphs_and_the_check_runs_in_slices(tmp_path):
    model = tiny("kmeans")
    path = export_onnx(model, tmp_path / "static.onnx", batch=3)
    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [3, 3, 32, 32]
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        session(path).run(None, {"images": images(2).numpy()})
    check = check_onnx(model, path, images(7), batch=3)  # 3 + 3 + 1, the last slice padded
    assert check.images == 7 and check.passed and check.max_abs_diff < 1e-4, check.line()


class _Opaque(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.exporttest.opaque(x)


@torch.library.custom_op("exporttest::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_opaque.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.mark.slow
def test_an_op_without_an_onnx_function_is_one_line_and_nothing_is_written(tmp_path):
    """The refusal names the op; an older file at the path is left as it was, and no partial file stays."""
    model = tiny()
    model.head = torch.nn.Sequential(model.head, _Opaque())
    out = tmp_path / "model.onnx"
    out.write_bytes(b"the previous export")
    with pytest.raises(ExportError) as err:
        export_onnx(model, out, label="the test model")
    message = str(err.value)
    assert "\n" not in message and "exporttest.opaque" in message and message.startswith("the test model")
    assert out.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.mark.slow
def test_method_model_takes_a_level_or_a_keep_list_and_refuses_neither():
    from pipeline.analysis.probe import load_subject, method_model

    subject = load_subject(model="deit_small_patch16_224")
    model, label, _ = method_model(subject, method="powerbert", level=3)
    assert label == "deit_small_patch16_224 with powerbert at 196,194,187,163,118,85,58,47,20,12,2,0"  # Table 1's
    assert model.blocks.config.keep == [196, 194, 187, 163, 118, 85, 58, 47, 20, 12, 2, 0]
    with pytest.raises(InputError, match="needs a keep list"):
        method_model(subject, method="powerbert")
    with pytest.raises(InputError, match="not both"):
        method_model(subject, method="powerbert", keep="1", level=3)
    run = dataclasses.replace(subject, label="demo-ft-S-L3 (finetune)")  # a checkpoint's label: its levels by name
    assert method_model(run, method="powerbert", level=3)[0].blocks.config.keep[:3] == [196, 194, 187]


def test_noise_derived_from_position_is_uniform_like_fixed_per_image_and_only_inside_its_block():
    like = torch.zeros(64, 4096)
    noise = hashed_noise(like)
    assert noise.dtype == torch.float32 and noise.shape == like.shape
    assert 0.0 <= noise.min().item() and noise.max().item() < 1.0
    assert abs(noise.mean().item() - 0.5) < 0.01 and len(noise[0].unique()) == 4096
    assert torch.equal(noise, noise[:1].expand_as(noise))  # an image's numbers whatever batch it is in
    assert torch.equal(hashed_noise(like[:5, :197]), noise[:5, :197])
    with derived_noise():
        assert torch.equal(uniform_noise(like, None), noise)
    assert not torch.equal(uniform_noise(like, None), noise)  # a draw again outside


def test_a_missing_runtime_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(InputError, match=r"needs onnxruntime, which is not installed here: run `make setup`"):
        require_runtime()


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch 0: give a static batch size of at least 1"),
    (["--check-images", "0"], "--check-images 0: give at least 1"),
    (["--out", "model.txt"], "give a file name ending in .onnx"),
])
def test_export_refuses_bad_flags_before_loading(argv, message, capsys, monkeypatch):
    import pipeline.analysis.probe as probe
    from pipeline.cli import main

    monkeypatch.setattr(probe, "load_subject", lambda **_: pytest.fail("loaded a model before checking the flags"))
    base = ["export", "--model", "deit_tiny_patch16_224", "--out", "m.onnx"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.beton
def test_the_export_command_checks_on_beton_images_and_writes_the_file(tmp_path, synthetic_data, capsys):
    from pipeline.cli import main

    val = synthetic_data(8, 24) / "val.beton"
    out = tmp_path / "m.onnx"
    assert main(["export", "--model", "deit_tiny_patch16_224", "--method", "powerbert", "--keep",
                 "196,98,49,49,30,20,10,5,5,5,5,5", "--check-data", str(val), "--check-images", "10",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "onnxruntime vs torch on 10 images: max |logit difference|" in captured.out
    assert f"images of {val}" in captured.err and out.is_file()


@pytest.mark.slow
@pytest.mark.speed
def test_bench_onnx_rows_give_the_realised_fraction_of_the_gflops_ratio():
    from pipeline.bench.onnx import onnx_speeds
    from pipeline.bench.paired import SpeedSettings
    from pipeline.flops import count_flops

    reference, model = tiny(), tiny("powerbert", keep=[8, 4])
    from tests.conftest import HANG_S, LOOSE_TOLERANCE

    rows = onnx_speeds({"powerbert": model}, reference, batches=[1, 2],  # a cap only a hang reaches
                       settings=SpeedSettings(tolerance=LOOSE_TOLERANCE, cap_s=HANG_S, warmup=1), log=lambda _: None)
    assert [(r.batch, r.runtime) for r in rows] == [(1, "onnxruntime"), (1, "torch"), (2, "onnxruntime"), (2, "torch")]
    pick, plain = count_flops(model).total, count_flops(reference).total
    for r in rows:
        row = r.row()
        assert row["gflops_ratio"] == pytest.approx(plain / pick, rel=1e-3)
        assert row["realised"] == pytest.approx(pick / (r.ratio.ratio * plain), rel=1e-2)  # speed-up / GFLOPs ratio
        assert row["realised_low"] <= row["realised"] <= row["realised_high"]
        assert np.isfinite(r.ratio.ratio) and r.ratio.blocks >= 1


# ---- the evaluate stage in onnxruntime (experiment.eval.runtime) ----------------------------------------------------

@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A `pipeline train`-format checkpoint of the tiny test model finetuned with PoWER-BERT, and its data."""
    from tests.conftest import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("export"), "powerbert", [12, 6, 3], val=24))


def eval_config(runtime: str):
    from pipeline.config import EvalConfig
    from tests.conftest import HANG_S, LOOSE_TOLERANCE

    return EvalConfig(runtime=runtime, batch=4, speed_tolerance=LOOSE_TOLERANCE, speed_cap_s=HANG_S, warmup=1)


@pytest.mark.slow
@pytest.mark.beton
def test_the_evaluate_stage_times_the_exports_in_onnxruntime_on_a_clock_named_for_it(finetuned, monkeypatch):
    import pipeline.evaluate as evaluate
    from pipeline.evaluate import evaluate_checkpoint, reference_scale

    torch_eval = evaluate_checkpoint(finetuned, eval_config("torch"), cuda=False)
    runs, real = [], evaluate.session

    class Counted:  # the sessions the timed calls run in
        def __init__(self, path, threads):
            self.inner = real(path, threads)

        def run(self, *args):
            runs.append(args[1]["images"].shape)
            return self.inner.run(*args)

    monkeypatch.setattr(evaluate, "session", lambda path, threads=1: Counted(path, threads))
    onnx_eval = evaluate_checkpoint(finetuned, eval_config("onnxruntime"), cuda=True)  # a GPU: still the CPU
    assert len(runs) >= 2 * onnx_eval.speed_blocks and set(runs) == {(4, 3, 16, 16)}  # both models, every block
    assert (torch_eval.clock, onnx_eval.clock) == ("cpu", "onnxruntime:cpu")
    assert (onnx_eval.device, onnx_eval.dtype, onnx_eval.compile) == ("cpu", "fp32", "none")
    assert onnx_eval.top1 == torch_eval.top1 and onnx_eval.gflops == torch_eval.gflops
    assert onnx_eval.speed_ratio_low <= onnx_eval.speed_ratio <= onnx_eval.speed_ratio_high and onnx_eval.speed_blocks
    assert reference_scale({"tiny": finetuned}, eval_config("onnxruntime"), cuda=False).clock == "onnxruntime:cpu"


@pytest.mark.slow
@pytest.mark.beton
def test_the_evaluate_stage_refuses_an_export_that_differs_from_torch(finetuned, monkeypatch):
    import pipeline.evaluate as evaluate
    from pipeline.export import ExportCheck

    monkeypatch.setattr(evaluate, "check_onnx", lambda *a, **k: ExportCheck(0.5, 1, 0.875, 8, False))
    with pytest.raises(ExportError, match=r"the ONNX export the evaluation would time differs from torch"):
        evaluate.evaluate_checkpoint(finetuned, eval_config("onnxruntime"), cuda=False)


def test_onnxruntime_evaluations_are_on_a_clock_of_their_own_and_on_the_cpu_in_float32():
    from pipeline.config import EvalConfig
    from pipeline.dag.select import check_one_clock
    from pipeline.dag.types import EvalResult

    with pytest.raises(ValueError, match=r"not with experiment.eval.dtype: bf16, experiment.eval.compile: default"):
        EvalConfig(runtime="onnxruntime", dtype="bf16", compile="default")
    EvalConfig(runtime="onnxruntime", device="cpu", dtype="fp32", compile="none")
    evaluations = {name: EvalResult(run_id=name, checkpoint="c", top1=1.0, gflops=1.0, images_per_s=1.0,
                                    images_per_s_spread=0.0, num_images=1, clock=clock)
                   for name, clock in (("a", "cpu"), ("b", "onnxruntime:cpu"))}
    with pytest.raises(InputError, match=r"cpu: 1 model\(s\), onnxruntime:cpu: 1 model\(s\)"):
        check_one_clock(evaluations)


@pytest.mark.parametrize("check, passed", [
    ((2e-6, 0, 1.0, 2000, False), True),
    ((0.196, 1, 1.0, 2000, False), True),  # one near tie in 2,000 (the demo's ToMe model)
    ((0.196, 11, 1.0, 2000, False), False),  # over 0.5% of the images
    ((0.3, 1, 0.99, 2000, False), False),  # top-1 under 99.5%
    ((0.196, 1, 1.0, 100, False), False),  # one image in 100 is 1%
    ((float("nan"), 0, 1.0, 2000, False), False),  # a non-finite logit
])
def test_a_check_passes_near_ties_of_a_discrete_step_and_nothing_more(check, passed):
    from pipeline.export import ExportCheck

    assert ExportCheck(*check).passed is passed


def test_an_experiment_named_like_a_twin_is_refused():
    from pipeline.config import ConfigError, load_config
    from tests.processes import ROOT

    demo = ROOT / "configs" / "experiments" / "demo.yaml"
    with pytest.raises(ConfigError, match=r"'demo-onnx' ends in -onnx, which names the registry's ONNX twins"):
        load_config(demo, ["experiment.name=demo-onnx"])
    assert load_config(demo, ["experiment.name=demo-onnx2"]).experiment.name == "demo-onnx2"
