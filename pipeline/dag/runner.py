"""``pipeline run``: base -> K search -> finetune sweep -> evaluate -> select, on Ray, recorded in MLflow."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config, ConfigError
from pipeline.dag.checks import plan_checks
from pipeline.dag.hpo import chosen_config, run_base_sweep, trial_resources
from pipeline.dag.latency import check_latency_targets, prepare_tables
from pipeline.dag.plan import (
    KINDS,
    Arch,
    Stage,
    archs,
    base_stage,
    check_targets,
    conv_levels,
    count_plan,
    dag_id,
    evaluate_stage,
    finetune_stage,
    ksearch_stages,
    no_finetune_stages,
    paper_levels,
    target_methods,
)
from pipeline.dag.records import find_done, open_parent, supersede
from pipeline.dag.select import no_finetune_rows, run_select
from pipeline.dag.stages import eval_task, run_evaluation_spec, run_training_spec, stage_spec, trained_done
from pipeline.dag.sweep import one_line, run_sweep
from pipeline.dag.types import EvalResult, Tracking, TrainedResult, from_record
from pipeline.errors import JobError
from pipeline.methods import GRID_CONV, KEEP_ALL
from pipeline.report import markdown_table
from pipeline.tracking import check_tracking_uri
from pipeline.train.launch import TIMING, check_reaches_workers, connect_ray, preflight, resolve_paths


@dataclass
class Context:
    config: Config
    dag: str
    parent: str
    client: Any
    exp_id: str
    log: Callable[[str], None]
    keep_going: bool = False  # a failed stage is recorded in ``failures`` and the stages that need it skipped
    slicer: Slicer | None = None  # which of the planned stages of a kind run (``pipeline run --rehearse``)
    failures: dict[str, str] = field(default_factory=dict)  # stage label -> its error, in one line
    planned: list[Stage] = field(default_factory=list)  # every stage that was to run, in order

    @property
    def out_dir(self) -> Path:
        exp = self.config.experiment
        return Path(exp.runs_dir) / exp.name

    def plan(self, stages: list[Stage]) -> list[Stage]:
        """The stages of one kind that run: all of them, or the slicer's pick (with its changes)."""
        chosen = self.slicer(stages) if self.slicer is not None and stages else stages
        self.planned += chosen
        return chosen

    def failed(self, label: str, error: Exception, why: str | None = None) -> None:
        """Records a failed stage with keep-going (``why``, else its error in one line); raises without."""
        if not self.keep_going:
            raise error
        self.failures[label] = why or one_line(error)
        self.log(f"[failed] {label}: {self.failures[label]}")


# Picks which stages of one kind run and may change their configs (a new stage, a new id); every
# stage kind's planned list passes through ``Context.plan``, so a new kind is sliced as well.
Slicer = Callable[[list[Stage]], list[Stage]]


def prepare_data(config: Config, log: Callable[[str], None]) -> None:
    """Writes the experiment's datasets that do not exist yet."""
    from pipeline.data import WriteSettings, open_source, write_beton
    from pipeline.data.write import metadata_path

    for item in config.experiment.prepare:
        out = Path(item.out)
        if out.exists() and metadata_path(out).exists():
            continue
        log(f"[data] writing {out} from {item.source}")
        write_beton(open_source(item.source, limit=item.limit), out,
                    WriteSettings(mode=item.mode, max_res=item.max_res), log=log)


def check_experiment(config: Config) -> None:
    """Everything that can be refused before any training: models, widths, methods, keep lists, data, tracking. Each
    method's model at each fixed keep list (a paper level, a conv placement) is built as its finetune's config builds
    it (normalised queries and keys included), on the meta device: its shapes, not its weights."""
    from pipeline.train.build import build_model

    def builds(method: str, level: str, keep: list[int]) -> None:
        with torch.device("meta"):
            build_model(finetune_stage(config, arch, stage, method, level, keep, []).config)

    for arch in archs(config):
        stage = base_stage(config, arch)
        preflight(stage.config)
        ksearch_stages(config, arch, stage)  # a target's missing cost table is refused here, before any training
        if config.experiment.levels is not None:
            untrained = config.experiment.no_finetune.methods if config.experiment.no_finetune is not None else []
            for level, keep in paper_levels(config, arch).items():
                for method in dict.fromkeys([*config.experiment.methods, *untrained]):  # finetuned or not
                    try:
                        builds(method, level, keep)
                    except ValueError as err:
                        raise ConfigError(f"experiment: {arch.label} level {level} with {method}: {err}") from None
        for level, keep in conv_levels(config, arch).items():  # each placement's layers fit the grid they meet
            try:
                builds(GRID_CONV, level, keep)
            except ValueError as err:
                raise ConfigError(f"experiment.conv: {arch.label} placement {level}: {err}") from None


def force_kinds(force: str | None) -> list[str]:
    """``--force STAGE``: that stage kind and every kind downstream of it."""
    if force is None:
        return []
    if force not in KINDS:
        raise ConfigError(f"--force {force!r}: choose one of {', '.join(KINDS)}")
    return list(KINDS[KINDS.index(force):])


def retire_storage(ctx: Context, stages: list[Stage]) -> None:
    """Moves forced stages' Ray storage aside so that their training starts over (kept, not deleted)."""
    storage = Path(ctx.config.train.storage_path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for stage in stages:
        folder = storage / stage.name
        if folder.exists():
            shutil.move(str(folder), str(storage / f".superseded-{stamp}-{stage.name}"))


def run_bases(ctx: Context, arch_list: list[Arch]) -> dict[str, tuple[Stage, TrainedResult]]:
    """One base per width: a multi-worker TorchTrainer job, a given checkpoint, or the best trial of a
    hyperparameter sweep (``experiment.base.sweep``)."""
    bases = {}
    sweep = ctx.config.experiment.base.sweep
    for stage in ctx.plan([base_stage(ctx.config, arch) for arch in arch_list]):
        spec = stage_spec(stage, init=None, parent_id=ctx.parent, dag=ctx.dag)
        try:
            if sweep is None or stage.meta.given:
                bases[stage.arch] = (stage, run_training_spec(spec, log=ctx.log))
            else:
                bases[stage.arch] = (stage, run_swept_base(ctx, spec, sweep))
        except Exception as err:  # noqa: BLE001 - keep-going records any stage's failure
            ctx.failed(stage.label, err)
    return bases


def run_swept_base(ctx: Context, spec, sweep) -> TrainedResult:
    import ray

    done = trained_done(ctx.client, ctx.exp_id, spec.id)
    if done is not None:
        ctx.log(f"[skip] {spec.label} sweep: done in MLflow run {done.run_id}")
        return done
    need, have = trial_resources(spec), ray.cluster_resources()
    slots = max(min(int(have.get(kind, 0) // amount) for kind, amount in need.items() if amount > 0), 1)
    slots = min(slots, sweep.max_concurrent) if sweep.max_concurrent else slots
    return run_base_sweep(spec, sweep, client=ctx.client, exp_id=ctx.exp_id, slots=slots, out_dir=ctx.out_dir,
                          parent=ctx.parent, log=ctx.log)


def downstream_config(ctx: Context, arch: Arch, base: TrainedResult) -> Config:
    """The config the K search and finetunes of ``arch`` plan from: with a swept base, the chosen trial's
    settings applied (its recipe, not the YAML's, is "the best recipe" they continue)."""

    if not base.settings:
        return ctx.config
    ctx.log(f"[sweep] {arch.label}: the K search and finetunes use the chosen settings {base.settings}")
    return chosen_config(ctx.config, base.settings)


def recorded(ctx: Context, stages: list[Stage], name: str | None = None) -> dict[str, TrainedResult | EvalResult]:
    """The stages of ``stages`` that MLflow records done, by id, read here so that a rerun starts no Ray
    worker for them (a Tune trial or task pays about 10 s of imports before it could find out itself).
    With ``name``, logs how many were done."""

    done = {}
    for stage in stages:
        found = find_done(ctx.client, ctx.exp_id, stage.id)
        if found is not None:
            done[stage.id] = from_record(EvalResult if stage.kind == "evaluate" else TrainedResult, *found,
                                         skipped=True)
    if done and name is not None:
        ctx.log(f"[skip] {name}: {len(done)} of {len(stages)} stage(s) done in MLflow")
    return done


def sweep(ctx: Context, stages: list[Stage], init: Callable[[Stage], str], name: str) -> dict[str, TrainedResult]:
    """Runs the stages MLflow does not record done as one Tune sweep; returns the result of every stage that
    finished (each of them without keep-going), by id. ``init``: a stage's checkpoint to start from."""
    stages = ctx.plan(stages)
    results = recorded(ctx, stages, name)
    todo = [s for s in stages if s.id not in results]
    specs = [stage_spec(s, init=init(s), parent_id=ctx.parent, dag=ctx.dag) for s in todo]
    timing = run_sweep(specs, ctx.config.experiment, storage=ctx.config.train.storage_path, name=name, log=ctx.log,
                       keep_going=ctx.keep_going)
    after = recorded(ctx, todo)
    for stage in todo:
        if stage.id not in after:
            why = timing.failed.get(stage.label, "JobError: no finished record after its sweep")
            ctx.failed(stage.label, JobError(f"stage {stage.label} ({stage.id}): {why}"), why)
    return results | after


def sparsity_levels(ctx: Context, arch: Arch, ks_results: dict[str, TrainedResult],
                    ks_stages: list[Stage]) -> dict[str, tuple[list[int], list[str]]]:
    """``{level: (keep, upstream ids)}``: the K search's lists (deduplicated), or the paper's pinned ones."""
    if ctx.config.experiment.levels is not None:
        return {level: (keep, []) for level, keep in paper_levels(ctx.config, arch).items()}
    levels: dict[str, tuple[list[int], list[str]]] = {}
    seen: dict[tuple[int, ...], str] = {}
    for stage in ks_stages:
        if stage.id not in ks_results:  # sliced away, or failed with keep-going
            continue
        keep = ks_results[stage.id].keep
        name = f"lam{stage.meta.lam:g}" if stage.meta.target is None else stage.meta.target
        if tuple(keep) in seen and stage.meta.target is None:  # a target's level stays: the report shows it
            ctx.log(f"[ksearch] {arch.label} {name} gave the same keep list as {seen[tuple(keep)]}; one level")
            continue
        seen[tuple(keep)] = name
        levels[name] = (keep, [stage.id])
    return levels


def run_experiment(config: Config, *, force: str | None = None, address: str | None = None,
                   log: Callable[[str], None] = print, keep_going: bool = False,
                   slicer: Slicer | None = None) -> dict[str, Any]:
    """Runs (or resumes) the whole DAG; returns the select stage's summary, with ``failures`` (stage label ->
    error) and ``planned`` (the stages that were to run).

    ``keep_going``: a failed stage is recorded and the stages that need it are skipped; the rest run.
    ``slicer``: runs only its pick of each kind's planned stages (``pipeline.dag.rehearse``)."""

    if config.experiment is None:
        raise ConfigError("`pipeline run` needs an experiment section; see configs/experiments/")
    config = resolve_paths(config)
    exp = config.experiment
    kinds = force_kinds(force)
    check_reaches_workers(config)  # every stage runs in a Ray worker, a Tune trial or a Ray task
    check_tracking_uri(config.train.tracking_uri)  # creates nothing; preflight creates the store after its checks
    plan_checks(config, address)  # what `run --plan` refuses, before any data is written
    prepare_data(config, log)
    prepare_tables(config, log)  # this machine's latency tables (table: auto), before the K search reads them
    check_targets(config)  # again: a table: auto is there now
    check_experiment(config)
    counts = count_plan(config)
    log(f"[plan] {exp.name}: {counts.as_dict()}")
    connect_ray(address or config.train.address)
    check_timing(log)
    client, exp_id, parent = open_parent(config.train.tracking_uri, config.train.experiment,
                                         config.train.artifact_root, dag_id(config), exp.name)
    ctx = Context(config, dag_id(config), parent, client, exp_id, log, keep_going, slicer)
    if kinds:
        log(f"[force] retiring {supersede(client, exp_id, ctx.dag, kinds)} run(s) of {', '.join(kinds)}")
    arch_list = archs(config)
    if "base" in kinds:
        retire_storage(ctx, [base_stage(config, a) for a in arch_list])
    bases = run_bases(ctx, arch_list)
    arch_list = [a for a in arch_list if a.label in bases]  # keep-going: a failed base's stages do not run
    downstream = {a.label: downstream_config(ctx, a, bases[a.label][1]) for a in arch_list}
    ks_stages = {a.label: ksearch_stages(downstream[a.label], a, bases[a.label][0]) for a in arch_list}
    all_ks = [s for stages in ks_stages.values() for s in stages]
    if "ksearch" in kinds:
        retire_storage(ctx, all_ks)
    ks_results = sweep(ctx, all_ks, lambda s: bases[s.arch][1].checkpoint, f"{exp.name}-ksearch")
    ks_stages = {a.label: [s for s in ctx.planned if s.kind == "ksearch" and s.arch == a.label] for a in arch_list}
    ks_results = check_latency_targets(ctx, [s for stages in ks_stages.values() for s in stages if s.id in ks_results],
                                       ks_results)
    ft_stages: list[Stage] = []
    untrained: list[Stage] = []  # experiment.no_finetune's evaluations
    for arch in arch_list:
        base = bases[arch.label][0]
        levels = sparsity_levels(ctx, arch, ks_results, ks_stages[arch.label])
        for level, (keep, upstream) in levels.items():
            ft_stages += [finetune_stage(downstream[arch.label], arch, base, m, level, keep, upstream)
                          for m in target_methods(exp, level)]
        untrained += no_finetune_stages(downstream[arch.label], arch, base, levels)
        ft_stages += [finetune_stage(downstream[arch.label], arch, base, GRID_CONV, level, keep, [])
                      for level, keep in conv_levels(downstream[arch.label], arch).items()]
        if exp.baseline:
            ft_stages.append(finetune_stage(downstream[arch.label], arch, base, KEEP_ALL, "full", None, []))
    if "finetune" in kinds:
        retire_storage(ctx, ft_stages)
    ft_results = sweep(ctx, ft_stages, lambda s: bases[s.arch][1].checkpoint, f"{exp.name}-finetune")
    ft_stages = [s for s in ctx.planned if s.kind == "finetune" and s.id in ft_results]
    evaluations = run_evaluations(ctx, ft_stages, ft_results)
    not_finetuned = run_no_finetune(ctx, untrained, {a: r for a, (_, r) in bases.items()})
    ft_stages = [s for s in ft_stages if s.id in evaluations]
    summary: dict[str, Any] = {}
    if not evaluations:  # every finetune or evaluation failed (keep-going), or none was planned
        why = "the failures above say why" if ctx.failures else "no finetune stage was planned"
        log(f"[select] {exp.name}: not run, no finetuned model was evaluated ({why})")
        if not_finetuned:  # what was measured without finetuning is not lost with the report
            log("\nWithout finetuning (Appendix E):\n" + markdown_table(no_finetune_rows(not_finetuned),
                                                                          ["arch", "level", "method", "carry", "gflops",
                                                                           "top1"]))
    else:
        try:
            summary = run_select(ctx, ft_stages, ft_results, evaluations, {a: r for a, (_, r) in bases.items()},
                                 not_finetuned)
        except Exception as err:  # noqa: BLE001 - keep-going records any stage's failure
            ctx.failed(f"{exp.name}-select", err)
    client.set_terminated(parent, "FAILED" if ctx.failures else "FINISHED")
    return {**summary, "failures": dict(ctx.failures), "planned": list(ctx.planned)}


def speed_line(result: EvalResult) -> str:
    """``time 0.642 [0.631, 0.655] of the unmodified model (31 blocks, tolerance, +-1.7%)``: the ratio, its interval,
    what bounded the measurement and the half-width it reached."""
    half = result.speed_half_width
    return (f"time {result.speed_ratio:.3f} [{result.speed_ratio_low:.3f}, {result.speed_ratio_high:.3f}] of the "
            f"unmodified model ({result.speed_blocks} blocks, {result.speed_stop}, +-{half:.1%})")


def check_timing(log: Callable[[str], None] = print) -> None:
    """A warning, before any stage runs, where no running node of the Ray cluster has the ``timing`` resource that
    every speed measurement holds (one at a time per node). Not an error: an autoscaling worker group that is at
    zero nodes now starts one when an evaluation asks for the resource; on a cluster without it the evaluations
    wait, and Ray reports them as infeasible."""
    import ray

    if ray.cluster_resources().get(TIMING, 0) < 1:
        log(f"[warning] no running node of the Ray cluster has the {TIMING!r} resource that every speed measurement "
            "holds (one a node, so that none shares a node with another); the evaluations wait for a node with it: "
            f"start each worker node with `ray start --resources='{{\"{TIMING}\": 1}}'` (jobs/k8s and jobs/vm do; "
            "docs/cluster.md)")


def run_evaluations(ctx: Context, ft_stages: list[Stage], ft_results: dict[str, TrainedResult]
                    ) -> dict[str, EvalResult]:
    """One Ray task per finetuned model; returns each model's evaluation by its finetune's id."""
    chosen = {stage.upstream[0]: stage for stage in ctx.plan([evaluate_stage(ctx.config, s) for s in ft_stages])}
    jobs = [(chosen[source.id], ft_results[source.id]) for source in ft_stages if source.id in chosen]
    results = evaluate(ctx, jobs)
    return {stage.upstream[0]: results[stage.id] for stage, _ in jobs if stage.id in results}


def run_no_finetune(ctx: Context, stages: list[Stage], bases: dict[str, TrainedResult]
                    ) -> list[tuple[Stage, EvalResult]]:
    """``experiment.no_finetune``'s evaluations: each base's model with a method inserted and no training, as Ray tasks
    beside the finetunes' (``plan.no_finetune_stages``); returns the stages that finished with their results."""
    if not stages:
        return []
    jobs = [(stage, bases[stage.arch]) for stage in ctx.plan(stages)]
    results = evaluate(ctx, jobs, "without finetuning")
    return [(stage, results[stage.id]) for stage, _ in jobs if stage.id in results]


def evaluate(ctx: Context, jobs: list[tuple[Stage, TrainedResult]], what: str = "") -> dict[str, EvalResult]:
    """One Ray task per (evaluate stage, the trained model it measures); each takes ``eval.cpus`` so timings do not
    share cores. Returns the results by stage id (a failed one recorded with keep-going)."""
    import ray

    config = ctx.config
    tracking = Tracking(uri=config.train.tracking_uri, experiment=config.train.experiment,
                        artifact_root=config.train.artifact_root, parent=ctx.parent, dag=ctx.dag)
    task, cuda = eval_task(config, run_evaluation_spec)
    stages = {stage.id: stage for stage, _ in jobs}
    name = f"{config.experiment.name}-evaluate" + (f" ({what})" if what else "")
    results = recorded(ctx, list(stages.values()), name)
    todo = [(stage, trained) for stage, trained in jobs if stage.id not in results]
    if todo:
        ctx.log(f"[evaluate] {len(todo)} model(s){' ' + what if what else ''}: top-1, GFLOPs, images/s at batch "
                f"{config.experiment.eval.batch}")
    futures = {}
    for stage, trained in todo:
        spec = stage_spec(stage, init=None, parent_id=ctx.parent, dag=ctx.dag)
        futures[stage.id] = task.remote(spec, trained.checkpoint, tracking, cuda, trained.run_id)
    for index, (stage_id, future) in enumerate(futures.items(), 1):
        try:
            result = results[stage_id] = ray.get(future)
        except Exception as err:  # noqa: BLE001 - keep-going records any stage's failure
            ctx.failed(stages[stage_id].label, err)
            continue
        ctx.log(f"[evaluate] {index}/{len(futures)} {result.top1:.2f}% {result.gflops:.4f} GFLOPs, "
                f"{speed_line(result)} ({result.device}, {result.dtype}, compile {result.compile})")
    return results
