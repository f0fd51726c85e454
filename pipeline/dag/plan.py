"""Expanding an experiment config into stages, each with a content identity.

A stage's id hashes its resolved config (without paths that only say where results go) and the
ids of the stages it reads from, so any change upstream changes every id downstream.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.config import Config, ConfigError, CostTarget, ExperimentConfig, StageRecipe, error_message
from pipeline.config.identity import IDENTITY_VERSION, identity_content
from pipeline.config.train import AUTO_TABLE
from pipeline.dag.types import StageMeta
from pipeline.errors import InputError
from pipeline.methods import KEEP_ALL, keeps_all
from pipeline.sparsity import level_keep

KINDS = ("base", "ksearch", "finetune", "evaluate", "select")
@dataclass(frozen=True)
class Arch:
    """One point of the width axis: a label (``M96`` or a model name) and its model overrides."""

    label: str
    overrides: dict[str, Any]


@dataclass
class Stage:
    kind: str
    label: str
    config: Config | None
    upstream: list[str]
    arch: str
    meta: StageMeta = field(default_factory=StageMeta)
    id: str = ""

    def __post_init__(self) -> None:
        self.id = stage_id(self.kind, self.config, self.upstream, self.meta.identity())

    @property
    def name(self) -> str:
        """The Ray Train run name: readable, and unique per identity."""
        return f"{self.label}-{self.id[:10]}"


def stage_id(kind: str, config: Config | None, upstream: list[str], meta: dict[str, Any]) -> str:
    content = {} if config is None else identity_content(config)
    canonical = json.dumps({"identity_version": IDENTITY_VERSION, "kind": kind, "config": content,
                            "upstream": upstream, "meta": meta}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def dag_id(config: Config) -> str:
    """The identity of a whole experiment (its parent run in MLflow, and the runs ``--force`` retires): the
    experiment section, the pooling settings its finetunes share (every method's options included) and the
    kernel choices of its evaluations. Two sweeps that differ only in ``pooling.carry`` or
    ``pooling.options.wkmedoids.iters`` are two experiments, and ``--force`` on one must not retire the other's
    runs. ``experiment.select.tie_margin`` is left out: it is how the select stage (never cached) reads the same
    measurements, so another margin selects again under the same parent run; so is ``experiment.select.check_cap_s``,
    how long a keep list's check may take (a checked list is recorded and read back), and so is
    ``experiment.register_onnx``, what the register step logs beside each pick. A setting that is off
    (``experiment.conv`` unset, ``experiment.eval.runtime: torch``) leaves the id as it was before the setting
    existed."""
    exp = config.experiment
    exclude: dict[str, Any] = {"select": {"tie_margin", "check_cap_s"}, "base": {"seed"},
                               "ksearch": {"seed"}, "register_onnx": True}  # the seeds: refused if set
    if exp.eval.runtime == "torch":
        exclude["eval"] = {"runtime"}
    for name in UNSET_IS_ABSENT:
        section, _, key = name.partition(".")
        if key and getattr(getattr(exp, section), key) is None:
            exclude[section] = {key}
        elif not key and getattr(exp, section) is None:
            exclude[section] = True
    meta = {"experiment": exp.model_dump(mode="json", exclude=exclude),
            # model.qk_norm and model.alpha were pooling's: named there still, so that a stored DAG's id stays
            "pooling": config.pooling.model_dump(mode="json", exclude={"method", "keep", "level"})
            | {"qk_norm": config.model.qk_norm, "alpha": config.model.alpha},
            "kernels": chosen_kernels(config)}
    return stage_id("dag", config, [], meta)


# Experiment settings that enter the DAG's id only when set, so that a stored DAG's id stays.
UNSET_IS_ABSENT = ("conv", "no_finetune", "finetune.seed")


def chosen_kernels(config: Config) -> dict[str, str]:
    """The config's kernel choices: part of an evaluation's identity."""
    return config.kernels.model_dump()


def archs(config: Config) -> list[Arch]:
    exp = config.experiment
    if exp.models is not None:
        found = [Arch(name, {"name": name}) for name in exp.models]
    else:
        heads = config.model.num_heads
        found = [Arch(f"M{dim}", {"embed_dim": dim, "num_heads": exp.num_heads.get(dim, heads)})
                 for dim in exp.embed_dims]
    labels = {arch.label for arch in found}
    for target in exp.ksearch_targets or []:
        unknown = sorted(set(target.archs or []) - labels)
        if unknown:
            raise InputError(f"experiment.ksearch_targets {target.label}: archs {unknown} are not among the "
                             f"experiment's {sorted(labels)}")
    return found


# The experiment-level key each setting of a stage config comes from: what an error in a stage config names.
_ORIGINS = {("model", "embed_dim"): "experiment.embed_dims", ("model", "name"): "experiment.models",
            ("model", "num_heads"): "experiment.num_heads or model.num_heads",
            ("train", "ksearch_lambda"): "experiment.lambdas",
            ("train", "ksearch_target"): "experiment.ksearch_targets",
            ("train", "workers"): "experiment.search.trial_workers",
            ("train", "cpus_per_worker"): "experiment.search.trial_cpus",
            ("train", "use_gpu"): "experiment.search.trial_gpus", ("pooling", "method"): "experiment.methods",
            ("pooling", "keep"): "experiment.levels or the K search's keep list"}


def _origin(loc: tuple[Any, ...], stage: str, updates: dict[str, dict[str, Any]]) -> str:
    """The experiment-level key behind an error at ``loc`` of a ``stage`` config made with ``updates``."""
    section, field = (str(loc[0]) if loc else None), (str(loc[1]) if len(loc) > 1 else None)
    if section == "recipe":
        return f"experiment.{stage}" + (f".{field}" if field else "")
    if (section, field) in _ORIGINS:
        return _ORIGINS[section, field]
    keys = [(name, key) for name, changed in updates.items() if section in (None, name) for key in changed]
    found = dict.fromkeys(_ORIGINS.get(key, f"experiment.{stage}" if key[0] == "recipe" else None) for key in keys)
    return " / ".join(origin for origin in found if origin) or f"experiment.{stage}"


def _with(config: Config, *, stage: str, model: dict[str, Any], recipe: StageRecipe, train: dict[str, Any],
          pooling: dict[str, Any] | None = None) -> Config:
    """``config`` with section updates (typed copies), validated again: a bad width or keep list fails here, as a
    ConfigError naming the experiment-level key it came from (``stage``: the experiment's recipe section)."""
    stage_recipe = {k: v for k, v in recipe.model_dump(exclude={"sweep", "seed"}).items() if v is not None}
    updates = {"model": model, "recipe": stage_recipe, "train": train, "pooling": pooling or {}}
    updated = config.model_copy(update={
        "seed": config.seed if recipe.seed is None else recipe.seed,
        "model": config.model.model_copy(update=model),
        "recipe": config.recipe.model_copy(update=stage_recipe),
        "train": config.train.model_copy(update=train),
        "pooling": config.pooling.model_copy(update=pooling or {}),
        "experiment": None,
    })
    try:
        return Config.model_validate(updated.model_dump())
    except ValidationError as err:
        problems = "; ".join(f"{_origin(e['loc'], stage, updates)}: {error_message(e)}"
                             + (f" ({'.'.join(map(str, e['loc']))}={e['input']!r})" if len(e["loc"]) > 1 else "")
                             for e in err.errors())
        raise ConfigError(f"a {stage} stage's config is not valid: {problems}") from None


def base_stage(config: Config, arch: Arch) -> Stage:
    exp = config.experiment
    given = exp.base_checkpoints.get(arch.label)
    train = {"mode": "base"} if exp.base.sweep is None else {"mode": "base", **trial_train(exp)}
    cfg = _with(config, stage="base", model=arch.overrides, recipe=exp.base, train=train)
    sweep = None if exp.base.sweep is None or given else exp.base.sweep.model_dump(mode="json")
    return Stage("base", f"{exp.name}-base-{arch.label}", cfg, [], arch.label, StageMeta(given=given or None,
                                                                                       sweep=sweep))


def trial_train(exp: ExperimentConfig) -> dict[str, Any]:
    """Worker settings of a Tune trial."""
    return {"workers": exp.search.trial_workers, "cpus_per_worker": exp.search.trial_cpus,
            "use_gpu": exp.search.trial_gpus > 0}


def ksearch_stages(config: Config, arch: Arch, base: Stage) -> list[Stage]:
    from pipeline.cost import table_loads  # here, not at the top: these import torch
    from pipeline.targets import ROUNDING

    exp = config.experiment
    stages = []
    for lam in exp.lambdas or []:
        cfg = _with(config, stage="ksearch", model=arch.overrides, recipe=exp.ksearch,
                    train={"mode": "ksearch", "ksearch_lambda": lam, **trial_train(exp)})
        stages.append(Stage("ksearch", f"{exp.name}-ksearch-{arch.label}-lam{lam:g}", cfg, [base.id], arch.label,
                            StageMeta(lam=lam)))
    for target in exp.ksearch_targets or []:
        if target.archs is not None and arch.label not in target.archs:
            continue
        table = None if target.table is None else target_table(config, target, arch)
        # A table: auto not measured yet (or one that does not load: a damaged file) has no content to follow: `pipeline
        # run` measures it before the K search (dag.latency.prepare_tables), and `run --plan` plans without it.
        pending = target.table == AUTO_TABLE and not table_loads(table)
        target = target.model_copy(update={"methods": None, "archs": None})  # the experiment's concern
        if table is not None:  # the identity follows the table's content, not its path
            target = target.model_copy(update={"table": table, "table_sha256": None if pending else _table_hash(table)})
        cfg = _with(config, stage="ksearch", model=arch.overrides, recipe=exp.ksearch,
                    train={"mode": "ksearch", "ksearch_target": target, **trial_train(exp)})
        stages.append(Stage("ksearch", f"{exp.name}-ksearch-{arch.label}-{target.label}", cfg, [base.id],
                            arch.label, StageMeta(target=target.label, rounding=ROUNDING)))
    return stages


def check_targets(config: Config) -> None:
    """Refuses a K-search target below the cheapest keep list its cost model allows (``targets.cheapest_fraction``),
    naming that fraction: at plan time, not when the K search rounds its list after a whole epoch."""
    import torch

    from pipeline.targets import cheapest_fraction, option_differences, target_cost_model, target_fraction
    from pipeline.train.build import build_model

    if not config.experiment.ksearch_targets:
        return
    for arch in archs(config):
        for stage in ksearch_stages(config, arch, base_stage(config, arch)):
            target = stage.config.train.ksearch_target
            if target is None or (target.cost == "latency" and target.table_sha256 is None):  # a table: auto to measure
                continue  # (every other table has its hash: ksearch_stages refuses a table that is not there)
            with torch.device("meta"):  # the shapes the cost model reads, without initialising any weight
                model = build_model(stage.config)
            costs = target_cost_model(target, model, stage.config.pooling)
            for method in target_methods(config.experiment, target.label) if target.cost == "latency" else []:
                differences = option_differences(costs, method, config.pooling)
                timed = costs.key["method"]
                if differences and timed != method:
                    raise InputError(f"experiment.ksearch_targets {target.label} ({arch.label}): the cost table "
                                     f"{target.table} timed {timed}, not {method}, which the target's finetunes run "
                                     f"(table's != config's: {'; '.join(differences)}); give the target methods: "
                                     f"[{timed}], or measure a table of {method} (`pipeline bench blocks`) for a "
                                     "target of its own")
                if differences:
                    raise InputError(f"experiment.ksearch_targets {target.label} ({arch.label}): the cost table "
                                     f"{target.table} timed {method} with other options than its finetunes run "
                                     f"(table's != config's: {'; '.join(differences)}); measure a table with the "
                                     f"config's options (`pipeline bench blocks`), or set pooling.options.{method} "
                                     "as the table's key has them")
            fraction, cheapest = target_fraction(target, costs), cheapest_fraction(costs)
            if fraction > 1:
                raise InputError(f"experiment.ksearch_targets {target.label} ({arch.label}): {target.value:g} is "
                                 f"above the unmodified model's {costs.unmodified():.4g}: a K search toward it keeps "
                                 "every token; give a value below that, or a fraction in (0, 1]")
            if fraction < cheapest:
                where = f"the cost table {target.table}" if target.cost == "latency" else f"{target.method}'s GFLOPs"
                raise InputError(f"experiment.ksearch_targets {target.label} ({arch.label}): {fraction:.4g} of the "
                                 f"unmodified model is below the cheapest keep list {where} allows, {cheapest:.4f}; "
                                 f"give a target of at least {math.ceil(cheapest * 1e4) / 1e4:.4f}")


def target_methods(exp: ExperimentConfig, level: str) -> list[str]:
    """The methods finetuned at ``level``: a K-search target's own ``methods`` where it gives them."""
    for target in exp.ksearch_targets or []:
        if target.label == level and target.methods is not None:
            return list(target.methods)
    return list(exp.methods)


def table_path(pattern: str, arch: Arch) -> str:
    """A target's table for ``arch``: ``{arch}`` in the path is its label (M32, or the model's name), ``{embed_dim}``
    its width (an experiment.embed_dims entry)."""
    if "{embed_dim}" in pattern and "embed_dim" not in arch.overrides:
        raise InputError(f"experiment.ksearch_targets: {{embed_dim}} in the table path {pattern} needs "
                         "experiment.embed_dims; use {arch} with experiment.models")
    return pattern.replace("{arch}", arch.label).replace("{embed_dim}", str(arch.overrides.get("embed_dim")))


def found(path: str, folder: bool = False) -> bool:
    """Whether ``path`` is a file (a folder with ``folder``); a name the file system refuses (too long) is none."""
    try:
        return Path(path).is_dir() if folder else Path(path).is_file()
    except OSError:
        return False


def target_table(config: Config, target: CostTarget, arch: Arch) -> str:
    """The cost table a latency target reads for ``arch``: its path (``table_path``), or for ``table: auto`` this
    machine's table of the target's one method in the evaluate stage's setting (``dag.tables.auto_table``)."""
    if target.table != AUTO_TABLE:
        return table_path(target.table, arch)
    from pipeline.dag.tables import auto_table  # here: it imports torch

    return str(auto_table(config, arch, auto_method(target))[1])


def auto_method(target: CostTarget) -> str:
    """The one method a ``table: auto`` target's table times: its ``methods``' only entry."""
    if target.methods is None or len(target.methods) != 1:
        raise InputError(f"experiment.ksearch_targets {target.label}: table: auto measures one table, of the method "
                         f"its finetunes run; give methods: [METHOD] (got {target.methods})")
    return target.methods[0]


def auto_tables(config: Config) -> list[tuple[CostTarget, Arch]]:
    """Every (target, arch) whose table is ``table: auto``."""
    return [(target, arch) for target in config.experiment.ksearch_targets or [] if target.table == AUTO_TABLE
            for arch in archs(config) if target.archs is None or arch.label in target.archs]


def _table_hash(path: str) -> str:
    from pipeline.cost import file_sha256

    if not found(path):
        raise InputError(f"experiment.ksearch_targets: no cost table at {path}; measure one with "
                         "`pipeline bench blocks`")
    return file_sha256(path)


def finetune_stage(config: Config, arch: Arch, base: Stage, method: str, level: str, keep: list[int] | None,
                   upstream: list[str]) -> Stage:
    """One trial of the sweep; a ``method`` that keeps every token is the no-downsampling baseline."""
    exp = config.experiment
    if keeps_all(method):
        cfg = _with(config, stage="finetune", model=arch.overrides, recipe=exp.finetune,
                    train={"mode": "baseline", **trial_train(exp)},
                    pooling={"keep": None, "level": None})
    else:
        cfg = _with(config, stage="finetune", model=arch.overrides, recipe=exp.finetune,
                    train={"mode": "finetune", **trial_train(exp)},
                    pooling={"method": method, "keep": keep, "level": None})
    label = f"{exp.name}-ft-{arch.label}-{level}-{method}"
    return Stage("finetune", label, cfg, [base.id, *upstream], arch.label, StageMeta(method=method, level=level))


def evaluate_stage(config: Config, model_stage: Stage) -> Stage:
    exp = config.experiment
    meta = StageMeta(method=model_stage.meta.method, level=model_stage.meta.level, eval=exp.eval,
                     kernels=chosen_kernels(config))
    return Stage("evaluate", model_stage.label.replace("-ft-", "-eval-"), None, [model_stage.id], model_stage.arch,
                 meta)


def no_finetune_stages(config: Config, arch: Arch, base: Stage, levels: dict[str, tuple[list[int], list[str]]]
                       ) -> list[Stage]:
    """``experiment.no_finetune``'s evaluations of ``arch``'s base (the paper's Appendix E): its unmodified model, then
    each method at each level (``{level: (keep, upstream ids)}``, the finetunes' levels) and carry setting, inserted
    with no training. Each stage's config is the model it evaluates (``train.mode`` finetune: the method at its keep
    list, built on the base's weights); empty without ``experiment.no_finetune``."""
    exp = config.experiment
    if exp.no_finetune is None:
        return []
    meta = {"eval": exp.eval, "kernels": chosen_kernels(config)}
    unmodified = _with(config, stage="no_finetune", model=arch.overrides, recipe=StageRecipe(), train={"mode": "base"})
    stages = [Stage("evaluate", f"{exp.name}-noft-{arch.label}-full-{KEEP_ALL}", unmodified, [base.id], arch.label,
                    StageMeta(method=KEEP_ALL, level="full", carry=False, **meta))]
    for (level, (keep, upstream)), method, carry in itertools.product(levels.items(), exp.no_finetune.methods,
                                                                      exp.no_finetune.carry):
        cfg = _with(config, stage="no_finetune", model=arch.overrides, recipe=StageRecipe(), train={"mode": "finetune"},
                    pooling={"method": method, "keep": keep, "level": None, "carry": carry})
        label = f"{exp.name}-noft-{arch.label}-{level}-{method}" + ("-carry" if carry else "")
        stages.append(Stage("evaluate", label, cfg, [base.id, *upstream], arch.label,
                            StageMeta(method=method, level=level, carry=carry, **meta)))
    return stages


def paper_levels(config: Config, arch: Arch) -> dict[str, list[int]]:
    """``{"L3": keep}`` for the pinned levels of ``arch`` (configs/sparsity/)."""

    name = arch.overrides.get("name", config.model.name)
    if "embed_dim" in arch.overrides:
        raise InputError("experiment.levels pins the paper's keep lists of named models; "
                         "use experiment.models (not embed_dims) with it")
    return {f"L{level}": level_keep(name, level) for level in config.experiment.levels or []}


def conv_layers_allowed(grid: tuple[int, int]) -> int:
    """How many 2x2 stride-2 layers an (h, w) token grid takes while more than one token is left (an odd side padded,
    ``pooling.conv.pooled_count``): 3 for DeiT-S's 14 x 14 (7, 4, 2 a side), 2 for the demo's 7 x 7 (4, 2)."""
    h, w = grid
    layers = 0
    while math.ceil(h / 2) * math.ceil(w / 2) > 1:
        h, w, layers = math.ceil(h / 2), math.ceil(w / 2), layers + 1
    return layers


def conv_placements(grid: tuple[int, int], depth: int, layers: list[int]) -> list[tuple[int, ...]]:
    """Every placement of c layers (c in ``layers``, at most ``conv_layers_allowed``) in a ``depth``-block model, as
    the blocks they follow (1-based, increasing, among 1 ... depth - 1), three layers equally spaced (the paper's
    Appendix D: l2 - l1 = l3 - l2); by number of layers, then in order."""
    most = conv_layers_allowed(grid)
    return [placement for c in sorted(set(layers)) if c <= most
            for placement in itertools.combinations(range(1, depth), c)
            if c < 3 or placement[1] - placement[0] == placement[2] - placement[1]]


def placement_keep(grid: tuple[int, int], depth: int, placement: tuple[int, ...]) -> list[int]:
    """The keep list of a placement: each block's tokens out, each layer quartering the grid (an odd side padded) in
    the block it follows (the model's downsampling step sits in that block, after its attention)."""
    (h, w), keep = grid, []
    for block in range(1, depth + 1):
        if block in placement:
            h, w = math.ceil(h / 2), math.ceil(w / 2)
        keep.append(h * w)
    return keep


def conv_levels(config: Config, arch: Arch) -> dict[str, list[int]]:
    """``{"conv3-6-9": keep}``: ``experiment.conv``'s placements for ``arch``'s token grid and depth (the model built
    on the meta device: its shapes only), each a fixed keep list; empty without ``experiment.conv``."""
    conv = config.experiment.conv
    if conv is None or (conv.archs is not None and arch.label not in conv.archs):
        return {}
    import torch

    from pipeline.train.build import build_model

    with torch.device("meta"):
        model = build_model(base_stage(config, arch).config)
    grid, depth = tuple(model.patch_embed.grid_size), len(model.blocks)
    return {"conv" + "-".join(map(str, placement)): placement_keep(grid, depth, placement)
            for placement in conv_placements(grid, depth, config.experiment.conv.layers)}


@dataclass
class PlanCounts:
    base: int
    ksearch: int
    finetune: int
    evaluate: int

    def as_dict(self) -> dict[str, int]:
        return {"base": self.base, "ksearch": self.ksearch, "finetune": self.finetune, "evaluate": self.evaluate}


def count_plan(config: Config) -> PlanCounts:
    """How many stages of each kind the experiment expands to (K-search levels counted before dedupe)."""
    exp = config.experiment
    n_arch = len(archs(config))
    levels = len(exp.lambdas or []) + len(exp.levels or [])
    labels = [arch.label for arch in archs(config)]
    targets = [(t, sum(t.archs is None or label in t.archs for label in labels)) for t in exp.ksearch_targets or []]
    trained = sum(1 for arch in archs(config) if arch.label not in exp.base_checkpoints)
    finetune = n_arch * (levels * len(exp.methods) + int(exp.baseline))
    finetune += sum(searched * len(target_methods(exp, t.label)) for t, searched in targets)
    finetune += sum(len(conv_levels(config, arch)) for arch in archs(config))
    searches = n_arch * len(exp.lambdas or []) + sum(searched for _, searched in targets)
    untrained = 0
    if exp.no_finetune is not None:  # each base's unmodified model, and each method and carry at each of its levels
        arch_levels = n_arch * levels + sum(searched for _, searched in targets)
        untrained = n_arch + arch_levels * len(exp.no_finetune.methods) * len(exp.no_finetune.carry)
    return PlanCounts(base=trained, ksearch=searches, finetune=finetune, evaluate=finetune + untrained)
