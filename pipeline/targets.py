"""The K search toward a cost target (``train.ksearch_target``): the cost models it targets (a latency
table, or ``flops.gflops_cost_model``), its self-adjusting penalty, and the rounding of the learned retention
to a keep list under the target.

- ``TargetSearch``: the penalty ``mu * rho + w * (rho - t)^2`` on ``rho``, the expected cost of the
  soft keep list over the unmodified model's, with ``mu`` moved after each step by ``dual_rate *
  (rho - t)`` (a dual ascent on ``rho = t``): each block is weighted by its marginal cost, and the
  strength settles where the search lands on the target (docs/design.md says why).
- ``round_keep``: the non-increasing integer keep list that keeps the most learned retention mass
  with a predicted cost at most the target, each block's count among the candidates nearest where the
  search landed (the window widening until a list fits; an exact dynamic program over Pareto fronts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.config import CostTarget, PoolingConfig
from pipeline.config.train import AUTO_TABLE
from pipeline.cost import CostModel, check_table_key, file_sha256, load_cost_model
from pipeline.errors import InputError
from pipeline.flops import gflops_cost_model
from pipeline.methods import method_spec


def target_cost_model(target: CostTarget, model: nn.Module, pooling: PoolingConfig | None = None) -> CostModel:
    """The cost model a target is measured in: its table (checked against its recorded hash), or the GFLOPs of
    its method with the options ``pooling`` gives it (the config's pooling section; the method's defaults without)."""
    if target.cost == "gflops":
        return gflops_cost_model(model, target.method, options=method_options(pooling, target.method))
    if target.table == AUTO_TABLE:
        raise InputError("a latency target's table: auto is this machine's table, which `pipeline run` measures "
                         "before the K search; give `pipeline train` a table's path (`pipeline bench blocks` "
                         "measures one)")
    if target.table_sha256 is not None and file_sha256(target.table) != target.table_sha256:
        raise InputError(f"the cost table {target.table} changed since this K search was planned (sha256 "
                         f"{target.table_sha256[:12]}...); rerun `pipeline run` so that the stage's identity "
                         "follows it")
    table = load_cost_model(target.table)
    n_tokens, depth = model.patch_embed.num_patches, len(list(model.blocks))
    check_table_key(table.key, target.table)
    if table.key["embed_dim"] != model.embed_dim:
        raise InputError(f"the cost table {target.table} times width {table.key['embed_dim']}; this model is "
                         f"{model.embed_dim} wide (give one table per width: {{arch}} in the path)")
    if (table.num_tokens, table.depth, table.prefix) != (n_tokens, depth, model.num_prefix_tokens):
        raise InputError(f"the cost table {target.table} is for N={table.num_tokens}, depth {table.depth}, prefix "
                         f"{table.prefix}; this model has N={n_tokens}, depth {depth}, prefix "
                         f"{model.num_prefix_tokens}")
    return table


def method_options(pooling: PoolingConfig | None, method: str) -> dict[str, Any] | None:
    """``method``'s options from the config's pooling section, or None (its defaults) without one."""
    return None if pooling is None else pooling.method_options(method)


def option_differences(costs: CostModel, method: str, pooling: PoolingConfig | None) -> list[str]:
    """``key=TABLE's != FINETUNE's`` for each option of ``method`` whose value differs between what the cost table was
    measured with (its key's resolved options) and what the finetune runs (the config's, resolved); for a table of
    another method, ``method=TABLE's != FINETUNE's`` alone (it times none of ``method``'s options: WK-Medoids at any
    ``iters`` is not PoWER-BERT's pooling step); empty for a table that times the finetune's method and options.
    ``iters`` and ``significance`` change latency even where they do not change GFLOPs, so a table prices only the
    method and options it timed."""
    if costs.key["method"] != method:
        return [f"method={costs.key['method']!r} != {method!r}"]
    timed, run = costs.key["options"], method_spec(method).resolve(method, method_options(pooling, method) or {})
    return [f"{key}={timed.get(key)!r} != {run.get(key)!r}" for key in sorted({*timed, *run})
            if timed.get(key) != run.get(key)]


def target_fraction(target: CostTarget, costs: CostModel) -> float:
    """The target as a fraction of the unmodified model's cost."""
    return target.fraction if target.fraction is not None else target.value / costs.unmodified()


def retentions(model: nn.Module) -> list[Tensor]:
    """Each block's soft-extract weights, clamped to [0, 1] with the gradient passed through: L x (N,)."""
    from pipeline.models.downsampling import unit_interval

    found = [unit_interval(block.retention) for block in model.blocks if hasattr(block, "retention")]
    if not found:
        raise InputError("the model has no soft-extract layers; apply_downsampling(..., soft_extract=True)")
    return found


def soft_keep(weights: list[Tensor]) -> Tensor:
    """The expected token count of each block (its retained mass), made non-increasing as the effective keep
    list is: (L,), differentiable in the weights."""
    counts, previous = [], None
    for weight in weights:
        mass = weight.sum()
        previous = mass if previous is None else torch.minimum(previous, mass)
        counts.append(previous)
    return torch.stack(counts)


def landing(weights: list[Tensor]) -> list[float]:
    """The counts a K search landed on, which its rounding stays nearest: ``soft_keep`` as numbers, (L,)."""
    with torch.no_grad():
        return soft_keep(weights).tolist()


@dataclass
class TargetSearch:
    """The self-adjusting penalty of one K search toward ``fraction`` of the unmodified cost."""

    costs: CostModel
    fraction: float
    dual_rate: float
    quadratic: float
    dual: float | Tensor = 0.0  # mu: its sign says which way the task loss pulls; a tensor on the model's device
    last_ratio: Tensor | None = None  # once the search steps, so that a step reads nothing back to the host

    @classmethod
    def build(cls, target: CostTarget, model: nn.Module, pooling: PoolingConfig | None = None) -> TargetSearch:
        costs = target_cost_model(target, model, pooling)
        return cls(costs, target_fraction(target, costs), target.dual_rate, target.quadratic)

    def ratio(self, model: nn.Module) -> Tensor:
        """rho: the expected cost of the soft keep list over the unmodified model's, differentiable."""
        weights = retentions(model)
        return self.costs.expected(soft_keep(weights).double()) / self.costs.unmodified()

    def penalty(self, model: nn.Module) -> Tensor:
        rho = self.ratio(model)
        self.last_ratio = rho.detach()
        return (self.dual * rho + self.quadratic * (rho - self.fraction) ** 2).float()

    def update(self) -> None:
        """The dual step after an optimiser step: mu grows while the search costs more than the target."""
        if self.last_ratio is not None:
            self.dual = self.dual + self.dual_rate * (self.last_ratio - self.fraction)

    def dual_value(self) -> float:
        """mu as a number (a read of the device: at a checkpoint or the search's end, not every step)."""
        return float(self.dual)

    def result(self, model: nn.Module) -> tuple[list[int], dict[str, float]]:
        """The rounded keep list and how the search landed: ``target_landed`` (rho before rounding),
        ``target_rounded`` (the keep list's predicted ratio), ``target`` and ``target_dual``."""
        with torch.no_grad():
            landed = float(self.ratio(model))
            weights = [w.detach().double() for w in retentions(model)]
        keep = round_keep(weights, self.costs, self.fraction * self.costs.unmodified(), around=landing(weights))
        return keep, {"target": self.fraction, "target_landed": landed, "target_dual": self.dual_value(),
                      "target_rounded": self.costs.predict(keep) / self.costs.unmodified()}


CANDIDATE_COUNTS = 48  # about as many evenly spaced counts besides the curves' points (every count while N < 72)


def candidates(costs: CostModel) -> list[int]:
    """The token counts a rounded keep list takes: the points of the cost curves (where their steps are), N, and
    every ``max(1, round(N / CANDIDATE_COUNTS))``-th count between them, so that a list can land near its limit where
    the curves are coarser than that (a table's grid step of 8 on a 49-token model left the demo's lists 0.1
    of the unmodified time apart); 0 (only the prefix goes on) only for a model with prefix tokens."""
    spacing = max(1, round(costs.num_tokens / CANDIDATE_COUNTS))
    points = {*costs.attn.xs, *costs.mlp.xs, *costs.pool.ns, *(x for c in costs.pool.curves for x in c.xs),
              *range(0, costs.num_tokens, spacing), costs.num_tokens}
    low = 0 if costs.prefix > 0 else 1
    return sorted(p for p in points if low <= p <= costs.num_tokens)


def cheapest_fraction(costs: CostModel) -> float:
    """The lowest cost over the unmodified model's that a rounded keep list can have (over ``candidates``): a target
    below it cannot be met."""
    return costs.cheapest(candidates(costs))[0] / costs.unmodified()


# The rounding's rule, in a target K search's id (``dag.plan``): a search rounded under an earlier rule (the most mass
# over every list) is not reused for this one's keep list.
ROUNDING = "near-landing"
TIE = 1e-9  # retention masses closer than this are a tie, which the list spending more of the limit wins


def round_keep(weights: list[Tensor], costs: CostModel, limit: float,
               around: Sequence[float] | None = None) -> list[int]:
    """The non-increasing keep list over ``candidates(costs)`` with the most kept retention mass (keeping k tokens
    in block l keeps its ranks 0..k-1: ``sum(weights[l][:k])``) whose predicted cost is at most ``limit``; where
    lists keep equal mass (weights clamped at 0 or 1), the one that spends more of the limit.

    ``around`` (L,): the counts the K search landed on (``soft_keep``). Block l's count is then one of the
    candidates nearest ``around[l]``: the candidate at or below it and the one at or above it (radius 1), and where
    no such list fits the limit, the ``r - 1`` candidates beyond each of those, r = 2, 4, 8, ..., until one fits
    (every candidate, at the last). The search lands its expected cost on the target; a rounding over every list
    would trade its counts for whatever keeps most mass under the limit (the demo's lat0.8 search landed on about
    20 tokens a block at 0.7996 of the unmodified time, with weights equal within each block, and the most mass
    over every list was ``[49, 49, 0, 0]``, predicted at 0.724). Without ``around``, every candidate.

    Exact over the counts allowed: a dynamic program over blocks whose state is the count kept so far, holding for
    each state the Pareto front of (cost so far, value so far), the value being the mass plus ``TIE`` times the cost
    over the limit: the value adds up block by block, so the tie rule is decided inside the fronts, and a mass
    ``TIE`` higher always beats any cost within the limit. "No pooling step" (k = the count received) is one of the
    choices where it is allowed. A partial list over the limit is dropped, which is exact because no block costs
    less than 0 (``cost.Curve`` holds its ends). Raises InputError when even the cheapest list costs more than
    ``limit``.
    """
    counts = candidates(costs)
    if around is not None and len(around) != costs.depth:
        raise ValueError(f"around has {len(around)} counts; the cost model has {costs.depth} blocks")
    radius = 1
    while True:
        allowed = [counts] * costs.depth if around is None else [_nearest(counts, c, radius) for c in around]
        best = _most_mass(weights, costs, limit, allowed)
        if best is not None:
            return best
        if around is None or all(len(a) == len(counts) for a in allowed):
            break
        radius *= 2
    cheapest, full = costs.cheapest(counts)[0], costs.unmodified()
    raise InputError(f"no keep list costs at most {limit:.4g} {costs.unit}: the cheapest over the cost model's "
                     f"counts costs {cheapest:.4g}, {cheapest / full:.3f} of the unmodified {full:.4g}; raise the "
                     "target")


def _nearest(counts: list[int], count: float, radius: int) -> list[int]:
    """The candidates (sorted ``counts``) nearest ``count``: the last at or below it and the first at or above it,
    and ``radius - 1`` more beyond each."""
    below = sum(1 for c in counts if c <= count) - 1  # -1: count is below every candidate
    above = next((i for i, c in enumerate(counts) if c >= count), len(counts) - 1)
    return counts[max(0, below - radius + 1):above + radius]


def _most_mass(weights: list[Tensor], costs: CostModel, limit: float,
               allowed: list[list[int]]) -> list[int] | None:
    """``round_keep``'s dynamic program, block l choosing its count from ``allowed[l]``; None where no list fits."""
    tie = TIE / max(abs(limit), 1e-300)
    mass = [torch.cat([w.new_zeros(1), w.cumsum(0)]).tolist() for w in weights]  # mass[l][k]
    fronts: dict[int, list[tuple[float, float, tuple[int, ...]]]] = {costs.num_tokens: [(costs.fixed, 0.0, ())]}
    for layer in range(costs.depth):
        nxt: dict[int, list[tuple[float, float, tuple[int, ...]]]] = {}
        for n, front in fronts.items():
            for k in (c for c in allowed[layer] if c <= n):
                step = costs.block(n, k)
                gain = mass[layer][min(k, len(mass[layer]) - 1)] + tie * step
                nxt.setdefault(k, []).extend((cost + step, value + gain, keep + (k,)) for cost, value, keep in front
                                             if cost + step <= limit + 1e-12 * abs(limit))
        fronts = {k: _pareto(items) for k, items in nxt.items() if items}
    best = max((item for front in fronts.values() for item in front), key=lambda i: i[1], default=None)
    return None if best is None else list(best[2])


def _pareto(items: list[tuple[float, float, tuple[int, ...]]]) -> list[tuple[float, float, tuple[int, ...]]]:
    """The items no other item beats in both cost (lower) and value (higher)."""
    front, best = [], float("-inf")
    for item in sorted(items, key=lambda i: (i[0], -i[1])):
        if item[1] > best:
            front.append(item)
            best = item[1]
    return front


# What a measurement of a keep list gives (``dag.latency.measure_on_table``): a paired ratio to the unmodified
# model with its interval (``bench.paired.SpeedRatio``: ``ratio``, ``low``, ``high``), a bare ratio, or None; and how
# it came about.
Measure = Callable[[CostModel, list[int]], tuple[Any, str]]


def measured_ratio(value: Any) -> tuple[float | None, float | None, float | None]:
    """(ratio, low, high) of what a ``Measure`` gave: a paired ratio's, a bare ratio as its own interval, or Nones."""
    if value is None:
        return None, None, None
    if isinstance(value, (int, float)):
        return float(value), float(value), float(value)
    return value.ratio, value.low, value.high


@dataclass(frozen=True)
class TargetCost:
    """A finetuned model against the K-search target of its level (one row of the report's target table)."""

    target: str  # the level name (lat0.8, gf0.5)
    unit: str  # "ms" or "gflops"
    target_cost: float  # the target as an absolute figure
    predicted: float | None  # the cost model's figure at the model's keep list, for its method
    measured: float | None  # GFLOPs: the evaluate stage's fvcore count; ms: the measured ratio times the measured
    # unmodified model's time, both from one paired measurement at the table's setting (None: see ``status``)
    status: str  # how ``measured`` came about, or why there is none
    measured_low: float | None = None  # the ratio's 95% interval x the measured reference (ms)
    measured_high: float | None = None
    speed_blocks: int | None = None  # the paired measurement's blocks, why they stopped and its relative half-width
    speed_stop: str | None = None
    speed_half_width: float | None = None


def target_cost(target: CostTarget, model: nn.Module, method: str, keep: list[int], gflops: float,
                measure: Measure | None = None, pooling: PoolingConfig | None = None) -> TargetCost:
    """``model`` (the finetune's network: its structure only) with ``method`` at ``keep`` against ``target``.

    A GFLOPs target is predicted with the closed forms for the model's own method (its pooling step may cost more
    than the searched method's) and measured by the evaluate stage's count. A latency target is predicted with its
    table; ``measure(table, keep)`` (``dag.latency.measure_on_table``) gives the paired measurement against the
    unmodified model (a ``bench.paired.SpeedRatio``: the ratio, its interval and the unmodified model's measured
    time), or None and why (another machine or setting than the table's key), for the table's own method only: the
    measured milliseconds are the ratio times that measured time, never the table's prediction of it.
    """
    if target.cost == "gflops":
        costs = target_cost_model(target, model, pooling)
        limit = target_fraction(target, costs) * costs.unmodified()
        predicted = (gflops_cost_model(model, method, options=method_options(pooling, method)).predict(keep)
                     if method_spec(method).flops is not None else None)
        return TargetCost(target.label, "gflops", limit, predicted, gflops, "measured (fvcore count)")
    costs = target_cost_model(target, model, pooling)
    limit = target_fraction(target, costs) * costs.unmodified()
    table_method, differences = costs.key["method"], option_differences(costs, method, pooling)
    if differences:
        timed = (f"{table_method}, not {method}" if table_method != method else
                 f"other options: {'; '.join(differences)}")
        return TargetCost(target.label, costs.unit, limit, costs.predict(keep), None, f"predicted (the table times "
                          f"{timed})")
    value, status = (None, "predicted (not measured)") if measure is None else measure(costs, keep)
    if value is None:
        return TargetCost(target.label, costs.unit, limit, costs.predict(keep), None, status)
    reference_ms = value.reference_s * 1e3  # the unmodified model's measured time, in the table's setting
    return TargetCost(target.label, costs.unit, limit, costs.predict(keep), value.ratio * reference_ms, status,
                      value.low * reference_ms, value.high * reference_ms, value.blocks, value.stop, value.half_width)


@dataclass(frozen=True)
class Repair:
    """What the check of a searched keep list against the machine found, and the list the finetunes get."""

    keep: list[int]  # the searched list, or the repaired one
    searched: list[int]
    measured: float | None  # the final list's measured cost ratio; None where it could not be measured
    status: str
    tries: int = 0  # roundings under a tightened limit
    first: float | None = None  # the searched list's measured cost ratio
    low: float | None = None  # the final list's measured ratio's 95% interval
    high: float | None = None


def repair_keep(weights: list[Tensor], costs: CostModel, fraction: float, keep: list[int], measure: Measure,
                tries: int = 3) -> Repair:
    """Measures ``keep`` (the rounding's list) and, while the lower end of its measured interval is over ``fraction``
    of the unmodified model (it is over the target beyond the measurement's doubt), rounds the retention again under
    a limit tightened by target / measured (at most ``tries`` times).

    ``measure(costs, keep)``: the measured cost ratio to the unmodified model (``Measure``), or None and why. A list
    that still measures over the target after ``tries`` is kept, and its status says so.
    """
    value, status = measure(costs, keep)
    ratio, low, high = measured_ratio(value)
    limit, searched, tried, first = fraction * costs.unmodified(), list(keep), 0, ratio
    while low is not None and low > fraction and tried < tries:
        limit *= fraction / ratio
        tried += 1
        try:
            keep = round_keep(weights, costs, limit, around=landing(weights))
        except InputError:
            return Repair(keep, searched, ratio, f"over the target ({ratio:.3f} > {fraction:.3f}) and no list fits a "
                          "tighter limit; " + status, tried, first, low, high)
        value, status = measure(costs, keep)
        ratio, low, high = measured_ratio(value)
    if low is not None and low > fraction:
        status = f"still over the target after {tried} repair(s): " + status
    return Repair(keep, searched, ratio, status, tried, first, low, high)
