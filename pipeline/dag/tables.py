"""``table: auto``: this machine's latency table of a K-search target's method, in the evaluate stage's setting, and
where it is kept (``dag.plan.target_table`` names it, ``dag.latency.prepare_tables`` measures it)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from pipeline.bench.blocks import BlocksSettings, ModelSpec, check_threads, table_key
from pipeline.evaluate import resolve_setting
from pipeline.runtime import KernelChoice


@functools.lru_cache(maxsize=64)
def meta_model(spec: ModelSpec, kernels: KernelChoice | None) -> nn.Module:
    """The model of ``spec`` on the meta device (its shapes, for a table's key), built once a process: a plan reads
    it for every table of every arch and method, and the tests and a sweep's driver plan again and again. Read only."""
    with torch.device("meta"):
        return spec.build() if kernels is None else spec.build(kernels=kernels)


def auto_settings(config, arch, method: str):
    """``bench.blocks.BlocksSettings`` of this machine's table for ``arch`` (``dag.plan.Arch``) and ``method`` in the
    evaluate stage's setting (its device, dtype, compile mode, batch and threads, as a local run resolves them; the
    thread's CPU clock at one thread; the cells the fixed part comes from to its speed tolerance, under its speed cap),
    with the config's method options and kernel choice. The grid: multiples of 8 tokens (and the powers of two below)
    up to 64 tokens, as the demo's shipped tables; multiples of 32 above (DeiT-S's 196: 8 points, not 26)."""
    model, ev = config.model.model_copy(update=arch.overrides), config.experiment.eval  # the arch's base model
    device, dtype, mode = resolve_setting(ev.device, ev.dtype, ev.compile, torch.cuda.is_available())
    spec = ModelSpec(name=model.name, img_size=model.img_size, patch_size=model.patch_size, embed_dim=model.embed_dim,
                     depth=model.depth, num_heads=model.num_heads, num_classes=config.data.num_classes,
                     patch_embed=model.patch_embed)
    tokens = meta_model(spec, None).patch_embed.num_patches
    return BlocksSettings(model=spec, method=method, options=config.pooling.method_options(method), batch=ev.batch,
                          dtype=dtype, compile=mode, threads=ev.threads if device == "cpu" else None, device=device,
                          step=8 if tokens <= 64 else 32, anchor_tolerance=ev.speed_tolerance,
                          anchor_cap_s=ev.speed_cap_s, anchor_cap_key="experiment.eval.speed_cap_s",
                          clock="cpu" if device == "cpu" and ev.threads == 1 else "wall",
                          kernels=config.kernels.choice())


def auto_table(config, arch, method: str):
    """(settings, path) of this machine's table for ``arch`` and ``method`` (``auto_settings``): under
    ``experiment.runs_dir``/latency-tables, named by the arch, the method and a digest of the table's key (the device,
    its setting, the versions and the kernels), so that another machine or setting measures a table of its own. The
    key is read off the model built on the meta device (its shapes), at the table's threads."""
    settings = auto_settings(config, arch, method)
    check_threads(settings.threads, "experiment.eval.threads")
    threads = torch.get_num_threads()
    try:
        if settings.threads is not None:  # the key records the threads torch runs, as measure_table sets them
            torch.set_num_threads(settings.threads)
        key = table_key(settings, meta_model(settings.model, settings.kernels), torch.device(settings.device))
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{arch.label}-{method}-{digest}.json"
    # absolute: the K search's Tune trials read it from working folders of their own
    return settings, Path(config.experiment.runs_dir).absolute() / "latency-tables" / name
