"""The machine's run-to-run spread of a paired speed ratio: ``pipeline doctor --speed``'s measurement and record.

A paired ratio's 95% interval (``bench.paired``) holds within one process. Between processes the ratio of one
pair can move further: on a VM whose host shifts the guest's speed, the demo's random-selection checkpoint measured
0.64 to 0.79 in different runs against intervals of +-1-2% (docs/data/cpu/2026-12-02_ratio-drift/). This module
times one fixed pair (a pooled DeiT-style model against its unmodified one, in an experiment's evaluation setting)
in k fresh processes spaced over a span, and records the spread of their ratios beside the half-width within a
process, one JSON file per device (by its name), thread count and timing setting (the device kind, dtype, compile
mode and batch: ``timing_setting``), where the report, ``pipeline select`` and ``experiment.select.tie_margin:
machine`` look it up by the name of the device the models were timed on and the setting they were timed in: a record
of another batch, dtype or compile mode is another record, never one that widens these models' intervals.

It stands beside ``report`` rather than in ``bench`` because it times as an evaluation does (``evaluate.speed``),
and ``evaluate`` imports ``bench``.

    python -m pipeline.spread --one '{"name": ...}'   # one process: prints one JSON line (``measure_pair``)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError, EvalConfig
from pipeline.errors import InputError, MissingFileError

MACHINE_DIR = Path("runs/machine")  # where the records are written and looked up (relative to the working folder)
PAIR_METHOD = "wkmedoids"  # the demo's latency target's method
PAIR_SEED = 0  # the pair's random weights: the ratio, not the accuracy, is measured
PROCESSES, OVER_S = 4, 180.0  # ``doctor --speed``'s default: 4 processes over 3 minutes (about 3.5 in all)


@dataclass(frozen=True)
class PairSpec:
    """The fixed pair and how it is timed: ``create_model(name, **args)`` without and with ``method`` at ``keep``
    (one K per block), with the ``kernels`` section's choice, timed as the evaluate stage times a model in the
    ``eval`` section (``experiment.eval``: the batch, setting, threads, tolerance and cap)."""

    name: str
    args: dict[str, Any]
    method: str
    keep: list[int]
    kernels: dict[str, str]
    eval: dict[str, Any]


def pair_spec(config: Config) -> PairSpec:
    """The pair of ``config``: its model at the narrowest of ``experiment.embed_dims`` (with that width's heads) or
    its first of ``experiment.models``, pooled with WK-Medoids to half its patch tokens in every block, timed in
    ``experiment.eval``'s setting. Random weights (seed ``PAIR_SEED``): only the ratio is measured."""
    from pipeline.models.factory import create_model
    from pipeline.train.build import model_args

    exp = config.experiment
    args = model_args(config) | {"pretrained": False}
    name = config.model.name
    if exp.models:
        name = exp.models[0]
    elif exp.embed_dims:
        width = min(exp.embed_dims)
        args |= {"embed_dim": width, "num_heads": exp.num_heads.get(width, config.model.num_heads)}
    tokens, depth = _tokens_and_depth(create_model, name, args)
    return PairSpec(name=name, args=args, method=PAIR_METHOD, keep=[max(1, tokens // 2)] * depth,
                    kernels=config.kernels.model_dump(mode="json"), eval=exp.eval.model_dump(mode="json"))


def _tokens_and_depth(create_model: Callable, name: str, args: dict[str, Any]) -> tuple[int, int]:
    """The patch tokens and blocks of the unmodified model, built on the meta device (no weights)."""
    import torch

    with torch.device("meta"):
        model = create_model(name, **args)
    return int(model.patch_embed.num_patches), len(model.blocks)


def timing_setting(device: str, dtype: str, compile: str, batch: int) -> str:
    """``cpu fp32 compile:none batch:64``: the setting a speed was timed in (``device`` the kind, ``cpu`` or
    ``cuda``; ``dtype`` and ``compile`` as resolved): part of a spread record's key."""
    return f"{device} {dtype} compile:{compile} batch:{batch}"


def measure_pair(spec: PairSpec) -> dict[str, Any]:
    """One paired ratio of ``spec``'s pair in this process, as ``evaluate.speed`` times an evaluation: the ratio,
    its 95% interval, its relative half-width, the blocks, why they stopped, the seconds, and what it ran on (the
    device's name, the threads, torch's and timm's versions)."""
    import timm
    import torch

    from pipeline.bench.blocks import device_name
    from pipeline.evaluate import speed, speed_settings
    from pipeline.models import set_kernels
    from pipeline.models.factory import create_model
    from pipeline.runtime import KernelChoice, compile_model, cuda_settings, resolve_setting

    cfg = EvalConfig(**spec.eval)
    device, dtype, mode = resolve_setting(cfg.device, cfg.dtype, cfg.compile, torch.cuda.is_available())
    target, kernels = torch.device(device), KernelChoice(**spec.kernels)
    torch.manual_seed(PAIR_SEED)
    model = create_model(spec.name, **spec.args, method=spec.method, keep=spec.keep).eval()
    reference = create_model(spec.name, **spec.args).eval()
    reference.load_state_dict(model.state_dict())  # the same weights, no downsampling
    model, reference = set_kernels(model.to(target), kernels), set_kernels(reference.to(target), kernels)
    images = torch.randn(cfg.batch, 3, *model.patch_embed.img_size, device=target)
    with cuda_settings(target):
        ratio = speed(compile_model(model, mode, target), compile_model(reference, mode, target), images,
                      device=target, dtype=dtype, compile=mode, threads=cfg.threads, settings=speed_settings(cfg))
    return {"ratio": ratio.ratio, "low": ratio.low, "high": ratio.high, "half_width": ratio.half_width,
            "blocks": ratio.blocks, "stop": ratio.stop, "seconds": ratio.seconds, "device": device_name(target),
            "setting": timing_setting(device, dtype, mode, cfg.batch), "threads": cfg.threads,
            "torch": torch.__version__, "timm": timm.__version__}


@dataclass(frozen=True)
class SpreadRecord:
    """k processes' ratios of one pair on one machine, and their spread.

    ``between``: the ratios' standard deviation (n - 1) over their mean, relative; ``within``: the median of the
    processes' relative half-widths (each a 95% interval's, ``bench.paired``); ``max_over_min``: the largest ratio
    over the smallest. ``path``: where it was read from or written to (not stored in the file)."""

    device: str
    threads: int
    setting: str
    torch: str
    timm: str
    date: str
    over_s: float
    seconds: float  # wall time of the whole measurement, first start to last end
    pair: dict[str, Any]
    processes: list[dict[str, Any]]
    between: float
    within: float
    max_over_min: float
    path: str = field(default="", compare=False)

    @property
    def k(self) -> int:
        return len(self.processes)

    @property
    def ratios(self) -> list[float]:
        return [p["ratio"] for p in self.processes]

    def across_runs(self, value: float, low: float, high: float) -> tuple[float, float]:
        """``[low, high]``, an interval of ``value`` that holds within one run (a ratio's 95%, or the select stage's
        chained images/s, at least 90%), widened by the spread between processes: each side apart (the interval is
        asymmetric), its distance from ``value`` and 1.96 times the spread at ``value`` added in quadrature. The
        spread is a ratio's, applied to images/s as a relative figure, as the two move together."""
        spread = statistics.NormalDist().inv_cdf(0.975) * self.between * value
        return value - math.hypot(value - low, spread), value + math.hypot(high - value, spread)

    def window(self) -> str:
        """``8 processes over 3600 s, 2026-12-08``: what the spread was measured over."""
        return f"{self.k} processes over {self.over_s:g} s, {self.date[:10]}"

    def source(self) -> str:
        """``runs/machine/speed-...json, 2026-12-08``: where the figure came from."""
        return f"{self.path}, {self.date[:10]}"

    def summary(self) -> str:
        """The figures in one sentence: the spread between processes beside the half-width within one."""
        return (f"between processes: ratio {min(self.ratios):.3f} to {max(self.ratios):.3f} over {self.k} processes "
                f"in {self.over_s:g} s, spread {self.between:.1%} (sd/mean); within a process: median half-width "
                f"{self.within:.1%}")

    def as_json(self) -> str:
        record = asdict(self)
        record.pop("path")
        return json.dumps(record, indent=1)


def spread_statistics(ratios: Sequence[float], half_widths: Sequence[float]) -> dict[str, float]:
    """``between`` (sample standard deviation over mean), ``max_over_min`` of ``ratios`` and ``within`` (median of
    ``half_widths``): ``SpreadRecord``'s figures. Two ratios at least."""
    if len(ratios) < 2:
        raise InputError(f"a spread between processes needs at least 2 ratios, got {len(ratios)}")
    return {"between": statistics.stdev(ratios) / statistics.fmean(ratios),
            "max_over_min": max(ratios) / min(ratios), "within": statistics.median(half_widths)}


def device_slug(device: str) -> str:
    """``amd-epyc-7763-64-core-processor``: a device name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


def record_path(device: str, threads: int, setting: str, root: Path = MACHINE_DIR) -> Path:
    """Where the record of ``device`` at ``threads`` timing threads in ``setting`` (``timing_setting``) is written and
    looked up."""
    return root / f"speed-{device_slug(device)}-t{threads}-{device_slug(setting)}.json"


def read_record(path: Path) -> SpreadRecord:
    """The record at ``path``; a file that is not one is an InputError saying how to write it again."""
    try:
        return SpreadRecord(**json.loads(path.read_text()), path=str(path))
    except (OSError, ValueError, TypeError) as err:
        raise InputError(f"{path}: not a record of `pipeline doctor --speed` ({err}); run it again to write one") \
            from None


def machine_record(name: str, threads: int, setting: str, root: Path = MACHINE_DIR) -> SpreadRecord | None:
    """The record of the device called ``name`` (``bench.blocks.device_name``: where a model was timed, which may
    be another node than this one) at ``threads`` in ``setting`` (``timing_setting``); None where there is none."""
    path = record_path(name, threads, setting, root)
    return read_record(path) if path.is_file() else None


def tie_margin(choice: str | float, timed: Sequence[tuple[str, str]], threads: int, root: Path = MACHINE_DIR
               ) -> tuple[float, SpreadRecord | None]:
    """``experiment.select.tie_margin`` as a relative margin for models timed on the devices and in the settings
    ``timed`` (each ``(name, setting)``: ``bench.blocks.device_name`` as their evaluations logged it, and
    ``timing_setting``), and the record shown beside their speeds: the widest recorded spread of those (a cluster of
    mixed cards takes its least steady). The margin is 0 for ``none``, that record's ``between`` for ``machine`` (a
    MissingFileError where a device in its setting has no record), a number as it is."""
    records = {f"{name} ({setting})": machine_record(name, threads, setting, root)
               for name, setting in dict.fromkeys(timed)}
    widest = max((r for r in records.values() if r is not None), key=lambda r: r.between, default=None)
    if choice != "machine":
        return (0.0 if choice == "none" else float(choice)), widest
    missing = [name for name, record in records.items() if record is None] or ([] if records else
                                                                               ["no evaluated device"])
    if missing:
        raise MissingFileError(f"experiment.select.tie_margin: machine, but no run-to-run spread is recorded for "
                               f"{'; '.join(missing)} at {threads} thread(s) under {root}; run `python -m pipeline "
                               "doctor --speed CONFIG` on a machine with that device first, or set tie_margin: none "
                               "or a number")
    return widest.between, widest


def check_tie_margin(config: Config, device: str, here: bool, root: Path = MACHINE_DIR) -> None:
    """``run --plan``'s check of ``experiment.select.tie_margin: machine`` for evaluations on ``device`` (``cpu`` or
    ``cuda``: ``eval.device`` as the evaluate stage resolves it on the cluster): where they run on this machine
    (``here``), its device's record at ``eval.threads``; on a cluster's nodes, whose names only their evaluations
    will log, a record of a ``device`` at ``eval.threads``. A ConfigError without one."""
    exp = config.experiment
    if exp.select.tie_margin != "machine":
        return
    import torch

    from pipeline.runtime import resolve_setting

    threads, ev = exp.eval.threads, exp.eval
    _, dtype, mode = resolve_setting(device, ev.dtype, ev.compile, device == "cuda")
    setting = timing_setting(device, dtype, mode, ev.batch)
    if here:
        from pipeline.bench.blocks import device_name

        try:
            tie_margin("machine", [(device_name(torch.device(device)), setting)], threads, root)
        except MissingFileError as err:
            raise ConfigError(str(err)) from None
        return
    records = [read_record(path) for path in sorted(root.glob(f"speed-*-t{threads}-*.json"))]  # each one readable
    if not any(record.setting == setting for record in records):
        raise ConfigError(f"experiment.select.tie_margin: machine, but no run-to-run spread of a {device} device at "
                          f"{threads} thread(s) in {setting} is recorded under {root}, and the evaluations run on the "
                          f"cluster's nodes: run `python -m pipeline doctor --speed CONFIG` on one of them and copy "
                          "its record there, or set tie_margin: none or a number")


def _run_one(spec: PairSpec) -> dict[str, Any]:
    """``measure_pair`` in a fresh process (this interpreter), its one JSON line read back."""
    command = [sys.executable, "-m", "pipeline.spread", "--one", json.dumps(asdict(spec))]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"a timing process of `doctor --speed` failed (exit {done.returncode}): {tail}")
    return json.loads(lines[-1])


def check_span(processes: int, over_s: float) -> None:
    """An InputError naming the flag, for fewer than 2 processes or a span that is not a finite number >= 0."""
    if processes < 2:
        raise InputError(f"--processes {processes}: a spread between processes needs at least 2")
    if not (over_s >= 0 and math.isfinite(over_s)):
        raise InputError(f"--over-s {over_s:g}: give the span the processes are spread over, in seconds (>= 0)")


def measure_spread(spec: PairSpec, processes: int, over_s: float, *, out: Path | None = None,
                   log: Callable[[str], None] = print, run_one: Callable[[PairSpec], dict[str, Any]] = _run_one,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> SpreadRecord:
    """``spec``'s ratio in ``processes`` fresh processes, the i-th started ``i * over_s / (processes - 1)`` s after
    the first (at once where the one before ran longer), written to ``out`` (default ``record_path`` of the device
    and threads the processes report) as a ``SpreadRecord``."""
    check_span(processes, over_s)
    start, results = clock(), []
    for index in range(processes):
        wait = start + index * over_s / (processes - 1) - clock()
        if wait > 0:
            sleep(wait)
        result = run_one(spec)
        results.append(result)
        log(f"[speed] {index + 1}/{processes}: {result['ratio']:.3f} [{result['low']:.3f}, {result['high']:.3f}] "
            f"({result['blocks']} blocks, {result['stop']}, +-{result['half_width']:.1%})")
    first = results[0]
    figures = spread_statistics([r["ratio"] for r in results], [r["half_width"] for r in results])
    path = out or record_path(first["device"], first["threads"], first["setting"])
    record = SpreadRecord(device=first["device"], threads=first["threads"], setting=first["setting"],
                          torch=first["torch"], timm=first["timm"], date=datetime.now(UTC).isoformat(),
                          over_s=over_s, seconds=clock() - start, pair=asdict(spec), processes=results,
                          path=str(path), **figures)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(record.as_json())
    except OSError as err:
        raise InputError(f"--out {path}: cannot write the record there ({err.strerror}); give a file path in a "
                         "writable folder") from None
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.spread", description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", required=True, help="the pair as JSON (PairSpec's fields)")
    args = parser.parse_args(argv)
    print(json.dumps(measure_pair(PairSpec(**json.loads(args.one)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
