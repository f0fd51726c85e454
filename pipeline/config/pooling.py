"""``pooling:``, the downsampling step: the method, the keep list, the settings every method shares, and each
method's own options under ``pooling.options.<method>`` (declared by its ``MethodSpec``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import MethodName, Section
from pipeline.errors import InputError
from pipeline.methods import METHODS, method_spec

# Keys that were the pooling section's and are the model's now (normalised queries and keys, Appendix F).
MOVED_TO_MODEL = ("qk_norm", "alpha")


class PoolingConfig(Section):
    """Options of the downsampling step (see ``pipeline.methods.build_downsampler``)."""

    method: MethodName = "wkmedoids"
    keep: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="K_1..K_L for finetuning (one per block, each >= 0); default: keep all")
    level: int | None = Field(None, ge=0, le=7, description="or the paper's sparsity level (configs/sparsity/)")
    carry: bool = Field(False, description="carry cluster sizes, proportional attention (Appendix E)")
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="each method's own options, by method: {wkmedoids: {iters: 3}, "
        "tome: {cluster_on: tokens}}; an option not set takes the method's default (`pipeline methods` lists them)")

    @model_validator(mode="before")
    @classmethod
    def _no_method_option_at_the_top(cls, data: Any) -> Any:
        """A method's option set as a key of ``pooling`` itself: one line naming where it goes."""
        if not isinstance(data, dict):
            return data
        moved = sorted(set(data) & set(MOVED_TO_MODEL))
        if moved:
            raise InputError(f"pooling.{moved[0]} is now model.{moved[0]}: the model's setting, honoured by every "
                             "stage (the base and the K search too); set it there")
        method = data.get("method", cls.model_fields["method"].default)
        for key in set(data) - set(cls.model_fields):
            takers = [name for name, spec in METHODS.items() if key in spec.options]
            if method in takers:
                raise InputError(f"pooling.{key} is a method's option: use pooling.options.{method}.{key}")
            if takers:
                raise InputError(f"pooling.{key} is a method's option, and {method!r} does not take it: set it as "
                                 f"pooling.options.METHOD.{key} for a method that does ({', '.join(takers)})")
        return data

    @field_validator("options")
    @classmethod
    def _options_fit_their_methods(cls, options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        checked = {}
        for method, given in options.items():
            spec = method_spec(method)  # names the registered methods when there is none
            resolved = spec.resolve(method, given)
            checked[method] = {key: resolved[key] for key in given}
        return checked

    @model_validator(mode="after")
    def _one_keep_source(self) -> PoolingConfig:
        if self.keep is not None and self.level is not None:
            raise InputError("set pooling.keep or pooling.level, not both")
        return self

    def method_options(self, method: str | None = None) -> dict[str, Any]:
        """Every option ``method`` (default ``self.method``) takes, as ``build_downsampler`` takes them:
        ``options[method]`` over the method's defaults."""
        name = self.method if method is None else method
        return method_spec(name).resolve(name, self.options.get(name, {}))
