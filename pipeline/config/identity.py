"""What decides a training's result: the part of a config that names it. A DAG stage's id hashes it
(``pipeline.dag.plan``), and ``pipeline train`` resumes a run only under the same one (``run_identity``)."""

from __future__ import annotations

from typing import Any

from pipeline.config.root import Config
from pipeline.methods import COUNTED_OPTIONS, method_spec, plugin_of

# Where a stage reads its result from; excluded from the identity.
VOLATILE = {("train", "name"), ("train", "init"), ("train", "parent_run_id"), ("train", "tags"),
             ("train", "tracking_uri"), ("train", "address"), ("train", "storage_path"), ("train", "artifact_root"),
             ("train", "progress_bar")}
# How a stage runs, not what it learns: the same function either way; excluded from the identity too.
EXECUTION_ONLY = {("train", "compile"), ("train", "log_every"), ("model", "patch_embed")}
# Method options added after stage identities were first recorded, at the value that does what the code
# did before them (each method's default): left out of the identity, so that the stages recorded then
# still count.
ADDED_OPTIONS = {"significance": "eq4"}


def identity_content(config: Config) -> dict[str, Any]:
    """What decides a training stage's result: the resolved config without where results go, without
    the benchmark sections, the kernel choice and execution-only settings (``train.compile``,
    ``model.patch_embed``), and with the pooling section only for finetunes: the method's options where they
    differ from its defaults (an option added at a default that does what the code did before,
    ``ADDED_OPTIONS``, changes no identity) and, for a plugin's method, that plugin's distribution and version."""
    content = config.model_dump(mode="json")
    for section, key in VOLATILE | EXECUTION_ONLY:
        content.get(section, {}).pop(key, None)
    # ``kernels`` changes how a training runs, not what it learns (the device self-check holds each kernel to
    # the torch path), so training identities leave it out; an evaluation's identity names it (``dag.plan``).
    for section in ("experiment", "bench", "bench_throughput", "bench_loop", "kernels"):
        content.pop(section, None)
    _target_identity(content.get("train", {}))
    pool = config.pooling
    if config.train.mode == "finetune":
        defaults = method_spec(pool.method).options
        options = {key: value for key, value in pool.method_options().items() if value != defaults.get(key)}
        content["pooling"] = {"method": pool.method, "keep": pool.keep, "level": pool.level, "carry": pool.carry,
                              "qk_norm": pool.qk_norm, "alpha": pool.alpha, "options": options}
        plugin = plugin_of(pool.method)
        if plugin is not None:  # another release of the plugin is another result; the pipeline's own is not
            content["pooling"]["plugin"] = {"distribution": plugin.distribution, "version": plugin.version}
    elif config.train.mode == "ksearch" and config.train.ksearch_target is not None:
        content["pooling"] = _counted_options(config)
        if not content["pooling"]:  # the method's defaults: the identity is what it was before
            content.pop("pooling")
    else:
        content.pop("pooling", None)
    return content


def _counted_options(config: Config) -> dict[str, Any]:
    """The options of a GFLOPs target's method that change its count (``methods.COUNTED_OPTIONS``) where they
    differ from the method's defaults: a K search toward ``cluster_on: metric``'s count searches toward another
    cost than one toward the tokens'."""
    target = config.train.ksearch_target
    if target.cost != "gflops":
        return {}
    defaults = method_spec(target.method).options
    given = config.pooling.method_options(target.method)
    return {key: given[key] for key in COUNTED_OPTIONS if key in given and given[key] != defaults.get(key)}


def _target_identity(train: dict[str, Any]) -> None:
    """A K-search target enters the identity by its table's content, not its path; no target (the default,
    and every stage recorded before targets existed) leaves the identity as it was, and so does a target
    without a ``name`` (added later)."""
    target = train.get("ksearch_target", "absent")
    if target is None:
        train.pop("ksearch_target")
    elif isinstance(target, dict):
        if target.get("name", "absent") is None:
            target.pop("name")
        if target.get("table_sha256"):
            target.pop("table")


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
    """``KEY: RECORDED -> CURRENT`` for every dotted key both hold with different values (a key only one of
    them holds comes from another release's schema and is left out)."""
    old, new = _flat(recorded), _flat(current)
    return [f"{key}: {old[key]!r} -> {new[key]!r}" for key in sorted(old.keys() & new.keys()) if old[key] != new[key]]
