"""The collective probe's arithmetic (nccl-tests' bus bandwidth, the latency + bytes ÷ bandwidth fit), its rows in
the user catalog, and the plan's link from them — on hand-made timings, against hand-computed figures."""

from __future__ import annotations

import pytest
from tests.unit.catalog.test_devices import cpu_rows, device

from tunecast.catalog.devices import (
    COLLECTIVES,
    DeviceFigures,
    MeasurementRow,
    as_gpu,
    merge_collectives,
    merge_device,
    read_devices,
)
from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.plan.collectives import Timing, bus_factor, fit, measurement_rows
from tunecast.plan.planner import device_counts
from tunecast.plan.throughput import _Rates, collective_link


def test_bus_bandwidth_is_nccl_tests_conversion() -> None:
    # 1 GB in 10 ms on 4 GPUs: algbw 100 GB/s; a ring all-reduce moves 2·3/4 of it over each link, the others 3/4
    timings = {c: Timing(c, 10**9, 0.01, 4) for c in COLLECTIVES}
    assert [t.algbw_gb_per_s for t in timings.values()] == pytest.approx([100.0] * 3)
    assert timings["all_reduce"].busbw_gb_per_s == pytest.approx(150.0)
    assert timings["all_gather"].busbw_gb_per_s == pytest.approx(75.0)
    assert timings["reduce_scatter"].busbw_gb_per_s == pytest.approx(75.0)
    # on 2 GPUs an all-reduce's bus bandwidth is its algorithm bandwidth; on 8, 7/4 of it
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_gather", 2) == 0.5
    assert bus_factor("all_reduce", 8) == 1.75 and bus_factor("reduce_scatter", 8) == 0.875


def test_the_fit_recovers_latency_and_bus_bandwidth() -> None:
    # all-gather on 4 GPUs over a 20 GB/s bus with 30 µs a call: t = 30e-6 + S·3/4 / 20e9
    sizes = (4096, 65536, 2**20, 2**24)
    timings = [Timing("all_gather", s, 30e-6 + s * 0.75 / 20e9, 4) for s in sizes]
    fitted = fit(timings)
    assert fitted.latency_s == pytest.approx(30e-6, rel=1e-9)
    assert fitted.bus_bytes_per_s == pytest.approx(20e9, rel=1e-9)
    # each size's own busbw is below the asymptote, the largest closest to it
    assert timings[-1].busbw_gb_per_s < 20 and timings[-1].busbw_gb_per_s > 19


def test_a_small_message_timed_slower_than_a_larger_one_counts_as_the_larger() -> None:
    exact = [Timing("all_reduce", s, 50e-6 + s / 5e9, 2) for s in (4096, 65536, 2**20, 2**23)]
    # another process slowed the 64 KiB rounds past the 1 MiB ones: taken at the 1 MiB time, not 10×
    noisy = [exact[0], Timing("all_reduce", 65536, 10 * exact[2].seconds, 2), exact[2], exact[3]]
    fitted, clean = fit(noisy), fit(exact)
    assert clean.latency_s == pytest.approx(50e-6) and clean.bus_bytes_per_s == pytest.approx(5e9)
    assert fitted.bus_bytes_per_s == pytest.approx(5e9, rel=0.05)  # the large sizes still set the bandwidth
    assert 50e-6 < fitted.latency_s < exact[2].seconds


def test_times_that_do_not_grow_with_size_are_refused() -> None:
    flat = [Timing("all_reduce", s, t, 2) for s, t in ((4096, 1e-3), (2**20, 5e-4))]
    with pytest.raises(TunecastError, match="do not grow as latency"):
        fit(flat)
    with pytest.raises(TunecastError, match="a fit needs two"):
        fit(flat[:1])


def _probe_rows(slug: str, processes: int, bus: float = 2.0, latency_us: float = 100.0) -> list[MeasurementRow]:
    probed = device(slug)
    timings = [Timing(c, s, latency_us * 1e-6 + s * bus_factor(c, processes) / (bus * 1e9), processes)
               for c in COLLECTIVES for s in (4096, 2**20)]
    fits = [fit([t for t in timings if t.collective == c]) for c in COLLECTIVES]
    return measurement_rows(probed, processes, "gloo", timings, fits)


def test_collective_rows_survive_a_device_probe_and_replace_only_their_count(tmp_path) -> None:
    merge_device(tmp_path, device(), cpu_rows())
    merge_collectives(tmp_path, device(), 2, _probe_rows("cpu-test", 2))
    merge_collectives(tmp_path, device(), 4, _probe_rows("cpu-test", 4))
    merge_device(tmp_path, device(), cpu_rows())  # probing the device again keeps the collectives
    merge_collectives(tmp_path, device(), 2, _probe_rows("cpu-test", 2, bus=3.0))  # a new probe of 2 replaces 2's
    devices, rows = read_devices(tmp_path)
    assert len(devices) == 1 and len([r for r in rows if r.quantity == "matmul"]) == 4
    figures = DeviceFigures(devices[0], tuple(rows))
    assert figures.collective_counts() == [2, 4]
    two = figures.measured_link(2)
    assert two is not None and two.bus_gb_per_s == pytest.approx(3.0, rel=1e-4)
    assert two.latency_us == pytest.approx(100.0, rel=1e-4)


def test_the_link_is_the_slowest_collective_on_as_many_devices_or_more() -> None:
    rows = cpu_rows() + _probe_rows("cpu-test", 4, bus=2.0, latency_us=100.0)
    # all-gather's fit made slower and longer by hand: the link takes its bandwidth and latency
    rows = [r.model_copy(update={"value": 1.5}) if (r.quantity, r.shape) == ("collective_bus_bandwidth",
                                                                             "all_gather:4") else r for r in rows]
    rows = [r.model_copy(update={"value": 250.0}) if (r.quantity, r.shape) == ("collective_latency",
                                                                               "reduce_scatter:4") else r
            for r in rows]
    figures = DeviceFigures(device(), tuple(rows))
    measured = figures.measured_link(2)
    assert measured is not None and measured.processes == 4
    assert (measured.bus_gb_per_s, measured.latency_us) == (1.5, 250.0)
    assert figures.measured_link(8) is None  # more devices than measured: links the probe never used

    constants = load_catalog(None).throughput
    gpu = as_gpu(figures, None)
    link = collective_link(gpu, 2, constants)
    assert link.name.startswith("measured by tunecast probe on 4 CPU processes (gloo") and "planned on 2" in link.name
    assert (link.bus_bytes_per_s, link.latency_s) == pytest.approx((1.5e9, 250e-6))
    # the plan names a CPU's measured count only when the run fixes it (`--gpus 4`); else the machine's one device
    assert device_counts(gpu, [4], fixed=True) == [4]
    assert device_counts(gpu, [2], fixed=True) == [1]
    assert device_counts(gpu, [1, 2, 4, 8]) == [1]


def test_a_catalog_gpu_with_measured_collectives_keeps_its_datasheet_compute(catalog) -> None:
    gpus = catalog.gpus
    h100 = gpus.get("h100-sxm")
    figures = DeviceFigures(device("h100-sxm", kind="cuda", count=2), tuple(_probe_rows("h100-sxm", 2, bus=300.0)))
    measured = as_gpu(figures, h100)
    constants = catalog.throughput
    link = collective_link(measured, 2, constants)
    assert link.name.startswith("measured by tunecast probe on 2 GPUs (nccl")
    assert link.bus_bytes_per_s == pytest.approx(300e9, rel=1e-4)
    # four GPUs were not measured: the catalog's NVLink at NCCL's efficiency, as without a probe
    assert collective_link(measured, 4, constants) == collective_link(h100, 4, constants)
    assert device_counts(measured, [1, 2, 4, 8]) == [1, 2, 4, 8]  # a catalog GPU: every count
    spec = RunSpec.model_validate({"model": "x", "method": "lora", "precision": "bf16-mixed"})
    assert _Rates.of(spec, measured, constants) == _Rates.of(spec, h100, constants)  # no matmul probed: datasheet


def test_collectives_alone_leave_the_catalog_usable_and_local_unprobed(tmp_path) -> None:
    merge_collectives(tmp_path, device(), 2, _probe_rows("cpu-test", 2))
    gpus = load_catalog(tmp_path).gpus  # a CPU without matmul figures is no row to plan on, and no error
    assert gpus.find("local") is None and gpus.find("cpu-test") is None
    with pytest.raises(TunecastError, match="unknown GPU 'local'"):
        gpus.get("local")
    merge_device(tmp_path, device(), cpu_rows())  # the device probe afterwards: local, with its collectives
    load_catalog.cache_clear()
    local = load_catalog(tmp_path).gpus.get("local")
    assert local.measured.collective_counts() == [2]
