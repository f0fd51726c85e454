"""pipeline.bench.paired: the order-statistic interval against scipy's binomial, and the paired ratio with its
stopping rule on a synthetic machine with a known ratio, drift and a first-call penalty (no real timing)."""

from __future__ import annotations

import math
import platform
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import scipy.stats

from pipeline.bench.paired import (
    SpeedSettings,
    chain,
    median_interval,
    order_statistic_rank,
    paired_ratio,
)
from pipeline.errors import InputError
from tests.processes import ROOT


def test_the_rank_is_the_binomial_order_statistic_at_95_percent():
    for n in [*range(6, 301), *range(301, 2001, 37), 2000]:
        j = order_statistic_rank(n)
        assert 2 * scipy.stats.binom.cdf(j - 1, n, 0.5) <= 0.05 < 2 * scipy.stats.binom.cdf(j, n, 0.5), n
    assert order_statistic_rank(8) == 1 and order_statistic_rank(20) == 6  # written-out values
    with pytest.raises(InputError, match="5 samples are too few"):
        order_statistic_rank(5)
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0, 6.0, 8.0, 7.0]) == (4.5, 1.0, 8.0)


class Machine:
    """A simulated machine: each call of a model takes ``base * drift(now) * noise`` simulated seconds, and a
    model's first call ``penalty`` times as long; ``now`` advances by what runs."""

    def __init__(self, rng: random.Random, *, drift: float = 0.3, period: float = 8.0, noise: float = 0.05,
                 penalty: float = 20.0) -> None:
        self.rng, self.now, self.noise, self.penalty = rng, 0.0, noise, penalty
        self.drift, self.period, self.phase = drift, period, rng.uniform(0, 2 * math.pi)

    def model(self, base: float):
        called = [0]

        def run() -> None:
            first = self.penalty if called[0] == 0 else 1.0
            called[0] += 1
            speed = 1 + self.drift * math.sin(2 * math.pi * self.now / self.period + self.phase)
            self.now += base * speed * first * math.exp(self.rng.gauss(0, self.noise))
        return run

    def timer(self, f) -> float:
        begin = self.now
        f()
        return self.now - begin


RATIO = 0.6  # the model takes 0.6 of the reference's time


def _paired(rng: random.Random, settings: SpeedSettings):
    machine = Machine(rng)
    return paired_ratio(machine.model(RATIO * 0.1), machine.model(0.1), timer=machine.timer, settings=settings,
                        wall=lambda: machine.now)


def _oracle_half_width(rng: random.Random, blocks: int) -> float:
    """The same blocks on a machine without drift: the interval only the noise leaves."""
    ratios = []
    for _ in range(blocks):
        a = [0.1 * math.exp(rng.gauss(0, 0.05)) for _ in range(2)]
        b = [RATIO * 0.1 * math.exp(rng.gauss(0, 0.05)) for _ in range(2)]
        ratios.append(sum(b) / sum(a))
    median, low, high = median_interval(ratios)
    return (high - low) / 2 / median


def _unpaired(rng: random.Random, blocks: int) -> tuple[float, float, float]:
    """What the evaluate stage did before: each model timed alone, one after the other, here with as many samples
    as the paired blocks hold and the same interval taken over sample i of one over sample i of the other."""
    machine = Machine(rng)
    model, reference = machine.model(RATIO * 0.1), machine.model(0.1)
    model(), reference()  # warm
    own = [machine.timer(model) for _ in range(2 * blocks)]
    base = [machine.timer(reference) for _ in range(2 * blocks)]
    return median_interval([b / a for b, a in zip(own, base)])


def test_the_interval_covers_the_true_ratio_in_95_percent_of_1000_trials_near_an_oracles_width():
    rng, settings = random.Random(7), SpeedSettings(tolerance=0.02, cap_s=1e9)
    results = [_paired(rng, settings) for _ in range(1000)]
    covered = sum(r.covers(RATIO) for r in results)
    assert covered >= 930, covered
    assert all(r.blocks >= 8 for r in results) and {r.stop for r in results} == {"tolerance", "wider"}
    # the pilot aims the median measurement at the tolerance: about half land within it, the rest a little wider
    assert 300 <= sum(r.stop == "tolerance" for r in results) <= 800
    assert max(r.half_width for r in results if r.stop == "tolerance") <= 0.02 < min(
        r.half_width for r in results if r.stop == "wider")
    widths = [r.half_width for r in results]
    oracle = [_oracle_half_width(rng, r.blocks) for r in results]
    assert statistics.median(widths) <= 1.2 * statistics.median(oracle), (statistics.median(widths),
                                                                           statistics.median(oracle))
    # The pilot sized the blocks for the 2% tolerance: the intervals land at it, not far under (the pilot's own
    # [min, max] interval scaled by sqrt(8 / n) asked for 99 blocks here, and landed at 1.3%).
    assert 0.016 <= statistics.median(widths) <= 0.022, statistics.median(widths)
    # Timed unpaired, as the evaluate stage did, the drift between the two models' samples is in the ratio.
    unpaired = [_unpaired(rng, r.blocks) for r in results[:300]]
    assert sum(low <= RATIO <= high for _, low, high in unpaired) < 0.93 * 300


def test_the_result_is_the_blocks_after_the_pilot_and_the_cap_bounds_them():
    rng = random.Random(3)
    machine = Machine(rng, drift=0.0)
    timed = [0]
    reference = machine.model(0.1)
    slow_pilot = machine.model(0.1)

    def model() -> None:  # twice as slow during the pilot's 16 timed calls of it
        timed[0] += 1
        slow_pilot()
        if timed[0] <= 2 + 16:  # the warm-up's 2 calls, then the pilot's
            machine.now += 0.1

    result = paired_ratio(model, reference, timer=machine.timer, settings=SpeedSettings(cap_s=1e9),
                          wall=lambda: machine.now)
    assert result.covers(1.0) and max(result.block_ratios) < 1.5 and len(result.block_ratios) == result.blocks
    capped = paired_ratio(machine.model(0.06), machine.model(0.1), timer=machine.timer,
                          settings=SpeedSettings(tolerance=0.001, cap_s=4.0), wall=lambda: machine.now)
    block = 2 * 0.06 + 2 * 0.1  # the cap counts the pilot: 8 blocks of it, then fewer than 6 more, so all 13 count
    assert capped.stop == "cap" and capped.seconds <= 4.0 + 1.1 * block and capped.blocks == 13
    with pytest.raises(InputError, match="a pilot of 4 blocks"):
        paired_ratio(model, reference, timer=machine.timer, settings=SpeedSettings(pilot=4))


def test_a_chained_ratio_multiplies_the_ratios_and_the_ends():
    rng = random.Random(5)
    one, two = _paired(rng, SpeedSettings()), _paired(rng, SpeedSettings())
    both = chain(one, two)
    assert both.ratio == pytest.approx(one.ratio * two.ratio)
    assert (both.low, both.high) == pytest.approx((one.low * two.low, one.high * two.high))
    assert both.blocks == one.blocks + two.blocks


def test_a_block_cancels_a_linear_drift_in_either_order():
    """Equal models on a machine slowing down 5% a call: each block's ratio is 1 up to the drift's square."""
    from pipeline.bench.paired import block_ratio

    now = [0.0]

    def model() -> None:
        now[0] += 1.0 + 0.05 * now[0]

    def timer(f) -> float:
        begin = now[0]
        f()
        return now[0] - begin

    other = lambda: model()  # noqa: E731  (the same model under another name)
    ratios = [block_ratio(other, model, index, timer) for index in range(4)]
    assert ratios == pytest.approx([1.0] * 4, abs=0.01), ratios


def test_the_pilot_plans_from_its_robust_spread():
    from pipeline.bench.paired import pilot_spread, planned_blocks, predicted_half_width

    pilot = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8, 1.0]  # all within 3 x 1.4826 x MAD (0.075) of the median
    spread = pilot_spread(pilot)
    assert spread == pytest.approx(statistics.stdev(pilot))
    # an outlier is pulled in to median + 3 x 1.4826 x MAD before the standard deviation (written out)
    outlying = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 2.0]  # median 1.0, MAD 0.01
    clipped = [*outlying[:-1], 1.0 + 3 * 1.4826 * 0.01]
    assert pilot_spread(outlying) == pytest.approx(statistics.stdev(clipped))
    n = planned_blocks(pilot, SpeedSettings())[0]  # the fewest whose predicted half-width is within 2%
    assert predicted_half_width(spread, n) <= 0.02 < predicted_half_width(spread, n - 1)
    assert planned_blocks(pilot, SpeedSettings(max_blocks=150))[0] == 150 < n
    assert planned_blocks([1.0, 1.001] * 4, SpeedSettings())[0] == 8  # never fewer than 8
    # One block twice as slow among 8 of 1% noise: the standard deviation (35%) asked for 493 blocks
    quiet = [1.0 + 0.01 * x for x in (-1.2, 0.4, -0.3, 0.9, -0.6, 0.2, 1.1)]
    assert statistics.stdev([*quiet, 2.0]) > 0.3
    assert planned_blocks([*quiet, 2.0], SpeedSettings())[0] <= 100


def _timers(pilot_noise: float, noise: float, seconds: float = 0.1, seed: int = 0):
    """A synthetic timer with a clock: the first 8 blocks (32 samples) jitter by ``pilot_noise``, the later ones by
    ``noise``; every sample takes ``seconds`` on the clock (both models, so the ratio is 1)."""
    rng, now, count = random.Random(seed), [0.0], [0]

    def timer(f) -> float:
        count[0] += 1
        jitter = pilot_noise if count[0] <= 32 else noise
        now[0] += seconds
        return seconds * math.exp(rng.gauss(0, jitter))
    return timer, (lambda: now[0])


def test_the_stop_label_says_what_bounded_the_blocks_and_what_they_reached():
    """A quiet pilot, then noisy blocks: the planned blocks are measured, and the interval is wider than the
    tolerance, which the label says (``wider``, not ``tolerance``); a quiet machine reaches it (``tolerance``);
    a cap stops it (``cap``); ``max_blocks`` too few for the tolerance (``max_blocks``)."""
    def measure(timer_clock, **settings):
        timer, clock = timer_clock
        return paired_ratio(lambda: None, lambda: None, timer=timer, wall=clock,
                            settings=SpeedSettings(warmup=0, **{"cap_s": 1e9, **settings}))

    noisy = measure(_timers(0.002, 0.05))
    assert noisy.stop == "wider" and noisy.half_width > 0.02, noisy
    quiet = measure(_timers(0.01, 0.01))
    assert quiet.stop == "tolerance" and quiet.half_width <= 0.02, quiet
    capped = measure(_timers(0.05, 0.05), cap_s=8.0)  # 0.4 s a block: 20 blocks fit, 8 of them the pilot's
    assert capped.stop == "cap" and capped.blocks in (12, 13) and capped.seconds <= 8.0 + 0.4 + 1e-9
    bounded = measure(_timers(0.05, 0.05), max_blocks=10)
    assert bounded.stop == "max_blocks" and bounded.blocks == 10 and bounded.half_width > 0.02


def test_the_cap_is_a_limit_on_the_clock_pilot_included():
    """10 s samples under a 20 s cap: the first block (40 s) ends past the cap and no other starts, and one block
    is no interval: one line says so and what cap would do."""
    timer, clock = _timers(0.01, 0.01, seconds=10.0)
    # the key a user sets (`--set experiment.eval.speed_cap_s=...`), not a path the config refuses
    with pytest.raises(InputError, match=r"^experiment.eval.speed_cap_s=20 s allowed 1 block\(s\) of four "
                                         r"timed samples \(40 s a block\); a 95% interval needs 6: raise "
                                         r"experiment.eval.speed_cap_s to at least 240 s \(to 640 s for a pilot and "
                                         r"the blocks it plans\)$"):
        paired_ratio(lambda: None, lambda: None, timer=timer, wall=clock,
                     settings=SpeedSettings(warmup=0, cap_s=20.0))
    assert clock() == 40.0  # within one block of the cap


def test_the_key_the_cap_error_names_is_one_the_config_takes():
    from pipeline.config import load_config

    key = SpeedSettings().cap_key
    assert key == "experiment.eval.speed_cap_s"
    assert load_config(ROOT / "configs" / "experiments" / "tiny.yaml", [f"{key}=7"]).experiment.eval.speed_cap_s == 7


def test_a_cap_that_runs_out_before_any_block_says_so_without_a_pace():
    """The wall clock jumps 5 s between the start and the first block's check, past a 1 s cap: no block, and the
    line says so rather than quoting a pace of no block and a cap of 0 s."""
    times = iter([0.0, 5.0, 5.0, 5.0, 5.0])
    with pytest.raises(InputError, match=r"^experiment.eval.speed_cap_s=1 s ran out before the first block of four "
                                         r"timed samples was measured \(5 s\): raise experiment.eval.speed_cap_s$"):
        paired_ratio(lambda: None, lambda: None, timer=lambda f: 1.0, wall=lambda: next(times),
                     settings=SpeedSettings(warmup=0, cap_s=1.0))


@pytest.mark.parametrize("samples", [[math.inf] * 4, [0.01, math.inf, 0.01, 0.01], [0.01, 0.01, math.nan, 0.01]])
def test_a_sample_that_is_not_a_finite_number_of_seconds_is_refused(samples):
    """Every sample +inf crashed in ``statistics.stdev``; some +inf made an interval [x, inf] labelled ``wider``."""
    from pipeline.bench.paired import TimerError

    read = iter(samples * 100)
    with pytest.raises(TimerError, match=r"^the timer read (inf|nan) s for one sample of the (reference|model): a "
                                         r"sample must be a finite number of seconds; check the timer's clock$"):
        paired_ratio(lambda: None, lambda: None, timer=lambda f: next(read), wall=lambda: 0.0,
                     settings=SpeedSettings(warmup=0, cap_s=1e9))


@pytest.mark.parametrize(("settings", "message"), [
    ({"tolerance": 0.0}, r"^a speed tolerance of 0.0: give the interval's relative half-width"),
    ({"tolerance": 1.0}, r"^a speed tolerance of 1.0: "),
    ({"tolerance": math.nan}, r"^a speed tolerance of nan: "),
    ({"cap_s": 0.0}, r"^experiment.eval.speed_cap_s=0.0: give the most seconds a measurement may take, above 0$"),
    ({"cap_s": -3.0, "cap_key": "--cap-s"}, r"^--cap-s=-3.0: "),
    ({"cap_s": math.nan}, r"^experiment.eval.speed_cap_s=nan: "),
    ({"pilot": 4}, r"^a pilot of 4 blocks, at most 2000 blocks and 2 warm-up calls: give a pilot of at least 8 "
                   r"blocks, allow at least as many"),
    ({"max_blocks": 7}, r"at most 7 blocks"),
    ({"warmup": -1}, r"-1 warm-up calls"),
    ({"pilot": 8.5}, r"^a speed setting's pilot of 8.5: give a whole number of blocks$"),
    ({"warmup": 1.5}, r"^a speed setting's warmup of 1.5: give a whole number of calls$"),
    ({"max_blocks": math.nan}, r"^a speed setting's max_blocks of nan: give a whole number of blocks$"),
    ({"pilot": True}, r"^a speed setting's pilot of True: "),
    ({"pilot": 100, "max_blocks": 8}, r"^a pilot of 100 blocks, at most 8 blocks .* allow at least as many blocks as "
                                      r"the pilot"),
    ({"tolerance": True}, r"^a speed tolerance of True: "),
    ({"cap_s": "60"}, r"^experiment.eval.speed_cap_s='60': "),
])
def test_speed_settings_that_cannot_measure_are_refused_in_one_line(settings, message):
    with pytest.raises(InputError, match=message):
        SpeedSettings(**settings)


def test_a_timer_that_reads_zero_is_refused_naming_it():
    from pipeline.bench.paired import TimerError, sample_timer

    def zero(f) -> float:
        return 0.0
    zero.describe = "the thread CPU time timer on the CPU"
    with pytest.raises(TimerError, match=r"^the thread CPU time timer on the CPU read 0.0 s for one sample of the "
                                         r"reference: it cannot time a call this short"):
        paired_ratio(lambda: None, lambda: None, timer=zero, settings=SpeedSettings(warmup=0))
    with pytest.raises(TimerError, match=r"^the timer read -1.0 s"):
        paired_ratio(lambda: None, lambda: None, timer=lambda f: -1.0, settings=SpeedSettings(warmup=0))
    import torch

    assert sample_timer(torch.device("cpu")).describe == "the thread CPU time timer on the CPU"


def _simulated_half_width(rng: random.Random, spread: float, blocks: int, trials: int = 600) -> float:
    """The median relative half-width of ``median_interval`` over ``blocks`` normal block ratios of mean 1 and
    standard deviation ``spread``, by simulation."""
    widths = []
    for _ in range(trials):
        median, low, high = median_interval([rng.gauss(1.0, spread) for _ in range(blocks)])
        widths.append((high - low) / 2 / median)
    return statistics.median(widths)


@pytest.mark.parametrize("tolerance", [0.02, 0.01])
def test_the_pilot_asks_for_the_fewest_blocks_whose_interval_meets_the_tolerance(tolerance):
    """Against a simulation of the interval itself: the blocks asked for give a half-width at the tolerance, and
    a fifth fewer would not."""
    from pipeline.bench.paired import pilot_spread, planned_blocks

    pilot = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 0.8, 1.0]
    spread = pilot_spread(pilot)
    n, _ = planned_blocks(pilot, SpeedSettings(tolerance=tolerance))
    rng = random.Random(11)
    assert 0.9 * tolerance <= _simulated_half_width(rng, spread, n) <= 1.05 * tolerance, n
    assert _simulated_half_width(rng, spread, int(0.8 * n)) > 1.05 * tolerance, n


def test_images_per_s_on_one_scale_written_out():
    """A 64-wide model timed at 0.5 [0.45, 0.55] of its reference, whose reference takes 2.0 [1.9, 2.1] of the
    32-wide anchor's time, the anchor at 1,000 images/s: 1000 / (0.5 * 2.0) = 1,000 images/s, and the interval's
    ends from the ends multiplied, 1000 / (0.55 * 2.1) and 1000 / (0.45 * 1.9)."""
    from pipeline.bench.paired import SpeedRatio
    from pipeline.evaluate import Scale

    one = SpeedRatio(1.0, 1.0, 1.0, 0, "anchor", 0.0, 0.0)
    scale = Scale("M32", 1000.0, {"M32": one, "M64": SpeedRatio(2.0, 1.9, 2.1, 40, "tolerance", 0.05, 3.0)},
                  SpeedRatio(1.001, 0.99, 1.01, 40, "tolerance", 0.05, 3.0), "cpu", "Test CPU")
    assert scale.images_per_s("M64", 0.5, 0.45, 0.55) == pytest.approx((1000.0, 1000 / 1.155, 1000 / 0.855))
    assert scale.images_per_s("M32", 0.5, 0.45, 0.55) == pytest.approx((2000.0, 1000 / 0.55, 1000 / 0.45))


# In a fresh interpreter: a 1 MiB block (over glibc's first 128 KiB threshold, so mmapped) freed, which raises the
# dynamic threshold to about 1 MiB; then an 8 MiB block: mmapped again under the default heap, from the heap once
# the thresholds are fixed. mallinfo2's hblks counts the mmapped blocks in use.
HEAP_PROBE = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = Info
import torch
from pipeline.bench.paired import sample_timer
libc.free(libc.malloc(2**20))
if sys.argv[1] == "timer":
    sample_timer(torch.device("cpu"))
before = libc.mallinfo2().hblks
block = libc.malloc(8 * 2**20)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc and its mallinfo2")
def test_a_cpu_timer_fixes_glibcs_thresholds_so_a_block_comes_from_the_heap():
    def mmapped(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.split()[-1])

    assert mmapped("default") == 1  # glibc's dynamic threshold: the 8 MiB block is mmapped
    assert mmapped("timer") == 0  # after a CPU timer is made: from the heap


class RhythmMachine(Machine):
    """A machine whose speed cycles with every four timed calls (a period of one block), ramping from 1 - d to
    1 + d, and whose first sample of a block is ``first`` slower still (the young collection before it, a cold cache):
    ABBA and BAAB give each model the same positions of the ramp, and in turn the first sample; AABB and AB give them
    different positions, and ABBA alone gives the reference every first sample."""

    def __init__(self, rng: random.Random, depth: float = 0.2, first: float = 0.0) -> None:
        super().__init__(rng, drift=0.0, noise=0.02, penalty=1.0)
        self.calls, self.depth, self.first = 0, depth, first

    def timer(self, f) -> float:
        begin = self.now
        f()
        position = self.calls % 4
        self.calls += 1
        return (self.now - begin) * (1 + self.depth * (position - 1.5) / 1.5) * (1 + self.first * (position == 0))


def _aabb(fn, reference, index, timer) -> float:
    a = timer(reference) + timer(reference)
    return (timer(fn) + timer(fn)) / a


def _ab(fn, reference, index, timer) -> float:
    a = timer(reference)
    return timer(fn) / a


def _abba_only(fn, reference, index, timer) -> float:
    """ABBA in every block: the alternation with BAAB lost."""
    a = timer(reference)
    b = timer(fn) + timer(fn)
    return b / (a + timer(reference))


def _rhythm_coverage(trials: int = 400) -> float:
    """Coverage of the true ratio over ``trials`` seeded regimes, each with its own first-sample penalty (2-10%)."""
    rng = random.Random(13)
    covered = 0
    for _ in range(trials):
        machine = RhythmMachine(rng, first=rng.uniform(0.02, 0.1))
        result = paired_ratio(machine.model(RATIO * 0.1), machine.model(0.1), timer=machine.timer,
                              settings=SpeedSettings(tolerance=0.02, cap_s=1e9, warmup=0),
                              wall=lambda machine=machine: machine.now)
        covered += result.covers(RATIO)
    return covered / trials


@pytest.mark.parametrize("order", [None, _aabb, _ab, _abba_only], ids=["ABBA-BAAB", "AABB", "AB", "ABBA-only"])
def test_the_coverage_check_sees_a_lost_balance(order, monkeypatch):
    """A drift in the rhythm of a block and a slower first sample: the blocks as measured (ABBA, then BAAB) keep 93%
    coverage; blocks that lose the balance (AABB, one A and one B, or ABBA alone, which gives the reference every
    first sample) put the same bias in every block, and the coverage check fails them (under 50%)."""
    from pipeline.bench import paired

    if order is not None:
        monkeypatch.setattr(paired, "block_ratio", order)
    coverage = _rhythm_coverage()
    assert coverage >= 0.93 if order is None else coverage < 0.5, coverage


class HeavyTailedMachine(Machine):
    """Each call's noise a Student t with 3 degrees of freedom (scaled to ``noise``) instead of a normal: rare calls
    far slower or faster than the rest."""

    def model(self, base: float):
        def run() -> None:
            chi2 = sum(self.rng.gauss(0, 1) ** 2 for _ in range(3)) / 3
            self.now += base * math.exp(self.noise * self.rng.gauss(0, 1) / math.sqrt(chi2))
        return run


TIMERS = {"iid": lambda rng: Machine(rng, drift=0.0, penalty=1.0),
          "heavy-tailed": lambda rng: HeavyTailedMachine(rng, drift=0.0, penalty=1.0),
          "drifting": lambda rng: Machine(rng, drift=0.3, penalty=1.0)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(TIMERS))
def test_the_within_run_interval_covers_its_process_and_the_widened_one_covers_across_processes(kind):
    """1,000 seeded measurements, each in a "process" whose own ratio is the population's times a between-process
    term (log-normal, 3%): the within-run interval covers its process's ratio at least 93% of the time under
    independent, heavy-tailed and drifting timers, but not the population's (the scope it says: "within this run");
    widened by a spread record of that 3% (``SpreadRecord.across_runs``), it covers the population's ratio 93%."""
    from pipeline.spread import SpreadRecord

    between, trials = 0.03, 1000
    record = SpreadRecord(device="simulated", threads=1, setting="", torch="", timm="", date="2026-12-07", over_s=0.0,
                          seconds=0.0, pair={}, processes=[], between=between, within=0.0, max_over_min=1.0)
    rng = random.Random(2026)
    within = own = across = 0
    for _ in range(trials):
        process_ratio = RATIO * math.exp(rng.gauss(0, between))
        machine = TIMERS[kind](rng)
        result = paired_ratio(machine.model(process_ratio * 0.1), machine.model(0.1), timer=machine.timer,
                              settings=SpeedSettings(tolerance=0.02, cap_s=1e9, warmup=0),
                              wall=lambda machine=machine: machine.now)
        own += result.covers(process_ratio)
        within += result.covers(RATIO)
        low, high = record.across_runs(result.ratio, result.low, result.high)
        across += low <= RATIO <= high
    assert own / trials >= 0.93, (kind, own / trials)
    assert within / trials < 0.9, (kind, within / trials)  # the within-run interval does not hold across processes
    assert across / trials >= 0.93, (kind, across / trials)
