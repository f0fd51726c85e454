"""Datasets and loaders: round trips against the source pixels, sharding, metadata checks, bad input, and one seed
giving one training (in-process, through the seeded loaders)."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import types
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data import DataWriteError, SourceError, WriteSettings, metadata_path, open_source, write_beton
from pipeline.data.loaders import (
    DatasetMismatchError,
    LoaderSpec,
    build_loader,
    check_dataset,
    ffcv_loader,
    loader_spec,
    progressive_res,
)
from pipeline.data.sources import FASHION_MNIST_DIR, read_image
from pipeline.data.write import write_folder

ROOT = Path(__file__).resolve().parents[1]
# mean 0 and std 1/255 make the normalisation an identity on 0..255, so loaders return the stored pixels.
IDENTITY = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))
RAW = WriteSettings(mode="raw", max_res=None, workers=2)


def exact_spec(path: Path, res: int, **kw) -> LoaderSpec:
    return LoaderSpec(str(path), train=False, batch_size=kw.pop("batch_size", 16), res=res, crop_pct=1.0,
                      workers=1, drop_last=False, **IDENTITY, **kw)


def read_all(loader) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for x, y in loader:  # FFCV reuses its output buffers: copy each batch
        images.append(x.permute(0, 2, 3, 1).numpy().copy())
        labels.append(y.numpy().copy())
    return np.concatenate(images), np.concatenate(labels)


def make_folder(root: Path, counts: dict[str, int], size: int = 40) -> list[tuple[Path, int]]:
    rng = np.random.default_rng(0)
    files = []
    for label, (name, count) in enumerate(sorted(counts.items())):
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = (rng.uniform(0, 1, (size // 8, size // 8, 3)) * 255).astype(np.uint8)
            image = Image.fromarray(pixels).resize((size, size + 8), Image.Resampling.BILINEAR)
            path = root / name / f"{i}.JPEG"
            image.save(path, quality=95)
            files.append((path, label))
    return files


@pytest.fixture(scope="module")
def synthetic_beton(tmp_path_factory) -> tuple[Path, object]:
    source = open_source("synthetic:classes=5,count=60,size=24")
    out = tmp_path_factory.mktemp("syn") / "syn.beton"
    write_beton(source, out, RAW, log=lambda _: None)
    return out, source


@pytest.mark.beton
def test_raw_round_trip_is_exact(synthetic_beton):
    beton, source = synthetic_beton
    images, labels = read_all(ffcv_loader(exact_spec(beton, 24)))
    assert images.shape == (60, 24, 24, 3) and labels.tolist() == source.labels.tolist()
    expected = np.stack([source.image(i) for i in range(len(source))]).astype(np.float32)
    np.testing.assert_array_equal(images, expected)


@pytest.mark.beton
def test_metadata_describes_the_file(synthetic_beton):
    beton, source = synthetic_beton
    meta = json.loads(metadata_path(beton).read_text())
    assert meta["num_images"] == 60 and meta["num_classes"] == 5 and meta["class_counts"] == [12] * 5
    assert meta["class_to_idx"] == {f"class_{i:03d}": i for i in range(5)}
    assert meta["bytes"] == beton.stat().st_size and len(meta["sha256"]) == 64
    assert meta["settings"] == {"mode": "raw", "max_res": None, "quality": 90}


@pytest.mark.beton
def test_jpeg_folder_round_trip_within_jpeg_tolerance(tmp_path):
    files = make_folder(tmp_path / "src", {"cat": 5, "dog": 4, "eel": 3})
    out = tmp_path / "f.beton"
    meta = write_beton(open_source(f"imagefolder:{tmp_path / 'src'}"), out,
                       WriteSettings(mode="jpg", max_res=None, quality=95), log=lambda _: None)
    assert meta["classes"] == ["cat", "dog", "eel"]  # sorted folder names, as torchvision's ImageFolder
    images, labels = read_all(ffcv_loader(exact_spec(out, 40)))  # centre crop 40x40 of 40x48
    assert labels.tolist() == [label for _, label in files]
    for image, (path, _) in zip(images, files):
        source = read_image(path)[4:44].astype(np.float32)
        assert np.abs(image - source).mean() < 3.0, path


def test_limit_keeps_every_class():
    source = open_source("fashion-mnist:test", limit=50)
    assert len(source) == 50 and set(source.labels.tolist()) == set(range(10))


def test_fashion_mnist_matches_the_published_dataset():
    if not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.fail("Debian's dataset-fashion-mnist is not installed; run `make setup`")
    train, test = open_source("fashion-mnist:train"), open_source("fashion-mnist:test")
    # Published facts: 60k/10k images, 6000 per class in train, the first labels 9,0,0,3 and 9,2,1,1.
    assert (len(train), len(test)) == (60000, 10000)
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert train.labels[:4].tolist() == [9, 0, 0, 3] and test.labels[:4].tolist() == [9, 2, 1, 1]
    image = train.image(0)
    assert image.shape == (28, 28, 3) and (image[..., 0] == image[..., 2]).all() and image.max() > 200


def test_torch_loader_reads_the_same_pixels(tmp_path):
    source = open_source("synthetic:classes=3,count=12,size=16")
    write_folder(source, tmp_path / "folder", size=None, quality=100, log=lambda _: None)
    images, labels = read_all(build_loader("torch", exact_spec(tmp_path / "folder", 16, batch_size=5)))
    assert images.shape == (12, 16, 16, 3)
    files = sorted((tmp_path / "folder").rglob("*.jpg"))  # ImageFolder's order: class folder, then name
    assert labels.tolist() == [int(source.labels[int(f.stem)]) for f in files]
    expected = np.stack([read_image(f) for f in files]).astype(np.float32)
    np.testing.assert_allclose(images, expected, atol=1e-3)


def _torch_epochs(spec: LoaderSpec, start: int = 0, epochs: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each epoch's (images in label order, labels in reading order); the labels are the images' identities."""
    loader, out = build_loader("torch", spec), []
    loader.next_epoch = start
    for _ in range(epochs):
        images, labels = read_all(loader)
        out.append((images[np.argsort(labels)], labels))
    return out


def test_torch_loader_epochs_depend_on_the_seed_and_epoch_alone(tmp_path):
    """torchvision's transforms draw from the global torch generator, and the shuffle continued from epoch
    to epoch: a run resumed at epoch 1 read other images in another order than an uninterrupted one, and
    with no workers the crops drew from the model's own stream. Now a loader started at epoch 1 reads
    what the uninterrupted one reads there, with 0 or 2 workers alike, and the global generator is untouched."""
    write_folder(open_source("synthetic:classes=48,count=48,size=24"), tmp_path / "ids", size=None, quality=95,
                 log=lambda _: None)
    spec = LoaderSpec(str(tmp_path / "ids"), train=True, batch_size=8, res=16, crop_scale=(0.2, 1.0), workers=0,
                      seed=3, **IDENTITY)
    state = torch.random.get_rng_state()
    first = _torch_epochs(spec)
    assert torch.equal(torch.random.get_rng_state(), state)
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # noqa: E731
    assert same(_torch_epochs(spec, start=1, epochs=1)[0], first[1])  # resumed at epoch 1
    assert same(_torch_epochs(replace(spec, workers=2))[1], first[1])
    other = _torch_epochs(replace(spec, seed=4))[0]
    same_image = lambda a, b: np.all(a == b, axis=(1, 2, 3))  # noqa: E731
    assert same_image(first[0][0], other[0]).mean() < 0.2 and not np.array_equal(first[0][1], other[1])
    assert same_image(first[0][0], first[1][0]).mean() < 0.2 and not np.array_equal(first[0][1], first[1][1])


@pytest.mark.beton
def test_train_pipeline_augments_and_normalises(synthetic_beton):
    beton, source = synthetic_beton
    spec = LoaderSpec(str(beton), train=True, batch_size=20, res=16, mean=(0.5,) * 3, std=(0.25,) * 3,
                      crop_scale=(0.3, 1.0), workers=1)
    x, y = read_all(ffcv_loader(spec))
    x, y = torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(y)
    assert x.shape == (60, 3, 16, 16) and x.dtype == torch.float32 and y.shape == (60,)
    assert -2.0 - 1e-6 <= x.min() and x.max() <= 2.0 + 1e-6  # (0..1 - 0.5) / 0.25


def _augmented_epochs(spec: LoaderSpec, epochs: int = 2) -> list[np.ndarray]:
    """Each epoch's images in label order (the labels are the images' identities)."""
    loader, out = ffcv_loader(spec), []
    for _ in range(epochs):
        images, labels = read_all(loader)
        out.append(images[np.argsort(labels)])
    return out


@pytest.mark.beton
@pytest.mark.parametrize("mode", ["raw", "jpg"])
def test_train_crops_and_flips_are_the_same_for_the_same_seed(tmp_path, mode):
    """FFCV's own crop and flip draw from numba's unseeded per-thread state; the seeded ops give every image
    the same crop and flip for the same loader seed, whether one thread decodes or two, and other ones
    for another seed and in the next epoch; raw pixels and JPEGs (decoded into per-image scratch)."""
    beton = tmp_path / "ids.beton"
    write_beton(open_source("synthetic:classes=48,count=48,size=24"), beton,
                WriteSettings(mode=mode, max_res=None, workers=2), log=lambda _: None)
    spec = LoaderSpec(str(beton), train=True, batch_size=8, res=16, crop_scale=(0.2, 1.0), workers=1, seed=3,
                      **IDENTITY)
    first = _augmented_epochs(spec)
    for again in (_augmented_epochs(spec), _augmented_epochs(replace(spec, workers=2))):
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    other = _augmented_epochs(replace(spec, seed=4))
    same_image = lambda a, b: np.all(a == b, axis=(1, 2, 3))  # noqa: E731
    assert same_image(first[0], other[0]).mean() < 0.2
    assert same_image(first[0], first[1]).mean() < 0.2


@pytest.mark.slow  # numba compiles FFCV's flip on the first case: 9 s here
@pytest.mark.parametrize("prob", [0.0, 0.25, 0.5, 1.0])
def test_seeded_flip_flips_with_its_probability(prob):
    from pipeline.data.augment import SeededHorizontalFlip

    images = np.tile(np.array([0, 1], dtype=np.uint8).reshape(1, 1, 2, 1), (4000, 1, 1, 1))  # (B, H, W, C)
    flip = SeededHorizontalFlip(prob, seed=0).generate_code()
    indices = np.arange(4000, dtype=np.uint64)
    out = flip(images, np.empty_like(images), indices)
    flipped = out[:, 0, 0, 0] == 1
    assert abs(flipped.mean() - prob) < 0.03  # 4000 draws: a standard deviation of at most 0.008
    assert np.array_equal(out[flipped], images[flipped][:, :, ::-1]) and np.array_equal(out[~flipped], images[~flipped])
    assert np.array_equal(flip(images, np.empty_like(images), indices), out)


def test_seeded_flip_refuses_a_probability_outside_zero_to_one():
    from pipeline.data.augment import SeededHorizontalFlip

    with pytest.raises(ValueError, match=r"flip_prob is a probability in \[0, 1\], got 1.5"):
        SeededHorizontalFlip(1.5)


def test_progressive_resolution_schedule():
    assert [progressive_res(e, 160, 192, 10, 12, 32) for e in (0, 10, 11, 12, 20)] == [160, 160, 160, 192, 192]
    assert progressive_res(11, 128, 256, 10, 12, 16) == 192


SHARD_WORKER = textwrap.dedent("""
    import os, sys, json, torch, torch.distributed as dist
    from pipeline.data.loaders import LoaderSpec, ffcv_loader
    rank, path, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = LoaderSpec(path, train=True, batch_size=4, res=8, mean=(0.,) * 3, std=(1.,) * 3, workers=1,
                      distributed=True, seed=7, drop_last=False)
    loader = ffcv_loader(spec)
    epochs = [[int(v) for _, y in loader for v in y] for _ in range(2)]
    print(json.dumps(epochs))
    dist.destroy_process_group()
""")


@pytest.mark.beton
@pytest.mark.slow  # two trainings in this process: 10 s here
def test_one_seed_gives_one_training(synthetic_data, tmp_path):
    """Two trainings from one config and seed, random crops and flips on, end with the same weights, bit for
    bit. FFCV's own crop and flip drew from numba's unseeded per-thread state, and two such runs here
    ended with different weights (pipeline/data/augment.py). In this process (``train.workers: 0``): no Ray."""
    from pipeline.config import load_config
    from pipeline.train import run_training
    from pipeline.train.checkpoint import load_checkpoint

    data = synthetic_data(256, 64)
    where = [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}", "train.workers=0",
             "data.num_workers=2", f"train.storage_path={tmp_path / 'ray'}",
             f"train.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"train.artifact_root={tmp_path / 'artifacts'}"]
    tiny = ROOT / "configs" / "train" / "tiny_synthetic.yaml"
    runs = [run_training(load_config(tiny, [*where, f"train.name=seeded{i}"])) for i in range(2)]
    a, b = (load_checkpoint(r.checkpoint)["model"] for r in runs)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert runs[0].summary["train_loss"] == runs[1].summary["train_loss"]


@pytest.mark.beton
def test_two_ranks_see_disjoint_shards_reshuffled_each_epoch(tmp_path):
    # One class per image, so a label is the sample's identity.
    beton = tmp_path / "ids.beton"
    write_beton(open_source("synthetic:classes=64,count=64,size=8"), beton, RAW, log=lambda _: None)
    script = tmp_path / "shard.py"
    script.write_text(SHARD_WORKER)
    port = str(29500 + os.getpid() % 1000)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(beton), port], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    (r0e0, r0e1), (r1e0, r1e1) = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    for a, b in ((r0e0, r1e0), (r0e1, r1e1)):
        assert len(a) == len(b) == 32 and not set(a) & set(b) and set(a) | set(b) == set(range(64))
    assert r0e0 != r0e1  # reseeded per epoch


@pytest.mark.beton
def test_metadata_mismatch_is_refused(synthetic_beton, tmp_path):
    beton, _ = synthetic_beton
    check_dataset(beton, 5, full_checksum=True)
    with pytest.raises(DatasetMismatchError, match="holds 5 classes .* data.num_classes=10"):
        check_dataset(beton, 10)
    partial = tmp_path / "partial.beton"
    partial.write_bytes(beton.read_bytes()[:-100])
    metadata_path(partial).write_text(metadata_path(beton).read_text())
    with pytest.raises(DatasetMismatchError, match="only partly copied"):
        check_dataset(partial, 5)
    flipped = bytearray(beton.read_bytes())
    flipped[-5] ^= 0xFF
    partial.write_bytes(bytes(flipped))
    check_dataset(partial, 5)  # same size: only the checksum can tell
    with pytest.raises(DatasetMismatchError, match="SHA-256 differs"):
        check_dataset(partial, 5, full_checksum=True)
    metadata_path(partial).unlink()
    with pytest.raises(DatasetMismatchError, match="no metadata file"):
        check_dataset(partial, 5)
    with pytest.raises(FileNotFoundError, match="pipeline data write"):
        check_dataset(tmp_path / "missing.beton", 5)


@pytest.mark.beton
def test_edited_or_broken_metadata_is_refused(synthetic_beton, tmp_path):
    # data check compares the metadata with the .beton itself, not only with its size.
    beton, _ = synthetic_beton
    copy = tmp_path / "copy.beton"
    copy.write_bytes(beton.read_bytes())
    meta = json.loads(metadata_path(beton).read_text())

    def with_meta(**changes) -> None:
        metadata_path(copy).write_text(json.dumps({k: v for k, v in (meta | changes).items() if v is not None}))

    with_meta(num_images=meta["num_images"] + 1)  # a consumer would index past the end
    with pytest.raises(DatasetMismatchError, match=f"holds {meta['num_images']} images but its metadata says "
                                                   f"num_images={meta['num_images'] + 1}"):
        check_dataset(copy, 5)
    with_meta(classes=meta["classes"][:-1])
    with pytest.raises(DatasetMismatchError, match="num_classes=5 but lists 4 classes"):
        check_dataset(copy, 5)
    with_meta(sha256=None)
    with pytest.raises(DatasetMismatchError, match="copy.beton.json lacks sha256"):
        check_dataset(copy, 5)
    metadata_path(copy).write_text("{not json")
    with pytest.raises(DatasetMismatchError, match="copy.beton.json: not valid JSON"):
        check_dataset(copy, 5)
    with_meta(bytes=10)
    copy.write_bytes(beton.read_bytes()[:10])  # size agrees with the edited metadata; the header is cut
    with pytest.raises(DatasetMismatchError, match="no FFCV header: it is truncated"):
        check_dataset(copy, 5)


def awkward_folder(root: Path) -> None:
    """Class ``a``: 3 good JPEGs, a truncated one, a fake one and a text file; class ``b``: odd modes."""
    make_folder(root, {"a": 3})
    (root / "a" / "trunc.jpg").write_bytes((root / "a" / "0.JPEG").read_bytes()[:300])
    (root / "a" / "fake.jpg").write_bytes(b"this is not an image")
    (root / "a" / "notes.txt").write_text("labels were checked by hand")
    (root / "b").mkdir()
    Image.new("L", (20, 20), 77).save(root / "b" / "gray.png")
    Image.new("RGBA", (20, 20), (200, 100, 50, 255)).save(root / "b" / "rgba.png")
    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(root / "b" / "cmyk.jpg", quality=100)
    Image.fromarray(np.full((20, 20), 32896, dtype=np.uint16)).save(root / "b" / "deep.png")


@pytest.mark.beton
def test_awkward_files_are_converted_skipped_and_counted(tmp_path):
    awkward_folder(tmp_path / "src")
    out = tmp_path / "out.beton"
    meta = write_beton(open_source(f"imagefolder:{tmp_path / 'src'}"), out, RAW, log=lambda _: None)
    assert meta["num_images"] == 7 and meta["class_counts"] == [3, 4]
    assert sorted(Path(s["path"]).name for s in meta["skipped"]) == ["fake.jpg", "trunc.jpg"]
    assert [Path(p).name for p in meta["non_image_files"]] == ["notes.txt"]
    images, labels = read_all(ffcv_loader(exact_spec(out, 20)))
    converted = {tuple(int(v) for v in img[10, 10]) for img, label in zip(images, labels) if label == 1}
    # gray 77 -> (77,77,77); RGBA -> its RGB; CMYK (0,255,255,0) = pure red; 16-bit 32896/65535*255 = 128.
    assert converted == {(77, 77, 77), (200, 100, 50), (255, 0, 0), (128, 128, 128)}


@pytest.mark.beton
def test_write_refuses_what_would_leave_a_class_empty_or_replace_a_file(tmp_path):
    awkward_folder(tmp_path / "src")
    (tmp_path / "src" / "c").mkdir()  # a class whose only image is unreadable
    (tmp_path / "src" / "c" / "broken.jpg").write_bytes(b"not an image either")
    out = tmp_path / "out.beton"
    with pytest.raises(DataWriteError, match="class\\(es\\) c have no readable image left"):
        write_beton(open_source(f"imagefolder:{tmp_path / 'src'}"), out, RAW, log=lambda _: None)
    assert not out.exists()
    with pytest.raises(SourceError, match="--limit 2 is below the 3 classes"):
        open_source(f"imagefolder:{tmp_path / 'src'}", limit=2)
    limited = open_source("synthetic:classes=5,count=100,size=8", limit=7)
    assert len(limited) == 7 and set(limited.labels.tolist()) == set(range(5))  # every class keeps images
    write_beton(open_source("synthetic:classes=2,count=8,size=8"), out, RAW, log=lambda _: None)
    with pytest.raises(DataWriteError, match="out.beton exists; pass --overwrite"):
        write_beton(open_source("synthetic:classes=2,count=8,size=8"), out, RAW, log=lambda _: None)
    overwrite = WriteSettings(mode="raw", max_res=None, overwrite=True)
    assert write_beton(open_source("synthetic:classes=2,count=6,size=8"), out, overwrite,
                       log=lambda _: None)["num_images"] == 6
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataWriteError, match="afile is a file, not a folder"):
        write_beton(open_source("synthetic:classes=2,count=8,size=8"), tmp_path / "afile" / "x.beton", RAW,
                    log=lambda _: None)


@pytest.mark.beton
def test_strict_fails_on_the_first_bad_file_and_writes_nothing(tmp_path):
    awkward_folder(tmp_path / "src")
    out = tmp_path / "out.beton"
    with pytest.raises(DataWriteError, match=r"(fake|trunc)\.jpg: cannot decode"):
        write_beton(open_source(f"imagefolder:{tmp_path / 'src'}"), out,
                    WriteSettings(mode="raw", max_res=None, strict=True), log=lambda _: None)
    assert list(tmp_path.glob("*.beton*")) == [] and not list(tmp_path.glob(".out.beton*"))


def test_bad_sources_name_the_problem(tmp_path):
    make_folder(tmp_path / "src", {"a": 2})
    (tmp_path / "src" / "empty").mkdir()
    with pytest.raises(SourceError, match="class folder 'empty' holds no image files"):
        open_source(f"imagefolder:{tmp_path / 'src'}")
    with pytest.raises(SourceError, match="does not exist"):
        open_source(f"imagefolder:{tmp_path / 'nope'}")
    with pytest.raises(SourceError, match="unknown source"):
        open_source("imagenet:/data")
    with pytest.raises(SourceError, match="unknown options"):
        open_source("synthetic:colours=3")


def test_unwritable_output_is_refused_before_any_work(tmp_path):
    source = open_source("synthetic:classes=2,count=4,size=8")
    with pytest.raises(DataWriteError, match="cannot create the folder /proc/no inside /proc"):
        write_beton(source, Path("/proc/no/x.beton"), RAW, log=lambda _: None)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataWriteError, match="file is a file, not a folder"):
        write_beton(source, blocker / "x.beton", RAW, log=lambda _: None)
    if os.geteuid() != 0:  # root ignores directory permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(DataWriteError, match="cannot write to"):
            write_beton(source, locked / "x.beton", RAW, log=lambda _: None)


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))


@pytest.mark.beton
@pytest.mark.alone  # a timing-sensitive process test: `make test` runs it after the parallel run, on an idle machine
def test_full_disk_fails_cleanly_and_keeps_the_previous_file(tmp_path):
    out = tmp_path / "big.beton"
    out.write_bytes(b"previous dataset")
    # 8000 images = 80 chunks of indices queued up front, more than a pipe holds: without
    # write._abandon_queues the failed write hangs at exit on FFCV's queue feeder thread.
    proc = subprocess.run([sys.executable, "-m", "pipeline", "data", "write", "--source",
                           "synthetic:count=8000,size=64", "--out", str(out), "--overwrite"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size)
    assert proc.returncode == 2, proc.stderr
    assert "ran out of room during the write (File too large)" in proc.stderr and "Traceback" not in proc.stderr
    assert out.read_bytes() == b"previous dataset"
    assert not list(tmp_path.glob(".big.beton.partial-*"))


@pytest.mark.beton
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
@pytest.mark.parametrize("disk", ["tmpfs", "planted"])
def test_a_full_disk_is_one_line_and_loses_nothing(disk, verbose, tmp_path, capfd, monkeypatch):
    """The disk fills up during `data write`: a 24 MB tmpfs (mounting one needs root; a .beton of FFCV's takes
    16.8 MB at least, its 8 MiB pages aligned), or ENOSPC planted in the writer processes' page writes, after a
    pause, so that the driver already waits on FFCV's queue (it used to wait forever, and did so again under the
    SIGINT handler that a Ray fit earlier in the process leaves). One line says so; a writer
    process's traceback only with --verbose; the .beton written before and its metadata are kept; no partial
    file is left."""
    from ffcv.memory_allocator import MemoryAllocator

    from pipeline.cli import main
    from pipeline.console import VERBOSE_ENV

    monkeypatch.delenv(VERBOSE_ENV, raising=False)  # main() sets it for --verbose; restored after the test
    folder = tmp_path / "disk"
    folder.mkdir()
    if disk == "tmpfs":
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(folder)], capture_output=True)
        if mount.returncode != 0:
            pytest.skip(f"no tmpfs here: {mount.stderr.decode().strip()}")
    try:
        out = folder / "x.beton"
        write_beton(open_source("synthetic:classes=2,count=8,size=8"), out, replace(RAW, workers=1), log=lambda _: None)
        before = {path.name: path.read_bytes() for path in folder.iterdir()}
        if disk == "planted":
            write_page = MemoryAllocator.flush_page

            def full(self):
                if self.my_page >= 0:  # a page to write (the workers are forked: they inherit this)
                    time.sleep(1)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return write_page(self)

            monkeypatch.setattr(MemoryAllocator, "flush_page", full)
        gone = set()
        dead = weakref.proxy(gone)  # a dead weak proxy among live objects, as earlier tests leave them: the
        del gone  # failed write's clean-up looks through every live object, and must pass it over
        capfd.readouterr()

        def hung(*_):  # a real signal: it ends a blocking read, where the write used to wait forever
            raise TimeoutError("the write still runs after 60 s")

        def as_rays(*_):  # the SIGINT handler Ray Train's fit leaves installed in its process: it returns
            pass

        previous = signal.signal(signal.SIGALRM, hung)
        interrupt = signal.signal(signal.SIGINT, as_rays)  # the write used to wait forever under it
        signal.alarm(60)
        try:
            code = main(["data", "write", "--source", "synthetic:classes=2,count=64,size=8", "--out", str(out),
                         "--overwrite", "--workers", "1", *(["--verbose"] if verbose else [])])
            assert signal.getsignal(signal.SIGINT) is as_rays  # and is there again after the write
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            signal.signal(signal.SIGINT, interrupt)
        err = capfd.readouterr().err
        assert code == 2, err
        assert err.splitlines()[-1] == (
            f"error: the disk holding {folder} ran out of room during the write (No space left on device); the "
            f"existing {out} is kept as it was, and no partial file is left; free space or choose another --out")
        if verbose:
            assert "Traceback" in err and "OSError: [Errno 28] No space left on device" in err, err
        else:
            assert len(err.splitlines()) == 1, err
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before  # no partial file either
        assert check_dataset(out, 2, full_checksum=True)["num_images"] == 8
        del dead
    finally:
        if disk == "tmpfs":
            subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.beton
def test_killed_write_leaves_no_complete_looking_file(tmp_path):
    out = tmp_path / "k.beton"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "data", "write", "--source",
                             "synthetic:count=20000,size=64", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".k.beton.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the write finished before it could be interrupted; make it larger"
    os.killpg(proc.pid, signal.SIGKILL)  # the writer and its worker processes, as a killed job
    proc.wait()
    assert not out.exists() and not metadata_path(out).exists()
    # The next write clears the dead writer's partial file and succeeds.
    write_beton(open_source("synthetic:count=10,size=8"), out, RAW, log=lambda _: None)
    assert out.exists() and not list(tmp_path.glob(".k.beton.partial-*"))


HANG_PROBE = textwrap.dedent("""
    import sys
    from pipeline.data.loaders import LoaderSpec, ffcv_loader
    for train in (True, False):
        spec = LoaderSpec(sys.argv[1], train=train, batch_size=8, res=16, mean=(0.5,) * 3, std=(0.5,) * 3, workers=1)
        # Read the whole epoch: FFCV's daemon iterator thread, left mid-epoch, can abort the interpreter at exit.
        shapes = [tuple(x.shape) for x, _ in ffcv_loader(spec)]
        print(train, shapes[0])
""")


@pytest.mark.beton
def test_cpu_pipelines_do_not_hit_ffcv_jit_order_hang(synthetic_beton, tmp_path):
    """FFCV 1.0.2 spins forever on a jitted -> non-jitted -> jitted chain; a hang here fails by timeout."""
    beton, _ = synthetic_beton
    try:
        proc = subprocess.run([sys.executable, "-c", HANG_PROBE, str(beton)], cwd=ROOT, capture_output=True,
                              text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("building and reading an FFCV train/val pipeline did not finish in 180 s: the op order "
                    "likely triggers FFCV's Graph.group_operations loop (see pipeline/data/loaders.py)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "(8,", "3,", "16,", "16)", "False", "(8,", "3,", "16,", "16)"]


@pytest.mark.beton
def test_cli_write_and_check(tmp_path):
    out = tmp_path / "c.beton"
    run = dict(cwd=ROOT, capture_output=True, text=True, timeout=300)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "data", "write", "--source", "synthetic:count=30",
                           "--out", str(out)], **run)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stderr and "img/s" in proc.stderr
    check = subprocess.run([sys.executable, "-m", "pipeline", "data", "check", str(out), "--num-classes", "3"], **run)
    assert check.returncode == 2 and "holds 10 classes" in check.stderr


@pytest.mark.beton
def test_holdout_split_is_stratified_disjoint_seeded_and_written_once(tmp_path):
    from pipeline.data.split import holdout_split, split_key, stratified_holdout

    source = open_source("synthetic:classes=5,count=60,size=8")
    out = tmp_path / "train.beton"
    write_beton(source, out, RAW, log=lambda _: None)
    labels = np.asarray(source.labels)
    split = holdout_split(out, 0.25, seed=3)
    assert len(np.intersect1d(split.train, split.val)) == 0  # nothing fitted on is ranked on
    assert sorted(np.concatenate([split.train, split.val]).tolist()) == list(range(60))
    assert np.bincount(labels[split.val]).tolist() == [3] * 5  # a quarter of each class's 12
    stored = json.loads(metadata_path(out).read_text())["holdout"][split_key(0.25, 3)]
    assert stored == split.val.tolist()
    written = metadata_path(out).stat().st_mtime_ns
    assert np.array_equal(holdout_split(out, 0.25, seed=3).val, split.val)  # read back, not drawn again
    assert metadata_path(out).stat().st_mtime_ns == written
    assert not np.array_equal(stratified_holdout(labels, 0.25, seed=4), split.val)  # the seed matters
    check_dataset(out, 5)  # the metadata stays valid


@pytest.mark.beton
def test_holdout_loaders_read_only_their_part_and_the_test_set_stays_whole(tmp_path):
    import dataclasses

    from pipeline.config import DataConfig
    from pipeline.data.split import holdout_split

    source = open_source("synthetic:classes=4,count=40,size=8")
    write_beton(source, tmp_path / "train.beton", RAW, log=lambda _: None)
    write_beton(open_source("synthetic:classes=4,count=12,size=8,seed=1"), tmp_path / "test.beton", RAW,
                log=lambda _: None)
    data = DataConfig(train=str(tmp_path / "train.beton"), val=str(tmp_path / "test.beton"), num_classes=4,
                      batch_size=4, num_workers=1, holdout=0.2, flip=False, crop_scale=(1.0, 1.0))
    model_data = {"input_size": (3, 8, 8), "mean": IDENTITY["mean"], "std": IDENTITY["std"], "crop_pct": 1.0}
    split = holdout_split(tmp_path / "train.beton", 0.2, 0)
    labels = np.asarray(source.labels)
    fit = dataclasses.replace(loader_spec(data, model_data, train=True), drop_last=False)
    held = loader_spec(data, model_data, train=False, holdout=True)
    test = loader_spec(data, model_data, train=False)
    _, fit_labels = read_all(ffcv_loader(fit))
    _, held_labels = read_all(ffcv_loader(held))
    _, test_labels = read_all(ffcv_loader(test))
    assert sorted(fit_labels.tolist()) == sorted(labels[split.train].tolist()) and len(fit_labels) == 32
    assert held_labels.tolist() == labels[split.val].tolist() and len(held_labels) == 8
    assert len(test_labels) == 12


def test_evaluation_loaders_of_different_recipes_share_one_spec():
    """The seed, crop scale and flip change only training loaders: evaluation specs leave them out, so
    models trained with different recipes share one FFCV loader (``shared_loader``)."""
    from pipeline.config import DataConfig

    model_data = {"input_size": (3, 8, 8), "mean": IDENTITY["mean"], "std": IDENTITY["std"], "crop_pct": 1.0}
    plain = DataConfig(train="a.beton", val="b.beton", num_classes=4)
    other = DataConfig(train="a.beton", val="b.beton", num_classes=4, flip=False, crop_scale=(0.5, 1.0))
    for holdout in (False, True):
        specs = {loader_spec(d, model_data, train=False, seed=seed, holdout=holdout)
                 for d in (plain, other) for seed in (0, 7)}
        assert len(specs) == 1, specs
    trains = {loader_spec(d, model_data, train=True, seed=seed) for d in (plain, other) for seed in (0, 7)}
    assert len(trains) == 4
    (trained,) = {loader_spec(other, model_data, train=True, seed=7)}
    assert (trained.seed, trained.flip, trained.crop_scale) == (7, False, (0.5, 1.0))


def test_the_numba_finalizer_keyerror_is_dropped_and_nothing_else(monkeypatch, capsys):
    """Garbage-collecting FFCV loaders that were built and iterated one after another makes numba's
    Dispatcher finalizer raise a KeyError that Python ignores (seen with a fresh numba cache: `make
    demo`'s evaluate stage printed it about 20 times). The hook drops exactly that traceback: a
    KeyError raised elsewhere, or another error from that finalizer, still reaches the previous hook."""
    from pipeline import console

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_type))
    console.quiet_numba_finalizer()
    console.quiet_numba_finalizer()  # idempotent: one hook, wrapping the previous one once

    def unraisable(filename: str, error: type[Exception]):
        code = compile(f"def finalizer():\n    raise {error.__name__}('x')\n", filename, "exec")
        scope = {}
        exec(code, scope)
        try:
            scope["finalizer"]()
        except error as err:
            return types.SimpleNamespace(exc_type=error, exc_value=err, exc_traceback=err.__traceback__,
                                         err_msg=None, object=None)

    numba_file = str(Path("site-packages") / "numba" / "core" / "dispatcher.py")
    sys.unraisablehook(unraisable(numba_file, KeyError))
    assert seen == []
    sys.unraisablehook(unraisable(str(Path("elsewhere") / "dispatcher.py"), KeyError))
    sys.unraisablehook(unraisable(numba_file, ValueError))
    assert seen == [KeyError, ValueError]
