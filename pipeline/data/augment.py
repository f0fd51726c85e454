"""FFCV training augmentations that crop and flip the same way for the same loader seed.

Why our own: FFCV 1.0.2's ``RandomResizedCropRGBImageDecoder`` and ``RandomHorizontalFlip`` draw from
numba's per-thread random state, which no ``Loader`` argument seeds, inside a loop that the loader's
threads share. So two trainings from one config and one seed cropped and flipped differently and
ended with different weights (a two-epoch tiny run here: train loss 0.96517 against 0.96568; with crop
and flip turned off the two runs gave the same weights, bit for bit). Here every image's draws come
from its own seed, a hash of the loader seed, the image's index in the dataset and its batch (the
batches change from epoch to epoch with FFCV's shuffling, which the loader seed already fixes), so
they depend on nothing a thread or a run can change.

- ``SeededRandomResizedCrop`` keeps FFCV's decoder (decode, crop draw, resize): it seeds numba's state
  before FFCV decodes each image, so the crop is FFCV's ``get_random_crop``, drawn from a seeded state.
- ``SeededHorizontalFlip`` flips with probability ``flip_prob``, from a counter-based hash (no random
  state at all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.compiler import Compiler
from ffcv.pipeline.operation import Operation
from ffcv.pipeline.state import State
from numba import njit

_CROP, _FLIP = 1, 2  # streams: a crop and a flip of the same image draw independent numbers


@njit(nogil=True)
def _mix(x: np.uint64) -> np.uint64:
    """splitmix64's finaliser: a bijection of uint64 whose output bits all depend on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(nogil=True)
def image_key(seed: int, stream: int, index: int, batch: np.ndarray) -> np.uint64:
    """A 64-bit key for one image's draws: the loader seed, the stream, the image's dataset index, and its
    batch (first and last index, length)."""
    key = _mix(np.uint64(seed) + np.uint64(stream) * np.uint64(0x9E3779B97F4A7C15))
    key = _mix(key ^ np.uint64(index))
    key = _mix(key ^ np.uint64(batch[0]))
    key = _mix(key ^ np.uint64(batch[len(batch) - 1]))
    return _mix(key ^ np.uint64(len(batch)))


class SeededRandomResizedCrop(RandomResizedCropRGBImageDecoder):
    """FFCV's random-resized-crop decoder, its crop drawn from a state seeded per image (``image_key``)."""

    def __init__(self, output_size: tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), seed: int = 0) -> None:
        super().__init__(output_size, scale=scale, ratio=ratio)
        self.seed = seed

    def generate_code(self) -> Callable:
        one = super().generate_code()
        one.is_parallel = False  # it decodes one image at a time here, inside this op's parallel loop
        decode_one = Compiler.compile(one)
        my_range = Compiler.get_iterator()
        seed = self.seed

        def decode(batch_indices, my_storage, metadata, storage_state):
            destination, temp_storage = my_storage
            for ix in my_range(len(batch_indices)):
                key = image_key(seed, _CROP, batch_indices[ix], batch_indices)
                np.random.seed(np.uint32(key >> np.uint64(32)))  # numba's state of the thread that decodes ix
                decode_one(batch_indices[ix:ix + 1], (destination[ix:ix + 1], temp_storage[ix:ix + 1]), metadata,
                           storage_state)
            return destination[:len(batch_indices)]

        decode.is_parallel = True
        return decode


class SeededHorizontalFlip(Operation):
    """Flips each image (B, H, W, C) horizontally with probability ``flip_prob``, drawn per image from
    ``image_key``."""

    def __init__(self, flip_prob: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 <= flip_prob <= 1.0:
            raise ValueError(f"SeededHorizontalFlip: flip_prob is a probability in [0, 1], got {flip_prob!r}")
        self.flip_prob = flip_prob
        self.seed = seed

    def generate_code(self) -> Callable:
        my_range = Compiler.get_iterator()
        seed, threshold = self.seed, np.uint64(self.flip_prob * 2.0**53)

        def flip(images, dst, indices):
            for ix in my_range(images.shape[0]):
                draw = image_key(seed, _FLIP, indices[ix], indices) >> np.uint64(11)  # uniform on [0, 2^53)
                if draw < threshold:
                    dst[ix] = images[ix, :, ::-1]
                else:
                    dst[ix] = images[ix]
            return dst

        flip.is_parallel = True
        flip.with_indices = True
        return flip

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        return replace(previous_state, jit_mode=True), AllocationQuery(previous_state.shape, previous_state.dtype)
