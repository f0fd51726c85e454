"""What a keep list costs: a model's time (or GFLOPs) as a sum of per-block curves in the token counts.

Every block of a ViT has the same parts, so one block's cost depends only on the tokens it receives
and keeps. Block l receives ``n`` non-prefix tokens (``N`` in block 1, ``K_{l-1}`` after) and keeps
``k = K_l``; with ``p`` prefix tokens (class, distillation, registers) riding along it costs

    attn(n) + pool(n, k) + mlp(k)

where ``attn`` is the first half (norm, qkv, attention, projection, residual) at ``n + p`` tokens,
``mlp`` the second half at ``k + p`` tokens, and ``pool`` the downsampling step, 0 when the block keeps
every token (``k == n``) or only the prefix (``k == 0``: a slice). A model costs ``fixed`` (patch
embedding, final norm, head) plus its blocks. The curves are piecewise linear between measured points
(``pipeline bench blocks`` measures them; ``pipeline.targets`` builds the GFLOPs ones), so the
cost of a soft keep list (the K search's expected token counts) is differentiable in it
(``CostModel.expected``).

Written here rather than taken from a library: the latency lookup tables of ProxylessNAS, FBNet or
HALP are per-architecture research code, none of them installable, and none models a pooling step
whose cost depends on both the tokens in and the tokens out.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import ConfigDict, Field
from torch import Tensor

from pipeline.config.base import MethodName, PatchEmbed
from pipeline.errors import InputError
from pipeline.kernel_choices import CompileMode
from pipeline.stored import Record, read_record

SCHEMA_VERSION = 1


def interpolate(x: Tensor, xs: Tensor, ys: Tensor) -> Tensor:
    """``numpy.interp`` in torch: linear between the two nearest of the points ``(xs, ys)`` (``xs`` increasing),
    the end values held outside them; x any shape, differentiable in x (the segment's slope; 0 outside).
    ``ys`` may be (..., P): the points' values of several curves on one ``xs``, giving (..., *x.shape)."""
    if xs.numel() == 1:  # the one point's value everywhere: (..., 1) -> (..., *x.shape), whatever x's dims
        return ys[..., :1].reshape(*ys.shape[:-1], *(1,) * x.dim()).expand(*ys.shape[:-1], *x.shape) + 0.0 * x
    i = (torch.searchsorted(xs, x.detach().contiguous(), right=True) - 1).clamp(0, xs.numel() - 2)
    x0, x1 = xs[i], xs[i + 1]
    held = torch.minimum(torch.maximum(x, xs[0]), xs[-1])
    return ys[..., i] + (ys[..., i + 1] - ys[..., i]) * (held - x0) / (x1 - x0)


class _Cached:
    """Tensors built once per (dtype, device) and kept on the instance (not a field: equality, hashing and
    JSON ignore them), so that a K search's step builds none from Python lists."""

    def _tensors(self, dtype: torch.dtype, device: torch.device, build: Callable[[], tuple[Tensor, ...]]
                 ) -> tuple[Tensor, ...]:
        cache = self.__dict__.setdefault("_tensor_cache", {})
        found = cache.get((dtype, device))
        if found is None:
            found = cache[(dtype, device)] = tuple(t.to(dtype=dtype, device=device) for t in build())
        return found


@dataclass(frozen=True)
class Curve(_Cached):
    """A piecewise-linear function of a token count: ``xs`` strictly increasing, ``ys`` the costs; the end
    values hold past the ends (a measured cost is never extended into a guess, such as a negative one)."""

    xs: tuple[int, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or not self.xs:
            raise InputError(f"a cost curve needs as many costs as token counts, at least one ({len(self.xs)} "
                             f"counts, {len(self.ys)} costs)")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise InputError(f"a cost curve's token counts must increase strictly, got {list(self.xs)}")

    def __call__(self, x: float) -> float:
        """The cost at ``x`` tokens: linear between the two nearest points, the nearest point's cost outside."""
        if x <= self.xs[0]:
            return self.ys[0]
        if x >= self.xs[-1]:
            return self.ys[-1]
        i = bisect.bisect_right(self.xs, x) - 1
        x0, x1, y0, y1 = self.xs[i], self.xs[i + 1], self.ys[i], self.ys[i + 1]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def at(self, x: Tensor) -> Tensor:
        """``self(x)`` for a tensor of token counts (any shape), differentiable in ``x``."""
        xs, ys = self._tensors(x.dtype, x.device, lambda: (torch.tensor(self.xs, dtype=torch.float64),
                                                           torch.tensor(self.ys, dtype=torch.float64)))  # not float32
        return interpolate(x, xs, ys)


@dataclass(frozen=True)
class PoolSurface(_Cached):
    """The downsampling step's cost over (tokens in ``n``, tokens kept ``k``): one curve in ``k`` per
    measured ``n`` (points with ``k <= n``), linear in ``n`` between two measured ``n``; the nearest measured
    ``n`` (and each curve's nearest ``k``) holds outside them."""

    ns: tuple[int, ...]
    curves: tuple[Curve, ...]

    def __post_init__(self) -> None:
        if len(self.ns) != len(self.curves) or not self.ns:
            raise InputError("a pooling surface needs one curve in k per token count n, at least one")
        if any(b <= a for a, b in zip(self.ns, self.ns[1:])):
            raise InputError(f"a pooling surface's token counts n must increase strictly, got {list(self.ns)}")
        for n, curve in zip(self.ns, self.curves):
            if curve.xs[-1] > n:
                raise InputError(f"the pooling curve at n={n} has a point at k={curve.xs[-1]} > n")

    def __call__(self, n: float, k: float) -> float:
        if len(self.ns) == 1 or n <= self.ns[0]:
            return self.curves[0](k)
        if n >= self.ns[-1]:
            return self.curves[-1](k)
        i = bisect.bisect_right(self.ns, n) - 1
        t = (n - self.ns[i]) / (self.ns[i + 1] - self.ns[i])
        return (1 - t) * self.curves[i](k) + t * self.curves[i + 1](k)

    def _grid(self) -> tuple[Tensor, Tensor, Tensor]:
        """The ``ns`` (C,), the union ``us`` (U,) of the curves' counts, and each curve at them (C, U): on a grid
        holding every curve's points, linear interpolation reproduces each curve exactly (ends held)."""
        us = sorted({x for curve in self.curves for x in curve.xs})
        return (torch.tensor(self.ns, dtype=torch.float64), torch.tensor(us, dtype=torch.float64),
                torch.tensor([[curve(u) for u in us] for curve in self.curves], dtype=torch.float64))

    def at(self, n: Tensor, k: Tensor) -> Tensor:
        """``self(n, k)`` for tensors of one shape, differentiable in both, with no read of their values on the
        host (every curve at ``k``, then linear in ``n`` between the two nearest ``ns``)."""
        ns, us, table = self._tensors(k.dtype, k.device, self._grid)
        at_k = interpolate(k, us, table)  # (C, *k.shape): each curve at k
        if ns.numel() == 1:
            return at_k[0]
        j = (torch.searchsorted(ns, n.detach().contiguous(), right=True) - 1).clamp(0, ns.numel() - 2)
        held = torch.minimum(torch.maximum(n, ns[0]), ns[-1])
        t = (held - ns[j]) / (ns[j + 1] - ns[j])
        lo = at_k.gather(0, j.unsqueeze(0)).squeeze(0)
        hi = at_k.gather(0, (j + 1).unsqueeze(0)).squeeze(0)
        return (1 - t) * lo + t * hi


@dataclass(frozen=True)
class CostModel:
    """A model's cost as a function of its keep list (see the module docstring).

    Attributes:
        unit: ``"ms"`` (a measured latency table) or ``"gflops"``.
        num_tokens: N, the non-prefix tokens after the patch embedding.
        prefix: p, the prefix tokens every block carries.
        depth: L, the blocks.
        fixed: the cost outside the blocks.
        attn: the first half of a block against the non-prefix tokens it receives.
        mlp: the second half against the non-prefix tokens it keeps.
        pool: the downsampling step against (received, kept).
        key: what the figures depend on (device, dtype, batch, versions, kernels, model, method...).
        predicted: True when the figures are used for another machine than the one that measured them.
    """

    unit: str
    num_tokens: int
    prefix: int
    depth: int
    fixed: float
    attn: Curve
    mlp: Curve
    pool: PoolSurface
    key: dict[str, Any] = field(default_factory=dict)
    predicted: bool = False

    def block(self, n: int, k: int) -> float:
        """One block's cost, receiving ``n`` non-prefix tokens and keeping ``k <= n``."""
        step = self.pool(n, k) if 0 < k < n else 0.0
        return self.attn(n) + step + self.mlp(k)

    def predict(self, keep: list[int]) -> float:
        """The whole model's cost at an effective keep list (non-increasing, each at most N)."""
        check_keep(keep, self.num_tokens, self.depth)
        total, n = self.fixed, self.num_tokens
        for k in keep:
            total += self.block(n, k)
            n = k
        return total

    def unmodified(self) -> float:
        """The cost with every token kept in every block (no pooling step anywhere)."""
        found = self.__dict__.get("_unmodified")
        if found is None:
            found = self.__dict__["_unmodified"] = self.predict([self.num_tokens] * self.depth)
        return found

    def expected(self, soft_keep: Tensor) -> Tensor:
        """The cost of a soft keep list (L,) of real token counts, differentiable in it.

        A block whose count is below what it receives pays the pooling step at those counts; whether it pools is
        decided on the device (a mask, no gradient), so a step reads nothing back to the host.
        """
        if soft_keep.shape != (self.depth,):
            raise InputError(f"a soft keep list has one count per block: expected ({self.depth},), "
                             f"got {tuple(soft_keep.shape)}")
        received = torch.cat([soft_keep.new_full((1,), float(self.num_tokens)), soft_keep[:-1]])  # (L,)
        pools = (soft_keep.detach() > 0) & (soft_keep.detach() < received.detach())
        step = torch.where(pools, self.pool.at(received, soft_keep), torch.zeros_like(soft_keep))
        return self.fixed + (self.attn.at(received) + step + self.mlp.at(soft_keep)).sum()

    def cheapest(self, counts: list[int]) -> tuple[float, list[int]]:
        """The lowest predicted cost of a keep list over ``counts`` (which must hold N) and that list: a dynamic
        program over blocks whose state is the count kept so far."""
        best: dict[int, tuple[float, list[int]]] = {self.num_tokens: (self.fixed, [])}
        for _ in range(self.depth):
            nxt: dict[int, tuple[float, list[int]]] = {}
            for n, (cost, keep) in best.items():
                for k in (c for c in counts if c <= n):
                    total = cost + self.block(n, k)
                    if k not in nxt or total < nxt[k][0]:
                        nxt[k] = (total, keep + [k])
            best = nxt
        return min(best.values(), key=lambda item: item[0])

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)  # the fields only: the tensor caches are attributes, not fields
        data["schema_version"] = SCHEMA_VERSION
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str = "the cost table", path: str | Path | None = None
                  ) -> CostModel:
        """The table of ``data`` (``to_json``'s); an InputError naming ``where`` (its file, ``path``) if it is not one
        this release reads."""
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise InputError(f"{where} has schema_version {version!r}; this release reads {SCHEMA_VERSION}; "
                             + remeasure(path))
        try:
            pool = data["pool"]
            return cls(
                unit=data["unit"], num_tokens=int(data["num_tokens"]), prefix=int(data["prefix"]),
                depth=int(data["depth"]), fixed=float(data["fixed"]),
                attn=Curve(tuple(data["attn"]["xs"]), tuple(data["attn"]["ys"])),
                mlp=Curve(tuple(data["mlp"]["xs"]), tuple(data["mlp"]["ys"])),
                pool=PoolSurface(tuple(pool["ns"]), tuple(Curve(tuple(c["xs"]), tuple(c["ys"]))
                                                          for c in pool["curves"])),
                key=dict(data.get("key", {})), predicted=bool(data.get("predicted", False)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"{where} is not a cost table ({type(err).__name__}: {err}); "
                             + remeasure(path)) from None


def check_keep(keep: list[int], num_tokens: int, depth: int) -> None:
    """InputError unless ``keep`` is an effective keep list: ``depth`` non-increasing counts in [0, N]."""
    if len(keep) != depth:
        raise InputError(f"the keep list {keep} has {len(keep)} entries; the model has {depth} blocks")
    previous = num_tokens
    for layer, k in enumerate(keep):
        if not 0 <= k <= previous:
            raise InputError(f"keep[{layer}] is {k}: an effective keep list is non-increasing and in [0, "
                             f"{num_tokens}] (block {layer + 1} receives {previous} tokens)")
        previous = k


def save_cost_model(model: CostModel, path: str | Path) -> Path:
    """Writes ``model`` to ``path`` whole or not at all: into a temporary file beside it, renamed over it, so that a
    process killed while writing leaves the table it replaced (or none), never half of one that every run trips on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(model.to_json(), indent=1, sort_keys=True) + "\n"
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared table from its other readers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remeasure(path: str | Path | None = None) -> str:
    """What to do about a table file that does not load: `pipeline bench blocks` measures it again into the same path
    (it replaces a file that is not a table of this release), as `pipeline run` does for a ``table: auto``."""
    out = "" if path is None else f" --out {path}"
    return f"measure it again with `pipeline bench blocks{out}` (it replaces a table that does not load)"


def load_cost_model(path: str | Path) -> CostModel:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no cost table at {path}; measure one with `pipeline bench blocks`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not valid JSON ({err}); {remeasure(path)}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a cost table (a JSON {type(data).__name__}); {remeasure(path)}")
    return CostModel.from_json(data, where=str(path), path=path)


def table_loads(path: str | Path) -> bool:
    """Whether ``path`` is a file that loads as a cost table of this release (``load_cost_model``): a damaged or
    older one is measured again, not read."""
    try:
        load_cost_model(path)
    except (InputError, OSError):
        return False
    return True


Positive = Annotated[int, Field(ge=1)]


class TableKey(Record):
    """What a latency table's key holds for the setting it was measured at to be read back
    (``bench.blocks.settings_from_key``) and for a latency target to price a finetune by it (``targets``), typed:
    every table `pipeline bench blocks` writes has them. The rest of a key
    says what the table was measured on (the device, the versions, the kernels that ran, the measurement's summary):
    ``key_differences`` compares those as a whole, and a release may record more of them, so they are kept as given."""

    model_config = ConfigDict(extra="allow")

    model: str
    img_size: Positive
    patch_size: Positive
    embed_dim: Positive
    depth: Positive
    num_heads: Positive
    num_classes: Positive
    patch_embed: PatchEmbed
    method: MethodName
    options: dict[str, Any]
    batch: Positive
    dtype: str
    compile: CompileMode
    threads: Positive
    device_type: str
    clock: Literal["wall", "cpu"]
    kernel_choice: dict[str, str]


TABLE_KEY_FIELDS = tuple(TableKey.model_fields)


def check_table_key(key: dict[str, Any], where: str) -> None:
    """InputError naming each of the ``TABLE_KEY_FIELDS`` the key of the table at ``where`` lacks or holds with
    another type (``TableKey``)."""
    read_record(TableKey, key, f"the cost table {where}'s key",
                "measure it again with `pipeline bench blocks`, which records them")


def key_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``NAME: RECORDED != CURRENT`` for every key field whose values differ (a field only one side has too)."""
    names = sorted(recorded.keys() | current.keys())
    return [f"{name}: {recorded.get(name)!r} != {current.get(name)!r}" for name in names
            if recorded.get(name) != current.get(name)]


# The key fields that describe the machine rather than what the table measures: an explicit override
# (``bench latency-check --other-device``) may let them differ, to predict another device's latency. The
# rest (model, method and its options, batch, dtype, compile mode) say what was timed and never differ.
MACHINE_FIELDS = ("device", "device_type", "threads", "torch", "timm", "triton", "kernels")


def check_key(table: CostModel, current: dict[str, Any], *, other_device: bool = False,
              where: str = "the table") -> CostModel:
    """``table`` if its key equals ``current`` (the machine and setting about to measure or validate);
    with ``other_device`` and only machine fields differing (``MACHINE_FIELDS``), the table marked
    ``predicted``; else an InputError listing each differing field.

    Called where latency is measured against a table, not where a K search uses a table as a cost model.
    """
    differences = key_differences(table.key, current)
    if not differences:
        return table
    fixed = [line for line in differences if line.split(":", 1)[0] not in MACHINE_FIELDS]
    if other_device and not fixed:
        return replace(table, predicted=True)
    lines = "\n  ".join(fixed if other_device else differences)
    hint = ("these fields say what the table measured; measure a table for this setting with `pipeline bench "
            "blocks`" if other_device else
            "measure a table on this machine with `pipeline bench blocks`, or pass --other-device to use it as a "
            "prediction for this machine (marked predicted)")
    raise InputError(f"{where} was measured under another key (recorded != here):\n  {lines}\n{hint}")


def file_sha256(path: str | Path) -> str:
    """A table file's content hash: what a stage's identity and a latency record name it by."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
