"""What every config section shares: strict, frozen pydantic models, the error they raise, and the
types several sections use."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

from pipeline.errors import PipelineError
from pipeline.methods import method_spec


def _known_method(name: str) -> str:
    method_spec(name)  # ValueError naming the registered methods
    return name


# A registered downsampling method (pipeline.methods.METHODS, read when a config is validated).
MethodName = Annotated[str, AfterValidator(_known_method)]
PatchEmbed = Literal["conv", "matmul"]  # models.patch_embed: timm's convolution, or the same function as a matmul


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(PipelineError, ValueError):
    """A config that cannot be used; the message names the key, its source and what is allowed."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
