"""The select stage: Pareto fronts, the best-at-budget table, the report, and the Model Registry."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any

from pipeline.dag.plan import Stage, archs, target_table
from pipeline.dag.types import EvalResult, TrainedResult
from pipeline.errors import InputError
from pipeline.report import COST_LABELS, TARGET_COLUMNS, default_budgets, fronts, markdown_table, write_report
from pipeline.serving.server import DEFAULT_STORE
from pipeline.spread import tie_margin, timing_setting


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
                     "analysis": measured.analysis, "speed_ratio": measured.speed_ratio,
                     "speed_ratio_low": measured.speed_ratio_low, "speed_ratio_high": measured.speed_ratio_high,
                     "speed_seconds": measured.speed_seconds, "speed_half_width": measured.speed_half_width,
                     "speed_blocks": measured.speed_blocks, "speed_stop": measured.speed_stop,
                     "speed_setting": f"{measured.device} {measured.dtype} compile:{measured.compile} "
                                      f"clock:{measured.clock}"})
    return rows


def no_finetune_rows(evaluated: list[tuple[Stage, EvalResult]]) -> list[dict[str, Any]]:
    """One row per model evaluated without finetuning (``report.NO_FINETUNE_COLUMNS``): ``keep`` empty for a base's
    unmodified model."""
    rows = []
    for stage, measured in evaluated:
        keep = stage.config.pooling.keep if stage.config.train.mode == "finetune" else None
        rows.append({"arch": stage.arch, "level": stage.meta.level, "method": stage.meta.method,
                     "carry": stage.meta.carry, "keep": ",".join(map(str, keep or [])), "gflops": measured.gflops,
                     "top1": measured.top1, "speed_ratio": measured.speed_ratio,
                     "speed_ratio_low": measured.speed_ratio_low, "speed_ratio_high": measured.speed_ratio_high,
                     "speed_blocks": measured.speed_blocks, "speed_stop": measured.speed_stop,
                     "speed_half_width": measured.speed_half_width, "run_id": measured.run_id})
    return rows


def check_one_clock(evaluations: dict[str, EvalResult]) -> None:
    """InputError where the evaluations' speeds were timed on different clocks (``evaluate.speed_clock``: a thread's
    CPU time, the wall clock, CUDA events), or some on a clock they did not record: their ratios and images/s do not
    compare, and a front drawn across them would rank the clocks, not the models."""
    counts: dict[str, int] = {}
    for evaluation in evaluations.values():
        clock = evaluation.clock or "not recorded"
        counts[clock] = counts.get(clock, 0) + 1
    if len(counts) > 1:
        found = ", ".join(f"{clock}: {n} model(s)" for clock, n in sorted(counts.items()))
        raise InputError(f"the evaluations' speeds were timed on different clocks ({found}), which do not compare: "
                         "time them all in one setting (experiment.eval.threads, experiment.eval.device) with "
                         "`pipeline run CONFIG --force evaluate`")


def check_scale_clock(evaluations: dict[str, EvalResult], scale) -> None:
    """InputError where the select stage's scale (``evaluate.Scale``) was timed on another clock than the evaluations it
    scales (one clock: ``check_one_clock``): the stage times it on whatever device its task gets now, and reused CUDA
    evaluations scaled by a CPU's clock (``eval.device: auto`` on a node without a GPU) would chain ratios of two
    clocks into images/s."""
    clocks = {evaluation.clock for evaluation in evaluations.values()}
    if clocks and clocks != {scale.clock}:
        names = ", ".join(sorted({str(evaluation.device_name) for evaluation in evaluations.values()}))
        raise InputError(f"the select stage's speed scale was timed on the {scale.clock} clock ({scale.device_name}), "
                         f"the evaluations on the {', '.join(sorted(map(str, clocks)))} clock ({names}): their "
                         "ratios do not chain into one scale; run the select stage where the evaluations ran (a "
                         "node with their device, experiment.eval.device), or time them again here with `pipeline "
                         "run CONFIG --force evaluate`")


def measure_scale(ctx, rows: list[dict[str, Any]]):
    """``evaluate.Scale`` of the rows' architectures, measured now (never cached: it is what puts this run's
    models on one scale) in a Ray task that holds the ``timing`` resource, as every evaluation does."""
    import ray

    from pipeline.dag.stages import eval_task

    checkpoints = {}
    for row in rows:
        checkpoints.setdefault(row["arch"], row["checkpoint"])
    task, cuda = eval_task(ctx.config, reference_scale_task)
    scale = ray.get(task.remote(checkpoints, ctx.config.experiment.eval, cuda, ctx.config.kernels.choice()))
    check, spent = scale.self_check, sum(r.get("speed_seconds") or 0.0 for r in rows)
    ctx.log(f"[select] the evaluations' paired speed measurements took {spent:.0f} s in all; half-widths "
            f"{_spread([r['speed_half_width'] for r in rows])}")
    ctx.log(f"[select] speed scale: {scale.anchor}'s unmodified model {scale.anchor_images_per_s:.0f} img/s; against "
            f"itself {check.ratio:.3f} [{check.low:.3f}, {check.high:.3f}]"
            + "".join(f"; {arch} {r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}] of it"
                      for arch, r in scale.references.items() if arch != scale.anchor))
    return scale


def self_check_warning(check) -> str | None:
    """Why the run's speeds are in doubt, where the unmodified model timed against itself (``evaluate.Scale``'s
    ``self_check``, a ``SpeedRatio``) has an interval that excludes 1; None where it covers 1."""
    if check.covers(1.0):
        return None
    return (f"the unmodified model timed against itself measured {check.ratio:.3f} [{check.low:.3f}, "
            f"{check.high:.3f}], an interval without 1: the machine's speed moved within the measurements, so this "
            "run's speed ratios and images/s may be off by as much; measure again on a quieter machine "
            "(`pipeline run CONFIG --force evaluate`)")


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"median {ordered[len(ordered) // 2]:.1%}, widest {ordered[-1]:.1%}"


def reference_scale_task(checkpoints, cfg, cuda, kernels):
    from pipeline.evaluate import reference_scale

    return reference_scale(checkpoints, cfg, cuda=cuda, kernels=kernels)


def on_scale(rows: list[dict[str, Any]], scale) -> list[dict[str, Any]]:
    """The rows with images/s and its interval on ``scale``."""
    out = []
    for row in rows:
        rate, low, high = scale.images_per_s(row["arch"], row["speed_ratio"], row["speed_ratio_low"],
                                             row["speed_ratio_high"])
        out.append(row | {"images_per_s": rate, "images_per_s_low": low, "images_per_s_high": high})
    return out


def record_scale(client, rows: list[dict[str, Any]], evaluations: dict[str, EvalResult]) -> None:
    """Each model's images/s on the scale and its interval, on its evaluate run: what ``pipeline select`` reads."""
    from pipeline.dag.records import RATE_HIGH, RATE_LOW, SCALED_RATE
    from pipeline.tracking import log_batch

    for row in rows:
        if row.get("images_per_s_low") is not None:
            log_batch(client, evaluations[row["stage_id"]].run_id, metrics={
                SCALED_RATE: row["images_per_s"], RATE_LOW: row["images_per_s_low"],
                RATE_HIGH: row["images_per_s_high"]})


def search_landed(ctx, stage: Stage) -> float | None:
    """How close the K search upstream of a finetune landed before rounding: its soft keep list's cost ratio
    (``target_landed``), from the search's MLflow run."""
    from pipeline.dag.records import find_done

    found = find_done(ctx.client, ctx.exp_id, stage.upstream[-1]) if len(stage.upstream) > 1 else None
    return None if found is None else ctx.client.get_run(found[1]).data.metrics.get("target_landed")


UNDERSPENT = 0.03  # a rounded list predicted further under its target is flagged in the target table


def target_rows(ctx, ft_stages: list[Stage], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of models finetuned at a K-search target's level, with the target, where the search landed before
    rounding (``searched``, a ratio), the predicted and the measured cost (``pipeline.targets.target_cost``); the
    others are not in it."""

    from pipeline.cost import file_sha256
    from pipeline.dag.latency import check_speed, measure_on_table
    from pipeline.targets import target_cost
    from pipeline.train.build import build_model

    config = ctx.config
    measure = partial(measure_on_table, speed=check_speed(config.experiment.select.check_cap_s))
    targets = {t.label: t for t in config.experiment.ksearch_targets or []}
    out = []
    for stage, row in zip(ft_stages, rows):
        target = targets.get(stage.meta.level)
        if target is None:
            continue
        if target.table is not None:
            arch = next(a for a in archs(config) if a.label == stage.arch)
            target = target.model_copy(update={"table": target_table(ctx.config, target, arch)})
        cost = asdict(target_cost(target, build_model(stage.config), stage.meta.method, row["keep"], row["gflops"],
                                  measure, pooling=config.pooling))
        cost["target_unit"], cost["cost_status"] = cost.pop("unit"), cost.pop("status")
        cost["spent"] = None if cost["predicted"] is None else cost["predicted"] / cost["target_cost"]
        if cost["spent"] is not None and cost["spent"] < 1 - UNDERSPENT:
            cost["cost_status"] = f"UNDER: predicted {1 - cost['spent']:.1%} under the target; " + cost["cost_status"]
        out.append(row | cost | {"table_sha256": None if target.table is None else file_sha256(target.table),
                                 "searched": search_landed(ctx, stage)})
    return out


def record_latency(client, rows: list[dict[str, Any]], evaluations: dict[str, EvalResult]) -> None:
    """The measured latency of each target row on its evaluate run, with its table's hash: what ``pipeline select
    --max-latency-ms`` reads."""
    from pipeline.dag.records import LATENCY_HIGH, LATENCY_METRIC, LATENCY_PREDICTED, LATENCY_TABLE_TAG
    from pipeline.tracking import log_batch

    for row in rows:
        if row["target_unit"] != "ms":
            continue
        metrics = {} if row["predicted"] is None else {LATENCY_PREDICTED: row["predicted"]}
        tags = {LATENCY_TABLE_TAG: row["table_sha256"]}
        if row["measured"] is not None:
            metrics |= {LATENCY_METRIC: row["measured"], LATENCY_HIGH: row["measured_high"],
                        "latency_speed_blocks": row["speed_blocks"],
                        "latency_speed_half_width": row["speed_half_width"]}
            tags["pipeline.latency_speed_stop"] = row["speed_stop"]
        log_batch(client, evaluations[row["stage_id"]].run_id, metrics=metrics, tags=tags)


def target_alias(label: str) -> str:
    """``target-lat0_8``: the most accurate model finetuned at that K-search target's level."""
    return f"target-{label}".replace(".", "_")


def fastest_alias(budget: float) -> str:
    """``fastest-under-1_5-gflops``: MLflow aliases allow letters, digits, ``_`` and ``-`` only."""
    return f"fastest-under-{budget:g}-gflops".replace(".", "_")


def fastest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The most accurate of the models the measurement cannot tell from the fastest: those whose images/s interval
    overlaps the fastest one's (each model its own point where there is no interval)."""
    def end(row: dict[str, Any], which: str) -> float:
        return row[which] if row.get(which) is not None else row["images_per_s"]

    top = max(rows, key=lambda r: (r["images_per_s"], r["top1"]))
    tied = [r for r in rows if end(r, "images_per_s_high") >= end(top, "images_per_s_low")]
    return max(tied, key=lambda r: (r["top1"], r["images_per_s"]))


def registry_picks(rows: list[dict[str, Any]], front: list[dict[str, Any]], budgets: list[float],
                   targeted: list[dict[str, Any]] = ()) -> list[tuple[str, dict[str, Any]]]:
    """(alias, row): ``pareto-1..n`` along the front, ``best`` (its top top-1), for each GFLOPs budget
    the most accurate model whose images/s interval overlaps the fastest one's within it (``fastest``),
    ``fastest-under-<budget>-gflops``, and for each
    K-search target the most accurate model of its level, ``target-<level>`` (``targeted``: ``target_rows``)."""
    picks = {f"pareto-{index}": row for index, row in enumerate(front, 1)}
    picks["best"] = max(front, key=lambda r: r["top1"])
    for budget in budgets:  # budgets that print alike (close default ones) give one alias
        fitting = [r for r in rows if r["gflops"] <= budget]
        if fitting:
            picks[fastest_alias(budget)] = fastest(fitting)
    for level in sorted({r["level"] for r in targeted}):
        picks[target_alias(level)] = max((r for r in targeted if r["level"] == level), key=lambda r: r["top1"])
    return list(picks.items())


def version_tags(row: dict[str, Any]) -> dict[str, str]:
    return {"method": row["method"], "level": row["level"], "arch": row["arch"], "gflops": f"{row['gflops']:.4f}",
            "top1": f"{row['top1']:.2f}", "images_per_s": f"{row['images_per_s']:.1f}",
            "speed_setting": row["speed_setting"], "keep": ",".join(map(str, row["keep"] or []))}


def register_models(ctx, picks: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Registers each picked model as an MLflow model (``pipeline.serving``) under its aliases.

    Idempotent: a rerun reuses the logged model and the version of each run, and moves aliases.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline.export import ExportError
    from pipeline.serving.publish import ONNX_SUFFIX, SERVING, SERVING_TAG, log_model, log_onnx_model

    client, name = ctx.client, f"token-pooling-{ctx.config.experiment.name}"
    mlflow.set_tracking_uri(ctx.config.train.tracking_uri)  # the registry resolves models:/ sources through it
    flavours = [(name, log_model, "mlflow.pyfunc.load_model('models:/NAME@best')", False)]
    if ctx.config.experiment.register_onnx:  # an export and its check a pick: say so, minutes for a front of DeiTs
        flavours.append((name + ONNX_SUFFIX, log_onnx_model, "the same picks exported to ONNX, run in onnxruntime",
                         True))
    aliases = []
    for registered, log, description, exported in flavours:
        try:
            client.get_registered_model(registered)
        except MlflowException:
            client.create_registered_model(registered, description=f"Pareto-optimal models of `pipeline run` "
                                           f"(MLflow models: {description})")
        versions = {v.run_id: v.version for v in client.search_model_versions(f"name = '{registered}'")}
        for alias, row in picks:
            version = versions.get(row["run_id"])
            if version is None:
                if exported:
                    ctx.log(f"[register] {registered}@{alias}: exporting {row['method']} {row['level']} to ONNX")
                metadata = {k: row[k] for k in ("arch", "level", "method", "keep", "gflops", "top1", "images_per_s",
                                                 "speed_setting")}
                try:
                    uri = log(ctx.config.train.tracking_uri, row["run_id"], row["checkpoint"], metadata)
                except ExportError as err:  # the torch classifier is registered; this pick has no ONNX twin
                    ctx.log(f"[warning] {registered}@{alias}: not registered: {err}")
                    continue
                version = versions[row["run_id"]] = client.create_model_version(
                    registered, uri, run_id=row["run_id"], tags={**version_tags(row), SERVING_TAG: SERVING},
                    model_id=uri.rsplit("/", 1)[-1]).version
            client.set_registered_model_alias(registered, alias, version)
            aliases.append(f"{registered}@{alias}")
    return aliases


def _store_flag(tracking_uri: str) -> str:
    """The ``--tracking-uri`` a command needs to find this store, or nothing for the default one."""

    return "" if tracking_uri == DEFAULT_STORE else f" --tracking-uri {tracking_uri}"


def run_select(ctx, ft_stages: list[Stage], ft_results: dict[str, TrainedResult],
               evaluations: dict[str, EvalResult], bases: dict[str, TrainedResult] | None = None,
               not_finetuned: list[tuple[Stage, EvalResult]] = ()) -> dict[str, Any]:
    """The fronts, the report and the registry from the finetuned models' evaluations; ``not_finetuned``
    (``experiment.no_finetune``) goes into the report's own section, never into a front or the registry."""
    from pipeline.dag.records import TIE_MARGIN, TIE_MARGIN_CHOICE
    from pipeline.tracking import log_batch

    exp = ctx.config.experiment
    check_one_clock(evaluations)
    rows = result_rows(ft_stages, ft_results, evaluations)
    scale = measure_scale(ctx, rows)
    check_scale_clock(evaluations, scale)
    rows = on_scale(rows, scale)
    warning = self_check_warning(scale.self_check)
    if warning:
        ctx.log(f"[warning] {warning}")
    record_scale(ctx.client, rows, evaluations)
    base_rows = [{"arch": arch, "val_top1": base.val_top1, "test_top1": base.test_top1, "run_id": base.run_id}
                 for arch, base in (bases or {}).items()]
    targeted = target_rows(ctx, ft_stages, rows)
    record_latency(ctx.client, targeted, evaluations)
    timed_on = [(e.device_name, timing_setting(e.device, e.dtype, e.compile, exp.eval.batch))  # each model's device,
                for e in evaluations.values()]  # by name, and the setting it was timed in
    margin, spread = tie_margin(exp.select.tie_margin, timed_on, exp.eval.threads)
    if spread is not None:
        ctx.log(f"[select] the run-to-run spread of {spread.device} ({spread.source()}): {spread.summary()}")
    untrained = no_finetune_rows(list(not_finetuned))
    files = write_report(rows, ctx.out_dir, exp.budgets, title=f"Experiment {exp.name}", bases=base_rows,
                         targets=targeted, speed_warning=warning, tie_margin=margin, spread=spread,
                         no_finetune=untrained)
    for path in files.values():
        ctx.client.log_artifact(ctx.parent, str(path), artifact_path="report")
    # after the report it describes: a rerun with another margin (not part of the DAG's id) retags the same parent
    log_batch(ctx.client, ctx.parent, tags={TIE_MARGIN_CHOICE: str(exp.select.tie_margin), TIE_MARGIN: f"{margin:.6g}"})
    front = fronts(rows, exp.select.cost, margin)["all"]
    budgets = list(exp.budgets) if exp.budgets else default_budgets(rows)
    aliases = register_models(ctx, registry_picks(rows, front, budgets, targeted)) if exp.register_models else []
    shown = ["arch", "level", "method", "gflops", "top1", "images_per_s"]
    if targeted:  # the target levels' models show their target, predicted and measured cost in the front too
        costs = {r["stage_id"]: r for r in targeted}
        front_rows = [costs.get(r["stage_id"], r) for r in front]
        shown += ["target_unit", "target_cost", "predicted", "measured"]
    table = markdown_table(front_rows if targeted else front, shown)
    ctx.log(f"\nPareto front ({COST_LABELS[exp.select.cost]}, top-1 higher):\n" + table)
    if targeted:
        ctx.log("\nK-search targets (target, predicted and measured cost per model):\n"
                + markdown_table(targeted, TARGET_COLUMNS))
    ctx.log(f"\nreport:  {files['report'].resolve()}")
    plots = ("tradeoff_plot", "speed_plot", "width_plot", "keep_plot")
    ctx.log(f"plots:   {', '.join(str(files[k].resolve()) for k in plots)}")
    ctx.log(f"mlflow:  {ctx.config.train.tracking_uri} (experiment {ctx.config.train.experiment!r}, "
            f"parent run {ctx.parent}); `mlflow ui --backend-store-uri {ctx.config.train.tracking_uri}`")
    if aliases:
        onnx = " (or in onnxruntime, its -onnx twin: add `--runtime onnxruntime`)" if exp.register_onnx else ""
        ctx.log(f"registry: {', '.join(aliases)} (image classifiers; serve one with `python -m pipeline serve "
                f"{aliases[0]}{_store_flag(ctx.config.train.tracking_uri)}`{onnx}; pickled modules: load them only "
                "from a store you trust)")
    if untrained:
        ctx.log("\nWithout finetuning (Appendix E; in no front):\n"
                + markdown_table(untrained, ["arch", "level", "method", "carry", "gflops", "top1"]))
    return {"rows": rows, "front": front, "targets": targeted, "no_finetune": untrained,
            "files": {k: str(v) for k, v in files.items()},
            "aliases": aliases, "parent_run_id": ctx.parent, "speed_warning": warning}
