"""Seeded FFCV crop and flip against FFCV's own, side by side: training images/s through the train pipeline.

python benchmarks/seeded_augmentation.py [--beton PATH] [--smoke]   (writes a synthetic JPEG .beton first)

Each pair times one epoch of each loader (alternating which goes first); the figure is the median of
the per-pair ratios (seeded / FFCV's), after one warm-up epoch each (numba compilation). ``--smoke``: 128
images and one pair, to check that the script runs (its figures then mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

from pipeline.data import WriteSettings, loaders, open_source, write_beton
from pipeline.data.loaders import LoaderSpec, ffcv_loader


def ffcv_own(spec: LoaderSpec) -> list:
    from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
    from ffcv.transforms import RandomHorizontalFlip

    return [RandomResizedCropRGBImageDecoder((spec.res, spec.res), scale=spec.crop_scale), RandomHorizontalFlip(),
            *loaders._to_model_input(spec)]


def epoch_s(loader) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beton", type=Path, default=Path("/tmp/seeded_bench.beton"), help="written if absent")
    parser.add_argument("--smoke", action="store_true", help="128 images, one pair: checks that it runs")
    args = parser.parse_args()
    count, pairs = (128, 1) if args.smoke else (8192, 9)
    beton = args.beton
    if not beton.exists():
        write_beton(open_source(f"synthetic:classes=10,count={count},size=64"), beton,
                    WriteSettings(mode="jpg", max_res=None, quality=90, workers=2), log=lambda _: None)
    spec = LoaderSpec(str(beton), train=True, batch_size=min(128, count), res=56, mean=(0.5,) * 3, std=(0.25,) * 3,
                      crop_scale=(0.35, 1.0), workers=2, seed=0)
    seeded = ffcv_loader(spec)
    original_pipeline = loaders.train_pipeline
    loaders.train_pipeline = ffcv_own
    try:
        own = ffcv_loader(replace(spec))
    finally:
        loaders.train_pipeline = original_pipeline
    epoch_s(seeded), epoch_s(own)  # warm-up: numba compiles each pipeline
    ratios = []
    for i in range(pairs):
        if i % 2:
            b, a = epoch_s(own), epoch_s(seeded)
        else:
            a, b = epoch_s(seeded), epoch_s(own)
        ratios.append(b / a)  # > 1: the seeded loader is faster
        print(f"pair {i}: seeded {count / a:.0f} img/s, FFCV's own {count / b:.0f} img/s, ratio {b / a:.3f}",
              flush=True)
    print(f"images/s ratio, seeded / FFCV's own: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}, {pairs} pairs)")


if __name__ == "__main__":
    main()
