"""Measuring a keep list against a latency table where this process matches the table's key (the select stage)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.cost import CostModel, key_differences


def measure_on_table(table: CostModel, keep: list[int], log: Callable[[str], None] = print
                     ) -> tuple[float | None, str]:
    """The measured time of the table's model and method at ``keep`` over the unmodified model's, paired at the
    table's setting (``bench.latency.measure_lists``), with how it was measured; None and why when this process
    is not what the table's key says (device, threads, versions, kernels): the figure would not be comparable."""
    from pipeline.bench.blocks import measured_key, settings_from_key, table_key
    from pipeline.bench.latency import measure_lists

    settings = settings_from_key(table.key, warmup=2, repeats=7)
    if settings.device == "cuda" and not torch.cuda.is_available():
        return None, "predicted (the table is a CUDA one; no CUDA device here)"
    threads = torch.get_num_threads()
    if settings.threads is not None:  # a setting of this process, not of the machine: take the table's
        torch.set_num_threads(settings.threads)
    try:
        torch.manual_seed(0)
        device = torch.device(settings.device)
        base = settings.model.build().to(device)
        differences = key_differences(measured_key(table), table_key(settings, base, device))
        if differences:
            return None, f"predicted (this machine is not the table's key: {'; '.join(differences)})"
        (row,) = measure_lists(settings, [("target", keep)], table, base, device, log)
    finally:
        torch.set_num_threads(threads)
    return row.measured, f"measured (paired against the unmodified model, IQR {row.iqr:.3f} of the ratio)"
