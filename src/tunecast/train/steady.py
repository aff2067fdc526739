"""When a measured speed is steady enough to stop measuring: the rule `tunecast calibrate` stops by.

What is measured is a sequence of steps, each with its speed: the tokens it computed (padding included: a step's
work grows with its padded tokens) per second. On a shared machine a few steps take several times as long as the
others (another process had the cores, the allocator grew, the garbage collector ran), so the mean of a short
run is as good as its worst step. The rule, step by step:

* warm-up: the first steps are slower (lazy initialisation, allocator growth, caches): the first
  `max(MIN_WARMUP_STEPS, 10%)` are left out, and more while the steps after them are still getting faster (see
  drift below), up to half of the steps;
* centre: the median of the rest, which an outlier cannot move;
* confidence: the distribution-free interval of the median from order statistics (the number of steps below
  the true median is Binomial(n, ½), so the k-th smallest and the k-th largest steps bracket it with probability
  1 − 2·P(Bin(n, ½) ≤ k − 1); Conover, *Practical Nonparametric Statistics*, §3.2). It needs no assumption on the
  shape of the noise, and needs at least 6 steps at 95% (2 × ½⁶ < 5%);
* spread: the interquartile range, reported alongside;
* drift: the two halves of the kept steps, each with its own interval of the median; when the two intervals do
  not overlap, the speed is still moving (a longer warm-up, a machine getting busier, memory growing) and the
  measurement is not steady, however narrow its interval;
* steady: at least MIN_STEADY_STEPS kept steps, the interval within ±`target` of the median (5% unless told),
  and no drift.

Pure functions of the sequence, so the rule is tested on synthetic sequences
(tests/unit/train/test_calibrate_steady.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
TARGET_RELATIVE_CI = 0.05
MIN_WARMUP_STEPS = 2
WARMUP_SHARE = 0.10
# The fewest steps an interval of the median at CONFIDENCE can be given on: 2 × ½ⁿ ≤ 1 − CONFIDENCE.
MIN_INTERVAL_STEPS = 6
# Kept steps before a measurement may be called steady: each half then has an interval of its own (drift).
MIN_STEADY_STEPS = 2 * MIN_INTERVAL_STEPS
# How far the warm-up may extend while the first steps are still getting faster: this share of the steps.
MAX_WARMUP_SHARE = 0.5


@dataclass(frozen=True)
class MedianInterval:
    median: float
    low: float
    high: float
    confidence: float  # the interval's exact coverage (≥ the confidence asked for)

    @property
    def relative_half_width(self) -> float:
        """The larger distance from the median to an end of the interval, as a share of the median."""
        return max(self.median - self.low, self.high - self.median) / self.median


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> MedianInterval | None:
    """The median of `values` and its distribution-free interval from order statistics; None when there are too
    few values for that confidence."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return None
    alpha = 1 - confidence
    # the largest k with P(Bin(n, ½) ≤ k − 1) ≤ α/2: the k-th smallest and the k-th largest values bracket it
    tail = 0.0
    k = 0
    for j in range(n // 2 + 1):
        tail += math.comb(n, j) / 2**n  # P(Bin ≤ j)
        if tail > alpha / 2:
            break
        k = j + 1
    if k == 0:
        return None
    covered = 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n
    return MedianInterval(statistics.median(ordered), ordered[k - 1], ordered[n - k], covered)


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles (the interquartile range's ends)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


@dataclass(frozen=True)
class Steadiness:
    """What the kept steps say, and whether they say it firmly enough to stop."""

    warmup: int  # steps left out at the start
    kept: int
    interval: MedianInterval | None  # of the kept steps' values
    q1: float
    q3: float
    drift: float | None  # second half's median speed ÷ first half's − 1; None with too few steps to tell
    drifting: bool  # the halves' intervals do not overlap
    steady: bool
    target: float

    @property
    def relative_ci(self) -> float | None:
        return self.interval.relative_half_width if self.interval is not None else None

    def why_not(self) -> str:
        """Why the measurement is not steady, in words ('' when it is)."""
        if self.steady:
            return ""
        if self.interval is None or self.kept < MIN_STEADY_STEPS:
            return f"too few steps after the warm-up ({self.kept}; {MIN_STEADY_STEPS} needed)"
        if self.drifting:
            faster = "faster" if (self.drift or 0.0) > 0 else "slower"
            return f"the steps were still getting {faster} ({abs(self.drift or 0.0):.0%} between the halves)"
        return f"the interval is ±{self.relative_ci:.1%}, wider than ±{self.target:.0%}"


def _halves(values: Sequence[float], confidence: float) -> tuple[float | None, bool]:
    """(drift, drifting) of `values`: the second half's median speed against the first's."""
    half = len(values) // 2
    first = median_interval(values[:half], confidence)
    second = median_interval(values[half:], confidence)
    if first is None or second is None:
        return None, False
    disjoint = first.high < second.low or second.high < first.low
    return second.median / first.median - 1, disjoint


def warmup_floor(steps: int) -> int:
    """The fewest steps left out as warm-up of `steps`: MIN_WARMUP_STEPS, or WARMUP_SHARE of them."""
    return max(MIN_WARMUP_STEPS, math.ceil(WARMUP_SHARE * steps))


def steadiness(values: Sequence[float], *, target: float = TARGET_RELATIVE_CI,
               confidence: float = CONFIDENCE) -> Steadiness:
    """The steadiness of a measured sequence: each step's speed (tokens per second), in order."""
    n = len(values)
    base = min(n, warmup_floor(n))
    warmup = base
    # a warm-up longer than the rule's: extend it while the kept steps' second half is reliably faster than the
    # first, by tenths of the steps (a few candidates: the rule runs after every step)
    stride = max(1, n // 10)
    for candidate in range(base, max(base, int(MAX_WARMUP_SHARE * n)) + 1, stride):
        drift, drifting = _halves(values[candidate:], confidence)
        warmup = candidate
        if not (drifting and drift is not None and drift > 0):
            break
    kept = list(values[warmup:])
    interval = median_interval(kept, confidence) if kept else None
    q1, q3 = quartiles(kept) if kept else (math.nan, math.nan)
    drift, drifting = _halves(kept, confidence)
    steady = (interval is not None and len(kept) >= MIN_STEADY_STEPS and not drifting
              and interval.relative_half_width <= target)
    return Steadiness(warmup, len(kept), interval, q1, q3, drift, drifting, steady, target)
