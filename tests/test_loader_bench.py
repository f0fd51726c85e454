"""``bench loader --imagenet-like``: its images have ImageNet's sizes and file sizes, and the run reports
images/s per core and the cores a GPU needs (pipeline/bench/loader.py)."""

from __future__ import annotations

import io
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.bench.loader import imagenet_like_size, natural_image

ROOT = Path(__file__).resolve().parents[1]


def test_sizes_follow_the_stated_distribution():
    """The mean of 20,000 draws against the distribution's mean worked out by hand: the long side is 500
    (p 0.6) or uniform on 150..500 (mean 325), so 430 on average; the width is the long side except for
    3:4 (p 0.15, 3/4 of it); the height is 3/4, 2/3, 1 and 1 of it for 4:3, 3:2, 1:1 and 3:4."""
    rng = np.random.default_rng(0)
    sizes = np.array([imagenet_like_size(rng) for _ in range(20_000)], dtype=np.float64)
    long = 0.6 * 500 + 0.4 * 325
    width = long * (0.85 + 0.15 * 0.75)
    height = long * (0.55 * 0.75 + 0.15 * 2 / 3 + 0.15 + 0.15)
    assert sizes[:, 0].mean() == pytest.approx(width, rel=0.01)  # about 414 x 349: ImageNet's ~400 x 350
    assert sizes[:, 1].mean() == pytest.approx(height, rel=0.01)
    assert sizes.min() >= 100 and sizes.max() <= 500  # 150 x 2/3 at the least


def test_images_compress_like_photos():
    """At JPEG quality 90 they take about ImageNet's ~110 KB a file (more than flat colours, less than noise),
    and most of their energy is at low spatial frequencies, as in photographs."""
    sizes, low_share = [], []
    for index in range(12):
        rng = np.random.default_rng([0, index])
        width, height = imagenet_like_size(rng)
        image = natural_image(width, height, rng)
        assert image.shape == (height, width, 3) and image.dtype == np.uint8
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, "JPEG", quality=90)
        sizes.append(len(buffer.getvalue()) / 1024)
        gray = image.astype(np.float64).mean(-1)
        power = np.abs(np.fft.fft2(gray - gray.mean())) ** 2
        fy, fx = np.meshgrid(np.fft.fftfreq(height), np.fft.fftfreq(width), indexing="ij")
        low_share.append(power[np.hypot(fy, fx) < 0.05].sum() / power.sum())
    assert 70 < np.mean(sizes) < 150, sizes
    assert np.median(low_share) > 0.5, low_share  # white noise would put ~1% below 0.05 cycles/pixel


@pytest.mark.slow
def test_the_imagenet_like_bench_runs_on_a_small_setting(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline", "bench", "loader", "--imagenet-like", "--images", "24",
                           "--threads", "1", "--epochs", "2", "--batch", "8", "--work-dir", str(tmp_path),
                           "--store", "jpg:256:90", "--store", "proportion:128:80:0.5",
                           "--step-rates", "a=1000,b=2500"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^24 ImageNet-like JPEGs \(mean \d+ x \d+ px, \d+ KB\), FFCV, random-resized crop to 224",
                     out, flags=re.M), out
    rows = re.findall(r"^\| `(--mode [^`]+)` \| 1 \| (\d+) \| (\d+) \|$", out, flags=re.M)
    assert [r[0] for r in rows] == ["--mode jpg --max-res 256 --quality 90",
                                    "--mode proportion --max-res 128 --quality 80 --compress-probability 0.5"], out
    cores = re.findall(r"^\| `--mode [^`]+` \| (\d+) \| (\d+) \|$", out, flags=re.M)
    for (_, rate, per_core), needs in zip(rows, cores):
        assert rate == per_core  # one thread: one core
        for step_rate, need in zip((1000, 2500), needs):  # ceil(step rate / per-core rate), that rate rounded
            assert int(need) in {math.ceil(step_rate / (int(per_core) + d)) for d in (-0.5, 0.5)}, out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "imagenet_like_24", "imagenet_like_24_jpg_256_90.beton", "imagenet_like_24_jpg_256_90.beton.json",
        "imagenet_like_24_proportion_128_80_p0.5.beton", "imagenet_like_24_proportion_128_80_p0.5.beton.json"]
