"""``pooling:``, the downsampling step's options."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pipeline.config.base import MethodName, Section
from pipeline.errors import InputError
from pipeline.methods import method_spec


class PoolingConfig(Section):
    """Options of the downsampling step (see ``pipeline.pooling.build_downsampler``)."""

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

    @model_validator(mode="after")
    def _one_keep_source(self) -> PoolingConfig:
        if self.keep is not None and self.level is not None:
            raise InputError("set pooling.keep or pooling.level, not both")
        return self

    def options(self, method: str | None = None) -> dict[str, Any]:
        """The options ``method`` (default ``self.method``) takes, from this section, as
        ``build_downsampler`` takes them; unset ones keep the method's defaults."""
        name = self.method if method is None else method
        spec = method_spec(name)
        given = {key: getattr(self, key) for key in spec.options if getattr(self, key, None) is not None}
        return spec.resolve(name, given)
