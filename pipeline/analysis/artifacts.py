"""The analyses as files (CSV + PNG), for the CLI and for the DAG's evaluate stage."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from pipeline.analysis.clustermap import cluster_maps
from pipeline.analysis.probe import Subject, first_batches, load_subject
from pipeline.analysis.reconstruction import COLUMNS as RECONSTRUCTION_COLUMNS
from pipeline.analysis.reconstruction import plot_reconstruction, reconstruction_rows
from pipeline.analysis.redundancy import COLUMNS as REDUNDANCY_COLUMNS
from pipeline.analysis.redundancy import plot_redundancy, redundancy_rows
from pipeline.plots import write_csv


def write_redundancy(subject: Subject, batches: Iterable[np.ndarray], out: Path, *,
                     qk_alphas: Sequence[float] = (), log=print) -> list[Path]:
    """redundancy.csv and redundancy.png: the model as it is, plus each imposed qk-norm alpha."""
    batches = list(batches)
    rows = redundancy_rows(subject, batches, log=log)
    for alpha in qk_alphas:
        rows += redundancy_rows(subject, batches, qk_alpha=alpha, log=log)
    return [write_csv(rows, out / "redundancy.csv", REDUNDANCY_COLUMNS),
            plot_redundancy(rows, out / "redundancy.png", title=f"Token redundancy per block: {subject.label}")]


def write_reconstruction(subject: Subject, batches: Iterable[np.ndarray], out: Path, *,
                         methods: Sequence[str] | None = None, ks: Sequence[int] | None = None,
                         keep: Sequence[int] | None = None, log=print) -> list[Path]:
    """reconstruction.csv and reconstruction.png: eq. 2's error per block for each method."""
    rows = reconstruction_rows(subject, batches, methods=methods, ks=ks, keep=keep, log=log)
    if not rows:  # a keep list that keeps every token (or none) at every block: nothing to compare
        log(f"[reconstruction] keep list {keep} downsamples at no block; no reconstruction error to plot")
        return []
    return [write_csv(rows, out / "reconstruction.csv", RECONSTRUCTION_COLUMNS),
            plot_reconstruction(rows, out / "reconstruction.png",
                                title=f"Reconstruction error (eq. 2) per block: {subject.label}")]


def evaluation_artifacts(checkpoint: str, out: Path, *, images: int, batch: int, log=print) -> list[Path]:
    """What the DAG's evaluate stage logs for one finetuned model, under ``out``.

    From its validation set: cluster maps of its own method and keep list at every block for the
    first ``images`` images (``maps/``); the redundancy and the reconstruction error of every method
    at its keep list over the first ``batch`` images. A no-downsampling baseline gets the redundancy only.
    """
    subject = load_subject(checkpoint=checkpoint)
    count = max(images, batch)
    if count == 0:
        return []
    data = np.concatenate(first_batches(subject.val, subject, batches=1, batch=count))  # one loader for both
    files: list[Path] = []
    if subject.method is not None and images > 0:
        files += cluster_maps(subject, data[:images], [f"val{i:04d}" for i in range(min(images, len(data)))],
                              methods=[subject.method], keep=subject.keep, layers=range(1, subject.depth + 1),
                              out=out / "maps", log=log)
    if batch > 0:
        files += write_redundancy(subject, [data[:batch]], out, log=log)
        if subject.method is not None:
            files += write_reconstruction(subject, [data[:batch]], out, keep=subject.keep, log=log)
    return files
