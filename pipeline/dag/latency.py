"""Measuring a keep list against a latency table where this process matches the table's key (the select stage)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial

import torch

from pipeline.bench.paired import SpeedSettings
from pipeline.config.experiment import SelectConfig
from pipeline.cost import CostModel, key_differences, table_loads
from pipeline.dag.plan import auto_method, auto_tables
from pipeline.errors import InputError
from pipeline.train.checkpoint import load_checkpoint


def measure_on_table(table: CostModel, keep: list[int], log: Callable[[str], None] = print,
                     speed: SpeedSettings | None = None):
    """The table's model and method at ``keep`` timed against the unmodified model, paired at the table's setting
    (``bench.latency.measure_lists``: a ``bench.paired.SpeedRatio``, the ratio with its 95% interval), and how it
    was measured; None and why when this process is not what the table's key says (device, threads against the
    usable cores, versions, kernels): the figure would not be comparable. ``speed``: how the pair is measured
    (default ``CHECK_SPEED``, a run's ``check_speed`` at its config's cap)."""
    from pipeline.bench.blocks import check_threads, measured_key, settings_from_key, table_key
    from pipeline.bench.latency import measure_lists

    settings = settings_from_key(table.key)
    if settings.device == "cuda" and not torch.cuda.is_available():
        return None, "predicted (the table is a CUDA one; no CUDA device here)"
    try:
        check_threads(settings.threads)
    except InputError as err:
        return None, f"predicted ({err})"
    threads = torch.get_num_threads()
    if settings.threads is not None:  # a setting of this process, not of the machine: take the table's
        torch.set_num_threads(settings.threads)
    try:
        torch.manual_seed(0)
        device = torch.device(settings.device)
        base = settings.model.build(kernels=settings.kernels).to(device)
        differences = key_differences(measured_key(table), table_key(settings, base, device))
        if differences:
            return None, f"predicted (this machine is not the table's key: {'; '.join(differences)})"
        (row,) = measure_lists(settings, [("target", keep)], table, base, device, log, speed or CHECK_SPEED)
    finally:
        torch.set_num_threads(threads)
    ratio = row.speed
    return ratio, (f"measured (paired against the unmodified model: {ratio.ratio:.3f} [{ratio.low:.3f}, "
                   f"{ratio.high:.3f}], {ratio.label()}; the unmodified model {ratio.reference_s * 1e3:.3f} ms)")


def check_speed(cap_s: float) -> SpeedSettings:
    """A keep list's check against its table: to a 2% interval, within ``cap_s`` of pilot and blocks
    (``experiment.select.check_cap_s``: the check and the select stage's target rows time tables' models of
    milliseconds, which reach the interval in seconds)."""
    return SpeedSettings(cap_s=cap_s, cap_key="experiment.select.check_cap_s")


CHECK_SPEED = check_speed(SelectConfig().check_cap_s)  # where no config is at hand: its default


REPAIR_TAG = "pipeline.target_check"  # on a latency K search's run: the check's Repair as JSON


def retention_weights(checkpoint: str) -> list[torch.Tensor]:
    """A K search's learned retention weights, block by block, from its checkpoint: L x (N,), clamped to [0, 1]."""

    state = load_checkpoint(checkpoint)["model"]
    found = {key: value for key, value in state.items() if key.endswith(".retention")}
    index = {key: int(next(part for part in reversed(key.split(".")[:-1]) if part.isdigit())) for key in found}
    return [found[key].double().clamp(0.0, 1.0) for key in sorted(found, key=index.__getitem__)]


def check_latency_targets(ctx, stages: list, results: dict) -> dict:
    """Each latency K search's keep list measured against its table where this machine is the table's key, and
    repaired if it measures over the target (``targets.repair_keep``), in the driver between the K-search and
    finetune sweeps (no trial shares the cores then). The check is recorded on the K search's run and read back
    on a rerun, so a rerun's finetunes get the same list (a new measurement would be noise on their identity).
    Returns ``results`` with the checked lists."""

    from pipeline.targets import Repair, repair_keep, target_cost_model, target_fraction
    from pipeline.tracking import log_batch
    from pipeline.train.build import build_model

    out = dict(results)
    for stage in stages:
        target, result = stage.config.train.ksearch_target, results[stage.id]
        if target is None or target.cost != "latency":
            continue
        recorded = ctx.client.get_run(result.run_id).data.tags.get(REPAIR_TAG)
        if recorded is not None:
            repair = Repair(**json.loads(recorded))
        else:
            costs = target_cost_model(target, build_model(stage.config))
            speed = check_speed(ctx.config.experiment.select.check_cap_s)
            repair = repair_keep(retention_weights(result.checkpoint), costs, target_fraction(target, costs),
                                 result.keep, partial(measure_on_table, log=lambda _: None, speed=speed))
            metrics = {} if repair.measured is None else {"target_measured": repair.measured}
            log_batch(ctx.client, result.run_id, tags={REPAIR_TAG: json.dumps(asdict(repair))}, metrics=metrics)
        interval = "" if repair.low is None else f" [{repair.low:.3f}, {repair.high:.3f}]"
        if repair.measured is None:
            said = f"{repair.searched} not measured"
        elif repair.keep == repair.searched:
            said = f"{repair.searched} measured {repair.measured:.3f}{interval} of the unmodified model"
        else:
            first = "over the target" if repair.first is None else f"{repair.first:.3f} of the unmodified model"
            said = (f"{repair.searched} measured {first}; repaired to {repair.keep}, measured "
                    f"{repair.measured:.3f}{interval}")
        ctx.log(f"[target] {stage.label}: {said}: {repair.status}")
        out[stage.id] = replace(result, keep=repair.keep)
    return out


def prepare_tables(config, log: Callable[[str], None] = print) -> None:
    """Measures each ``table: auto`` table this machine lacks (``dag.plan.auto_tables``), before the K search reads
    it: one line a table, then ``bench blocks``' progress; a table already measured under its key is kept."""
    from pipeline.bench.blocks import measure_table
    from pipeline.dag.tables import auto_table

    for target, arch in auto_tables(config):
        settings, path = auto_table(config, arch, auto_method(target))
        if table_loads(path):
            continue
        again = " again: the file there does not load as a table of this release" if path.exists() else ""
        log(f"[latency] {target.label} ({arch.label}): measuring this machine's table of {settings.method} "
            f"(table: auto) into {path}{again}")
        threads = torch.get_num_threads()
        try:
            measure_table(settings, path, log=log)
        finally:
            torch.set_num_threads(threads)
