"""``pipeline bench loader``: FFCV against torchvision's ``DataLoader`` on the same JPEG folder, side by side."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.loaders import LoaderSpec, build_loader
from pipeline.data.sources import open_source
from pipeline.data.write import WriteSettings, write_beton, write_folder


@dataclass(frozen=True)
class LoaderBenchSettings:
    images: int = 5000
    size: int = 160
    res: int = 128
    batch: int = 128
    workers: int = 2
    epochs: int = 4


def prepare_data(work_dir: Path, settings: LoaderBenchSettings, folder: Path | None,
                 log: Callable[[str], None]) -> tuple[Path, Path]:
    """The JPEG folder (given, or Fashion-MNIST test upscaled to ``size``) and a ``.beton`` written from it.

    Both are reused when they already exist in ``work_dir``; only the data is reused, never a timing.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    if folder is None:
        folder = work_dir / f"fmnist_{settings.images}_{settings.size}px"
        if not folder.exists():
            log(f"writing {settings.images} JPEGs of {settings.size}px (Fashion-MNIST test, upscaled) to {folder}")
            write_folder(open_source("fashion-mnist:test", limit=settings.images), folder, settings.size, log=log)
    beton = work_dir / f"{folder.name}.beton"
    if not beton.exists():
        source = open_source(f"imagefolder:{folder}")
        write_beton(source, beton, WriteSettings(mode="jpg", max_res=None, quality=90, workers=settings.workers),
                    log=log)
    return folder, beton


def time_epochs(loader, epochs: int) -> list[float]:
    """Images per second of each full pass over ``loader``."""
    rates = []
    for _ in range(epochs):
        count, start = 0, time.perf_counter()
        for images, _labels in loader:
            count += images.shape[0]
        rates.append(count / (time.perf_counter() - start))
    return rates


def run_loader_benchmark(folder: Path, beton: Path, settings: LoaderBenchSettings,
                         log: Callable[[str], None]) -> dict[str, list[float]]:
    """Epoch rates (img/s) per loader; the first epoch (numba compile, worker start) is kept apart."""
    common = dict(train=True, batch_size=settings.batch, res=settings.res, mean=(0.5, 0.5, 0.5),
                  std=(0.5, 0.5, 0.5), workers=settings.workers, seed=0)
    rates = {}
    for kind, path in (("ffcv", beton), ("torch", folder)):
        log(f"timing {kind} loader, {settings.epochs} epochs")
        rates[kind] = time_epochs(build_loader(kind, LoaderSpec(str(path), **common)), settings.epochs)
    return rates


def format_loader_table(rates: dict[str, list[float]], settings: LoaderBenchSettings) -> str:
    """Markdown: median img/s over epochs 2.. per loader, and FFCV's ratio to torchvision."""
    lines = [f"{settings.images} JPEGs, {settings.size}px source, random-resized crop to {settings.res}px + flip + "
             f"normalise, batch {settings.batch}, {settings.workers} workers, median of epochs 2..{settings.epochs}",
             "", "| loader | first epoch (img/s) | later epochs (img/s) | median (img/s) |", "|---|---|---|---|"]
    medians = {}
    for kind, values in rates.items():
        later = values[1:] or values
        medians[kind] = statistics.median(later)
        lines.append(f"| {kind} | {values[0]:.0f} | {', '.join(f'{v:.0f}' for v in later)} | {medians[kind]:.0f} |")
    lines += ["", f"FFCV / torchvision: **{medians['ffcv'] / medians['torch']:.2f}x**"]
    return "\n".join(lines)
