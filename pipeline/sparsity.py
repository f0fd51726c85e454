"""The paper's sparsity levels: keep lists per architecture, with the GFLOPs the paper prints for them."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.config import CONFIG_DIR, ConfigError, error_message
from pipeline.config.loading import parse_yaml

SPARSITY_DIR = CONFIG_DIR / "sparsity"


class Level(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    keep: list[int] = Field(min_length=1)
    powerbert: float  # GFLOPs printed for PoWER-BERT at this level
    kmedoids: float  # GFLOPs printed for (W)K-Medoids
    kmeans: float | None = None  # GFLOPs printed for (W)K-Means (DeiT-S only)
    kmedoids_mflops: float | None = None  # the Appendix B figure's plotted values (DeiT-S only)
    kmeans_mflops: float | None = None


class SparsityFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str
    levels: dict[int, Level]


def sparsity_files() -> list[Path]:
    return sorted(SPARSITY_DIR.glob("*.yaml"))


def load_sparsity(path: str | Path) -> SparsityFile:
    """Loads one ``configs/sparsity/*.yaml``; errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        names = ", ".join(p.stem for p in sparsity_files())
        raise ConfigError(f"sparsity file not found: {path}; the shipped ones are: {names}")
    try:
        return SparsityFile.model_validate(parse_yaml(path.read_text(), str(path)))
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {error_message(e)}" for e in err.errors())
        raise ConfigError(f"{path}: {problems}") from None


def level_keep(model_name: str, level: int) -> list[int]:
    """The keep list of ``level`` for ``model_name``, from the sparsity file that names that model."""
    for path in sparsity_files():
        table = load_sparsity(path)
        if table.model == model_name:
            if level not in table.levels:
                raise ConfigError(f"{path}: no level {level}; levels are {sorted(table.levels)}")
            return list(table.levels[level].keep)
    known = ", ".join(load_sparsity(p).model for p in sparsity_files())
    raise ConfigError(f"no sparsity levels for {model_name!r}; the paper gives them for: {known}")
