"""Image sources for ``pipeline data write``: an ImageNet-style folder, Fashion-MNIST's IDX files, synthetic data.

A source is an indexable list of samples. ``source[i]`` returns ``(image, label)`` with ``image`` a
``(H, W, 3)`` uint8 array, whatever the file's mode was (grayscale, RGBA, CMYK, 16-bit), so that
every writer and loader downstream sees RGB.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pipeline.errors import PipelineError

# torchvision's ImageFolder list, so that both loaders see the same files.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
FASHION_MNIST_DIR = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")


class SourceError(PipelineError, ValueError):
    """A source that cannot be read; the message says which path or option and how to fix it."""


def to_rgb(image: Image.Image) -> np.ndarray:
    """Any PIL image -> ``(H, W, 3)`` uint8 RGB.

    16-bit modes are rescaled (PIL's own ``convert`` clips them at 255); transparency is composited
    on black, CMYK and palettes go through PIL's conversions.
    """
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        wide = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") else max(float(wide.max()), 1.0)
        gray = np.clip(np.rint(wide * (255.0 / top)), 0, 255).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    if image.mode == "F":
        wide = np.asarray(image, dtype=np.float64)
        span = max(float(wide.max() - wide.min()), 1e-12)
        gray = np.rint((wide - wide.min()) * (255.0 / span)).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        image = image.convert("RGBA")
        black = Image.new("RGBA", image.size, (0, 0, 0, 255))
        image = Image.alpha_composite(black, image)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def read_image(path: str | Path, draft: int | None = None) -> np.ndarray:
    """Decodes an image file fully -> ``(H, W, 3)`` uint8. Raises OSError/SyntaxError/ValueError on a bad file.

    ``draft`` lets JPEG decode at a reduced scale (at least ``draft`` pixels a side): a cheap full
    decode for validation.
    """
    with Image.open(path) as image:
        if draft is not None and image.format == "JPEG":
            image.draft("RGB", (draft, draft))
        image.load()
        return to_rgb(image)


@dataclass
class Source:
    """Samples to write: ``items[i]`` is a file path or an index into ``arrays``; labels are class indices."""

    spec: str
    classes: list[str]
    items: list[Any]
    labels: np.ndarray
    arrays: np.ndarray | None = None
    grayscale: bool = False
    non_images: list[str] = field(default_factory=list)
    skipped_links: list[str] = field(default_factory=list)  # directory links into folders walked already
    synthetic_seed: int | None = None
    synthetic_size: int = 32

    def __len__(self) -> int:
        return len(self.items)

    def image(self, index: int) -> np.ndarray:
        """The ``index``-th image as ``(H, W, 3)`` uint8."""
        item = self.items[index]
        if self.arrays is not None:
            gray = self.arrays[item]
            return np.repeat(gray[..., None], 3, axis=2)
        if self.synthetic_seed is not None:
            return synthetic_image(int(self.labels[index]), len(self.classes), self.synthetic_size,
                                   np.random.default_rng([self.synthetic_seed, index]))
        return read_image(item)

    def subset(self, keep: np.ndarray) -> Source:
        """The samples at positions ``keep`` (used to drop files that failed validation)."""
        return dataclasses.replace(self, items=[self.items[i] for i in keep], labels=self.labels[keep])


def _scan_class(directory: Path, tree: Path) -> tuple[list[str], list[str], list[str]]:
    """The image files and the other files under ``directory``, and the directory links skipped: a link is
    followed out of the ``tree`` (a class folder on another disk), never back into it (a loop, or another
    class's images read twice), nor into a folder already walked."""
    images, others, skipped = [], [], []
    inside, walked = os.path.realpath(tree), {os.path.realpath(directory)}
    for root, dirs, files in os.walk(directory, followlinks=True):
        for name in list(dirs):
            path = os.path.join(root, name)
            target = os.path.realpath(path)
            into_tree = os.path.islink(path) and (target == inside or target.startswith(inside + os.sep))
            if into_tree or target in walked:
                dirs.remove(name)
                skipped.append(path)
            walked.add(target)
        for name in sorted(files):
            path = os.path.join(root, name)
            (images if name.lower().endswith(IMAGE_EXTENSIONS) else others).append(path)
    return sorted(images), sorted(others), sorted(skipped)


def imagefolder_source(path: str | Path, limit: int | None = None) -> Source:
    """``PATH/<class>/*.JPEG``; classes are the sorted folder names, as in torchvision's ImageFolder."""
    root = Path(path)
    if not root.exists():
        raise SourceError(f"imagefolder:{root}: the path does not exist")
    if not root.is_dir():
        raise SourceError(f"imagefolder:{root}: not a directory; expected PATH/<class>/<image files>")
    classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    if not classes:
        raise SourceError(f"imagefolder:{root}: no class folders; expected PATH/<class>/<image files> "
                          "(for ImageNet, point at the train/ or val/ folder)")
    items: list[str] = []
    labels: list[int] = []
    non_images: list[str] = []
    skipped_links: list[str] = []
    for index, name in enumerate(classes):
        images, others, skipped = _scan_class(root / name, root)
        skipped_links += skipped
        if not images:
            raise SourceError(f"imagefolder:{root}: the class folder {name!r} holds no image files "
                              f"(extensions {', '.join(IMAGE_EXTENSIONS)}); remove it or add its images, "
                              "since the class index of every later folder depends on it")
        items += images
        labels += [index] * len(images)
        non_images += others
    source = Source(f"imagefolder:{root.resolve()}", classes, items, np.asarray(labels, dtype=np.int64),
                    non_images=non_images, skipped_links=skipped_links)
    return _limit(source, limit)


def _read_idx(path: Path) -> np.ndarray:
    if not path.is_file():
        raise SourceError(f"Fashion-MNIST file not found: {path}. Install Debian's dataset-fashion-mnist "
                          "(make setup does), or point FASHION_MNIST_DIR at a folder holding the IDX .gz files")
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    magic = int.from_bytes(raw[:4], "big")
    ndim = magic & 0xFF
    if magic >> 8 != 0x08:  # 0x08: unsigned bytes
        raise SourceError(f"{path}: not an IDX file of unsigned bytes (magic {magic:#x})")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise SourceError(f"{path}: truncated IDX file ({data.size} bytes of data, header says {shape})")
    return data.reshape(shape)


def fashion_mnist_source(split: str, limit: int | None = None) -> Source:
    """Debian's Fashion-MNIST (``train``: 60k, ``test``: 10k), 28x28 grayscale stored as 3 equal channels."""
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise SourceError(f"fashion-mnist:{split}: unknown split; use fashion-mnist:train or fashion-mnist:test")
    images = _read_idx(FASHION_MNIST_DIR / f"{prefix}-images-idx3-ubyte.gz")
    labels = _read_idx(FASHION_MNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
    if len(images) != len(labels):
        raise SourceError(f"Fashion-MNIST {split}: {len(images)} images but {len(labels)} labels")
    source = Source(f"fashion-mnist:{split}", list(FASHION_MNIST_CLASSES), list(range(len(images))), labels,
                    arrays=images, grayscale=True)
    return _limit(source, limit)


def synthetic_image(label: int, num_classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """A class-conditional image ``(size, size, 3)`` uint8: an oriented grating and a colour per class, plus noise."""
    angle = np.pi * label / num_classes
    freq = 2.0 + 3.0 * ((label * 7) % num_classes) / max(num_classes - 1, 1)
    hue = np.array([np.cos(2 * np.pi * label / num_classes), np.cos(2 * np.pi * label / num_classes + 2.1),
                    np.cos(2 * np.pi * label / num_classes + 4.2)])
    y, x = np.mgrid[0:size, 0:size] / size
    phase = rng.uniform(0, 2 * np.pi)
    grating = np.sin(2 * np.pi * freq * (x * np.cos(angle) + y * np.sin(angle)) + phase)
    image = 127.5 + 60.0 * grating[..., None] + 50.0 * hue + rng.normal(0, 12.0, (size, size, 3))
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def synthetic_source(options: dict[str, int], limit: int | None, seed: int = 0) -> Source:
    """``synthetic[:classes=C,count=N,size=S]``: N images (default 1000, or ``--limit``), balanced over C classes."""
    unknown = set(options) - {"classes", "count", "size", "seed"}
    if unknown:
        raise SourceError(f"synthetic: unknown options {sorted(unknown)}; allowed: classes, count, size, seed")
    classes = options.get("classes", 10)
    count = options.get("count", limit if limit is not None else 1000)
    size = options.get("size", 32)
    if classes < 1 or count < 1 or size < 4:
        raise SourceError(f"synthetic: need classes >= 1, count >= 1 and size >= 4, got {options}")
    if count < classes:
        raise SourceError(f"synthetic: count={count} is below classes={classes}: {classes - count} class(es) would "
                          f"have no image; give count >= {classes}")
    labels = np.arange(count, dtype=np.int64) % classes
    source = Source(f"synthetic:classes={classes},count={count},size={size},seed={options.get('seed', seed)}",
                    [f"class_{i:03d}" for i in range(classes)], list(range(count)), labels,
                    synthetic_seed=options.get("seed", seed), synthetic_size=size)
    return _limit(source, limit)


def _limit(source: Source, limit: int | None) -> Source:
    if limit is None or limit >= len(source):
        return source
    if limit < len(source.classes):
        raise SourceError(f"--limit {limit} is below the {len(source.classes)} classes of {source.spec}: every "
                          f"class keeps at least one image, so give --limit {len(source.classes)} or more")
    # Evenly spaced within each class, in proportion to its size (at least one image per class).
    counts = np.bincount(source.labels, minlength=len(source.classes))
    quota = counts * limit / len(source)
    share = np.minimum(counts, np.maximum(1, np.floor(quota).astype(np.int64)))
    while share.sum() > limit:  # the floor of one per class can overshoot: trim the largest shares
        share[np.argmax(share)] -= 1
    while share.sum() < limit:  # the rest to the largest remainders (a class never gives more than it has)
        room = np.where(share < counts, quota - share, -np.inf)
        share[np.argmax(room)] += 1
    keep = []
    for label, n in enumerate(share):
        members = np.flatnonzero(source.labels == label)
        keep.append(members[np.linspace(0, len(members) - 1, n).round().astype(np.int64)])
    return source.subset(np.sort(np.concatenate(keep)))


def _parse_options(text: str, spec: str) -> dict[str, int]:
    options: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        try:
            options[key.strip()] = int(value)
        except ValueError:
            raise SourceError(f"{spec}: option {part!r} must be KEY=INTEGER") from None
    return options


def open_source(spec: str, limit: int | None = None) -> Source:
    """Parses ``--source``: ``imagefolder:PATH``, ``fashion-mnist:train|test`` or ``synthetic[:k=v,...]``."""
    if limit is not None and limit < 1:
        raise SourceError(f"--limit {limit}: give the number of images to keep, 1 or more (or leave --limit out "
                          "for all of them)")
    kind, _, rest = spec.partition(":")
    if kind == "imagefolder":
        if not rest:
            raise SourceError("imagefolder: give the folder, for example imagefolder:/data/imagenet/train")
        return imagefolder_source(rest, limit)
    if kind == "fashion-mnist":
        return fashion_mnist_source(rest, limit)
    if kind == "synthetic":
        return synthetic_source(_parse_options(rest, spec), limit)
    raise SourceError(f"unknown source {spec!r}; use imagefolder:PATH, fashion-mnist:train, fashion-mnist:test "
                      "or synthetic[:classes=C,count=N,size=S]")
