"""``pipeline bench loader``: FFCV against torchvision's ``DataLoader`` on the same JPEG folder, side by side;
and, with ``--imagenet-like``, FFCV's host work at ImageNet's image sizes, per core, against a GPU's step rate.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.console import quiet_numba_finalizer
from pipeline.data.loaders import LoaderSpec, build_loader, label_pipeline, train_decode
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


# ---- ImageNet-like: JPEGs of ImageNet's sizes and statistics, the DeiT training pipeline's host work ----

# ImageNet-1k's training JPEGs average about 400 x 350 px, most with a 500 px long side (4:3, 3:4, 3:2).
# The sizes drawn here: the long side 500 px for 60% of the images, else uniform on 150..500; the shape
# 4:3 (55%), 3:4 (15%), 3:2 (15%) or 1:1 (15%). The mean the run drew is printed with its figures.
_SHAPES = ((4 / 3, 0.55), (3 / 4, 0.15), (3 / 2, 0.15), (1.0, 0.15))  # (width / height, probability)


def imagenet_like_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) of one ImageNet-like image."""
    long = 500 if rng.random() < 0.6 else int(rng.integers(150, 501))
    ratio = _SHAPES[rng.choice(len(_SHAPES), p=[p for _, p in _SHAPES])][0]
    return (long, round(long / ratio)) if ratio >= 1 else (round(long * ratio), long)


def natural_image(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """``(height, width, 3)`` uint8: smooth colour fields at five scales, a few hard-edged blobs and sensor
    noise. What a JPEG decoder and a resize cost depends on the pixels and on the detail (the entropy-coded
    bytes), so the detail is set to make files of ImageNet's size: these average about 105 KB at quality
    90, ImageNet's training JPEGs about 110 KB (138 GB for 1.28 M files). Flat colours would decode much
    faster, white noise much slower."""

    field = np.zeros((height, width, 3), np.float32)
    for cells, amplitude in ((3, 50.0), (9, 40.0), (27, 40.0), (81, 40.0), (243, 40.0)):
        small = rng.normal(0, amplitude, (cells, cells, 3)).astype(np.float32)
        for c in range(3):
            field[..., c] += np.asarray(Image.fromarray(small[..., c], mode="F").resize((width, height),
                                                                                        Image.BICUBIC))
    y, x = np.mgrid[0:height, 0:width]
    for _ in range(int(rng.integers(2, 6))):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(0.05, 0.3) * min(width, height)
        field[(y - cy) ** 2 + (x - cx) ** 2 < r * r] += rng.normal(0, 40, 3).astype(np.float32)
    field += 127.5 + rng.normal(0, 10.0, field.shape).astype(np.float32)
    return np.clip(np.rint(field), 0, 255).astype(np.uint8)


@dataclass(frozen=True)
class FolderStats:
    images: int
    mean_width: float
    mean_height: float
    mean_kb: float  # JPEG file size


def write_imagenet_like(folder: Path, images: int, classes: int, seed: int, log: Callable[[str], None]
                        ) -> FolderStats:
    """Writes ``folder/class_NNN/NNNNNN.JPEG`` (quality 90, 4:2:0, as ImageNet's JPEGs are) unless it exists."""

    if not folder.exists():
        log(f"writing {images} ImageNet-like JPEGs to {folder}")
        tmp = folder.with_name(folder.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        for index in range(images):
            rng = np.random.default_rng([seed, index])
            width, height = imagenet_like_size(rng)
            target = tmp / f"class_{index % classes:03d}" / f"{index:06d}.JPEG"
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(natural_image(width, height, rng)).save(target, quality=90)
        tmp.rename(folder)
    files = sorted(folder.glob("*/*.JPEG"))
    sizes = []
    for path in files:
        with Image.open(path) as image:
            sizes.append(image.size)
    widths, heights = zip(*sizes)
    return FolderStats(len(files), float(np.mean(widths)), float(np.mean(heights)),
                       float(np.mean([path.stat().st_size for path in files])) / 1024)


@dataclass(frozen=True)
class HostRate:
    store: str  # the .beton's storage settings, as `data write` flags
    workers: int  # decoding threads, one a core
    images_per_s: float  # median of the epochs after the first

    @property
    def per_core(self) -> float:
        return self.images_per_s / self.workers


def store_label(settings: WriteSettings) -> str:
    extra = f" --compress-probability {settings.compress_probability}" if settings.mode == "proportion" else ""
    return f"--mode {settings.mode} --max-res {settings.max_res} --quality {settings.quality}{extra}"


def host_loader(beton: Path, workers: int, batch: int, res: int, seed: int = 0):
    """FFCV's training loader as a GPU node runs it, up to the copy: decode with DeiT's random-resized crop,
    flip, to a uint8 tensor (``pipeline.data.loaders.train_decode``). Normalisation runs on the GPU there."""
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor, ToTorchImage

    quiet_numba_finalizer()
    spec = LoaderSpec(str(beton), train=True, batch_size=batch, res=res, mean=(0.5,) * 3, std=(0.5,) * 3,
                      workers=workers, seed=seed)
    pipelines = {"image": [*train_decode(spec), ToTensor(), ToTorchImage()], "label": label_pipeline(spec)}
    return Loader(str(beton), batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, seed=seed,
                  pipelines=pipelines, drop_last=False)


def run_imagenet_like(folder: Path, stores: list[WriteSettings], workers: list[int], batch: int, res: int,
                      epochs: int, log: Callable[[str], None]) -> list[HostRate]:
    """Writes ``folder`` once per storage setting (reused when present) and times the host loader on each
    with each thread count; the first epoch (numba compilation) is left out of the median."""
    rates = []
    for store in stores:
        mix = f"_p{store.compress_probability}" if store.mode == "proportion" else ""
        beton = folder.with_name(f"{folder.name}_{store.mode}_{store.max_res}_{store.quality}{mix}.beton")
        if not beton.exists():
            write_beton(open_source(f"imagefolder:{folder}"), beton, store, log=log)
        for threads in workers:
            log(f"timing {beton.name} with {threads} decoding thread(s), {epochs} epochs")
            values = time_epochs(host_loader(beton, threads, batch, res), epochs)
            rates.append(HostRate(store_label(store), threads, statistics.median(values[1:] or values)))
    return rates


def format_imagenet_like(stats: FolderStats, rates: list[HostRate], step_rates: dict[str, float], res: int,
                         batch: int) -> str:
    """Markdown: images/s per setting and thread count, then the cores one GPU needs at each step rate."""
    lines = [f"{stats.images} ImageNet-like JPEGs (mean {stats.mean_width:.0f} x {stats.mean_height:.0f} px, "
             f"{stats.mean_kb:.0f} KB), FFCV, random-resized crop to {res} + flip to uint8 (the host's part; "
             f"normalisation runs on the GPU), batch {batch}, median of the epochs after the first", "",
             "| stored as (`data write`) | threads | images/s | images/s per core |", "|---|---:|---:|---:|"]
    lines += [f"| `{r.store}` | {r.workers} | {r.images_per_s:.0f} | {r.per_core:.0f} |" for r in rates]
    widest = max(r.workers for r in rates)
    per_core = {r.store: r.per_core for r in rates if r.workers == widest}
    lines += ["", f"Cores one GPU needs to feed its training step, at the per-core rate with {widest} thread(s):", "",
              "| stored as | " + " | ".join(f"{name} ({rate:,.0f} images/s)" for name, rate in step_rates.items())
              + " |", "|---|" + "---:|" * len(step_rates)]
    for store, rate in per_core.items():
        lines.append(f"| `{store}` | " + " | ".join(f"{math.ceil(step / rate)}" for step in step_rates.values())
                     + " |")
    return "\n".join(lines)
