"""What decides a training's result: the part of a config that names it. A DAG stage's id hashes it
(``pipeline.dag.plan``), and ``pipeline train`` resumes a run only under the same one (``run_identity``)."""

from __future__ import annotations

from typing import Any

from pipeline.config.root import Config
from pipeline.methods import method_spec, plugin_of

# Bumped when what an identity hashes changes its meaning: every stage id, experiment id and run identity
# hashes it, so stages recorded under another version are never taken for this one's, and a store that holds
# them is refused (``pipeline.dag.records.check_identity_version``).
IDENTITY_VERSION = 2
# Where a stage reads its result from; excluded from the identity.
VOLATILE = {("train", "name"), ("train", "init"), ("train", "parent_run_id"), ("train", "tags"),
            ("train", "tracking_uri"), ("train", "address"), ("train", "storage_path"), ("train", "artifact_root"),
            ("train", "progress_bar")}
# How a stage runs, not what it learns: the same function either way; excluded from the identity too.
EXECUTION_ONLY = {("train", "compile"), ("train", "log_every"), ("model", "patch_embed")}


def identity_content(config: Config) -> dict[str, Any]:
    """What decides a training stage's result: the resolved config without where results go, without
    the benchmark sections, the kernel choice and execution-only settings (``train.compile``,
    ``model.patch_embed``), and with the pooling section only for finetunes (the method, its resolved options
    and, for a plugin's method, that plugin's distribution and version) and for K searches toward GFLOPs (the
    options of the target's method that change its count)."""
    content = config.model_dump(mode="json")
    for section, key in VOLATILE | EXECUTION_ONLY:
        content.get(section, {}).pop(key, None)
    # ``kernels`` changes how a training runs, not what it learns (the device self-check holds each kernel to
    # the torch path), so training identities leave it out; an evaluation's identity names it (``dag.plan``).
    for section in ("experiment", "bench", "bench_throughput", "bench_loop", "kernels"):
        content.pop(section, None)
    if config.model.qk_norm is None:  # unset, the model's normalisation leaves every id as it was before it existed
        for key in ("qk_norm", "alpha"):
            content["model"].pop(key)
    target = content.get("train", {}).get("ksearch_target")
    if target and target.get("table_sha256"):  # a table enters by its content, not its path
        target.pop("table")
    pool = config.pooling
    if config.train.mode == "finetune":
        # qk_norm and alpha were the pooling section's before they were the model's: named here still, so that a
        # finetune's id stays what it was
        content["pooling"] = {"method": pool.method, "keep": pool.keep, "level": pool.level, "carry": pool.carry,
                              "qk_norm": config.model.qk_norm, "alpha": config.model.alpha,
                              "options": pool.method_options()}
        plugin = plugin_of(pool.method)
        if plugin is not None:  # another release of the plugin is another result; the pipeline's own is not
            content["pooling"]["plugin"] = {"distribution": plugin.distribution, "version": plugin.version}
    elif config.train.mode == "ksearch" and config.train.ksearch_target is not None \
            and config.train.ksearch_target.cost == "gflops":
        method = config.train.ksearch_target.method
        content["pooling"] = {"counted": method_spec(method).counted(pool.method_options(method))}
    else:
        content.pop("pooling", None)
    return {"identity_version": IDENTITY_VERSION, **content}


# How a single ``pipeline train`` run is run, beyond EXECUTION_ONLY: faults it injects, restarts it survives,
# checkpoints it keeps, where its workers sit and which MLflow experiment it logs to may change between
# reruns, and so may the epochs (more epochs continue the run). ``train.init`` is part of it: a DAG stage
# has it in its upstream ids instead.
RUN_EXECUTION = {("train", "debug_fail_at_step"), ("train", "debug_pause_at_step"), ("train", "debug_pause_s"),
                 ("train", "max_failures"), ("train", "keep_checkpoints"), ("train", "placement"),
                 ("train", "cpus_per_worker"), ("train", "checkpoint_artifact_mb"), ("train", "experiment"),
                 ("recipe", "epochs")}


def run_identity(config: Config) -> dict[str, Any]:
    """The identity of a ``pipeline train`` run: ``identity_content`` without ``RUN_EXECUTION``, with ``train.init``."""
    content = identity_content(config)
    for section, key in RUN_EXECUTION:
        content.get(section, {}).pop(key, None)
    content.setdefault("train", {})["init"] = config.train.init
    return content


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``KEY: RECORDED -> CURRENT`` for every dotted key whose values differ (``<absent>`` where only one holds
    it): a record of another ``IDENTITY_VERSION`` shows that first."""
    old, new = _flat(recorded), _flat(current)
    keys = sorted(old.keys() | new.keys(), key=lambda key: (key != "identity_version", key))
    absent = "<absent>"
    return [f"{key}: {old.get(key, absent)!r} -> {new.get(key, absent)!r}" for key in keys
            if old.get(key, absent) != new.get(key, absent)]
