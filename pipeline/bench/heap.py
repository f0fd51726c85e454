"""A steady heap for CPU timings: glibc's malloc thresholds fixed for the rest of the process.

glibc adapts its mmap and trim thresholds to what the process has freed so far (mallopt(3), "dynamic mmap
threshold"). Two processes that time the same pair of models can then differ in which buffers come from fresh
``mmap`` pages and how much of the heap goes back to the kernel between calls, and so in the page faults each
forward pays: a cost that is steady inside one process (the paired blocks agree) but not from one process to
the next. Measured on a 2-core AMD EPYC VM (docs/data/cpu/2026-12-02_timing-between-processes/): two demo checkpoints,
each against its own unmodified model in fresh processes, gave 0.81 to 0.99 and 0.81 to 0.95 with the default
heap (each process's interval about +-3% and +-6%), and 0.93 to 0.99 and 0.96 to 0.99 with these thresholds set
after the models were loaded, as ``sample_timer`` sets them. Less, not nothing: the first model's spread stays
above its intervals.

No library sets this (torch's CPU allocator is glibc's malloc); ``mallopt`` is glibc's own switch. Elsewhere
(musl, macOS) it is a no-op that returns False.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): anything smaller, from the heap
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap's top goes back to the kernel only past 2 GiB free
TOP_PAD = 64 * 2**20  # each time the heap grows, 64 MiB more than asked

_fixed: bool | None = None


def steady_heap() -> bool:
    """Fix glibc's mmap threshold, trim threshold and top pad in this process (once; later calls only answer).

    Returns whether they are fixed: False where the C library is not glibc. A process that calls it keeps more
    memory mapped than before (up to what its timed calls used at once): every timing process does."""
    global _fixed
    if _fixed is not None:
        return _fixed
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError, TypeError):
        _fixed = False
        return _fixed
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _fixed = all(mallopt(param, value) == 1 for param, value in
                 ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    return _fixed
