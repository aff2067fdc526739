"""The rule `tunecast calibrate` stops by (train/steady.py), on synthetic step speeds: the interval of the median
against its binomial arithmetic, and the verdict on steady, noisy, drifting and outlying sequences."""

from __future__ import annotations

import random

import pytest

from tunecast.train.steady import (
    MIN_INTERVAL_STEPS,
    MIN_STEADY_STEPS,
    median_interval,
    quartiles,
    steadiness,
    warmup_floor,
)


def noisy(n: int, spread: float, *, seed: int = 1, centre: float = 1000.0) -> list[float]:
    """Speeds scattered uniformly within ±spread of the centre."""
    chooser = random.Random(seed)
    return [centre * (1 + chooser.uniform(-spread, spread)) for _ in range(n)]


def test_the_interval_of_the_median_is_the_binomial_order_statistic() -> None:
    values = [float(v) for v in range(1, 11)]  # 10 values: P(Bin(10, ½) ≤ 1) = 11/1024 ≤ 2.5% < P(≤ 2) = 56/1024
    interval = median_interval(list(reversed(values)))
    assert interval is not None
    assert (interval.median, interval.low, interval.high) == (5.5, 2.0, 9.0)
    assert interval.confidence == pytest.approx(1 - 2 * 11 / 1024)
    assert interval.relative_half_width == pytest.approx(3.5 / 5.5)
    # the fewest values a 95% interval can be given on: 2 × ½⁶ < 5% ≤ 2 × ½⁵
    assert median_interval([1.0] * (MIN_INTERVAL_STEPS - 1)) is None
    six = median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0])
    assert six is not None and (six.low, six.high) == (1.0, 6.0) and six.confidence == pytest.approx(1 - 2 / 64)
    assert quartiles(values) == pytest.approx((3.25, 7.75))


def test_a_steady_sequence_stops_after_its_warmup_and_is_centred_on_the_true_speed() -> None:
    speeds = [200.0, 600.0, *noisy(40, 0.03)]  # two slow first steps, then within ±3%
    state = steadiness(speeds)
    assert state.steady and state.warmup == 5  # 10% of 42 steps
    assert state.interval is not None and state.interval.median == pytest.approx(1000.0, rel=0.02)
    assert state.relative_ci is not None and state.relative_ci <= 0.05 and state.why_not() == ""


def test_too_few_steps_are_not_steady_however_close() -> None:
    state = steadiness([1000.0] * (warmup_floor(MIN_STEADY_STEPS) + MIN_STEADY_STEPS - 1))
    assert not state.steady and "too few steps" in state.why_not()
    assert steadiness([1000.0] * (warmup_floor(20) + 20)).steady


def test_a_noisy_sequence_is_not_steady_until_enough_steps_narrow_the_interval() -> None:
    few = steadiness(noisy(25, 0.4))
    assert not few.steady and "wider than ±5%" in few.why_not()
    many = steadiness(noisy(800, 0.4))
    assert many.steady and many.interval is not None and many.interval.median == pytest.approx(1000.0, rel=0.05)


def test_outliers_move_neither_the_median_nor_the_verdict() -> None:
    speeds = noisy(60, 0.02)
    calm = steadiness(speeds)
    spiked = list(speeds)
    for index in (10, 25, 40, 55):  # another process took the cores: a step ten times slower
        spiked[index] = 100.0
    stormy = steadiness(spiked)
    assert calm.steady and stormy.steady
    assert stormy.interval is not None and calm.interval is not None
    assert stormy.interval.median == pytest.approx(calm.interval.median, rel=0.02)
    mean = sum(spiked[stormy.warmup:]) / stormy.kept
    assert mean < 0.95 * stormy.interval.median  # what a mean would have said


def test_a_drifting_sequence_is_not_steady_however_narrow() -> None:
    # a machine getting busier: 0.5% slower every step, noise-free, so the interval is narrow at first sight
    slowing = [1000.0 * (1 - 0.005 * i) for i in range(60)]
    state = steadiness(slowing)
    assert not state.steady and state.drifting and state.drift is not None and state.drift < 0
    assert "getting slower" in state.why_not()


def test_a_long_warmup_is_left_out_rather_than_called_drift() -> None:
    # forty steps getting faster (lazy initialisation, caches, a cold machine), then steady: the kept steps' first
    # half would be reliably slower than their second, so the warm-up grows past 10%
    speeds = [300.0 + 700.0 * i / 40 for i in range(40)] + noisy(50, 0.02)
    state = steadiness(speeds)
    assert state.warmup > warmup_floor(len(speeds)) and state.steady
    assert state.interval is not None and state.interval.median == pytest.approx(1000.0, rel=0.02)
