"""The training loop reads the device only every ``train.log_every`` steps (pipeline/train/loop.py).

Every read of a device value makes the host wait for the GPU, so the loop must not read one per step.
On the CPU every tensor is a host tensor; ``DeviceReads`` counts what would be a device read on a GPU
(``.item()``, ``float(t)``, ``bool(t)``, ``nonzero``, ``.tolist()``, ``.cpu()``, ``.numpy()``) while the
CUDA code path runs, over a steady-state epoch (the second) of a real tiny training, loader excluded.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from pipeline.bench.profiling import DeviceReads
from pipeline.config import load_config
from pipeline.data import WriteSettings, open_source, write_beton
from pipeline.train import loop

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_synthetic.yaml"
STEPS = 16  # 256 training images, batch 16


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for split, spec in (("train", "synthetic:classes=4,count=256,size=16"),
                        ("val", "synthetic:classes=4,count=64,size=16,seed=1")):
        write_beton(open_source(spec), root / f"{split}.beton", WriteSettings(mode="raw", max_res=None),
                    log=lambda _: None)
    return root


def config(data: Path, tmp: Path, *overrides: str):
    return load_config(TINY, [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
                              "train.workers=0", f"train.storage_path={tmp / 'ray'}",
                              f"train.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                              f"train.artifact_root={tmp / 'artifacts'}", "train.progress_bar=false", *overrides])


class _Paused:
    """The training loader with its own (host-side) work left out of the count."""

    def __init__(self, loader, reads: DeviceReads) -> None:
        self.loader, self.reads = loader, reads

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        with self.reads.paused():
            iterator = iter(self.loader)
        while True:
            with self.reads.paused():
                batch = next(iterator, None)
            if batch is None:
                return
            yield batch


def _counted(reads: DeviceReads, job, attribute: str, fn, *args, **kwargs):
    """``fn(job, *args, **kwargs)`` counted by ``reads``, the loader ``job.<attribute>`` paused."""
    loader = getattr(job, attribute)
    setattr(job, attribute, _Paused(loader, reads))
    try:
        with reads:
            return fn(job, *args, **kwargs)
    finally:
        setattr(job, attribute, loader)


class ReadsAndBuilds(DeviceReads):
    """``DeviceReads`` that also counts the tensors built from Python data (``torch.tensor``, ``new_tensor``:
    ``aten.lift_fresh``), each a host-to-device copy on a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("aten.lift_fresh"):
            self._count(str(func))
        return super().__torch_dispatch__(func, types, args, kwargs)


def count_reads(monkeypatch, cfg, counter: type[DeviceReads] = DeviceReads) -> tuple[DeviceReads, DeviceReads]:
    """Trains ``cfg`` for 2 epochs; returns the device reads of the second epoch's steps and of the
    evaluations after it."""
    steps, evals = counter(), counter()
    train_one_epoch, evaluate = loop.train_one_epoch, loop.evaluate
    epoch = [0]

    def counted_epoch(job, at, step):
        epoch[0] = at
        if at != 1:
            return train_one_epoch(job, at, step)
        return _counted(steps, job, "train_loader", train_one_epoch, at, step)

    def counted_eval(job, *args, **kwargs):
        if epoch[0] != 1:
            return evaluate(job, *args, **kwargs)
        return _counted(evals, job, "val_loader", evaluate, *args, **kwargs)

    monkeypatch.setattr(loop, "train_one_epoch", counted_epoch)
    monkeypatch.setattr(loop, "evaluate", counted_eval)
    if cfg.train.compile != "none":  # the inductor backend compiles C++ for minutes here; aot_eager runs aten ops
        from pipeline.runtime import compile_model

        monkeypatch.setattr(loop, "compile_model", functools.partial(compile_model, backend="aot_eager"))
    loop.train_local(cfg)
    return steps, evals


MODES = {
    "base": ("train.mode=base",),
    "ksearch": ("train.mode=ksearch",),
    "finetune": ("train.mode=finetune", "pooling.method=wkmedoids", "pooling.keep=[12,8,4]"),
}


@pytest.mark.beton
@pytest.mark.parametrize("compile_mode", ["none", pytest.param("default", marks=pytest.mark.compile)])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_steady_epoch_reads_the_device_once_per_log_every_steps(monkeypatch, data, tmp_path, mode, compile_mode):
    """With the DeiT recipe's extras on (Mixup/CutMix, EMA, gradient clipping): 16 steps at log_every 5
    read the device at steps 5, 10, 15 and at the epoch's end, and each evaluation reads it once."""
    cfg = config(data, tmp_path, *MODES[mode], f"train.compile={compile_mode}", "train.log_every=5",
                 "recipe.mixup=0.8", "recipe.cutmix=1.0", "recipe.ema=true", "recipe.clip_grad=1.0")
    steps, evals = count_reads(monkeypatch, cfg)
    assert steps.count == math.ceil(STEPS / 5), steps.reads
    assert set(steps.reads) == {next(iter(steps.reads))}, steps.reads  # all from one line: StepTotals.read
    assert evals.count == 2, evals.reads  # the model and its EMA, one read each


@pytest.mark.beton
def test_a_latency_target_search_reads_the_device_as_the_lambda_search_does(monkeypatch, data, tmp_path):
    """The K search toward a latency table's target adds no device read and builds no tensor from Python data per
    step: its penalty's curves are tensors built once, and whether a block pools is a mask on the device."""
    from dataclasses import replace

    from pipeline.cost import save_cost_model
    from pipeline.flops import gflops_cost_model
    from pipeline.train.build import build_model

    searched = config(data, tmp_path, "train.mode=ksearch")
    table = gflops_cost_model(build_model(searched), "powerbert", step=4)
    # a table's shape, and a key with every field `pipeline bench blocks` records (cost.TABLE_KEY_FIELDS)
    table = replace(table, unit="ms", key={**table.key, "img_size": 16, "patch_size": 4, "depth": 3, "num_heads": 2,
                                           "num_classes": 4, "patch_embed": "conv", "batch": 1, "dtype": "fp32",
                                           "compile": "none", "threads": 1, "device_type": "cpu", "clock": "cpu",
                                           "kernel_choice": {}})
    path = save_cost_model(table, tmp_path / "table.json")
    cfg = config(data, tmp_path, "train.mode=ksearch", "train.log_every=5",
                 f"train.ksearch_target={{cost: latency, fraction: 0.6, table: {path}}}")
    steps, _ = count_reads(monkeypatch, cfg, ReadsAndBuilds)
    reads = {what: n for what, n in steps.reads.items() if "lift_fresh" not in what}
    builds = {what: n for what, n in steps.reads.items() if "lift_fresh" in what}
    assert sum(reads.values()) == math.ceil(STEPS / 5), steps.reads  # the lambda search's count
    assert not builds, builds


@pytest.mark.beton
def test_the_count_sees_the_loops_reads(monkeypatch, data, tmp_path):
    """log_every 1 reads at every step, as the loop did before: the count is not blind to them."""
    steps, _ = count_reads(monkeypatch, config(data, tmp_path, "train.log_every=1"))
    assert steps.count == STEPS, steps.reads


@pytest.mark.beton
def test_a_nonfinite_loss_stops_the_job_naming_the_steps(monkeypatch, data, tmp_path):
    """The loss turns NaN at global step 7 of 32; the read at step 8 (log_every 4) finds it."""
    build_recipe = loop.build_recipe

    def poisoned(*args, **kwargs):
        recipe = build_recipe(*args, **kwargs)
        loss, calls = recipe.loss, []

        def nan_at_7(logits, targets):
            calls.append(1)
            return loss(logits, targets) * (math.nan if len(calls) == 7 else 1.0)
        recipe.loss = nan_at_7
        return recipe

    monkeypatch.setattr(loop, "build_recipe", poisoned)
    with pytest.raises(FloatingPointError, match=r"the training loss is not finite at one of the steps 5\.\.8 "
                                                 r"\(epoch 1\); lower recipe.lr or enable recipe.clip_grad"):
        loop.train_local(config(data, tmp_path, "train.log_every=4"))
    assert not list((tmp_path / "ray").rglob("epoch_*")), "no checkpoint of the poisoned epoch"


def test_step_totals_against_python_sums():
    totals = loop.StepTotals(torch.device("cpu"))
    losses, images = [2.0, 1.0, 4.0, 0.5, 3.0], [16, 16, 8, 16, 4]
    for loss, n in zip(losses[:3], images[:3]):
        totals.add(torch.tensor(loss), n, penalty=torch.tensor(0.25))
    assert totals.read(epoch=0, step=3) == pytest.approx((2 * 16 + 16 + 4 * 8) / 40)
    for loss, n in zip(losses[3:], images[3:]):
        totals.add(torch.tensor(loss), n, penalty=torch.tensor(0.25))
    assert totals.read(epoch=0, step=5) == pytest.approx((0.5 * 16 + 3 * 4) / 20)
    assert math.isnan(totals.read(epoch=0, step=5))  # nothing new since the last read: no device read
    stats = totals.stats(seconds=2.0)
    assert stats.images == 60 and stats.penalty == pytest.approx(0.25)
    assert stats.loss == pytest.approx(sum(v * n for v, n in zip(losses, images)) / 60)


def test_step_totals_name_the_single_step_of_a_nonfinite_loss():
    totals = loop.StepTotals(torch.device("cpu"))
    totals.add(torch.tensor(1.0), 4)
    totals.read(epoch=2, step=10)
    totals.add(torch.tensor(math.inf), 4)
    with pytest.raises(FloatingPointError, match=r"not finite at step 11 \(epoch 3\)"):
        totals.read(epoch=2, step=11)


@pytest.mark.beton
def test_train_init_is_read_once_per_process(monkeypatch, data, tmp_path):
    """The driver's check of ``train.init`` and the job that loads it, in one process, share one read."""
    from pipeline.train import run_training

    base = run_training(config(data, tmp_path, "train.name=base", "recipe.epochs=1"))
    reads, load = [], torch.load

    def counted(file, *args, **kwargs):
        reads.append(Path(file).parent)
        return load(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    run_training(config(data, tmp_path, "train.name=tuned", "recipe.epochs=1", "train.mode=finetune",
                        f"train.init={base.checkpoint}", "pooling.method=powerbert", "pooling.keep=[12,8,4]"))
    assert reads.count(Path(base.checkpoint)) == 1, reads
