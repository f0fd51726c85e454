"""``data:``, the datasets and loaders."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section
from pipeline.errors import InputError


class ProgressiveConfig(Section):
    """ffcv-imagenet's progressive resizing: ``start_res`` until ``start_epoch``, then linear to ``end_res``
    at ``end_epoch``."""

    start_res: int = Field(ge=8)
    end_res: int = Field(ge=8)
    start_epoch: int = Field(ge=0)
    end_epoch: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> ProgressiveConfig:
        if self.end_epoch < self.start_epoch:
            raise InputError(f"end_epoch ({self.end_epoch}) must be >= start_epoch ({self.start_epoch})")
        return self


class DataConfig(Section):
    """Datasets and loaders. Paths are ``.beton`` files for ``loader: ffcv``, image folders for ``loader: torch``."""

    train: str | None = Field(None, description="training set (.beton, or a folder for loader: torch)")
    val: str | None = Field(None, description="validation set (.beton, or a folder for loader: torch)")
    loader: Literal["ffcv", "torch"] = "ffcv"
    num_classes: int = Field(1000, ge=2, description="must match the dataset's metadata")
    batch_size: int = Field(128, ge=1, description="per worker")
    num_workers: int = Field(2, ge=0, description="loader threads (ffcv) or processes (torch) per worker")
    os_cache: bool = Field(True, description="FFCV: rely on the page cache (True) or its own process cache")
    flip: bool = Field(True, description="random horizontal flip in training")
    crop_scale: tuple[float, float] = Field((0.08, 1.0), description="random-resized-crop area range")
    progressive: ProgressiveConfig | None = None
    verify_checksum: bool = Field(False, description="SHA-256 the .beton before training (reads the whole file)")
    holdout: float = Field(0.0, ge=0, lt=1, description="fraction of data.train held out (stratified, seeded) to "
                           "validate and rank on; data.val is then the test set, measured once at the end")
    holdout_seed: int = Field(0, description="seed of the held-out split")

    @field_validator("crop_scale", mode="before")
    @classmethod
    def _scale_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _scale_range(self) -> DataConfig:
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise InputError(f"crop_scale must satisfy 0 < low <= high <= 1, got {list(self.crop_scale)}")
        if self.holdout > 0 and self.loader != "ffcv":
            raise InputError("data.holdout splits a .beton: it needs data.loader: ffcv")
        return self
