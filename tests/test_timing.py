"""Timing primitives (``pipeline.bench.timing``) and the inference context the timings hold
(``runtime.inference``): how many calls a sample makes, what the host time measures, and that a
held context casts each weight once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.bench import timing
from pipeline.bench.profiling import OpCounter
from pipeline.bench.throughput import _held
from pipeline.config import BenchThroughputConfig
from pipeline.models import create_model
from pipeline.runtime import inference

CPU = torch.device("cpu")


def test_default_calls_queue_on_cuda_only():
    assert timing.default_calls(torch.device("cuda")) == 10
    assert timing.default_calls(CPU) == 1


def test_timed_returns_seconds_a_call_over_calls_back_to_back(monkeypatch):
    """On a clock that a call advances by 2 s and a synchronisation by 1 s: 3 calls then one sync read 7 s."""
    events, now = [], [100.0]
    monkeypatch.setattr(timing, "sync", lambda device: (events.append("sync"), now.__setitem__(0, now[0] + 1.0)))

    def fn():
        events.append("call")
        now[0] += 2.0

    seconds = timing.timed(fn, torch.device("cuda"), calls=3, clock=lambda: now[0])
    assert events == ["call", "call", "call", "sync"], "one synchronisation after the last call"
    assert seconds == pytest.approx(7.0 / 3)  # a call's time, the sync's share included, not the sample's


def test_time_paired_alternates_samples_of_calls():
    order = []
    base, own = timing.time_paired(lambda: order.append("f"), lambda: order.append("b"), warmup=1, repeats=2,
                                   device=CPU, calls=3)
    assert order == ["b", "f"] + (["b"] * 3 + ["f"] * 3) * 2
    assert len(base) == len(own) == 2


def test_host_seconds_times_each_call_from_an_idle_device(monkeypatch):
    """On a clock that each call advances by its own step and a synchronisation by 100 s (outside the timed call):
    the median of the calls' steps."""
    events, now = [], [0.0]
    monkeypatch.setattr(timing, "sync", lambda device: (events.append("sync"), now.__setitem__(0, now[0] + 100.0)))
    steps = iter([1.0, 30.0, 8.0])

    def fn():
        events.append("call")
        now[0] += next(steps)

    seconds = timing.host_seconds(fn, torch.device("cuda"), repeats=3, clock=lambda: now[0])
    assert events == ["sync", "call"] * 3 + ["sync"]
    assert seconds == 8.0, "the median of the three calls"


def _casts(counter: OpCounter) -> int:
    return counter.ops.get("aten._to_copy.default", 0)


def test_a_held_inference_context_casts_each_weight_once():
    """A linear layer's bf16 call casts the input, the weight and the bias; in a held context the weight's
    and the bias's copies are kept, so later calls cast only the input, and give the same bits."""
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 4), torch.randn(2, 8)
    with inference(CPU, "bf16"):
        with OpCounter() as first:
            expected = layer(x)
        with OpCounter() as later:
            out = layer(x)
    assert (_casts(first), _casts(later)) == (3, 1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    with OpCounter() as fresh:
        with inference(CPU, "bf16"):
            layer(x)
        with inference(CPU, "bf16"):
            layer(x)
    assert _casts(fresh) == 6, "a context entered for each call casts the weights again"
    with OpCounter() as inference_mode, torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
        layer(x)
    assert inference_mode.ops.get("aten.to.dtype", 0) == 6, "autocast keeps no copies under inference_mode"


def test_a_held_context_saves_two_casts_per_weighted_layer_of_a_deit():
    """A DeiT forward in a held context casts only activations: the saving is the weight and bias of every
    linear layer and of the patch embedding's convolution (127 -> 27 casts for DeiT-S, docs/benchmarks.md)."""
    model, x = create_model("deit_tiny_patch16_224").eval(), torch.randn(1, 3, 224, 224)
    layers = sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in model.modules())
    with OpCounter() as fresh, inference(CPU, "bf16"):
        model(x)
    with inference(CPU, "bf16"):
        model(x)
        with OpCounter() as held:
            model(x)
    assert layers == 12 * 4 + 2
    assert _casts(fresh) - _casts(held) == 2 * layers


@pytest.mark.parametrize("train", [False, True])
def test_bench_throughput_holds_autocast_for_inference_only(train):
    """A training step changes the weights, which a held autocast context would serve from stale copies."""
    cfg = BenchThroughputConfig(dtype="bf16", train=train)
    with _held(cfg, CPU):
        assert torch.is_autocast_enabled("cpu") is not train
        assert torch.is_grad_enabled() is train


def test_bench_throughput_times_inference_in_one_held_context(monkeypatch):
    """Every timed call of both models runs in the held context: no weight is cast again, and each sample
    queues the configured calls."""
    from pipeline.bench import throughput
    from pipeline.config import PoolingConfig

    seen = []

    def spy(fn, baseline, **kwargs):
        for call in (fn, baseline):
            call()  # the warm-up: a model's first call in the context casts its weights
            with OpCounter() as counter:
                call()
            seen.append((torch.is_autocast_enabled("cpu"), _casts(counter), kwargs["calls"]))
        return [1.0], [1.0]

    monkeypatch.setattr(throughput, "time_paired", spy)
    cfg = BenchThroughputConfig(model="deit_tiny_patch16_224", methods=["random"], level=None, batch=1, dtype="bf16",
                                keep=[196, 150, 120, 100, 80, 60, 50, 40, 30, 20, 10, 5], warmup=0, repeats=1,
                                ceiling=False, calls=3)
    throughput.run_throughput(cfg, PoolingConfig(), log=lambda line: None)
    model = create_model("deit_tiny_patch16_224")
    with OpCounter() as fresh, inference(CPU, "bf16"):
        model(torch.randn(1, 3, 224, 224))
    layers = sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in model.modules())
    assert [(enabled, calls) for enabled, _, calls in seen] == [(True, 3), (True, 3)]
    assert seen[1][1] == _casts(fresh) - 2 * layers, "the unmodified model casts no weight in the timed calls"
    assert seen[0][1] == seen[1][1], "nor does the downsampled one (random drop casts no activation of its own)"


def test_bench_throughput_profiles_only_after_every_timing(monkeypatch):
    """torch.profiler leaves CUPTI attached after its session (pytorch/pytorch#144455), slowing later launches:
    no model may be timed after any profile of the run."""
    from pipeline.bench import throughput
    from pipeline.config import PoolingConfig

    events = []
    timer, table = throughput.time_paired, throughput.kernel_table
    monkeypatch.setattr(throughput, "time_paired", lambda *a, **k: (events.append("time"), timer(*a, **k))[1])
    monkeypatch.setattr(throughput, "kernel_table", lambda run: (events.append("profile"), table(run))[1])
    cfg = BenchThroughputConfig(model="deit_tiny_patch16_224", methods=["random", "powerbert"], level=None, batch=1,
                                keep=[196, 150, 120, 100, 80, 60, 50, 40, 30, 20, 10, 5], warmup=0, repeats=1,
                                ceiling=False, profile=True)
    result = throughput.run_throughput(cfg, PoolingConfig(), log=lambda line: None)
    assert events == ["time"] * 2 + ["profile"] * 3, "two timed methods, then the three models' profiles"
    assert [row.label for row in result.rows] == ["random", "powerbert"]


def test_the_evaluate_stage_times_in_one_held_context(monkeypatch):
    from pipeline import evaluate

    seen = {}

    def spy(fn, reference, **kwargs):
        fn()
        with OpCounter() as counter:
            fn()
        seen.update(casts=_casts(counter))

    monkeypatch.setattr(evaluate, "paired_ratio", spy)
    model = create_model("deit_tiny_patch16_224").eval()
    evaluate.speed(model, model, torch.randn(1, 3, 224, 224), device=CPU, dtype="bf16")
    with OpCounter() as fresh, inference(CPU, "bf16"):
        model(torch.randn(1, 3, 224, 224))
    layers = sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in model.modules())
    assert seen == {"casts": _casts(fresh) - 2 * layers}


def test_the_evaluations_clock_follows_its_device_and_threads():
    """CUDA events on a GPU; on the CPU the thread's CPU time at one torch thread, the wall clock at more (whose work
    the thread's clock would not count): the clock each evaluation logs (``eval_clock``)."""
    from pipeline.evaluate import speed_clock

    assert speed_clock(torch.device("cuda"), 1) == "cuda"
    assert speed_clock(torch.device("cpu"), 1) == "cpu"
    assert speed_clock(torch.device("cpu"), 2) == "wall"
