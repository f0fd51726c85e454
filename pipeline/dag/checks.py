"""What ``pipeline run --plan`` refuses, or warns about, without running anything (as ``terraform plan`` does):
every stage's config made and validated, the K-search targets, the learning rates, the data paths and each
training's global batch against the training set, and the resources against the cluster the run would connect
to. Each failure is one line, before any stage runs; ``pipeline run`` makes the same checks before its first.

The config's own validation comes first (``pipeline.config``): what one section or the experiment section can
refuse alone, it refuses at load. docs/usage.md lists what is refused and what is warned about.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError, PrepareItem
from pipeline.config.recipe import TYPICAL_LR
from pipeline.dag.plan import (
    Stage,
    archs,
    auto_method,
    auto_tables,
    base_stage,
    check_targets,
    finetune_stage,
    found,
    ksearch_stages,
    paper_levels,
)
from pipeline.errors import InputError, MissingFileError, PipelineWarning
from pipeline.methods import GRID_CONV, KEEP_ALL
from pipeline.spread import check_tie_margin
from pipeline.train.launch import check_batch_fits, check_fits, connect_ray


def plan_checks(config: Config, address: str | None = None) -> list[Stage]:
    """Every check that needs no stage to run, the cheapest first (the data's: no torch to import) and the cluster
    last (it may connect to one); returns the training stages it made (a finetune a method, with its level's keep
    list left open)."""
    check_data_plan(config)
    check_paper_levels(config)
    check_model_families(config)
    stages = training_stages(config)
    check_given_bases(config)
    check_latency_with_qk_norm(config)
    check_operators(config)
    check_auto_tables(config, address)
    check_targets(config)
    warn_learning_rates(config)
    check_cluster(config, stages, address)
    return stages


def check_model_families(config: Config) -> None:
    """Every arch's model is one the downsampling step runs in (``models.families``: its family, its blocks, and a
    forward that calls ``model.blocks``), built on the meta device, and every planned method one its position terms
    can follow; refused in one line."""
    from pipeline.models.factory import ARCH_OVERRIDES
    from pipeline.models.families import check_method

    for arch in archs(config):
        model_config = base_stage(config, arch).config.model
        overrides = tuple((key, getattr(model_config, key)) for key in ARCH_OVERRIDES)
        try:
            model, adapter = _decided_model(model_config.name, overrides)
        except InputError as err:
            raise ConfigError(f"model: {err}") from None
        for method in planned_methods(config):
            try:
                check_method(model, adapter, method)
            except InputError as err:
                raise ConfigError(f"experiment.methods: {err}") from None


@functools.lru_cache(maxsize=32)
def _decided_model(name: str, overrides: tuple[tuple[str, Any], ...]) -> tuple[Any, Any]:
    """(the model ``name`` with these architecture overrides, on the meta device, and its block adapter), once a
    process: what the family decision reads depends on nothing else of the config, and a plan is made again and
    again by the tests and a sweep's driver (a DeiT-S on the meta device takes 0.3 s, timm's weight init)."""
    import torch

    from pipeline.models.factory import create_model
    from pipeline.models.families import block_adapter

    with torch.device("meta"):
        model = create_model(name, **{key: value for key, value in overrides if value is not None})
    return model, block_adapter(model)


def check_paper_levels(config: Config) -> None:
    """Each model has the paper's keep list at each ``experiment.levels`` level (configs/sparsity/), read as the
    run reads it before its first stage (``runner.check_experiment``): DeiT-Ti, whose keep lists the paper does not
    print, is refused by the plan as by the run, in the same line."""
    if config.experiment.levels is not None:
        for arch in archs(config):
            paper_levels(config, arch)


def check_given_bases(config: Config) -> None:
    """Each ``experiment.base_checkpoints`` entry was trained as its base stage's model (``train.build.arch_signature``:
    normalised queries and keys, widths, depth, heads, patches, classes), which its K search and finetunes continue;
    refused in one line naming the entry, before anything runs."""
    given = [(arch, config.experiment.base_checkpoints[arch.label]) for arch in archs(config)
             if arch.label in config.experiment.base_checkpoints]
    if not given:
        return
    import torch  # here: `run --plan` imports torch only to read a given checkpoint

    from pipeline.train.build import arch_signature, build_model
    from pipeline.train.checkpoint import CheckpointError, check_architecture, load_init

    for arch, path in given:
        with torch.device("meta"):  # the shapes and settings only
            model = build_model(base_stage(config, arch).config)
        try:
            check_architecture(load_init(path), arch_signature(model), path)
        except CheckpointError as err:
            raise ConfigError(f"experiment.base_checkpoints.{arch.label}: {err}") from None


def check_latency_with_qk_norm(config: Config) -> None:
    """A latency target with ``model.qk_norm`` is refused in one line: the latency tables (``pipeline bench blocks``,
    ``table: auto``) time blocks with timm's own attention, not normalised queries and keys."""
    if config.model.qk_norm is None:
        return
    for target in config.experiment.ksearch_targets or []:
        if target.cost == "latency":
            raise ConfigError(f"experiment.ksearch_targets {target.label}: cost: latency reads a table of blocks timed "
                              f"with timm's attention, and model.qk_norm is {config.model.qk_norm}; give the target "
                              "cost: gflops, or leave model.qk_norm unset")


def planned_methods(config: Config) -> list[str]:
    """The methods an experiment finetunes: its methods, then those its K-search targets name."""
    exp = config.experiment
    conv = [GRID_CONV] if exp.conv is not None else []
    return list(dict.fromkeys([*exp.methods, *(m for t in exp.ksearch_targets or [] for m in t.methods or []), *conv]))


def check_operators(config: Config) -> None:
    """Each planned method's operator runs with the options the config gives it (``models.probe``), on a tiny model:
    a spec that declares an option its operator does not take fails here, not at a Ray worker's first forward."""
    from pipeline.models.probe import probe_method

    for method in planned_methods(config):
        try:
            probe_method(method, config.pooling.method_options(method))
        except InputError as err:
            raise ConfigError(f"experiment.methods: {err}") from None


def cluster_address(config: Config, address: str | None) -> str | None:
    """The Ray cluster a run uses: ``--address``, else ``train.address``, else ``RAY_ADDRESS``; None for a local Ray."""
    return address or config.train.address or os.environ.get("RAY_ADDRESS")


def check_auto_tables(config: Config, address: str | None) -> None:
    """A ``table: auto`` target on a cluster is refused: its table is this machine's (the driver's device, under its
    runs folder), while the K search's trials, the check and the evaluations run on the cluster's nodes."""
    address = cluster_address(config, address)
    found = auto_tables(config)
    if found and address is not None:
        raise InputError(f"experiment.ksearch_targets {found[0][0].label}: table: auto measures the driver's own "
                         f"device, but this run uses the Ray cluster at {address}, whose nodes train and evaluate; "
                         "measure a table on an evaluation node (`pipeline bench blocks`, on shared storage) and give "
                         "its path")


def unmeasured_targets(config: Config) -> list[str]:
    """A line for each ``table: auto`` target whose table this machine has not measured (or that does not load): the
    plan cannot check it against its cheapest keep list, which `pipeline run` does once it has measured the table,
    before any K search starts (``check_targets`` after ``dag.latency.prepare_tables``)."""
    from pipeline.cost import table_loads  # here: these import torch
    from pipeline.dag.tables import auto_table

    lines = []
    for target, arch in auto_tables(config):
        path = auto_table(config, arch, auto_method(target))[1]
        if not table_loads(path):
            lines.append(f"experiment.ksearch_targets {target.label} ({arch.label}): table: auto is not measured on "
                         f"this machine yet ({path}): `pipeline run` measures it first, then checks the target "
                         "against it (one below the cheapest keep list the table allows is refused then, before any K "
                         "search starts)")
    return lines


def training_stages(config: Config) -> list[Stage]:
    """The base, K-search and finetune stages of every arch, each config validated (``plan._with``): a finetune per
    method, the baseline's too, with no keep list (a K search's list is known only once it ran)."""
    exp = config.experiment
    methods = planned_methods(config)
    stages: list[Stage] = []
    for arch in archs(config):
        base = base_stage(config, arch)
        stages += [base, *ksearch_stages(config, arch, base)]
        stages += [finetune_stage(config, arch, base, method, "plan", None, []) for method in methods]
        if exp.baseline:
            stages.append(finetune_stage(config, arch, base, KEEP_ALL, "full", None, []))
    return stages


def warn_learning_rates(config: Config) -> None:
    """A warning for a learning rate two orders of magnitude outside what timm's and DeiT's recipes use: a run at
    1e30 diverges at its first step, one at 1e-9 learns nothing; neither is refused (a study may want one)."""
    low, high = TYPICAL_LR
    given = {"recipe.lr": config.recipe.lr}
    given |= {f"experiment.{stage}.lr": getattr(config.experiment, stage).lr
              for stage in ("base", "ksearch", "finetune")}
    for key, lr in given.items():
        if lr is not None and not low <= lr <= high:
            warnings.warn(f"{key}={lr:g} is outside {low:g} to {high:g}, two orders of magnitude beyond the learning "
                          "rates of timm's and DeiT's recipes (about 1e-4 to 0.5): the training will likely diverge "
                          "or not learn", PipelineWarning, stacklevel=2)


def _prepared(config: Config, path: str) -> PrepareItem | None:
    resolved = Path(path).resolve()
    return next((item for item in config.experiment.prepare if Path(item.out).resolve() == resolved), None)


def training_images(config: Config) -> tuple[int | None, str]:
    """The training set's image count where the plan can know it: its metadata, else the limit of the
    ``experiment.prepare`` item that writes it; and where it came from."""
    from pipeline.data.write import metadata_path  # FFCV's writer: only its path helper, and only here

    path = config.data.train
    meta = metadata_path(path)
    if config.data.loader == "ffcv" and found(str(meta)):
        return int(json.loads(meta.read_text())["num_images"]), path
    item = _prepared(config, path)
    if item is not None and item.limit is not None:
        return item.limit, f"{path} (experiment.prepare writes {item.limit} images of {item.source})"
    return None, path


def check_data_plan(config: Config) -> None:
    """Both data paths are set and exist, or an ``experiment.prepare`` item writes them; each training's global
    batch (the bases' ``train.workers``, the trials' ``experiment.search.trial_workers``, a base sweep's
    ``data.batch_size`` values) fits the training set where its size is known."""
    exp = config.experiment
    for split in ("train", "val"):
        path = getattr(config.data, split)
        if path is None:
            raise ConfigError(f"data.{split} is not set; write a dataset with `python -m pipeline data write`, or "
                              "add an experiment.prepare item")
        if not found(path, folder=config.data.loader == "torch") and _prepared(config, path) is None:
            raise MissingFileError(f"data.{split}: {path} does not exist and no experiment.prepare item writes it; "
                                   "write it with `python -m pipeline data write`, or add one")
    images, source = training_images(config)
    if images is None:
        return
    sweep = exp.base.sweep.space.get("data.batch_size") if exp.base.sweep is not None else None
    for batch in [config.data.batch_size, *([] if sweep is None else sweep.values())]:
        key = "data.batch_size" if batch == config.data.batch_size else "experiment.base.sweep.space.data.batch_size"
        if len(exp.base_checkpoints) < len(archs(config)):  # a base to train
            world = config.train.workers if exp.base.sweep is None else 0
            check_batch_fits(config, images, source, workers_key="train.workers", world=world, batch=batch,
                             batch_key=key)
    check_batch_fits(config, images, source, workers_key="experiment.search.trial_workers",
                     world=exp.search.trial_workers)


def local_resources(gpus: bool) -> dict[str, float]:
    """What a local Ray would have here: the CPUs this process may run on, and the CUDA devices (``gpus``:
    counted only when a stage asks for one)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not gpus:
        return {"CPU": float(cpus)}
    import torch

    return {"CPU": float(cpus), "GPU": float(torch.cuda.device_count())}


def check_cluster(config: Config, stages: list[Stage], address: str | None) -> None:
    """Each training's workers, each sweep trial and each evaluation fit the cluster the run would use: the one
    at ``address`` (or ``train.address``, ``RAY_ADDRESS``), connected to, else this machine as a local Ray."""
    address = cluster_address(config, address)
    exp = config.experiment
    if address is not None:
        import ray

        connect_ray(address)
        resources, nodes = ray.cluster_resources(), sum(1 for node in ray.nodes() if node["Alive"])
        cluster = f"the Ray cluster at {address}"
    else:
        wants_gpu = exp.eval.device == "cuda" or any(s.config.train.use_gpu for s in stages)
        resources, nodes, cluster = local_resources(wants_gpu), 1, "this machine (a local Ray)"
    for stage in stages:
        train = stage.config.train
        if stage.meta.given is not None or (stage.kind == "base" and train.workers == 0 and exp.base.sweep is None):
            continue  # nothing to train, or trained in this process
        if train.workers > 0:
            check_fits(train, resources, nodes, cluster)
            continue
        gpus = 1.0 if stage.kind == "base" and train.use_gpu else exp.search.trial_gpus
        if resources.get("CPU", 0) < train.cpus_per_worker or resources.get("GPU", 0) < gpus:
            raise ConfigError(f"a {stage.kind} trial takes {train.cpus_per_worker:g} CPU(s) and {gpus:g} GPU(s) "
                              "(experiment.search.trial_cpus, trial_gpus) but "
                              f"{cluster} has {resources.get('CPU', 0):g} and {resources.get('GPU', 0):g}; Tune would "
                              "wait for them forever: lower them")
    if exp.eval.device == "cuda" and resources.get("GPU", 0) < 1:
        raise ConfigError(f"experiment.eval.device=cuda but {cluster} has no GPU; use device auto or cpu, or "
                          "connect to a GPU cluster (--address)")
    if exp.select.tie_margin == "machine":  # on the device the evaluate stage will pick (``dag.stages.eval_task``)
        auto = exp.eval.device == "auto"
        gpus = (local_resources(True) if auto and address is None else resources).get("GPU", 0)
        gpu = exp.eval.device == "cuda" or auto and gpus > 0
        check_tie_margin(config, "cuda" if gpu else "cpu", here=address is None)
