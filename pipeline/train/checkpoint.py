"""Training checkpoints: everything needed to continue bit-for-bit, and to start later stages from them.

A checkpoint is a directory (what ``ray.train.report`` stores) holding ``checkpoint.pt`` (model,
optimizer, scheduler, scaler, EMA, epoch, step, per-rank RNG states, data-order seed, the
architecture and the keep list) and ``summary.json`` (metrics, readable without torch).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import Config
from pipeline.errors import PipelineError

CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"


class CheckpointError(PipelineError, ValueError):
    """A checkpoint that is missing, unreadable or made for another architecture."""


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU and CUDA) generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_file(path: str | Path) -> Path:
    """``path`` itself if it is a file, else ``path/checkpoint.pt``."""
    path = Path(path)
    return path / CHECKPOINT_FILE if path.is_dir() else path


def save_checkpoint(directory: str | Path, state: dict[str, Any], summary: dict[str, Any]) -> None:
    directory = Path(directory)
    torch.save(state, directory / CHECKPOINT_FILE)
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state dict saved by ``save_checkpoint`` (a directory or its ``checkpoint.pt``)."""
    file = checkpoint_file(path)
    if not file.is_file():
        raise CheckpointError(f"checkpoint not found: {file}")
    try:
        # Our own files: RNG states and numpy arrays need the full unpickler.
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"{file}: not a readable checkpoint ({type(err).__name__}: {err})") from None


_INIT: dict[tuple[str, int, int], dict[str, Any]] = {}  # the last train.init read in this process


def load_init(path: str | Path) -> dict[str, Any]:
    """``load_checkpoint`` of a ``train.init`` checkpoint, read once per process: the driver's checks and a
    job in the same process (``train.workers: 0``, Tune trials) share it. The key holds the file's size
    and modification time, so a rewritten file is read again."""
    file = checkpoint_file(path)
    stat = file.stat() if file.is_file() else None
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns) if stat else None
    if key is None or key not in _INIT:
        state = load_checkpoint(path)
        _INIT.clear()
        if key is None:
            return state
        _INIT[key] = state
    return _INIT[key]


def check_architecture(state: dict[str, Any], expected: dict[str, Any], path: str | Path) -> None:
    """Raises CheckpointError naming each architecture field that differs."""
    found = state.get("arch")
    if found is None:
        raise CheckpointError(f"{path}: no architecture record; it was not written by `pipeline train`")
    diffs = [f"{key}: checkpoint {found.get(key)} vs config {value}" for key, value in expected.items()
             if found.get(key) != value]
    if diffs:
        raise CheckpointError(f"{path} was trained for a different architecture ({'; '.join(diffs)}); "
                              "point train.init at a checkpoint of this model, or change model.*")


def load_model_weights(model: torch.nn.Module, state: dict[str, Any], path: str | Path) -> None:
    """Loads a checkpoint's weights; parameters the new mode adds (retention, alpha, convs) may be absent."""
    from pipeline.models.weights import load_state

    try:
        load_state(model, state["model"], path)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


# The sections that decide what network a checkpoint holds; the rest (benchmarks, the experiment) may
# come from an older schema and are not needed to rebuild it.
_MODEL_SECTIONS = ("seed", "pooling", "model", "data", "recipe", "train")


def model_from_checkpoint(path: str | Path, *, plain: bool = False, built: Config | None = None):
    """Rebuilds the network a checkpoint was trained as, from its own config, with its weights.

    ``plain=True`` builds it without its downsampling (its method and keep list stay in the
    returned config), for the analyses that apply methods off the shelf and the evaluations' reference (a conv
    placement's own layers are left out: ``models.weights.load_state``). ``built``: the network this config defines
    instead, on the checkpoint's weights (a method inserted into a base with no training); an architecture the weights
    do not fit is refused as for any checkpoint.

    Returns:
        (the model in eval mode, its Config, the checkpoint's state dict).
    """
    from pipeline.train.build import build_model

    state = load_checkpoint(path)
    try:
        config = Config.model_validate({k: v for k, v in state["config"].items() if k in _MODEL_SECTIONS})
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: not a `pipeline train` checkpoint (no usable config: {err})") from None
    if plain:
        built = config.model_copy(update={"train": config.train.model_copy(update={"mode": "base"})})
    elif built is None:
        built = config
    model = build_model(built)
    load_model_weights(model, state, path)
    return model.eval(), config, state
