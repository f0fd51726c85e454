"""What every config section shares: strict, frozen pydantic models, the error they raise, and the
types several sections use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pipeline.errors import PipelineError
from pipeline.methods import method_spec


def _known_method(name: str) -> str:
    method_spec(name)  # ValueError naming the registered methods
    return name


# A registered downsampling method (pipeline.methods.METHODS, read when a config is validated).
MethodName = Annotated[str, AfterValidator(_known_method)]
PatchEmbed = Literal["conv", "matmul"]  # models.patch_embed: timm's convolution, or the same function as a matmul
# A run's seed: each rank seeds NumPy with seed * 1000 + rank, and NumPy takes 32-bit seeds.
Seed = Annotated[int, Field(ge=0, lt=2**32 // 1000 - 1)]


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(PipelineError, ValueError):
    """A config that cannot be used; the message names the key, its source and what is allowed."""


def error_message(error: Mapping[str, Any]) -> str:
    """One pydantic error's message as the user reads it: a validator's own text without the ``Value error, ``
    pydantic puts before it. Every place that turns a ValidationError into a ConfigError words it with this."""
    return str(error["msg"]).removeprefix("Value error, ")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
