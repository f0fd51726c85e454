"""Paired speed ratios with a confidence interval: the one measurement behind every speed the DAG reports.

A model's speed is a ratio to a reference (the same architecture's unmodified model, or another width's
reference), measured in one process with both warm. The unit is a *block* of four timed samples, ABBA or
BAAB in turn (A the reference, B the model), whose ratio is ``(B1 + B2) / (A1 + A2)``: a drift of the
machine's speed that is linear over a block cancels, and one that is slower than a block nearly does.

The statistic is the median of the block ratios with the distribution-free 95% interval of the median from
the binomial order statistics (``median_interval``): no bootstrap of a median at these sizes. The number of
blocks is set before they are measured, from a pilot (``paired_ratio``): the spread of 8 pilot blocks (their
standard deviation after pulling each to within 3 MAD-sigmas of the median, so one outlier does not size the run,
``pilot_spread``) sets the fewest new blocks (at least 8)
whose interval it predicts within the tolerance (``planned_blocks``); the result comes from the new blocks
alone. Stopping the moment the interval first dips under the tolerance would pick a lucky run of blocks and
bias the interval.

``cap_s`` is a limit on the wall clock, pilot included: the clock is read before every block, and a measurement
ends within one block of the cap. The result says why it stopped (``SpeedRatio.stop``) and what it reached: the
label ``tolerance`` only where the interval's half-width is within the tolerance.

Written here rather than taken from a library: ``torch.utils.benchmark`` and pytest-benchmark time one
function at a time (no interleaved pairs, no interval of a ratio), and neither sizes a measurement from a pilot.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeline.bench.heap import steady_heap
from pipeline.errors import InputError
from pipeline.pareto import relative_half_width

CONFIDENCE = 0.95
MIN_BLOCKS = 8
FEWEST_BLOCKS = 6  # the fewest whose median has a 95% interval (``order_statistic_rank``)
# Why a measurement stopped: ``tolerance``, the planned blocks were measured and the interval is within the
# tolerance; ``wider``, they were measured and it is not; ``cap``, the clock reached ``cap_s`` first;
# ``max_blocks``, the tolerance would have needed more than ``max_blocks`` and the interval is wider.
STOPS = ("tolerance", "wider", "cap", "max_blocks")


class TimerError(InputError):
    """A timed sample that is not a positive number of seconds: the timer cannot time that call."""


def _real(value: object) -> bool:
    """Whether ``value`` is a number a setting can hold (an int or a float; not a bool, not text)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeedSettings:
    """How a paired ratio is measured: the relative half-width it aims at, the time it may take, the warm-up.
    Refused in one line (InputError) where a value could not measure: a tolerance outside (0, 1), a cap that is not
    a positive number of seconds, a count of blocks or calls that is not a whole number, a pilot under
    ``MIN_BLOCKS`` or over the most blocks allowed."""

    tolerance: float = 0.02  # the interval's relative half-width aimed at (of the median)
    cap_s: float = 20.0  # the most wall-clock seconds the pilot and the blocks may take (to within one block)
    cap_key: str = "experiment.eval.speed_cap_s"  # where the user sets ``cap_s``, for the error that says to raise it
    pilot: int = MIN_BLOCKS
    warmup: int = 2  # calls of each function before the pilot (compiles, caches, first-call costs)
    max_blocks: int = 2000

    def __post_init__(self) -> None:
        counts = {"pilot": self.pilot, "warmup": self.warmup, "max_blocks": self.max_blocks}
        for name, value in counts.items():  # a float here measured 8.5 blocks, or failed in range() mid-measurement
            if not isinstance(value, int) or isinstance(value, bool):
                raise InputError(f"a speed setting's {name} of {value!r}: give a whole number of "
                                 f"{'calls' if name == 'warmup' else 'blocks'}")
        if not (_real(self.tolerance) and 0 < self.tolerance < 1):
            raise InputError(f"a speed tolerance of {self.tolerance!r}: give the interval's relative half-width aimed "
                             "at, between 0 and 1 (0.02 is 2% of the ratio)")
        if not (_real(self.cap_s) and math.isfinite(self.cap_s) and self.cap_s > 0):
            raise InputError(f"{self.cap_key}={self.cap_s!r}: give the most seconds a measurement may take, above 0")
        if self.pilot < MIN_BLOCKS or self.max_blocks < self.pilot or self.warmup < 0:
            raise InputError(f"a pilot of {self.pilot} blocks, at most {self.max_blocks} blocks and {self.warmup} "
                             f"warm-up calls: give a pilot of at least {MIN_BLOCKS} blocks, allow at least as many "
                             "blocks as the pilot, and 0 or more warm-up calls")


@dataclass(frozen=True)
class SpeedRatio:
    """A paired ratio: the model's time over the reference's, as the median of block ratios with its interval.

    ``stop``: one of ``STOPS``. ``pilot_half_width``: the half-width the pilot's spread predicts at the pilot's
    size. ``reference_s``: the reference's median measured seconds a call over the blocks (its own scale)."""

    ratio: float
    low: float
    high: float
    blocks: int
    stop: str
    pilot_half_width: float
    seconds: float  # wall time of the pilot and the blocks
    block_ratios: tuple[float, ...] = field(repr=False, default=())
    reference_s: float = math.nan

    @property
    def half_width(self) -> float:
        """The interval's half-width relative to the ratio."""
        return relative_half_width(self.ratio, self.low, self.high)

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high

    def label(self) -> str:
        """``31 blocks, tolerance, +-1.7%``: what bounded it and what it reached."""
        return f"{self.blocks} blocks, {self.stop}, +-{self.half_width:.1%}"


@functools.cache
def order_statistic_rank(n: int, confidence: float = CONFIDENCE) -> int:
    """The largest j (1-based) such that the sorted samples' [x_(j), x_(n+1-j)] covers the median with at least
    ``confidence``: 2 P(Bin(n, 1/2) <= j - 1) <= 1 - confidence. InputError when no j does (n < 6 at 95%).
    The binomial terms in log space (exact integers took 70 ms at n = 1,900, and ``planned_blocks`` asks for
    hundreds of n)."""
    alpha, cumulative, rank = 1.0 - confidence, 0.0, 0
    log_all = math.lgamma(n + 1) - n * math.log(2)
    for i in range(n // 2 + 1):
        cumulative += math.exp(log_all - math.lgamma(i + 1) - math.lgamma(n - i + 1))
        if 2 * cumulative > alpha:
            break
        rank = i + 1
    if rank == 0:
        raise InputError(f"{n} samples are too few for a {confidence:.0%} interval of their median")
    return rank


def median_interval(samples: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The median of ``samples`` and the distribution-free interval of the population median around it."""
    ordered = sorted(samples)
    rank = order_statistic_rank(len(ordered), confidence)
    return statistics.median(ordered), ordered[rank - 1], ordered[len(ordered) - rank]


def block_ratio(fn: Callable[[], object], reference: Callable[[], object], index: int,
                timer: Callable[[Callable[[], object]], float]) -> float:
    """One block: ABBA for an even ``index``, BAAB for an odd one; ``(B1 + B2) / (A1 + A2)``."""
    order = "ABBA" if index % 2 == 0 else "BAAB"
    seconds = {"A": 0.0, "B": 0.0}
    for who in order:
        sample = timer(reference if who == "A" else fn)
        if not 0 < sample < math.inf:  # also NaN
            what = getattr(timer, "describe", "the timer")
            why = "a sample must be a finite number of seconds; check the timer's clock" \
                if math.isnan(sample) or sample == math.inf else ("it cannot time a call this short (or its clock "
                                                                 "does not advance); time more calls a sample "
                                                                 "(calls) or use the wall clock")
            raise TimerError(f"{what} read {sample!r} s for one sample of the "
                             f"{'reference' if who == 'A' else 'model'}: {why}")
        seconds[who] += sample
    return seconds["B"] / seconds["A"]


def predicted_half_width(spread: float, n: int) -> float:
    """The relative half-width of ``median_interval`` over ``n`` blocks whose ratios spread with relative standard
    deviation ``spread``: its ends are the order statistics of rank j and n + 1 - j (``order_statistic_rank``),
    which for normal samples lie about ``-Phi^-1((j - 0.375) / (n + 0.25))`` standard deviations from the centre
    (Blom's approximation)."""
    rank = order_statistic_rank(n)
    return spread * -statistics.NormalDist().inv_cdf((rank - 0.375) / (n + 0.25))


def pilot_spread(pilot: list[float]) -> float:
    """The pilot's relative spread as a standard deviation, winsorized at 3 robust standard deviations (1.4826 times
    the median absolute deviation) from the median: one outlier block among 8 moves it little, where it would
    multiply a plain standard deviation, and normal blocks keep the standard deviation's efficiency (the MAD's
    alone, 37% of it at 8 blocks, sized too few blocks as often as it sized enough)."""
    median = statistics.median(pilot)
    bound = 3 * 1.4826 * statistics.median(abs(x - median) for x in pilot)
    return statistics.stdev([min(max(x, median - bound), median + bound) for x in pilot]) / median


def planned_blocks(pilot: list[float], s: SpeedSettings) -> tuple[int, float]:
    """The blocks to measure after the pilot, and the pilot's half-width (its interval's, as its spread predicts
    it: ``predicted_half_width`` at the pilot's size).

    The blocks asked for are the fewest whose interval the pilot's spread predicts within the tolerance, at most
    ``max_blocks`` (then the interval is predicted wider). Not ``len(pilot) * (h / tolerance)^2`` with h the pilot's
    own interval: at 8 blocks that interval is [min, max], which covers 99.2%, not 95%, and scaled so it asks for
    more blocks than the tolerance needs (about 2.7 times for normal blocks)."""
    spread = pilot_spread(pilot)
    # The fewest blocks from 0.8 of the large-sample count on (the exact interval is never narrower than that
    # count's; its half-width falls with n only up to the ranks' steps, so the scan, not a bisection, finds it).
    z = statistics.NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
    large_sample = (z * math.sqrt(math.pi / 2) * spread / s.tolerance) ** 2
    needed = max(MIN_BLOCKS, min(math.floor(0.8 * large_sample), s.max_blocks))
    while needed < s.max_blocks and predicted_half_width(spread, needed) > s.tolerance:
        needed += 1
    return needed, predicted_half_width(spread, len(pilot))


def _timed_blocks(fn: Callable[[], object], reference: Callable[[], object], timer: Callable[[Callable], float],
                  first: int, count: int, within: Callable[[], bool]) -> list[float]:
    """Up to ``count`` blocks from index ``first``, each started only while ``within()`` (the cap's clock), with the
    young garbage collected before it; ``paired_ratio`` turns the collector off for the measurement, so no collection
    lands in a sample (a young one takes 0.04 ms; a full one, 170 ms once timm is imported, waits until after)."""
    blocks = []
    for index in range(first, first + count):
        if not within():
            break
        gc.collect(1)
        blocks.append(block_ratio(fn, reference, index, timer))
    return blocks


def paired_ratio(fn: Callable[[], object], reference: Callable[[], object], *, timer: Callable[[Callable], float],
                 settings: SpeedSettings = SpeedSettings(), log: Callable[[str], None] | None = None,
                 wall: Callable[[], float] = time.perf_counter) -> SpeedRatio:
    """``fn``'s time over ``reference``'s (both already on their device, inputs bound), as ``SpeedRatio``.

    ``timer(f)``: seconds of one timed sample of ``f`` (``sample_timer``); ``wall``: the clock the cap is read on,
    before every block of the pilot and after it. The pilot sets how many blocks follow, and the result is theirs
    alone, unless the cap leaves fewer than ``FEWEST_BLOCKS`` after the pilot: then it is every block measured. A
    cap that leaves fewer than ``FEWEST_BLOCKS`` in all is an InputError that says what the cap would need."""
    for _ in range(settings.warmup):
        reference()
        fn()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _measure(fn, reference, timer, settings, log, wall)
    finally:
        if enabled:
            gc.enable()


def _measure(fn: Callable[[], object], reference: Callable[[], object], timer: Callable[[Callable], float],
             settings: SpeedSettings, log: Callable[[str], None] | None, wall: Callable[[], float]) -> SpeedRatio:
    """The pilot and the blocks of ``paired_ratio``, the collector off."""
    start = wall()

    def within() -> bool:
        return wall() - start < settings.cap_s

    reference_times: list[float] = []

    def recorded(f: Callable[[], object]) -> float:
        seconds = timer(f)
        if f is reference:
            reference_times.append(seconds)
        return seconds

    recorded.describe = getattr(timer, "describe", "the timer")
    pilot = _timed_blocks(fn, reference, recorded, 0, settings.pilot, within)
    planned, half = planned_blocks(pilot, settings) if len(pilot) >= FEWEST_BLOCKS else (0, math.nan)
    if log is not None and len(pilot) == settings.pilot:
        log(f"[speed] the pilot's spread predicts a half-width of {half:.1%} at {settings.pilot} blocks: "
            f"measuring {planned} blocks")
    blocks = _timed_blocks(fn, reference, recorded, settings.pilot, planned, within) if planned else []
    capped = len(pilot) < settings.pilot or len(blocks) < planned
    if len(blocks) < FEWEST_BLOCKS:
        blocks = pilot + blocks
    seconds = wall() - start
    if not blocks:
        raise InputError(f"{settings.cap_key}={settings.cap_s:g} s ran out before the first block of four timed "
                         f"samples was measured ({seconds:.3g} s): raise {settings.cap_key}")
    if len(blocks) < FEWEST_BLOCKS:
        pace = seconds / len(blocks)
        raise InputError(f"{settings.cap_key}={settings.cap_s:g} s allowed {len(blocks)} block(s) of four timed "
                         f"samples ({pace:.3g} s a block); a {CONFIDENCE:.0%} interval needs {FEWEST_BLOCKS}: raise "
                         f"{settings.cap_key} to at least {math.ceil(pace * FEWEST_BLOCKS)} s (to "
                         f"{math.ceil(pace * 2 * MIN_BLOCKS)} s for a pilot and the blocks it plans)")
    ratio, low, high = median_interval(blocks)
    reached = relative_half_width(ratio, low, high) <= settings.tolerance
    stop = ("cap" if capped else "tolerance" if reached
            else "max_blocks" if planned == settings.max_blocks else "wider")
    return SpeedRatio(ratio, low, high, len(blocks), stop, half, seconds, tuple(blocks),
                      statistics.median(reference_times))


def sample_timer(device: torch.device, *, calls: int = 1, clock: str = "cpu") -> Callable[[Callable], float]:
    """Seconds a call of ``f``, over ``calls`` calls back to back: CUDA events on a GPU (the device's own time
    of the queued calls); on the CPU this thread's CPU time (``clock="cpu"``, which equals latency at one torch
    thread and leaves out what else the machine runs; more threads are refused, since their work would not be
    counted) or wall time (``"wall"``). On the CPU it fixes glibc's malloc thresholds for the rest of the process
    first (``bench.heap``): a timing then varies less from one process to the next. The timer's ``describe``
    names its clock and device for the errors that quote it."""
    if device.type == "cuda":
        def cuda_time(f: Callable[[], object]) -> float:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                f()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1000 / calls
        cuda_time.describe = f"the CUDA event timer on {torch.cuda.get_device_name(device)}"
        return cuda_time
    if clock not in ("cpu", "wall"):
        raise InputError(f"clock {clock!r}: use cpu or wall")
    if clock == "cpu" and torch.get_num_threads() != 1:
        raise InputError(f"the cpu clock counts this thread's time, and torch runs {torch.get_num_threads()} threads "
                         "here: time with one thread (threads: 1) or with the wall clock")
    steady_heap()
    now = time.thread_time if clock == "cpu" else time.perf_counter

    def cpu_time(f: Callable[[], object]) -> float:
        begin = now()
        for _ in range(calls):
            f()
        return (now() - begin) / calls
    cpu_time.describe = f"the {'thread CPU time' if clock == 'cpu' else 'wall clock'} timer on the CPU"
    return cpu_time


def chain(first: SpeedRatio, second: SpeedRatio) -> SpeedRatio:
    """``first * second`` (a model against its reference, that reference against an anchor): the ratios multiply,
    and so, conservatively, do the interval's ends. Each interval holds with its own 95%, so the product's holds
    with at least 90% (Bonferroni; its readers call it that); its stop is the first one's that is not
    ``tolerance``."""
    stop = next((r.stop for r in (first, second) if r.stop != "tolerance"), "tolerance")
    return SpeedRatio(first.ratio * second.ratio, first.low * second.low, first.high * second.high,
                      first.blocks + second.blocks, stop, max(first.pilot_half_width, second.pilot_half_width),
                      first.seconds + second.seconds, reference_s=second.reference_s)
