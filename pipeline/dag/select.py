"""The select stage: Pareto fronts, the best-at-budget table, the report, and the Model Registry."""

from __future__ import annotations

from typing import Any

from pipeline.dag.plan import Stage
from pipeline.dag.types import EvalResult, TrainedResult
from pipeline.report import COST_LABELS, fronts, markdown_table, write_report


def result_rows(ft_stages: list[Stage], ft_results: dict[str, TrainedResult],
                evaluations: dict[str, EvalResult]) -> list[dict[str, Any]]:
    """One row per finetuned model: what the report and the registry need (the results.csv columns)."""
    rows = []
    for stage in ft_stages:
        trained, measured = ft_results[stage.id], evaluations[stage.id]
        rows.append({"arch": stage.arch, "level": stage.meta.level, "method": stage.meta.method,
                     "keep": trained.keep, "gflops": measured.gflops, "top1": measured.top1,
                     "images_per_s": measured.images_per_s, "train_top1": trained.val_top1,
                     "checkpoint": trained.checkpoint, "stage_id": stage.id, "run_id": trained.run_id,
                     "analysis": measured.analysis,
                     "speed_setting": f"{measured.device} {measured.dtype} compile:{measured.compile}"})
    return rows


def register_front(ctx, front: list[dict[str, Any]]) -> list[str]:
    """Registers each Pareto-optimal model (its logged weights) with aliases ``pareto-1..n`` and ``best``."""
    from mlflow.exceptions import MlflowException

    client, name = ctx.client, f"token-pooling-{ctx.config.experiment.name}"
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Pareto-optimal models of `pipeline run`")
    versions = {v.run_id: v.version for v in client.search_model_versions(f"name = '{name}'")}
    aliases = []
    best = max(front, key=lambda r: r["top1"])
    for index, row in enumerate(front, 1):
        version = versions.get(row["run_id"])
        if version is None:  # idempotent: a rerun does not register the same run twice
            version = client.create_model_version(name, f"runs:/{row['run_id']}/checkpoint", run_id=row["run_id"],
                                                  tags={"method": row["method"], "level": row["level"],
                                                        "arch": row["arch"], "gflops": f"{row['gflops']:.4f}",
                                                        "top1": f"{row['top1']:.2f}"}).version
        client.set_registered_model_alias(name, f"pareto-{index}", version)
        aliases.append(f"{name}@pareto-{index}")
        if row is best:
            client.set_registered_model_alias(name, "best", version)
    return aliases


def run_select(ctx, ft_stages: list[Stage], ft_results: dict[str, TrainedResult],
               evaluations: dict[str, EvalResult]) -> dict[str, Any]:
    exp = ctx.config.experiment
    rows = result_rows(ft_stages, ft_results, evaluations)
    files = write_report(rows, ctx.out_dir, exp.budgets, title=f"Experiment {exp.name}")
    for path in files.values():
        ctx.client.log_artifact(ctx.parent, str(path), artifact_path="report")
    front = fronts(rows, exp.select.cost)["all"]
    aliases = register_front(ctx, front) if exp.register_models else []
    table = markdown_table(front, ["arch", "level", "method", "gflops", "top1", "images_per_s"])
    ctx.log(f"\nPareto front ({COST_LABELS[exp.select.cost]}, top-1 higher):\n" + table)
    ctx.log(f"\nreport:  {files['report'].resolve()}")
    plots = ("tradeoff_plot", "speed_plot", "width_plot", "keep_plot")
    ctx.log(f"plots:   {', '.join(str(files[k].resolve()) for k in plots)}")
    ctx.log(f"mlflow:  {ctx.config.train.tracking_uri} (experiment {ctx.config.train.experiment!r}, "
            f"parent run {ctx.parent}); `mlflow ui --backend-store-uri {ctx.config.train.tracking_uri}`")
    if aliases:
        ctx.log(f"registry: {', '.join(aliases)}")
    return {"rows": rows, "front": front, "files": {k: str(v) for k, v in files.items()}, "aliases": aliases,
            "parent_run_id": ctx.parent}
