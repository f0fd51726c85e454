"""The downsampling methods: everything the rest of the project knows about each one, in one place.

This module imports no torch, so the config (and ``jobs/submit.py`` on a laptop that only submits
jobs) can validate method names and options with pydantic and PyYAML alone. The operators themselves
are named by ``"module:attribute"`` and imported on first use.

Adding a method is one module with its operator plus one ``register_method`` call::

    from pipeline.methods import MethodSpec, Option, register_method

    register_method("firstk", MethodSpec(
        build="mypackage.firstk:build",   # build(**options) -> step(tokens, k, *, scores, sizes, metric, ...)
        summary="keep the first K tokens",
        options={"offset": Option(0, minimum=0, doc="the first token kept")},
        flops=lambda n, k, width, options: 0,  # its step's multiply-adds, for GFLOPs targets
    ))

or, from another installed package, one entry point in the group ``pipeline.methods`` naming a
``MethodSpec`` (``firstk = "mypackage.firstk:SPEC"`` under ``[project.entry-points."pipeline.methods"]``):
it loads wherever the registry is first read, so in the CLI, the config validation and every Ray worker.
The config, ``pipeline flops``, the benchmarks, training and the analyses then accept ``method: firstk``
(docs/architecture.md). Every method's options, built-in or not, are set under ``pooling.options.<method>``
and checked against its ``Option`` declarations. A plugin may not take a built-in method's name, a plugin
that does not load is named in a warning while the others load, and the package and version of a plugin's
method are part of its stages' identities and its runs' MLflow tags (``Plugin``).

The operators live in ``pipeline.pooling``, which never imports this module: the registry names their
factories by ``"module:attribute"``, so there is no import loop.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Any

from pipeline.errors import InputError, PipelineWarning

PLUGIN_GROUP = "pipeline.methods"  # entry points naming a MethodSpec of another package

# An option's type, from its default (None: any YAML value); an int is accepted where a float is.
_OPTION_TYPES: tuple[tuple[type, tuple[type, ...]], ...] = (
    (bool, (bool,)), (int, (int,)), (float, (int, float)), (str, (str,)), (list, (list,)), (dict, (dict,)))


@dataclass(frozen=True)
class Option:
    """One option of a method, declared once: the config, ``--set``, the stage identity, the GFLOPs and
    ``pipeline methods`` read it from here.

    Attributes:
        default: the value it takes when not set; its type is the option's type (None: any YAML value).
        choices: the values it may take (None: any of its type).
        minimum: the smallest value a number may take.
        counted: changes the pooling step's GFLOPs (``MethodSpec.flops``), so a GFLOPs target's cost model
            and a K search toward it depend on it.
        doc: one line for ``pipeline methods`` and the docs.
    """

    default: Any
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    counted: bool = False
    doc: str = ""

    def check(self, where: str, value: Any) -> Any:
        """``value`` as this option takes it (an int where a float is: a float); InputError naming ``where``."""
        if self.default is None:
            if value is not None and not isinstance(value, (bool, int, float, str, list, dict)):
                raise InputError(f"{where} takes a YAML value, got {type(value).__name__}")
        else:
            value = _typed(where, value, self.default)
        if self.choices is not None and value not in self.choices:
            raise InputError(f"{where} is one of {', '.join(map(repr, self.choices))}, got {value!r}")
        if self.minimum is not None and isinstance(value, (int, float)) and not value >= self.minimum:  # NaN too
            raise InputError(f"{where} is at least {self.minimum:g}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{where} is a finite number, got {value!r}")
        return value

    def samples(self) -> tuple[Any, ...]:
        """Two values it allows where it has a second (its default first; another choice, the other bool, or a number
        at its minimum or 1 above), else its default alone: what ``models.probe`` runs the operator with."""
        default = self.default
        if self.choices is not None:
            return (default, *[c for c in self.choices if c != default][:1])
        if isinstance(default, bool):
            return default, not default
        if isinstance(default, (int, float)):
            other = self.minimum if self.minimum is not None and self.minimum != default else default + 1
            return default, type(default)(other)
        return (default,)

    def describe(self) -> str:
        """``5 (>= 1)`` or ``'tokens' (tokens, metric; counted in GFLOPs)``: its default, what it allows and
        whether it changes the GFLOPs."""
        notes = [", ".join(map(str, self.choices)) if self.choices is not None
                 else f">= {self.minimum:g}" if self.minimum is not None else "", "counted in GFLOPs" * self.counted]
        notes = [note for note in notes if note]
        return f"{self.default!r}" + (f" ({'; '.join(notes)})" if notes else "")


def _typed(where: str, value: Any, default: Any) -> Any:
    for kind, accepted in _OPTION_TYPES:
        if isinstance(default, kind):
            if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
                raise InputError(f"{where} takes a value of type {kind.__name__} (its default is {default!r}), "
                                 f"got {value!r}")
            return float(value) if kind is float else value
    return value


@dataclass(frozen=True)
class MethodSpec:
    """One registered method: everything the project knows about it.

    Attributes:
        build: the operator's factory, or ``"module:attribute"`` naming it. Called as
            ``build(**options)``, or ``build(dim, **options)`` for a learnable method (one instance
            per downsampling block, ``build(dim, grid=(h, w), k=K)``).
        summary: one line for ``pipeline methods``.
        needs_scores: reads significance scores (eq. 4 by default; the models compute them only then).
        options: the options it accepts, by name: an ``Option``, or a plain default (``{"offset": 0}`` is
            ``{"offset": Option(0)}``). They are set under ``pooling.options.<method>``. Two names mean
            something to the models: ``cluster_on: metric`` makes them hand the step the attention keys
            averaged over heads as ``metric``; ``significance: cls`` makes them compute its scores from the
            class token's attention instead of eq. 4.
        flops: the multiply-adds of its pooling step, ``flops(n, k, width, options)`` for n non-prefix tokens
            pooled to k, clustering vectors of ``width`` (the tokens', or the head width with ``cluster_on:
            metric``), with its resolved options (those marked ``counted`` may change it); None where it has no
            closed form (GFLOPs targets and ``pipeline flops``' fvcore count differ then).
        takes_kernels: its step takes the model's ``kernels`` (the fused-kernel choice) as an argument.
        learnable: has parameters of its own, one set per block.
        reconstructs: takes part in ``analyze reconstruction`` (parameter-free methods that downsample).
        downsamples: takes tokens away; False only for the method that keeps every token (the baseline).
        swept: in an experiment's default method list (``experiment.methods``).
        keeps_positions: each output has an input token behind it (``PoolResult.index``: a selection's kept token,
            K-Medoids' medoid), whose position a pooled token of a rotary family (EVA-02, ...) keeps; methods whose
            outputs are new vectors are refused for those families (``models.families``).
    """

    build: Callable[..., Any] | str
    summary: str
    needs_scores: bool = False
    options: Mapping[str, Option] = field(default_factory=dict)
    flops: Callable[[int, int, int, Mapping[str, Any]], int] | None = None
    takes_kernels: bool = False
    learnable: bool = False
    reconstructs: bool = True
    downsamples: bool = True
    swept: bool = False
    keeps_positions: bool = False

    def __post_init__(self) -> None:
        declared = {name: value if isinstance(value, Option) else Option(value) for name, value in self.options.items()}
        for name, option in declared.items():  # a default its own declaration refuses is the spec's mistake
            option.check(f"the default of option {name!r} of MethodSpec {self.summary!r}", option.default)
        object.__setattr__(self, "options", MappingProxyType(declared))

    def factory(self) -> Callable[..., Any]:
        if callable(self.build):
            return self.build
        module, _, attribute = self.build.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def defaults(self) -> dict[str, Any]:
        """Every option at its default."""
        return {name: option.default for name, option in self.options.items()}

    def resolve(self, name: str, given: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults updated by ``given``, each value checked against its ``Option``; InputError for an
        option this method does not take or a value it does not allow, naming ``pooling.options.NAME.KEY``."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            accepted = ", ".join(sorted(self.options)) or "none"
            raise InputError(f"pooling.options.{name}: method {name!r}{_origin(name)} has no option "
                             f"{', '.join(map(repr, unknown))}; it takes: {accepted}")
        checked = {key: self.options[key].check(f"pooling.options.{name}.{key}{_origin(name)}", value)
                   for key, value in given.items()}
        return {**self.defaults(), **checked}

    def counted(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The (resolved) options that change its pooling step's GFLOPs."""
        return {key: options[key] for key, option in self.options.items() if option.counted and key in options}

    def needs_metric(self, options: Mapping[str, Any]) -> bool:
        """Whether, with these (resolved) options, the method clusters on the mean keys."""
        return options.get("cluster_on") == "metric"

    @staticmethod
    def significance(options: Mapping[str, Any]) -> str:
        """Which scores the models compute for it, with these (resolved) options: ``"eq4"`` or ``"cls"``."""
        return options.get("significance", "eq4")


def _origin(name: str) -> str:
    plugin = METHODS.plugins.get(name)
    return f" (from {plugin})" if plugin is not None else ""


# The built-in methods' options, each declared once.
ITERS = Option(5, minimum=1, doc="rounds of assignment and centre update")
INIT = Option("topk", choices=("topk", "random"), doc="the first centres: the K most significant tokens, or random")
CLUSTER_ON = Option("tokens", choices=("tokens", "metric"), counted=True,
                    doc="match on the tokens, or on the cheaper metric (keys averaged over heads)")
SIGNIFICANCE = Option("eq4", choices=("eq4", "cls"),
                      doc="the scores: eq4, the attention each token receives from every query (the paper's), or "
                          "cls, the class token's attention alone (EViT; one query row, cheaper)")
_SCORED = {"significance": SIGNIFICANCE}
_CLUSTERED = {"iters": ITERS, "init": INIT, "cluster_on": CLUSTER_ON, **_SCORED}
# K-Means' iterations multiply (each one's distances and means), so their number changes its count; K-Medoids'
# Gram matrix is built once, and its iterations only compare and pick (tests/test_flops.py checks every flag on fvcore).
_MEANS = {**_CLUSTERED, "iters": replace(ITERS, counted=True)}


def _selects(n: int, k: int, width: int, options: Mapping[str, Any]) -> int:
    """A selection (top-K, sampling) multiplies nothing."""
    return 0


def _gram(n: int, k: int, width: int, options: Mapping[str, Any]) -> int:
    """K-Medoids builds the n x n Gram matrix of what it clusters (the paper's "+0.1" GFLOPs on DeiT-S)."""
    return n * n * width


_F = "pipeline.pooling.factories:"
KEEP_ALL = "none"  # the method that keeps every token: the unmodified model, and the baseline finetune
GRID_CONV = "conv"  # grid downsampling: finetuned at its own placements (experiment.conv), not on searched keep lists
_BUILTIN: dict[str, MethodSpec] = {
    KEEP_ALL: MethodSpec(_F + "keep_all", "keep every token", takes_kernels=True, reconstructs=False,
                         downsamples=False, keeps_positions=True),
    # In this order, the swept ones are the default experiment.methods.
    "kmeans": MethodSpec(_F + "kmeans", "Token Pooling by K-Means (eq. 6-7), top-K initialisation",
                         needs_scores=True, options=_MEANS, takes_kernels=True),
    "wkmeans": MethodSpec(_F + "wkmeans", "weighted K-Means (Appendix A), weights = significance",
                          needs_scores=True, options=_MEANS, takes_kernels=True),
    "wkmedoids": MethodSpec(_F + "wkmedoids", "weighted K-Medoids (Appendix A), weights = significance",
                            needs_scores=True, options=_CLUSTERED, flops=_gram, takes_kernels=True,
                            swept=True, keeps_positions=True),
    "kmedoids": MethodSpec(_F + "kmedoids", "Token Pooling by K-Medoids (eq. 8), top-K initialisation",
                           needs_scores=True, options=_CLUSTERED, flops=_gram, takes_kernels=True,
                           swept=True, keeps_positions=True),
    "powerbert": MethodSpec(_F + "powerbert", "PoWER-BERT: keep the K most significant tokens",
                            needs_scores=True, options=_SCORED, flops=_selects, takes_kernels=True,
                            swept=True, keeps_positions=True),
    "random": MethodSpec(_F + "random", "keep K tokens drawn uniformly", flops=_selects, takes_kernels=True,
                         swept=True, keeps_positions=True),
    "importance": MethodSpec(_F + "importance", "keep K tokens drawn in proportion to significance",
                             needs_scores=True, options=_SCORED, flops=_selects, takes_kernels=True,
                             swept=True, keeps_positions=True),
    # ToMe matches on the keys averaged over heads, as ToMe itself does, unless told otherwise.
    "tome": MethodSpec(_F + "tome", "ToMe bipartite soft matching, size-weighted merge",
                       options={"cluster_on": replace(CLUSTER_ON, default="metric")}, takes_kernels=True, swept=True),
    GRID_CONV: MethodSpec("pipeline.pooling.conv:GridConvDownsample", "learnable 2x2 stride-2 convolution (Appendix D)",
                       learnable=True, reconstructs=False),
}


class PluginWarning(PipelineWarning):
    """An entry point of ``PLUGIN_GROUP`` left out of the registry (it does not load, or its name is taken);
    the other methods load."""


@dataclass(frozen=True)
class Plugin:
    """Where a method of another package comes from: its distribution, that distribution's version, and
    the entry point (``name = "module:attribute"``)."""

    distribution: str
    version: str
    entry_point: str

    def tags(self) -> dict[str, str]:
        """The MLflow tags of a run of this method."""
        return {"pipeline.plugin": self.distribution, "pipeline.plugin_version": self.version}

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


class _Registry(MutableMapping[str, MethodSpec]):
    """The methods by name: the built-in ones, then those of installed packages (``PLUGIN_GROUP``),
    loaded the first time the registry is read.

    An entry point that does not load, does not name a ``MethodSpec``, or takes a name already taken (a
    built-in's, or another package's) is left out with a ``PluginWarning`` that names it; every other
    one loads (``problems`` keeps the messages by name)."""

    def __init__(self, builtin: dict[str, MethodSpec]) -> None:
        self._specs = dict(builtin)
        self.builtin = frozenset(builtin)
        self.plugins: dict[str, Plugin] = {}
        self.problems: dict[str, str] = {}
        self._state = "unread"  # "loading" while a plugin's import reads the registry, then "loaded"

    def _load_plugins(self) -> None:
        if self._state != "unread":
            return
        self._state = "loading"
        try:
            for point in entry_points(group=PLUGIN_GROUP):
                problem = self._add_plugin(point)
                if problem is not None:
                    self.problems.setdefault(point.name, problem)
                    warnings.warn(problem, PluginWarning, stacklevel=4)
        except BaseException:
            self._state = "unread"  # interrupted: the next read tries again
            raise
        self._state = "loaded"

    def reload_plugins(self) -> None:
        """Forgets the plugins' methods (and their problems); the next read loads the entry points again (a
        package installed or removed in a running process). Methods registered in code stay."""
        for name in self.plugins:
            del self._specs[name]
        self.plugins.clear()
        self.problems.clear()
        self._state = "unread"

    def _add_plugin(self, point: EntryPoint) -> str | None:
        """Registers ``point``'s method; the message naming it when it cannot."""
        dist = point.dist
        plugin = Plugin(dist.name if dist else "an unnamed package", dist.version if dist else "unknown",
                        f"{point.name} = {point.value}")
        where = f"entry point {point.name} = {point.value!r} of {dist.name if dist else 'a package'}"
        if point.name in self.builtin:
            return (f"{where} ({plugin}, group {PLUGIN_GROUP}) takes the name of the built-in method "
                    f"{point.name!r}, which a plugin may not replace; it is not loaded: rename the entry point")
        if point.name in self._specs:
            owner = (f"{self.plugins[point.name]}'s method" if point.name in self.plugins
                     else "a method registered in code")
            return (f"{where} ({plugin}, group {PLUGIN_GROUP}) takes the name {point.name!r} of {owner}; it is not "
                    "loaded: rename one of them")
        if not _valid_name(point.name):
            return f"{where} (group {PLUGIN_GROUP}): a method name is letters, digits and underscores"
        try:
            spec = point.load()
        except Exception as err:  # noqa: BLE001 - any failure of a foreign import, named with its cause
            return (f"{where} (group {PLUGIN_GROUP}) does not load: {type(err).__name__}: {err}; "
                    "fix or uninstall that package")
        if not isinstance(spec, MethodSpec):
            return f"{where} (group {PLUGIN_GROUP}) names a {type(spec).__name__}, not a pipeline.methods.MethodSpec"
        self._specs[point.name] = spec
        self.plugins[point.name] = plugin
        return None

    def __getitem__(self, name: str) -> MethodSpec:
        self._load_plugins()
        return self._specs[name]

    def __setitem__(self, name: str, spec: MethodSpec) -> None:
        if name in self.builtin:
            raise InputError(f"{name!r} is a built-in method, which register_method may not replace; "
                             "give your method a name of its own")
        self._specs[name] = spec
        self.plugins.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self._specs[name]
        self.plugins.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        self._load_plugins()
        return iter(self._specs)

    def __len__(self) -> int:
        self._load_plugins()
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        self._load_plugins()
        return name in self._specs


METHODS = _Registry(_BUILTIN)


def _valid_name(name: str) -> bool:
    return name.replace("_", "").isalnum()


def register_method(name: str, spec: MethodSpec) -> None:
    """Adds (or replaces) a method of this process; a built-in one's name is refused.

    Only this process knows it: Ray workers, which validate the config again, do not, so the runs that
    use Ray refuse it (``pipeline.train.launch.check_reaches_workers``); a package's entry point reaches
    them (docs/architecture.md)."""
    if not _valid_name(name):
        raise InputError(f"method name must be letters, digits and underscores, got {name!r}")
    METHODS[name] = spec


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of this project's own methods (a plugin may not take its name)."""
    return name in METHODS.builtin


def plugin_of(name: str) -> Plugin | None:
    """The package a method comes from, when an entry point registered it; None for a built-in method or
    one registered in code."""
    METHODS._load_plugins()
    return METHODS.plugins.get(name)


def registered_in_code(name: str) -> bool:
    """Whether ``name`` is a method that ``register_method`` added in this process (no package brings it)."""
    return name in METHODS and not is_builtin(name) and plugin_of(name) is None


def method_spec(name: str) -> MethodSpec:
    """The spec of ``name``; ValueError listing the methods when there is none."""
    spec = METHODS.get(name)
    if spec is None and name in METHODS.problems:
        raise InputError(f"method {name!r} is not registered: {METHODS.problems[name]}")
    if spec is None:
        raise InputError(f"unknown downsampling method {name!r}; choose one of {sorted(METHODS)}")
    return spec


def downsamples(name: str) -> bool:
    """Whether the method ``name`` takes tokens away (every method but the baseline's ``KEEP_ALL``)."""
    return method_spec(name).downsamples


def keeps_all(name: str) -> bool:
    """Whether ``name`` is a registered method that keeps every token (the baseline); False for a name the
    registry does not know (say, a plugin's, in a results table read where it is not installed)."""
    spec = METHODS.get(name)
    return spec is not None and not spec.downsamples


def downsampling_methods() -> list[str]:
    """Every registered method that takes tokens away, in registry order."""
    return [name for name, spec in METHODS.items() if spec.downsamples]


def swept_methods() -> list[str]:
    """An experiment's default finetunes: the registered methods marked ``swept``."""
    return [name for name, spec in METHODS.items() if spec.swept]


def build_downsampler(name: str, *, dim: int | None = None, grid: tuple[int, int] | None = None,
                      k: int | None = None, **options: Any) -> Callable[..., Any]:
    """Builds the method ``name`` with its ``options`` (defaults from its ``MethodSpec``): a
    ``pipeline.pooling.factories.Downsampler``.

    Options: those its spec declares (``pipeline methods`` lists them), each checked against its ``Option``. A
    learnable method (``conv``) also needs ``dim``, the token width M, and may check the ``grid`` (h, w)
    it will see and the ``k`` it must produce (a ValueError when it cannot).
    """
    spec = method_spec(name)
    options = spec.resolve(name, options)
    if spec.learnable:
        if dim is None:
            raise InputError(f"method {name!r} has learnable weights and needs dim (the token width M)")
        return spec.factory()(dim, grid=grid, k=k, **options)
    return spec.factory()(**options)
