"""``pooling:``, the downsampling step's options."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import MethodName, Section
from pipeline.errors import InputError
from pipeline.methods import is_builtin, method_spec, plugin_of

# An option's type, from the default its MethodSpec gives it (None: any of these).
_OPTION_TYPES: tuple[tuple[type, tuple[type, ...]], ...] = (
    (bool, (bool,)), (int, (int,)), (float, (int, float)), (str, (str,)), (list, (list,)), (dict, (dict,)))


def _typed_option(method: str, key: str, value: Any, default: Any) -> Any:
    """``value`` for option ``key`` of ``method``, of its default's type (an int where a float is: a float)."""
    where = f"option {key!r} of method {method!r}" + (f" (from {plugin_of(method)})" if plugin_of(method) else "")
    if default is None:
        if value is not None and not isinstance(value, (bool, int, float, str, list, dict)):
            raise InputError(f"{where} takes a YAML value, got {type(value).__name__}")
        return value
    for kind, accepted in _OPTION_TYPES:
        if isinstance(default, kind):
            if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
                raise InputError(f"{where} takes a value of type {kind.__name__} (its default is {default!r}), "
                                 f"got {value!r}")
            return float(value) if kind is float else value
    return value


class PoolingConfig(Section):
    """Options of the downsampling step (see ``pipeline.methods.build_downsampler``)."""

    method: MethodName = "wkmedoids"
    iters: int = Field(5, ge=1, description="rounds of assignment and centre update")
    init: Literal["topk", "random"] = "topk"
    cluster_on: Literal["tokens", "metric"] | None = Field(
        None, description="match on the tokens, or on the cheaper metric (keys averaged over heads); "
        "default: the method's own (tokens for clustering, keys for ToMe)")
    significance: Literal["eq4", "cls"] | None = Field(
        None, description="the scores of the methods that read them: eq4, the attention each token receives "
        "from every query (the paper's), or cls, the class token's attention alone (EViT; one query row, "
        "cheaper); default eq4")
    keep: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="K_1..K_L for finetuning (one per block, each >= 0); default: keep all")
    level: int | None = Field(None, ge=0, le=7, description="or the paper's sparsity level (configs/sparsity/)")
    carry: bool = Field(False, description="carry cluster sizes, proportional attention (Appendix D)")
    qk_norm: Literal["fixed", "learned"] | None = Field(None, description="normalised queries/keys (Appendix F)")
    alpha: float = Field(1.0, gt=0, description="the (initial) alpha of qk_norm")
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="the options of methods that are not built in (plugins), by method: "
        "{firstk: {offset: 3}}; an option not set takes the method's own default (built-in methods take "
        "theirs from the keys above)")

    @field_validator("options")
    @classmethod
    def _options_fit_their_methods(cls, options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        checked = {}
        for method, given in options.items():
            spec = method_spec(method)  # names the registered methods when there is none
            if is_builtin(method):
                keys = ", ".join(f"pooling.{key}" for key in spec.options) or "none"
                raise InputError(f"{method!r} is a built-in method: its options are pooling's own keys ({keys}), "
                                 "not pooling.options")
            unknown = sorted(set(given) - set(spec.options))
            if unknown:
                origin = f" (from {plugin_of(method)})" if plugin_of(method) else ""
                raise InputError(f"method {method!r}{origin} has no option {unknown[0]!r}; it takes: "
                                 f"{', '.join(sorted(spec.options)) or 'none'}")
            checked[method] = {key: _typed_option(method, key, value, spec.options[key])
                               for key, value in given.items()}
        return checked

    @model_validator(mode="after")
    def _one_keep_source(self) -> PoolingConfig:
        if self.keep is not None and self.level is not None:
            raise InputError("set pooling.keep or pooling.level, not both")
        return self

    def method_options(self, method: str | None = None) -> dict[str, Any]:
        """The options ``method`` (default ``self.method``) takes, as ``build_downsampler`` takes them: a
        built-in method's from this section's keys, any other's from ``options[method]``; unset ones keep
        the method's defaults (a plugin's ``iters`` is its own, not ``pooling.iters``)."""
        name = self.method if method is None else method
        spec = method_spec(name)
        if not is_builtin(name):
            return spec.resolve(name, self.options.get(name, {}))
        given = {key: getattr(self, key) for key in spec.options if getattr(self, key, None) is not None}
        return spec.resolve(name, given)
