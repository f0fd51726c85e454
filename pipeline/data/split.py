"""A validation split carved from a training ``.beton``: stratified, seeded, and written once into the
dataset's metadata (key ``holdout``), so that every rank, trial and rerun fits and ranks on the same
images. Models are ranked on it; the test set (``data.val``) is measured once, at the end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.write import metadata_path
from pipeline.errors import InputError


@dataclass(frozen=True)
class Split:
    """Indices into the ``.beton``: ``train`` to fit on, ``val`` to rank on (disjoint, sorted)."""

    train: np.ndarray
    val: np.ndarray


def split_key(fraction: float, seed: int) -> str:
    return f"fraction={fraction:g},seed={seed}"


def stratified_holdout(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """The held-out indices: ``round(fraction * n_c)`` of each class c (at least one, never all), drawn
    with ``numpy.random.default_rng(seed)``; sorted."""
    rng = np.random.default_rng(seed)
    held = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        if len(members) < 2:
            raise InputError(f"class {int(label)} has {len(members)} image(s): a validation split needs 2 or more "
                             "per class; lower data.holdout or write more images")
        count = min(max(round(fraction * len(members)), 1), len(members) - 1)
        held.append(rng.choice(members, size=count, replace=False))
    return np.sort(np.concatenate(held))


def holdout_split(beton: str | Path, fraction: float, seed: int) -> Split:
    """The split of ``beton`` for (``fraction``, ``seed``): read from its metadata, or drawn from its
    labels and written there first (atomically; every writer draws the same indices)."""
    from ffcv.reader import Reader

    if not 0 < fraction < 1:
        raise InputError(f"data.holdout={fraction}: the held-out fraction must be between 0 and 1")
    meta_file = metadata_path(Path(beton))
    meta = json.loads(meta_file.read_text())
    key = split_key(fraction, seed)
    stored = meta.get("holdout", {}).get(key)
    count = int(meta["num_images"])
    if stored is None:
        val = stratified_holdout(np.asarray(Reader(str(beton)).metadata["f1"]), fraction, seed)
        meta.setdefault("holdout", {})[key] = val.tolist()
        scratch = meta_file.with_name(f".{meta_file.name}.{os.getpid()}")
        scratch.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(scratch, meta_file)
    else:
        val = np.asarray(stored, dtype=np.int64)
    train = np.setdiff1d(np.arange(count), val)
    return Split(train=train, val=val)
