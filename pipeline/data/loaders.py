"""Train and validation loaders: FFCV on ``.beton`` files (the default), or torchvision's ImageFolder (baseline).

Normalisation and the validation crop come from the model's data config
(``timm.data.resolve_model_data_config``), never from hard-coded ImageNet statistics.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from pipeline.config import DataConfig
from pipeline.console import quiet_numba_finalizer
from pipeline.data.jit_cache import cache_ffcv_compilation
from pipeline.data.split import holdout_split
from pipeline.data.write import metadata_path, sha256_file
from pipeline.errors import InputError, MissingFileError, PipelineError


class DatasetMismatchError(PipelineError, ValueError):
    """A dataset file that does not match the config (or has no metadata); says what differs."""


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a loader needs; built from the data config and the model's data config."""

    path: str
    train: bool
    batch_size: int
    res: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_pct: float = 0.875
    crop_scale: tuple[float, float] = (0.08, 1.0)
    workers: int = 2
    distributed: bool = False
    seed: int = 0
    os_cache: bool = True
    device: str = "cpu"
    drop_last: bool | None = None
    flip: bool = True
    part: str = "all"  # "fit" / "holdout": that part of the file's validation split (pipeline.data.split)
    holdout: tuple[float, int] = (0.0, 0)  # (fraction, seed) of that split


def loader_spec(data: DataConfig, model_data: dict[str, Any], *, train: bool, seed: int = 0, world: int = 1,
                device: str = "cpu", holdout: bool = False) -> LoaderSpec:
    """The loader of ``data.train`` (a distributed shard reshuffled per epoch when ``world`` > 1) or
    ``data.val``, at the model's resolution and normalisation (``model_data``: timm's data config).

    With ``data.holdout`` > 0 the training loader reads only the fitting part of ``data.train``, and
    ``holdout=True`` gives the (unaugmented) loader of its held-out validation part.
    """
    split = data.holdout > 0
    part = "fit" if split and train else "holdout" if holdout else "all"
    augment = {"seed": seed, "crop_scale": data.crop_scale, "flip": data.flip} if train else {}
    # An evaluation loader reads in order without augmentation, so the seed, crop scale and flip leave
    # it out: equal evaluation loaders then share one FFCV build (``shared_loader``), where each new
    # spec cost a numba compilation and evicted an older loader.
    return LoaderSpec(path=data.train if train or holdout else data.val, train=train, batch_size=data.batch_size,
                      res=model_data["input_size"][-1], mean=tuple(model_data["mean"]), std=tuple(model_data["std"]),
                      crop_pct=model_data["crop_pct"], workers=data.num_workers, distributed=train and world > 1,
                      os_cache=data.os_cache, device=device, part=part, holdout=(data.holdout, data.holdout_seed),
                      **augment)


def read_metadata(beton: str | Path) -> dict[str, Any]:
    """The JSON written beside a ``.beton`` by ``pipeline data write``."""
    beton = Path(beton)
    if not beton.is_file():
        raise MissingFileError(f"dataset not found: {beton}; write it with "
                                f"`python -m pipeline data write --source ... --out {beton}`")
    meta = metadata_path(beton)
    if not meta.is_file():
        raise DatasetMismatchError(f"{beton} has no metadata file {meta.name} beside it; it was not written by "
                                   "`python -m pipeline data write` or its write did not finish; rewrite it")
    try:
        data = json.loads(meta.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DatasetMismatchError(f"{meta}: not valid JSON ({err}); write {beton} again with "
                                   "`python -m pipeline data write`") from None
    missing = [key for key in REQUIRED_METADATA if key not in data] if isinstance(data, dict) else REQUIRED_METADATA
    if missing:
        raise DatasetMismatchError(f"{meta} lacks {', '.join(missing)}; it was not written by this version of "
                                   "`python -m pipeline data write`; write the dataset again")
    return data


REQUIRED_METADATA = ["num_images", "num_classes", "classes", "source", "bytes", "sha256", "settings", "skipped"]


def beton_samples(beton: str | Path) -> int:
    """The number of samples an FFCV ``.beton`` itself holds (its header), for checking the metadata."""
    from ffcv.reader import CURRENT_VERSION
    from ffcv.types import HeaderType

    header = np.fromfile(beton, dtype=HeaderType, count=1)
    if len(header) == 0 or int(header[0]["version"]) != CURRENT_VERSION:
        raise DatasetMismatchError(f"{beton} has no FFCV header: it is truncated or not a .beton; write it again")
    return int(header[0]["num_samples"])


def label_range(beton: str | Path) -> tuple[int, int]:
    """The smallest and largest label a ``.beton`` holds, read from its index (no image is decoded)."""
    from ffcv.reader import Reader

    reader = Reader(str(beton))
    labels = reader.metadata[f"f{reader.field_names.index('label')}"]
    return (int(labels.min()), int(labels.max())) if len(labels) else (0, -1)


def check_dataset(beton: str | Path, num_classes: int | None = None, full_checksum: bool = False
                  ) -> dict[str, Any]:
    """Refuses a ``.beton`` whose metadata disagrees with the config or with the file itself; returns
    the metadata. ``num_classes`` None: no class count is required.

    The size check is free; the SHA-256 (``full_checksum``) reads the whole file.
    """

    meta = read_metadata(beton)
    size = Path(beton).stat().st_size
    if size != meta["bytes"]:
        raise DatasetMismatchError(f"{beton} is {size} bytes but its metadata says {meta['bytes']}: the file was "
                                   "changed or only partly copied; copy or write it again")
    samples = beton_samples(beton)
    if samples != meta["num_images"]:
        raise DatasetMismatchError(f"{beton} holds {samples} images but its metadata says num_images="
                                   f"{meta['num_images']}; the metadata was edited or belongs to another file; "
                                   "write the dataset again")
    if meta["num_classes"] != len(meta["classes"]):
        raise DatasetMismatchError(f"{beton}: its metadata says num_classes={meta['num_classes']} but lists "
                                   f"{len(meta['classes'])} classes; write the dataset again")
    low, high = label_range(beton)
    if low < 0 or high >= meta["num_classes"]:
        raise DatasetMismatchError(f"{beton}: its labels run from {low} to {high}, but its metadata says "
                                   f"num_classes={meta['num_classes']} (labels 0..{meta['num_classes'] - 1}); the file "
                                   "or its metadata was edited, or they belong to different writes; write it again")
    if num_classes is not None and meta["num_classes"] != num_classes:
        raise DatasetMismatchError(f"{beton} holds {meta['num_classes']} classes ({meta['source']}) but the config "
                                   f"says data.num_classes={num_classes}; fix the config or point at the right file")
    if full_checksum and sha256_file(beton) != meta["sha256"]:
        raise DatasetMismatchError(f"{beton}: SHA-256 differs from its metadata; the file is corrupt, write it again")
    return meta


def train_pipeline(spec: LoaderSpec) -> list:
    """FFCV ops for training images: random-resized crop, flip, normalise; the crop and the flip drawn per image
    from the loader seed (``pipeline/data/augment.py``), so that one seed gives one training.

    On the CPU the jitted ops come first (NormalizeImage is jitted there): FFCV 1.0.2 hangs in
    ``Graph.group_operations`` on a jitted -> non-jitted -> jitted chain. On a GPU this follows
    ffcv-imagenet's order, with a torch module for normalisation so that cupy is not needed.
    """
    return [*train_decode(spec), *_to_model_input(spec)]


def train_decode(spec: LoaderSpec) -> list:
    """The host's part of the training pipeline: decode with a random-resized crop, then flip (uint8)."""
    from pipeline.data.augment import SeededHorizontalFlip, SeededRandomResizedCrop

    decoder = SeededRandomResizedCrop((spec.res, spec.res), scale=spec.crop_scale, seed=spec.seed)
    return [decoder, *([SeededHorizontalFlip(seed=spec.seed)] if spec.flip else [])]


def val_pipeline(spec: LoaderSpec) -> list:
    """FFCV ops for validation: a centre crop of ``crop_pct`` of the shorter side, resized, then normalised."""
    from ffcv.fields.rgb_image import CenterCropRGBImageDecoder

    return [CenterCropRGBImageDecoder((spec.res, spec.res), ratio=spec.crop_pct), *_to_model_input(spec)]


class _Normalize(torch.nn.Module):
    """uint8 ``(B, 3, H, W)`` on the device -> normalised float32."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1) * 255)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() - self.mean.to(images.device)) / self.std.to(images.device)


def _to_model_input(spec: LoaderSpec) -> list:
    from ffcv.transforms import NormalizeImage, ToDevice, ToTensor, ToTorchImage

    if spec.device == "cpu":
        mean, std = np.array(spec.mean) * 255, np.array(spec.std) * 255
        return [NormalizeImage(mean, std, np.float32), ToTensor(), ToTorchImage()]
    return [ToTensor(), ToDevice(torch.device(spec.device), non_blocking=True), ToTorchImage(),
            _Normalize(spec.mean, spec.std)]


def label_pipeline(spec: LoaderSpec) -> list:
    from ffcv.fields.basics import IntDecoder
    from ffcv.transforms import Squeeze, ToDevice, ToTensor

    ops = [IntDecoder(), ToTensor(), Squeeze(1)]
    if spec.device != "cpu":
        ops.append(ToDevice(torch.device(spec.device), non_blocking=True))
    return ops


def ffcv_loader(spec: LoaderSpec, indices: np.ndarray | None = None):
    """An ``ffcv.loader.Loader``; under DDP (``distributed``) each rank reads a disjoint shard, reshuffled per epoch.

    ``indices`` restricts it to those samples (a rank's validation slice, the first images of a file);
    without them, ``spec.part`` picks the fitting or held-out part of the file's validation split.
    """
    from ffcv.loader import Loader, OrderOption

    quiet_numba_finalizer()
    cache_ffcv_compilation()

    if indices is None and spec.part != "all":
        split = holdout_split(spec.path, *spec.holdout)
        indices = split.train if spec.part == "fit" else split.val
    # QUASI_RANDOM is not implemented with distributed=True in FFCV 1.0.2; RANDOM reseeds with seed + epoch.
    order = OrderOption.RANDOM if spec.train else OrderOption.SEQUENTIAL
    pipelines = {"image": train_pipeline(spec) if spec.train else val_pipeline(spec), "label": label_pipeline(spec)}
    return Loader(spec.path, batch_size=spec.batch_size, num_workers=spec.workers, os_cache=spec.os_cache,
                  order=order, distributed=spec.distributed, seed=spec.seed, pipelines=pipelines, indices=indices,
                  drop_last=spec.train if spec.drop_last is None else spec.drop_last)


def read_pixels(beton: str | Path, res: int, crop_pct: float, count: int, batch: int = 64) -> Iterator[np.ndarray]:
    """The first ``count`` images of a ``.beton`` as uint8 ``(B, res, res, 3)`` batches, in file order: the
    pixels the validation loader sees (centre crop of ``crop_pct``, resized), before normalisation."""
    for images, _ in read_labelled(beton, res, crop_pct, count, batch):
        yield images


def read_labelled(beton: str | Path, res: int, crop_pct: float, count: int, batch: int = 64
                  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``read_pixels``' batches with their labels: (uint8 (B, res, res, 3), int64 (B,))."""
    spec = LoaderSpec(str(beton), train=False, batch_size=batch, res=res, mean=(0.0,) * 3, std=(1.0 / 255,) * 3,
                      workers=1, flip=False, crop_pct=crop_pct)
    # Only the wanted indices: the iterator then runs to its end (an abandoned FFCV iterator can abort at exit).
    for images, labels in ffcv_loader(spec, indices=np.arange(count)):
        yield (images.permute(0, 2, 3, 1).round().clamp(0, 255).to(torch.uint8).numpy(),
               labels.reshape(-1).to(torch.int64).numpy())

def set_resolution(loader, res: int) -> None:
    """Progressive resizing (ffcv-imagenet): changes the random-resized-crop output size for the next epoch."""
    from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder

    spec = getattr(loader, "pipeline_specs", {}).get("image")
    ops = [] if spec is None else [spec.decoder, *spec.transforms]
    decoders = [op for op in ops if isinstance(op, RandomResizedCropRGBImageDecoder)]
    if not decoders:
        raise InputError("progressive resizing needs an FFCV train loader with a random-resized-crop decoder")
    for decoder in decoders:
        decoder.output_size = (res, res)


def progressive_res(epoch: int, start_res: int, end_res: int, start_epoch: int, end_epoch: int,
                    multiple: int = 32) -> int:
    """ffcv-imagenet's schedule: ``start_res`` until ``start_epoch``, then linear to ``end_res`` at ``end_epoch``.

    Rounded down to a multiple of ``multiple`` (use the patch size for ViTs).
    """
    if epoch <= start_epoch:
        return start_res
    if epoch >= end_epoch:
        return end_res
    res = np.interp(epoch, [start_epoch, end_epoch], [start_res, end_res])
    return int(res // multiple) * multiple


class _EpochKeys(torch.utils.data.Sampler):
    """One epoch's sample indices as ``(epoch, index)`` keys: the epoch travels with each index into the
    ``DataLoader``'s worker processes (persistent ones included), where ``_SeededFolder`` draws from it."""

    def __init__(self, indices: torch.utils.data.Sampler) -> None:
        self.indices, self.epoch = indices, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.indices, "set_epoch"):
            self.indices.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, int(index)) for index in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class _SeededFolder(torch.utils.data.Dataset):
    """An ``ImageFolder`` whose random transforms draw from a generator seeded by (seed, epoch, index).

    torchvision's transforms draw from the process's global torch generator: in the main process
    (``num_workers: 0``) that is the model's own stream, and in workers it starts from a per-iterator
    seed, so a resumed run cropped its epochs differently from an uninterrupted one. Here each image's
    draws depend only on the loader seed, the epoch and the image, like the FFCV loader's
    (``pipeline.data.augment``), and the global generator is left as it was.
    """

    def __init__(self, folder, seed: int) -> None:
        self.folder, self.seed = folder, seed

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        state = np.random.SeedSequence([self.seed, epoch, index]).generate_state(1, np.uint64)[0]
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: torch.manual_seed also seeds the
            torch.default_generator.manual_seed(int(state))  # accelerators', several times the cost (design.md)
            return self.folder[index]


class _TorchLoader:
    """torchvision ImageFolder + PIL ``DataLoader`` behind the same ``len``/``iter`` as FFCV's loader.

    Training order is a permutation seeded by (seed, epoch), as FFCV's ``OrderOption.RANDOM`` is, split
    over the ranks under DDP; crops and flips come from (seed, epoch, image) (``_SeededFolder``). So an
    epoch's batches depend on ``next_epoch`` alone, and a run resumed at epoch E reads what an
    uninterrupted one reads there.
    """

    def __init__(self, spec: LoaderSpec) -> None:
        from torchvision import datasets, transforms

        if spec.train:
            flip = [transforms.RandomHorizontalFlip()] if spec.flip else []
            tf = transforms.Compose([transforms.RandomResizedCrop(spec.res, scale=spec.crop_scale), *flip,
                                     transforms.ToTensor(),
                                     transforms.Normalize(spec.mean, spec.std)])
        else:
            tf = transforms.Compose([transforms.Resize(int(spec.res / spec.crop_pct)), transforms.CenterCrop(spec.res),
                                     transforms.ToTensor(), transforms.Normalize(spec.mean, spec.std)])
        if not Path(spec.path).is_dir():
            raise MissingFileError(f"loader=torch reads an image folder (PATH/<class>/<images>), but {spec.path} is "
                                    "not a directory; write one with `python -m pipeline data folder`")
        folder = datasets.ImageFolder(spec.path, transform=tf)
        if spec.train:  # one replica unless distributed: DistributedSampler is then a permutation from seed + epoch
            replicas = {} if spec.distributed else {"num_replicas": 1, "rank": 0}
            indices = DistributedSampler(folder, shuffle=True, seed=spec.seed, **replicas)
        else:
            indices = SequentialSampler(folder)
        self.sampler = _EpochKeys(indices)
        # The generator only seeds the workers (every draw is reseeded per image), so that starting an
        # epoch does not draw from the global generator, the model's.
        generator = torch.Generator().manual_seed(spec.seed)
        self.loader = DataLoader(_SeededFolder(folder, spec.seed), batch_size=spec.batch_size, sampler=self.sampler,
                                 num_workers=spec.workers, generator=generator,
                                 drop_last=spec.train if spec.drop_last is None else spec.drop_last,
                                 pin_memory=spec.device != "cpu", persistent_workers=spec.workers > 0)
        self.device = torch.device(spec.device)
        self.next_epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_epoch(self.next_epoch)
        self.next_epoch += 1
        for images, labels in self.loader:
            yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


def torch_loader(spec: LoaderSpec) -> _TorchLoader:
    """The torchvision baseline loader (and the fallback without FFCV)."""
    return _TorchLoader(spec)


def build_loader(kind: str, spec: LoaderSpec) -> Iterable:
    """``kind`` is ``ffcv`` or ``torch``."""
    if kind == "ffcv":
        return ffcv_loader(spec)
    if kind == "torch":
        return torch_loader(spec)
    raise InputError(f"unknown loader {kind!r}; use ffcv or torch")


_SHARED: dict[tuple[str, LoaderSpec], Any] = {}


def shared_loader(kind: str, spec: LoaderSpec) -> Iterable:
    """``build_loader``, but an FFCV loader is built once per process and spec, then reused.

    FFCV compiles every new loader with numba (about 10 s here); Tune runs many short trials in the
    same reused actor, and they all read the same data with the same spec.
    """
    if kind != "ffcv":
        return build_loader(kind, spec)
    key = (kind, spec)
    if key not in _SHARED:
        if len(_SHARED) >= 4:
            _SHARED.pop(next(iter(_SHARED)))
        _SHARED[key] = build_loader(kind, spec)
    return _SHARED[key]
