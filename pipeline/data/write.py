"""Writing FFCV ``.beton`` files (and plain JPEG folders) from a source, atomically, with metadata beside them.

Every image is decoded once before FFCV's writer starts: FFCV 1.0.2's ``DatasetWriter`` waits
forever when one of its worker processes dies (``writer.py: _write_common`` polls a counter that
then never reaches the total), so a corrupt file must be found first. A watchdog covers what the
validation cannot foresee, such as a disk that fills up halfway: the write then ends with one line (a
worker's traceback only with ``verbose``), no partial file, and an existing output kept.
"""

from __future__ import annotations

import errno
import functools
import gc
import hashlib
import json
import multiprocessing
import multiprocessing.queues
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image
from tqdm import tqdm

from pipeline.config import git_sha
from pipeline.data.sources import Source, read_image
from pipeline.errors import InputError, PipelineError
from pipeline.signals import ctrl_c_raises

METADATA_VERSION = 1
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit
WriteMode = Literal["raw", "jpg", "smart", "proportion"]


class DataWriteError(PipelineError, RuntimeError):
    """A write that could not finish; nothing was left at the output path."""


@dataclass(frozen=True)
class WriteSettings:
    """How images are stored: FFCV's ``RGBImageField`` options."""

    mode: WriteMode = "jpg"
    max_res: int | None = 256
    quality: int = 90
    compress_probability: float = 0.5  # mode "proportion": the share stored as JPEG, the rest raw (ffcv-imagenet)
    workers: int = 2
    strict: bool = False
    overwrite: bool = False  # replace an existing .beton (refused otherwise)

    def __post_init__(self) -> None:
        if not 1 <= self.quality <= 100:
            raise InputError(f"--quality {self.quality}: JPEG quality runs from 1 to 100 (90 is ffcv-imagenet's)")
        if not 0 <= self.compress_probability <= 1:
            raise InputError(f"--compress-probability {self.compress_probability}: give a probability in [0, 1]")
        if self.max_res is not None and self.max_res < 1:
            raise InputError(f"--max-res {self.max_res}: give the longest side in pixels (>= 1), or 0 to keep it")

    def as_dict(self) -> dict[str, Any]:
        settings = {"mode": self.mode, "max_res": self.max_res, "quality": self.quality}
        if self.mode == "proportion":
            settings["compress_probability"] = self.compress_probability
        return settings


def metadata_path(beton: str | Path) -> Path:
    """``train.beton`` -> ``train.beton.json``."""
    beton = Path(beton)
    return beton.with_name(beton.name + ".json")


def _check_one(args: tuple[str, int]) -> str | None:
    path, draft = args
    try:
        read_image(path, draft=draft)
    except Exception as err:  # noqa: BLE001 - any decoder failure means the file is unusable
        return f"{type(err).__name__}: {err}"
    return None


def validate_files(source: Source, settings: WriteSettings, log=print) -> tuple[Source, list[dict[str, str]]]:
    """Decodes every file of a folder source; returns the usable ones and ``[{path, reason}]`` for the rest.

    Raises DataWriteError on the first bad file under ``settings.strict``.
    """
    if source.arrays is not None or source.synthetic_seed is not None:
        return source, []
    draft = settings.max_res or 4096
    bad: list[dict[str, str]] = []
    keep: list[int] = []
    context = multiprocessing.get_context("fork")
    with context.Pool(max(settings.workers, 1)) as pool:
        results = pool.imap(_check_one, [(path, draft) for path in source.items], chunksize=64)
        for index, reason in enumerate(tqdm(results, total=len(source), desc="validate", unit="img",
                                            file=sys.stderr, disable=None)):
            if reason is None:
                keep.append(index)
                continue
            if settings.strict:
                raise DataWriteError(f"{source.items[index]}: cannot decode ({reason}); "
                                     "drop --strict to skip and count such files")
            bad.append({"path": str(source.items[index]), "reason": reason})
    if bad:
        log(f"skipped {len(bad)} unreadable file(s); they are listed in the metadata under 'skipped'")
    if not keep:
        raise DataWriteError(f"{source.spec}: none of the {len(source)} files could be decoded")
    kept = source.subset(np.asarray(keep, dtype=np.int64))
    empty = [name for label, name in enumerate(source.classes) if not (kept.labels == label).any()]
    if empty:
        raise DataWriteError(f"{source.spec}: class(es) {', '.join(empty)} have no readable image left (every file "
                             "was skipped, see above); fix or remove those folders")
    return kept, bad


class _Samples:
    """What FFCV's writer indexes: ``(image, label)`` with ``image`` ``(H, W, 3)`` uint8, its longest side at
    most ``max_res``.

    Resized here rather than by FFCV: FFCV scales both sides by the same ratio and truncates, so an image of
    2000 x 2 at 256 px became 256 x 0, which OpenCV refuses inside a writer process. Here each side keeps at
    least one pixel; otherwise it is FFCV's own resize (the same truncation, OpenCV's INTER_AREA), and FFCV
    then leaves the image as it is.
    """

    def __init__(self, source: Source, max_res: int | None = None) -> None:
        self.source, self.max_res = source, max_res

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        image = self.source.image(index)
        height, width = image.shape[:2]
        if self.max_res is not None and max(height, width) > self.max_res:
            import cv2

            ratio = self.max_res / max(height, width)
            size = (max(1, int(width * ratio)), max(1, int(height * ratio)))
            image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
        return image, int(self.source.labels[index])


def _check_output(out: Path, overwrite: bool) -> None:
    if out.is_dir():
        raise DataWriteError(f"--out {out} is a directory; give a file name such as {out / 'train.beton'}")
    if out.exists() and not overwrite:
        raise DataWriteError(f"--out {out} exists; pass --overwrite to replace it (its metadata too), or choose "
                             "another name")
    existing = next(p for p in [out.parent, *out.parent.parents] if p.exists())
    if not existing.is_dir():
        raise DataWriteError(f"cannot create {out.parent}: {existing} is a file, not a folder; choose another --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataWriteError(f"cannot create the folder {out.parent} inside {existing} ({err.strerror or err}); "
                             "choose a writable --out") from None
    try:
        probe = out.with_name(f".{out.name}.probe-{os.getpid()}")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise DataWriteError(f"cannot write to {out.parent}: {err.strerror or err}; choose a writable --out") from None


def _check_space(out: Path, source: Source, settings: WriteSettings) -> None:
    """Refuses a write that cannot fit: raw mode needs its pixels, JPEG about the source's own size."""
    side = settings.max_res or 4096
    if source.arrays is not None:
        side = min(side, max(source.arrays.shape[1:3]))
    elif source.synthetic_seed is not None:
        side = min(side, source.synthetic_size)
    if settings.mode == "raw" or source.arrays is not None or source.synthetic_seed is not None:
        need = len(source) * side * side * 3
    else:
        need = sum(os.path.getsize(path) for path in source.items[:2000]) * len(source) // min(len(source), 2000)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise DataWriteError(f"{out.parent} has {free / 1e9:.2f} GB free but the dataset needs about "
                             f"{need / 1e9:.2f} GB; free space or choose another --out")


def _no_room(out: Path, err: OSError) -> DataWriteError:
    kept = f"the existing {out} is kept as it was" if out.exists() else f"nothing was written to {out}"
    return DataWriteError(f"the disk holding {out.parent} ran out of room during the write ({err.strerror or err}); "
                          f"{kept}, and no partial file is left; free space or choose another --out")


def _interrupt_main() -> None:
    """KeyboardInterrupt in the main thread, also inside a blocking read: ``_thread.interrupt_main`` alone sets a
    flag that a thread blocked in ``os.read`` never checks, and FFCV's driver reads a queue a dead worker would
    have filled (``allocations_queue.get()``, once every image is counted). The write runs under
    ``ctrl_c_raises``, so the signal raises whatever handler was installed before (Ray's, after a fit, does not)."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _watch_workers(done: threading.Event, failed: list[str], workers: list[multiprocessing.Process]) -> None:
    """Interrupts the main thread if one of FFCV's writer processes (``workers``, as they start) exits with
    an error: FFCV's writer would wait for it forever."""
    while not done.wait(0.1):
        for worker in list(workers):
            if worker.exitcode not in (None, 0):
                failed.append(f"{worker.name} exited with code {worker.exitcode}")
                _interrupt_main()
                return


def _abandon_queues() -> None:
    """Lets this process exit although FFCV's work queue still holds chunks no worker will read.

    FFCV's writer puts every chunk of indices on a ``multiprocessing.Queue`` up front; once its
    workers are dead, the queue's feeder thread blocks on the full pipe, and the exit-time join of
    that thread hangs the process. The queue is local to FFCV's ``_write_common``, so it is found
    among live objects; ``cancel_join_thread`` is the documented way to exit without flushing.
    """

    for obj in gc.get_objects():
        # type(), not isinstance(): that reads ``__class__``, which a dead weak proxy answers with ReferenceError
        # and a deprecated alias of torch's with a FutureWarning
        if issubclass(type(obj), multiprocessing.queues.Queue):
            obj.cancel_join_thread()


def _run_ffcv_writer(tmp: Path, source: Source, settings: WriteSettings, verbose: bool = False) -> None:
    from ffcv import writer as ffcv_writer
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    fields = {"image": RGBImageField(write_mode=settings.mode, max_resolution=settings.max_res,
                                     jpeg_quality=settings.quality, compress_probability=settings.compress_probability),
              "label": IntField()}
    writer = DatasetWriter(str(tmp), fields, num_workers=max(settings.workers, 1))
    done, failed, workers = threading.Event(), [], []
    # The first failing worker's error in one line, and its errno: shared memory, as nothing waits on it.
    said, said_errno = multiprocessing.RawArray("c", 1024), multiprocessing.RawValue("i", 0)

    class Tracked(multiprocessing.Process):
        """FFCV's worker process, kept in ``workers`` once started: one that fails before the watchdog first
        looks has already left ``multiprocessing.active_children()``. Its error goes to the driver's one line;
        its traceback to stderr only when ``verbose``."""

        def start(self) -> None:
            super().start()
            workers.append(self)

        def run(self) -> None:
            try:
                super().run()
            except Exception as err:
                if not said.value:
                    said_errno.value = getattr(err, "errno", None) or 0
                    said.value = f"{type(err).__name__}: {err}".splitlines()[0].encode()[:1023]
                if verbose:
                    raise
                sys.exit(1)  # multiprocessing prints nothing for SystemExit(1)

    ffcv_writer.Process = Tracked  # the name ffcv.writer starts its workers by
    ffcv_writer.tqdm = functools.partial(tqdm, disable=None)  # its progress bar, as ours: on a terminal only
    try:
        with ctrl_c_raises() as wakeable:
            # Off the main thread no signal can wake the write; FFCV then waits as it always did.
            watchdog = threading.Thread(target=_watch_workers, args=(done, failed, workers), daemon=True)
            if wakeable:
                watchdog.start()
            try:
                writer.from_indexed_dataset(_Samples(source, settings.max_res), chunksize=100)
            finally:  # the watchdog stopped while SIGINT still raises: a signal it sent is never another's
                done.set()
                if watchdog.is_alive():
                    watchdog.join()
    except KeyboardInterrupt:
        if not failed:
            raise
        for child in multiprocessing.active_children():
            child.terminate()
        _abandon_queues()
        writer.metadata_sm.close()
        writer.metadata_sm.unlink()
        if said_errno.value in NO_ROOM:  # said as write_beton says the driver's own
            raise OSError(said_errno.value, os.strerror(said_errno.value)) from None
        reason = ": " + said.value.decode(errors="replace") if said.value else ""
        hint = "" if verbose else " (--verbose shows its traceback)"
        raise DataWriteError(f"a writer process failed ({failed[0]}{reason}); the source may have changed during "
                             f"the write{hint}") from None
    finally:
        ffcv_writer.Process, ffcv_writer.tqdm = multiprocessing.Process, tqdm
        done.set()


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """The hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _remove_stale_partials(out: Path) -> None:
    """Deletes partial files left by writers that were killed (their pid is gone)."""
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            partial.unlink(missing_ok=True)


def write_beton(source: Source, out: str | Path, settings: WriteSettings, log=print,
                verbose: bool = False) -> dict[str, Any]:
    """Writes ``source`` to ``out`` (a ``.beton``) and ``out.json``; returns the metadata.

    The data goes to a hidden temporary file in the same directory, renamed into place only when
    complete, so an interrupted write never leaves a ``.beton`` that looks finished. A disk that fills
    up raises DataWriteError; ``verbose`` shows a failed writer process's traceback.
    """

    out = Path(out)
    _check_output(out, settings.overwrite)
    _remove_stale_partials(out)
    source, skipped = validate_files(source, settings, log)
    _check_space(out, source, settings)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    meta = metadata_path(out)
    meta_tmp = meta.with_name(f".{meta.name}.tmp-{os.getpid()}")
    started = time.perf_counter()
    try:
        _run_ffcv_writer(tmp, source, settings, verbose)
        metadata = {
            "format_version": METADATA_VERSION,
            "source": source.spec,
            "num_images": len(source),
            "num_classes": len(source.classes),
            "classes": source.classes,
            "class_to_idx": {name: index for index, name in enumerate(source.classes)},
            "class_counts": np.bincount(source.labels, minlength=len(source.classes)).tolist(),
            "grayscale_source": source.grayscale,
            "settings": settings.as_dict(),
            "skipped": skipped,
            "non_image_files": source.non_images,
            "skipped_links": source.skipped_links,
            "bytes": tmp.stat().st_size,
            "sha256": sha256_file(tmp),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "git": git_sha(Path(__file__).parent),
        }
        meta_tmp.write_text(json.dumps(metadata, indent=2) + "\n")  # before either is renamed: a full disk fails here
        tmp.replace(out)
        meta_tmp.replace(meta)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        meta_tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in NO_ROOM:
            raise _no_room(out, err) from None
        raise
    seconds = time.perf_counter() - started
    log(f"wrote {out} ({len(source)} images, {len(source.classes)} classes, {metadata['bytes'] / 1e6:.1f} MB, "
        f"{len(source) / max(seconds, 1e-9):.0f} img/s; {len(skipped)} skipped, "
        f"{len(source.non_images)} non-image files ignored)")
    links = source.skipped_links
    if links:
        log(f"not followed: {len(links)} directory link(s) into a folder already read (they would loop or read it "
            f"twice): {', '.join(links[:5])}{' ...' if len(links) > 5 else ''}")
    return metadata


def write_folder(source: Source, out: str | Path, size: int | None, quality: int = 90, log=print) -> int:
    """Writes ``source`` as ``out/<class>/<index>.jpg`` (upscaled to ``size`` if given), atomically; returns the count.

    Used for the loader benchmark and for the ``torch`` loader on sources that are not folders.
    """

    out = Path(out)
    if out.exists():
        raise DataWriteError(f"{out} already exists; remove it or choose another --out")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    safe = [name.replace("/", "_").replace(" ", "_") for name in source.classes]
    try:
        for name in safe:
            (tmp / name).mkdir(parents=True)
        for index in tqdm(range(len(source)), desc="write", unit="img", file=sys.stderr, disable=None):
            image = Image.fromarray(source.image(index))
            if size is not None:
                image = image.resize((size, size), Image.Resampling.BICUBIC)
            image.save(tmp / safe[int(source.labels[index])] / f"{index:07d}.jpg", quality=quality)
        tmp.rename(out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in NO_ROOM:
            raise _no_room(out, err) from None
        raise
    log(f"wrote {len(source)} images under {out}")
    return len(source)
