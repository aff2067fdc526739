"""Probed devices as catalog rows: lookups between measured shapes, the user catalog round trip, `local`."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import pytest

from tunecast.catalog.devices import (
    LOCAL,
    DeviceFigures,
    DeviceRow,
    MeasurementRow,
    as_gpu,
    device_slug,
    figures_by_slug,
    from_probe,
    is_cpu,
    merge_device,
    read_devices,
    this_host,
)
from tunecast.catalog.store import load_catalog

WHEN = date(2026, 12, 1)


def device(slug: str = "cpu-test", kind: str = "cpu", host: str | None = None, **changes: object) -> DeviceRow:
    values = {"slug": slug, "name": "Test CPU (2 cores)", "kind": kind, "host": host or this_host(), "count": 1,
              "memory_gib": 16.0, "usable_memory_gib": 12.0, "threads": 2, "torch_version": "2.13.0",
              "as_of": WHEN, "source": "tunecast probe on test"}
    values.update(changes)
    return DeviceRow.model_validate(values)


def row(slug: str, quantity: str, value: float, *, dtype: str = "", shape: str = "", unit: str = "x") -> MeasurementRow:
    return MeasurementRow.model_validate({"device": slug, "quantity": quantity, "dtype": dtype, "shape": shape,
                                          "value": value, "unit": unit, "as_of": WHEN, "source": "test"})


def cpu_rows(slug: str = "cpu-test") -> list[MeasurementRow]:
    return [row(slug, "matmul", 0.01, dtype="fp32", shape="64x512x512"),
            row(slug, "matmul", 0.04, dtype="fp32", shape="1024x512x512"),
            row(slug, "matmul", 0.02, dtype="fp32", shape="64x2048x2048"),
            row(slug, "matmul", 0.08, dtype="fp32", shape="1024x2048x2048"),
            row(slug, "bandwidth", 30.0, shape="4MiB"), row(slug, "bandwidth", 20.0, shape="512MiB"),
            row(slug, "op_overhead", 40.0, shape="full"), row(slug, "op_overhead", 50.0, shape="lora"),
            row(slug, "optimizer", 1.0, dtype="fp32", shape="fused"),
            row(slug, "optimizer_tensor", 20.0, dtype="fp32", shape="fused")]


def test_matmul_rate_interpolates_between_probed_shapes() -> None:
    figures = DeviceFigures(device(), tuple(cpu_rows()))
    assert figures.matmul_tflops("fp32", 64, 512, 512) == pytest.approx(0.01)
    assert figures.matmul_tflops("fp32", 1024, 2048, 2048) == pytest.approx(0.08)
    # halfway in log(tokens) at the smaller width: halfway between its rates
    assert figures.matmul_tflops("fp32", 256, 512, 512) == pytest.approx(0.025)
    # a width between the probed ones: between the two widths' rates at that token count
    between = figures.matmul_tflops("fp32", 1024, 1024, 1024)
    assert 0.04 < between < 0.08
    # beyond the largest probed shape the rate holds; below the smallest token count it falls with the work
    assert figures.matmul_tflops("fp32", 8192, 8192, 8192) == pytest.approx(0.08)
    assert figures.matmul_tflops("fp32", 16, 512, 512) == pytest.approx(0.01 * 16 / 64)
    assert figures.matmul_tflops("bf16", 64, 512, 512) is None  # not measured in that dtype


def test_a_wide_shape_probed_at_few_token_counts_grows_as_its_neighbour_does() -> None:
    head = [row("cpu-test", "matmul", 0.005, dtype="fp32", shape="16x1024x32768"),
            row("cpu-test", "matmul", 0.02, dtype="fp32", shape="64x1024x32768")]
    figures = DeviceFigures(device(), tuple(cpu_rows() + head))
    assert figures.matmul_tflops("fp32", 64, 1024, 32768) == pytest.approx(0.02)
    # beyond 64 tokens the 2048² line (the nearest width probed further) grows 4× up to 1024 tokens
    assert figures.matmul_tflops("fp32", 1024, 1024, 32768) == pytest.approx(0.02 * 0.08 / 0.02)


def test_each_product_has_its_own_rate_where_probed() -> None:
    products = [row("cpu-test", "matmul_forward", 0.06, dtype="fp32", shape="1024x512x512"),
                row("cpu-test", "matmul_weight_grad", 0.02, dtype="fp32", shape="1024x512x512")]
    figures = DeviceFigures(device(), tuple(cpu_rows() + products))
    assert figures.matmul_tflops("fp32", 1024, 512, 512, "forward") == pytest.approx(0.06)
    assert figures.matmul_tflops("fp32", 1024, 512, 512, "weight_grad") == pytest.approx(0.02)
    # a product the probe did not time: the three together
    assert figures.matmul_tflops("fp32", 1024, 512, 512, "input_grad") == pytest.approx(0.04)


def test_probes_round_trip_through_the_user_catalog(tmp_path: Path) -> None:
    merge_device(tmp_path, device(), cpu_rows())
    merge_device(tmp_path, device(memory_gib=32.0), cpu_rows()[:3])  # probed again: replaces the first
    devices, rows = read_devices(tmp_path)
    assert [d.memory_gib for d in devices] == [32.0] and len(rows) == 3
    merge_device(tmp_path, device("cpu-other"), cpu_rows("cpu-other"))
    devices, rows = read_devices(tmp_path)
    assert {d.slug for d in devices} == {"cpu-test", "cpu-other"} and len(rows) == 3 + len(cpu_rows())


def test_this_hosts_device_is_local_and_a_cpu_gets_a_row_of_its_own(tmp_path: Path) -> None:
    merge_device(tmp_path, device(), cpu_rows())
    catalog = load_catalog(tmp_path)
    local = catalog.gpus.get(LOCAL)
    assert local.slug == "cpu-test" and is_cpu(local) and from_probe(local)
    assert local.usable_memory_gib == 12.0 and local.memory_bandwidth_gb_per_s == 20.0
    assert local.measured.value("op_overhead", "lora") == 50.0


def test_a_probed_catalog_gpu_keeps_its_row_with_the_figures(tmp_path: Path) -> None:
    gpus = load_catalog(None).gpus
    slug = device_slug("NVIDIA H200", "cuda", gpus)
    assert slug == "h200"
    merge_device(tmp_path, device(slug, kind="cuda", name="NVIDIA H200", usable_memory_gib=139.8),
                 cpu_rows(slug))
    merge_device(tmp_path, device("cpu-other"), cpu_rows("cpu-other"))
    catalog = load_catalog(tmp_path)
    h200 = catalog.gpus.get("h200")
    assert h200.measured is not None and not from_probe(h200) and h200.bf16_tflops == 989
    assert catalog.gpus.get(LOCAL).slug == "h200"  # the GPU, when a host has both


def test_another_hosts_probe_is_not_local(tmp_path: Path) -> None:
    merge_device(tmp_path, device(host="elsewhere"), cpu_rows())
    catalog = load_catalog(tmp_path)
    assert catalog.gpus.find(LOCAL) is None and catalog.gpus.find("cpu-test") is not None


def test_a_probe_without_the_figures_a_row_needs_is_an_error() -> None:
    figures = figures_by_slug([device()], [row("cpu-test", "op_overhead", 40.0, shape="full")])["cpu-test"]
    with pytest.raises(Exception, match="lacks matmul or bandwidth"):
        as_gpu(figures, None)
