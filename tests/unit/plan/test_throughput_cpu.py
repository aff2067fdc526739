"""The throughput model on a probed CPU, where a small model's step is thousands of small operations: each
operation's cost by its size, small matmuls at the rate measured at their size, attention by the work of a call —
on tiny tables of probed figures, each term against its arithmetic."""

from __future__ import annotations

import math
from typing import Any

import pytest
from tests.models import shallow_llama
from tests.unit.catalog.test_devices import cpu_rows, device, row

from tunecast.catalog.devices import DeviceFigures, as_gpu
from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.estimate.profiles import get_profiles
from tunecast.plan.throughput import StepTime, step_time
from tunecast.step.settings import TraceSettings

MODEL = shallow_llama(hidden_size=128, intermediate_size=352)  # the demo model's width: every operation is small
RUN = RunSpec.model_validate({"model": "x", "method": "lora", "precision": "fp32", "micro_batch": 4, "seq_len": 64})


pytestmark = pytest.mark.usefixtures("profile_cache")


def elementwise(*timings: tuple[int, float]) -> list[Any]:
    """Probed `torch.add` calls: (values, µs per call)."""
    return [row("cpu-test", "elementwise", us, dtype="fp32", shape=str(values)) for values, us in timings]


# a thousand values cost 2 µs (the fixed cost the host overhead holds); larger operations cost far more than their
# bytes at the bandwidth (started and joined over the cores)
SPLIT = elementwise((1024, 2.0), (16384, 30.0), (65536, 60.0), (1048576, 400.0))


def test_an_operation_costs_what_one_of_its_size_costs_beyond_the_smallest() -> None:
    figures = DeviceFigures(device(), tuple(cpu_rows() + SPLIT))
    bytes_of = 3 * 4  # two fp32 inputs read, one written
    assert figures.elementwise_seconds("fp32", 1024 * bytes_of) == pytest.approx(0.0)
    assert figures.elementwise_seconds("fp32", 100) == 0.0  # below the smallest probed: its cost is the host's
    assert figures.elementwise_seconds("fp32", 65536 * bytes_of) == pytest.approx(58e-6)
    # between probed sizes: log-log
    between = figures.elementwise_seconds("fp32", 32768 * bytes_of)
    assert between == pytest.approx((30.0 * 60.0) ** 0.5 * 1e-6 - 2e-6)
    # beyond the largest, the time grows with the bytes
    assert figures.elementwise_seconds("fp32", 4 * 1048576 * bytes_of) == pytest.approx(1600e-6 - 2e-6)
    assert figures.elementwise_seconds("bf16", 1e6) is None  # not probed in that dtype


def _step(rows: list[Any], run: RunSpec = RUN) -> StepTime:
    pair = get_profiles(MODEL, TraceSettings.from_spec(run, grad_checkpointing=False), 4, 64)
    gpu = as_gpu(DeviceFigures(device(), tuple(rows)), None)
    return step_time(run, pair, gpu, load_catalog(None).throughput, micro_batch=4, seq=64, grad_accum=1,
                     gpu_count=1, grad_checkpointing=False)


def test_small_operations_cost_their_probed_time_not_their_bytes_at_the_bandwidth() -> None:
    from tunecast.plan.throughput import _work

    pair = get_profiles(MODEL, TraceSettings.from_spec(RUN, grad_checkpointing=False), 4, 64)
    work = _work(pair, 4, 64)
    plain = _step(cpu_rows())
    split = _step(cpu_rows() + SPLIT)
    per_operation = DeviceFigures(device(), tuple(SPLIT)).elementwise_seconds("fp32",
                                                                              work["moved_bytes"] / work["kernels"])
    assert per_operation is not None and per_operation > 0
    # the step's operations at their mean size's cost replace their bytes at the 512 MiB copy's 20 GB/s
    bandwidth_s = work["moved_bytes"] / 20e9
    assert work["kernels"] * per_operation > bandwidth_s
    assert split.compute_s - plain.compute_s == pytest.approx(work["kernels"] * per_operation - bandwidth_s,
                                                              rel=1e-6)
    assert split.dispatch_s == pytest.approx(plain.dispatch_s)  # the host's part is apart, and unchanged
    # operations cheaper than their bytes (a device whose eager calls are fast) keep the bandwidth's figure
    fast = _step(cpu_rows() + elementwise((1024, 2.0), (1048576, 2.0001)))
    assert fast.compute_s == pytest.approx(plain.compute_s)


def test_a_small_models_matmuls_run_at_the_rate_probed_at_its_width() -> None:
    plain = _step(cpu_rows())  # widths 512 and 2048 probed: the 128-wide layers take the 512-wide rate
    small = [row("cpu-test", "matmul", 0.005, dtype="fp32", shape="64x128x128"),
             row("cpu-test", "matmul", 0.01, dtype="fp32", shape="1024x128x128")]
    slower = _step(cpu_rows() + small)  # a small product reaches a quarter of the rate a 512-wide one does
    assert slower.compute_s > plain.compute_s
    assert slower.dispatch_s == pytest.approx(plain.dispatch_s) and slower.optimizer_s == plain.optimizer_s


def test_attention_runs_at_the_rate_probed_for_a_call_of_its_work() -> None:
    figures = DeviceFigures(device(), tuple([row("cpu-test", "attention", 0.01, dtype="fp32", shape="4x4x128x32"),
                                             row("cpu-test", "attention", 0.05, dtype="fp32", shape="1x8x512x64")]))
    small, large = 7.0 * 4 * 4 * 128 * 128 * 32, 7.0 * 8 * 512 * 512 * 64
    assert figures.attention_tflops("fp32", small) == pytest.approx(0.01)
    # below the smallest call the rate keeps falling as it falls between the two smallest (log-log)
    slope = math.log(0.05 / 0.01) / math.log(large / small)
    assert figures.attention_tflops("fp32", small / 10) == pytest.approx(0.01 * 10**-slope)
    assert figures.attention_tflops("fp32", (small * large) ** 0.5) == pytest.approx(0.03)  # halfway in log
    assert figures.attention_tflops("fp32", large * 10) == pytest.approx(0.05)
    assert figures.attention_tflops("fp32") == pytest.approx(0.05)  # no work given: the best rate
    slow = _step(cpu_rows() + list(figures.rows)[:1])
    fast = _step(cpu_rows() + list(figures.rows)[1:])
    assert slow.compute_s > fast.compute_s
