"""Running one stage: a training job (base, K search, finetune trial) or an evaluation, recorded in MLflow."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipeline.config import Config
from pipeline.dag.plan import Stage
from pipeline.dag.records import DAG, FINETUNED, STAGE_ID, STAGE_KIND, TRAINED_RUN, find_done, mark_done, open_child
from pipeline.dag.types import EvalResult, StageSpec, Tracking, TrainedResult, from_record
from pipeline.evaluate import evaluate_checkpoint
from pipeline.methods import plugin_of
from pipeline.pareto import relative_half_width
from pipeline.runtime import KernelChoice, peak_memory_mb
from pipeline.tracking import experiment_id, log_batch
from pipeline.train import run_training
from pipeline.train.launch import TIMING


def stage_spec(stage: Stage, *, init: str | None, parent_id: str, dag: str) -> StageSpec:
    """What a Ray task or Tune trial needs to run ``stage``: its config, pointed at its run and inputs."""
    config = None
    if stage.config is not None:
        train = stage.config.train.model_copy(update={
            "name": stage.name, "init": init, "parent_run_id": parent_id,
            "tags": {DAG: dag, STAGE_KIND: stage.kind, STAGE_ID: stage.id}})
        config = stage.config.model_copy(update={"train": train})
    return StageSpec(id=stage.id, kind=stage.kind, label=stage.label, meta=stage.meta, config=config)


def _client(config: Config) -> tuple[MlflowClient, str]:
    client = MlflowClient(tracking_uri=config.train.tracking_uri)
    return client, experiment_id(client, config.train.experiment, config.train.artifact_root)


def trained_done(client: MlflowClient, exp_id: str, stage_id: str) -> TrainedResult | None:
    """The recorded result of a finished training stage, or None."""
    found = find_done(client, exp_id, stage_id)
    return None if found is None else from_record(TrainedResult, *found, skipped=True)


def run_training_spec(spec: StageSpec, log: Callable[[str], None] = print) -> TrainedResult:
    """Trains the stage unless MLflow already records it done; returns its result either way."""

    config = spec.config
    client, exp_id = _client(config)
    done = trained_done(client, exp_id, spec.id)
    if done is not None:
        log(f"[skip] {spec.label}: done in MLflow run {done.run_id}")
        return done
    if spec.meta.given:  # a base checkpoint from the config: recorded as this stage's result, nothing trained
        run_id = open_child(client, exp_id, config.train.parent_run_id, name=spec.label, kind=spec.kind,
                            stage_id=spec.id, dag_id=config.train.tags[DAG])
        result = TrainedResult(run_id=run_id, checkpoint=spec.meta.given)
        mark_done(client, run_id, stage_id=spec.id, kind=spec.kind, result=result.as_record())
        client.set_terminated(run_id, "FINISHED")
        return result
    started = time.perf_counter()
    log(f"[run] {spec.label} ({config.train.mode}, {config.recipe.epochs} epochs)")
    trained = run_training(config)
    result = TrainedResult(run_id=trained.run_id, checkpoint=trained.checkpoint, keep=trained.keep,
                           val_top1=trained.summary["val_top1"], seconds=round(time.perf_counter() - started, 1),
                           test_top1=trained.summary.get("test_top1"))
    mark_done(client, trained.run_id, stage_id=spec.id, kind=spec.kind, result=result.as_record())
    log(f"[done] {spec.label}: val_top1 {result.val_top1:.2f}% in {result.seconds:.0f} s")
    return result


def log_analysis(client: MlflowClient, run_id: str, checkpoint: str, cfg) -> str | None:
    """Cluster maps, redundancy and reconstruction error of one model, as artifacts under ``analysis/``.

    Returns their artifact URI, or None when ``eval.analysis_images`` and ``eval.analysis_batch`` are 0.
    """

    from pipeline.analysis.artifacts import evaluation_artifacts

    if cfg.analysis_images == 0 and cfg.analysis_batch == 0:
        return None
    with tempfile.TemporaryDirectory(prefix="analysis-") as tmp:
        evaluation_artifacts(checkpoint, Path(tmp), images=cfg.analysis_images, batch=cfg.analysis_batch,
                             log=lambda _: None)
        client.log_artifacts(run_id, tmp, artifact_path="analysis")
    return f"{client.get_run(run_id).info.artifact_uri}/analysis"


def run_evaluation_spec(spec: StageSpec, checkpoint: str, tracking: Tracking, cuda: bool = False,
                        trained_run: str | None = None) -> EvalResult:
    """Top-1, GFLOPs and images/s of a finetuned model, or of a base with a method inserted and no training (the
    stage's config is that model: ``experiment.no_finetune``, tagged ``pipeline.finetuned=false``), recorded as a
    child run of the DAG.

    ``cuda``: the task was given a GPU (``eval.device`` auto resolves to it). ``trained_run``: the
    finetune run that produced the model (tag ``pipeline.trained_run``, what ``pipeline select`` follows).
    """

    client = MlflowClient(tracking_uri=tracking.uri)
    exp_id = experiment_id(client, tracking.experiment, tracking.artifact_root)
    done = find_done(client, exp_id, spec.id)
    if done is not None:
        return from_record(EvalResult, *done, skipped=True)
    cfg = spec.meta.eval
    run_id = open_child(client, exp_id, tracking.parent, name=spec.label, kind="evaluate", stage_id=spec.id,
                        dag_id=tracking.dag)
    plugin = None if spec.meta.method is None else plugin_of(spec.meta.method)
    tags = ({} if trained_run is None else {TRAINED_RUN: trained_run}) | ({} if plugin is None else plugin.tags())
    if tags:
        log_batch(client, run_id, tags=tags)
    if not spec.meta.finetuned:  # a base with a method inserted (experiment.no_finetune): its config is the model
        log_batch(client, run_id, tags={FINETUNED: "false"}, params={"carry": spec.meta.carry})
    choice = KernelChoice(**(spec.meta.kernels or {}))
    measured = evaluate_checkpoint(checkpoint, cfg, cuda=cuda, kernels=choice,
                                   model_config=None if spec.meta.finetuned else spec.config)
    setting = {"device": measured.device, "device_name": measured.device_name, "dtype": measured.dtype,
               "compile": measured.compile, "batch": cfg.batch, "threads": cfg.threads,
               "clock": measured.clock}  # the runtime is in the clock where not torch (onnxruntime:cpu)
    kernels = {f"kernels.{key}": value for key, value in choice.as_dict().items()}
    kernels |= {f"kernels_run.{key}": value for key, value in measured.kernels.items()}
    speed = {key: getattr(measured, key) for key in ("speed_ratio", "speed_ratio_low", "speed_ratio_high",
                                                      "speed_blocks", "speed_seconds", "load_before", "load_after")}
    speed["speed_half_width"] = relative_half_width(measured.speed_ratio, measured.speed_ratio_low,
                                                    measured.speed_ratio_high)
    log_batch(client, run_id, metrics={"top1": measured.top1, "gflops": measured.gflops,
                                       "images_per_s": measured.images_per_s,
                                       "images_per_s_spread": measured.images_per_s_spread, **speed,
                                       "peak_memory_mb": peak_memory_mb("cuda" if cuda else "cpu")},
              params={"checkpoint": checkpoint, "method": spec.meta.method, "level": spec.meta.level,
                      "speed_stop": measured.speed_stop, **{f"eval_{key}": value for key, value in setting.items()},
                      **kernels})
    analysis = log_analysis(client, run_id, checkpoint, cfg) if spec.meta.finetuned else None  # a base's are its own
    result = EvalResult(run_id=run_id, checkpoint=checkpoint, analysis=analysis, **measured.as_dict())
    mark_done(client, run_id, stage_id=spec.id, kind="evaluate", result=result.as_record())
    client.set_terminated(run_id, "FINISHED")
    return result


def eval_task(config: Config, fn: Callable):
    """``fn`` as a Ray task in the evaluate stage's setting, holding the ``timing`` resource, and whether it gets a
    GPU."""
    import ray

    resources = ray.cluster_resources()
    device = config.experiment.eval.device
    cuda = config.experiment.eval.runtime == "torch" and (
        device == "cuda" or (device == "auto" and resources.get("GPU", 0) > 0))  # onnxruntime times on the CPU
    task = ray.remote(num_cpus=min(config.experiment.eval.cpus, resources.get("CPU", 1)), num_gpus=1 if cuda else 0,
                      resources={TIMING: 1})(fn)
    return task, cuda
