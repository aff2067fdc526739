"""Measured devices: what `tunecast probe` measured on a machine, as catalog rows with a date and a source.

Two files in the user's catalog directory, in the shape of the bundled CSV files:

* `devices.csv`: one row per probed device (a CUDA GPU model or a CPU): its name, kind, the host it was
  probed on, how many the host has, its memory and what PyTorch may use of it;
* `device_measurements.csv`: one row per measured figure: `quantity`, `dtype`, `shape`, `value`, `unit`.

The quantities (the probe's docstring says how each is measured):

* `matmul` (TFLOPS) of an (M × K) @ (K × N) product, shape `MxKxN`, per dtype;
* `attention` (TFLOPS) of causal scaled-dot-product attention forward + backward, shape `BxHxSxD` (small to
  large shapes: the rate of a call is interpolated by its work);
* `bandwidth` (GB/s) of a copy of `N` MiB (bytes read + bytes written);
* `elementwise` (µs per operation) of an eager `torch.add` of two tensors into a new one, shape the number of
  values (a CPU; a thousand to a million), per dtype;
* `random` (ns per element) of drawing dropout's random mask;
* `transcendental` (GB/s written) of exp/log/erf-like elementwise operations (GELU, softmax, log-softmax), per
  dtype: on a CPU their arithmetic, not memory, sets their pace;
* `op_overhead` (µs per operation) of an eager training step whose kernels are too small to matter, shape
  `full` or `lora` (transformers, and transformers + peft with its adapter hooks and casts);
* `optimizer` (ns per parameter) of one AdamW step over large tensors, shape `fused` or `foreach`, and
  `optimizer_tensor` (µs per tensor, same shapes) over many small ones;
* `bnb_4bit_call` (µs per call) and `bnb_4bit_dequantize` (ns per weight), shape `nf4`, per compute dtype, of
  a bitsandbytes 4-bit linear layer on a handful of tokens, where bitsandbytes is installed;
* from `tunecast probe --collectives` (plan/collectives.py says how): `all_reduce`, `all_gather` and
  `reduce_scatter` (µs per call), shape `NxS` (N processes, a message of S bytes: nccl-tests' size, the whole
  array), and their fit `collective_bus_bandwidth` (GB/s) and `collective_latency` (µs), shape `COLLECTIVE:N`:
  time = latency + S × the collective's bus factor ÷ bus bandwidth. A probe of N processes replaces the
  collective rows of N only; the device probe keeps them.

A device row whose name is a catalog GPU's alias lends its figures to that GPU; `--gpu local` is the device
probed on this host.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Literal

from pydantic import Field

from tunecast.catalog.gpus import LOCAL, Gpu, GpuIndex
from tunecast.catalog.rows import CatalogRow, parse_rows, write_rows
from tunecast.errors import TunecastError

DEVICES_FILE = "devices.csv"
MEASUREMENTS_FILE = "device_measurements.csv"

# `first_touch` (a CPU's cost of faulting fresh pages in) was measured by probes before the runner kept freed
# memory on a CPU (train/host_memory.py); rows of it in a user's catalog still load, and nothing reads them.
Quantity = Literal["matmul", "matmul_forward", "matmul_input_grad", "matmul_weight_grad", "attention", "bandwidth",
                   "elementwise", "random", "transcendental", "first_touch", "op_overhead", "optimizer",
                   "optimizer_tensor", "bnb_4bit_call", "bnb_4bit_dequantize", "all_reduce", "all_gather",
                   "reduce_scatter", "collective_bus_bandwidth", "collective_latency"]
# A Linear layer's three products: x·Wᵀ forward, g·W for the input gradient, gᵀ·x for the weight gradient.
PRODUCTS = ("forward", "input_grad", "weight_grad")
# The collectives `tunecast probe --collectives` times (their torch.distributed names, without `_tensor`), and the
# quantities of its rows.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
COLLECTIVE_QUANTITIES = (*COLLECTIVES, "collective_bus_bandwidth", "collective_latency")


class DeviceRow(CatalogRow):
    """One probed device. `slug` is the catalog GPU's slug when the device is one, else its own."""

    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    name: str
    kind: Literal["cuda", "cpu"]
    host: str
    count: int = Field(ge=1)
    """Devices of this kind on the host (CUDA GPUs; a CPU counts as one device)."""
    memory_gib: float = Field(gt=0)
    usable_memory_gib: float = Field(gt=0)
    """What PyTorch may use: CUDA `total_memory`; on a CPU the memory available when probed."""
    threads: int = Field(ge=1)
    """Threads PyTorch computed with (CPU intra-op threads; host threads for CUDA)."""
    torch_version: str


class MeasurementRow(CatalogRow):
    device: str
    quantity: Quantity
    dtype: str = ""
    shape: str = ""
    value: float = Field(gt=0)
    unit: str


DEVICE_COLUMNS = DeviceRow.columns()
MEASUREMENT_COLUMNS = MeasurementRow.columns()


@dataclass(frozen=True)
class MatmulPoint:
    tokens: int
    width: float  # √(K·N): the weight's size, the dimension that sets efficiency besides M
    tflops: float
    aspect: float = 1.0  # √(K·N) ÷ min(K, N): 1 for a square weight, 4 for a 128 × 8 adapter or a 1024 × 16384 head


@dataclass(frozen=True)
class MeasuredLink:
    """The link between `processes` devices of one machine as `tunecast probe --collectives` measured it: the
    slowest of its three collectives' fitted bus bandwidths and the longest of their latencies, so that no
    engine's collectives (DDP's all-reduce, ZeRO's and FSDP's all-gather and reduce-scatter) are planned faster
    than measured."""

    processes: int
    kind: str  # cuda (NCCL between GPUs) or cpu (gloo between processes)
    bus_gb_per_s: float
    latency_us: float
    as_of: date


def timing_shape(processes: int, size_bytes: int) -> str:
    """Shape of a collective's timing row: `NxS`."""
    return f"{processes}x{size_bytes}"


def fit_shape(collective: str, processes: int) -> str:
    """Shape of a collective's fitted rows: `COLLECTIVE:N`."""
    return f"{collective}:{processes}"


def collective_processes(row: MeasurementRow) -> int:
    """How many processes a collective row was measured on."""
    if row.quantity in COLLECTIVES:
        return int(row.shape.split("x", 1)[0])
    return int(row.shape.rsplit(":", 1)[1])


@dataclass(frozen=True)
class DeviceFigures:
    """A device's measured figures, looked up by what the throughput model asks."""

    device: DeviceRow
    rows: tuple[MeasurementRow, ...]

    def value(self, quantity: str, shape: str = "", dtype: str = "") -> float | None:
        for row in self.rows:
            if row.quantity == quantity and row.shape == shape and (not dtype or row.dtype == dtype):
                return row.value
        return None

    def has(self, quantity: str) -> bool:
        return any(row.quantity == quantity for row in self.rows)

    def _points(self, quantity: str, dtype: str) -> list[MatmulPoint]:
        points = []
        for row in self.rows:
            if row.quantity == quantity and row.dtype == dtype:
                m, k, n = (int(part) for part in row.shape.split("x"))
                points.append(MatmulPoint(m, math.sqrt(k * n), row.value, math.sqrt(k * n) / min(k, n)))
        return points

    def collective_counts(self) -> list[int]:
        """The process counts `tunecast probe --collectives` measured on this device, ascending."""
        return sorted({collective_processes(row) for row in self.rows if row.quantity == "collective_bus_bandwidth"})

    def measured_link(self, count: int) -> MeasuredLink | None:
        """The link of `count` devices as measured: on the fewest measured that are at least `count` (the devices
        of a smaller run are a subset of the measured ones and share their links; bus bandwidth is nccl-tests'
        figure that compares across counts). None when no probe measured that many: more devices than measured may
        cross links the probe never used (a third GPU off an NVLink pair goes through PCIe)."""
        counts = [measured for measured in self.collective_counts() if measured >= count]
        if not counts:
            return None
        shapes = [fit_shape(collective, counts[0]) for collective in COLLECTIVES]
        fitted = [row for row in self.rows if row.quantity in ("collective_bus_bandwidth", "collective_latency")
                  and row.shape in shapes]
        bus = [row.value for row in fitted if row.quantity == "collective_bus_bandwidth"]
        latency = [row.value for row in fitted if row.quantity == "collective_latency"]
        if len(bus) != len(COLLECTIVES) or len(latency) != len(COLLECTIVES):
            return None  # a hand-edited table missing a collective: not a measurement of all three
        return MeasuredLink(counts[0], self.device.kind, min(bus), max(latency), min(row.as_of for row in fitted))

    def dtypes(self, quantity: str = "matmul") -> set[str]:
        return {row.dtype for row in self.rows if row.quantity == quantity}

    def matmul_tflops(self, dtype: str, tokens: float, inputs: int, outputs: int,
                      product: str | None = None) -> float | None:
        """Measured rate of a (tokens × inputs) @ (inputs × outputs) product: interpolated in log(tokens) and
        log(width) between the probed shapes, held at the nearest probed shape beyond them. `product` (one of
        PRODUCTS) asks for that product's own rate where the probe timed it; None, the three together.

        The width is √(K·N), but no more than the probed shapes' largest aspect times the weight's narrow side: a
        narrower weight (a LoRA adapter: 352 × 8 is no 53-wide square, its 8 columns set its rate) is placed as the
        probed shape of its narrow side would be."""
        points = self._points(f"matmul_{product}", dtype) if product else []
        points = points or self._points("matmul", dtype)
        if not points:
            return None
        aspect = max(point.aspect for point in points)
        return _interpolate(points, tokens, min(math.sqrt(inputs * outputs), aspect * min(inputs, outputs)))

    def elementwise_seconds(self, dtype: str, moved_bytes: float) -> float | None:
        """Seconds an eager elementwise operation moving `moved_bytes` takes beyond the smallest one probed (whose
        cost the host overhead per operation holds): the probed `torch.add` of as many bytes (three tensors),
        interpolated in log-log between the probed sizes, growing with the bytes beyond the largest. None when
        the probe timed none in this dtype."""
        element = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype, 4)
        points = sorted((3.0 * element * int(row.shape), row.value * 1e-6) for row in self.rows
                        if row.quantity == "elementwise" and row.dtype == dtype)
        if len(points) < 2:
            return None
        smallest = points[0][1]
        if moved_bytes <= points[0][0]:
            return 0.0
        if moved_bytes >= points[-1][0]:
            return max(0.0, points[-1][1] * moved_bytes / points[-1][0] - smallest)
        for (b0, t0), (b1, t1) in itertools.pairwise(points):
            if b0 <= moved_bytes <= b1:
                share = (math.log(moved_bytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
                return max(0.0, math.exp(math.log(t0) + (math.log(t1) - math.log(t0)) * share) - smallest)
        raise AssertionError("unreachable: moved_bytes lies within the points")

    def attention_tflops(self, dtype: str, flops: float | None = None) -> float | None:
        """Measured rate of causal attention (forward and backward) of `flops` FLOPs a call: interpolated in
        log(FLOPs) between the probed shapes, held beyond the largest; below the smallest, falling as it falls
        between the two smallest (a call's fixed costs weigh more the less it computes); the best probed rate
        when `flops` is not given."""
        points = sorted((_attention_flops(row.shape), row.value) for row in self.rows
                        if row.quantity == "attention" and row.dtype == dtype)
        if not points:
            return None
        if flops is None:
            return max(rate for _, rate in points)
        if flops <= points[0][0]:
            if len(points) < 2 or points[1][1] <= points[0][1] or points[1][0] <= points[0][0]:
                return points[0][1]
            slope = math.log(points[1][1] / points[0][1]) / math.log(points[1][0] / points[0][0])
            return float(points[0][1] * (flops / points[0][0]) ** slope)
        if flops >= points[-1][0]:
            return points[-1][1]
        for (f0, r0), (f1, r1) in itertools.pairwise(points):
            if f0 <= flops <= f1:
                share = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0)) if f1 > f0 else 0.0
                return r0 + (r1 - r0) * share
        raise AssertionError("unreachable: flops lies within the points")


def _attention_flops(shape: str) -> float:
    """FLOPs of one probed attention call, shape `BxHxSxD`: 7·B·H·S²·D (forward and backward, causal)."""
    batch, heads, seq, size = (int(part) for part in shape.split("x"))
    return 7.0 * batch * heads * seq * seq * size


def _interpolate(points: list[MatmulPoint], tokens: float, width: float) -> float:
    widths = sorted({p.width for p in points})

    lines = {w: sorted((p.tokens, p.tflops) for p in points if p.width == w) for w in widths}

    def along_tokens(w: float) -> float:
        line = lines[w]
        last = line[-1][0]
        longer = [other for other in widths if lines[other][-1][0] > last]
        if tokens <= last or not longer:
            return _log_interp(line, tokens)
        # beyond the largest token count probed at this width (a wide one, timed at fewer tokens to keep the
        # probe short): the rate grows from there as it does at the nearest width probed further
        guide = lines[min(longer, key=lambda other: abs(math.log(other / w)))]
        return line[-1][1] * _log_interp(guide, tokens) / _log_interp(guide, last)

    if width <= widths[0] or len(widths) == 1:
        return along_tokens(widths[0])
    if width >= widths[-1]:
        return along_tokens(widths[-1])
    upper = next(w for w in widths if w >= width)
    lower = max(w for w in widths if w < width)
    share = (math.log(width) - math.log(lower)) / (math.log(upper) - math.log(lower))
    return along_tokens(lower) * (1 - share) + along_tokens(upper) * share


def _log_interp(line: list[tuple[int, float]], x: float) -> float:
    if x <= line[0][0]:
        # below the smallest probed size, a matmul's time stops shrinking with its work: the rate falls with it
        return line[0][1] * max(x, 1) / line[0][0]
    if x >= line[-1][0]:
        return line[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(line):
        if x0 <= x <= x1:
            share = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + (y1 - y0) * share
    raise AssertionError("unreachable: x lies within the line")


def this_host() -> str:
    import socket  # here: most commands never ask for the host name

    return socket.gethostname() or "localhost"


def read_devices(directory: Path | None) -> tuple[list[DeviceRow], list[MeasurementRow]]:
    """The probed devices of a catalog directory (none when it has no devices file)."""
    if directory is None or not (directory / DEVICES_FILE).is_file():
        return [], []
    devices = parse_rows((directory / DEVICES_FILE).read_text(encoding="utf-8"), DeviceRow,
                         str(directory / DEVICES_FILE))
    path = directory / MEASUREMENTS_FILE
    rows = parse_rows(path.read_text(encoding="utf-8"), MeasurementRow, str(path)) if path.is_file() else []
    return devices, rows


def merge_device(directory: Path, device: DeviceRow, rows: Iterable[MeasurementRow]) -> None:
    """Add a probe to the catalog directory, replacing an earlier probe of the same device on the same host."""
    devices, measurements = read_devices(directory)
    devices = [d for d in devices if (d.slug, d.host) != (device.slug, device.host)] + [device]
    keep = {d.slug for d in devices if d.slug != device.slug}
    # the collectives were measured apart (`tunecast probe --collectives`): a new device probe keeps them
    measurements = [m for m in measurements if m.device in keep or (m.device == device.slug and
                                                                    m.quantity in COLLECTIVE_QUANTITIES)]
    _write_devices(directory, devices, measurements + list(rows))


def merge_collectives(directory: Path, device: DeviceRow, processes: int, rows: Iterable[MeasurementRow]) -> None:
    """Add a collective probe of `processes` processes to the catalog directory: it replaces the collective rows
    of an earlier one of as many processes on the device, and keeps everything else; the device's row is added
    when no probe of it on this host is there yet."""
    devices, measurements = read_devices(directory)
    if not any((d.slug, d.host) == (device.slug, device.host) for d in devices):
        devices.append(device)
    measurements = [m for m in measurements if not (m.device == device.slug and m.quantity in COLLECTIVE_QUANTITIES
                                                    and collective_processes(m) == processes)]
    _write_devices(directory, devices, measurements + list(rows))


def _write_devices(directory: Path, devices: list[DeviceRow], measurements: list[MeasurementRow]) -> None:
    from tunecast.atomic import write_text_atomic

    write_text_atomic(directory / DEVICES_FILE, write_rows(devices, DEVICE_COLUMNS))
    write_text_atomic(directory / MEASUREMENTS_FILE, write_rows(measurements, MEASUREMENT_COLUMNS))


def figures_by_slug(devices: list[DeviceRow], rows: list[MeasurementRow]) -> dict[str, DeviceFigures]:
    """Each device's figures (the newest probe of a slug wins)."""
    newest: dict[str, DeviceRow] = {}
    for device in devices:
        if device.slug not in newest or device.as_of >= newest[device.slug].as_of:
            newest[device.slug] = device
    return {slug: DeviceFigures(device, tuple(r for r in rows if r.device == slug))
            for slug, device in newest.items()}


def device_slug(name: str, kind: str, gpus: GpuIndex) -> str:
    """The catalog GPU's slug when `name` is one of its aliases; else a slug made from the name."""
    if kind == "cuda":
        gpu = gpus.find(name)
        if gpu is not None:
            return gpu.slug
    stem = "-".join(part for part in _words(name.split(" (")[0]) if part)
    return f"{kind}-{stem}"[:40].strip("-")


def _words(name: str) -> list[str]:
    cleaned = "".join(c if c.isalnum() else " " for c in name.lower())
    noise = {"r", "tm", "processor", "cpu", "with", "graphics", "intel", "amd", "nvidia", "geforce", "core"}
    return [word for word in cleaned.split() if word not in noise]


def is_cpu(gpu: Gpu) -> bool:
    """A probed CPU, planned on as a device (`--gpu local` on a machine without a GPU)."""
    return gpu.measured is not None and gpu.measured.device.kind == "cpu"


def from_probe(gpu: Gpu) -> bool:
    """A row built from a probe alone (a CPU, a GPU the catalog does not list), not a catalog GPU's."""
    return gpu.measured is not None and gpu.architecture == gpu.measured.device.kind


def with_measured(gpus: dict[str, Gpu], directory: Path | None) -> dict[str, Gpu]:
    """`gpus` with the probed devices of `directory`: a catalog GPU carries its measured figures; a device the
    catalog does not list becomes a row of its own. The device probed on this host (its GPU, when it has both)
    also answers to `local`."""
    devices, rows = read_devices(directory)
    if not devices:
        return gpus
    figures = figures_by_slug(devices, rows)
    # a device the catalog does not list whose collectives alone were measured (`tunecast probe --collectives`)
    # has nothing to plan its computation on until `tunecast probe` measures it
    plannable = {slug: found for slug, found in figures.items()
                 if found.has("matmul") or (found.device.kind == "cuda" and slug in gpus)}
    here = [f for f in plannable.values() if f.device.host == this_host()]
    local = max(here, key=lambda f: (f.device.kind == "cuda", f.device.as_of)) if here else None
    merged = dict(gpus)
    for slug, found in plannable.items():
        catalog_gpu = gpus.get(slug) if found.device.kind == "cuda" else None
        merged[slug] = as_gpu(found, catalog_gpu, local=found is local)
    return merged


def as_gpu(figures: DeviceFigures, catalog_gpu: Gpu | None, *, local: bool = False) -> Gpu:
    """The row the planner and the memory fit use for a measured device: the catalog GPU's own row (its
    specifications, interconnect and price) with the measured figures attached, or for a device the
    catalog does not know (a CPU, an unlisted GPU) a row built from what the probe measured."""
    device = figures.device
    aliases = (LOCAL,) if local else ()
    if catalog_gpu is not None:
        return catalog_gpu.model_copy(update={"measured": figures, "usable_memory_gib": device.usable_memory_gib,
                                              "aliases": catalog_gpu.aliases + aliases})
    best = max((row.value for row in figures.rows if row.quantity == "matmul"), default=None)
    bandwidth = figures.value("bandwidth", _largest_shape(figures, "bandwidth"))
    if best is None or bandwidth is None:
        raise TunecastError(f"the probe of {device.name} lacks matmul or bandwidth figures", field="--gpu",
                            hint="run `tunecast probe` again")
    return Gpu(slug=device.slug, name=device.name, vendor="cpu" if device.kind == "cpu" else "nvidia",
               architecture=device.kind, aliases=aliases, memory_gib=device.memory_gib,
               usable_memory_gib=min(device.usable_memory_gib, device.memory_gib),
               bf16_tflops=best, matmul_efficiency=1.0, memory_bandwidth_gb_per_s=bandwidth,
               interconnect="none" if device.kind == "cpu" else "pcie", interconnect_gb_per_s=16.0, pcie_gen=4,
               tdp_w=1.0, as_of=device.as_of, source=device.source, notes="measured by tunecast probe",
               measured=figures)


def _largest_shape(figures: DeviceFigures, quantity: str) -> str:
    shapes = [row.shape for row in figures.rows if row.quantity == quantity]
    return max(shapes, key=lambda s: float(s.removesuffix("MiB")), default="")

