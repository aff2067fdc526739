"""The collective probe (`tunecast probe --collectives`): how fast this machine's GPUs — or N processes on its
CPU — move a training step's collectives between them, measured, for the plan's `Link` in place of the catalog's
interconnect × efficiency.

What is measured, and how:

* N worker processes (`python -m tunecast.plan.collective_worker`), one per GPU (N processes sharing the CPU
  with `--device cpu`, each an even share of its cores), with torchrun's rank variables and a rendezvous on a
  free loopback port; each joins a torch.distributed process group (NCCL on CUDA, gloo on the CPU) with a
  timeout, so that a rank that never arrives or stops answering fails the others instead of hanging them; the
  whole probe has a time limit too, after which every worker is stopped;
* all-reduce, all-gather (`all_gather_into_tensor`) and reduce-scatter (`reduce_scatter_tensor`) of fp32
  tensors, each at message sizes from a few KiB, where the fixed cost of a call dominates, to the largest
  (8 MiB on a CPU, a GiB on GPUs), where the bandwidth does; S is nccl-tests' size: the whole array (all-reduce's
  buffer, all-gather's output, reduce-scatter's input);
* per size: a call to set up, a timed warm-up call, then seven rounds of back-to-back calls (at least 20 ms on a
  CPU, 5 ms on CUDA; CUDA synchronized before and after), every rank starting each round together; the median
  round's time per call, the slowest rank's (a collective ends when its last rank does). A size whose warm-up
  call takes over half a second ends that collective's sweep;
* nccl-tests' bandwidths (doc/PERFORMANCE.md): algbw = S ÷ t; busbw = algbw × 2(n−1)/n for all-reduce and
  × (n−1)/n for all-gather and reduce-scatter — the bytes each device's link carries in a ring, the figure that
  compares to the link whatever n;
* the fit per collective: t = latency + S × factor ÷ bus bandwidth, the `Link`'s own formula
  (plan/throughput.py: a fixed time per collective plus its bus bytes), by least squares on relative errors so
  that the smallest sizes (the latency) weigh as much as the largest (the bandwidth), each time capped at the
  time of any larger message (`fit`).

What is saved: each time and each fit, as rows of the device in the user catalog (catalog/devices.py:
`all_reduce`, `all_gather`, `reduce_scatter`, `collective_bus_bandwidth`, `collective_latency`). What the plan
makes of them: `DeviceFigures.measured_link` (the slowest collective's bus bandwidth, the longest latency, for
runs of as many devices as were measured or fewer).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tunecast.catalog.devices import (
    COLLECTIVES,
    DeviceRow,
    MeasuredLink,
    MeasurementRow,
    fit_shape,
    timing_shape,
)
from tunecast.catalog.gpus import GpuIndex
from tunecast.errors import TunecastError

# Message sizes, bytes (each rounded down to whole fp32 values per process). On a CPU, small ones: gloo moves a
# few GB/s through memory and the probe stays a few seconds; on GPUs up to 1 GiB, where NCCL's bus bandwidth levels
# off on NVLink (docs/research/collective-bandwidth.md: 16 MiB reaches about half of it).
SIZES = {"cpu": (4 * 2**10, 64 * 2**10, 2**20, 8 * 2**20),
         "cuda": (8 * 2**10, 128 * 2**10, 2 * 2**20, 32 * 2**20, 256 * 2**20, 2**30)}
TIMEOUT_S = 120.0  # the whole probe, workers' start-up included; a worker joining or in one collective: half of it
WORKER = (sys.executable, "-m", "tunecast.plan.collective_worker")
POLL_S = 0.05


def bus_factor(collective: str, processes: int) -> float:
    """nccl-tests' busbw ÷ algbw: 2(n−1)/n for all-reduce (a reduce-scatter then an all-gather), (n−1)/n for
    all-gather and reduce-scatter (each device's link carries all shards but its own)."""
    ring = (processes - 1) / processes
    return 2 * ring if collective == "all_reduce" else ring


@dataclass(frozen=True)
class Timing:
    """One collective at one message size: seconds per call."""

    collective: str
    size_bytes: int
    seconds: float
    processes: int

    @property
    def algbw_gb_per_s(self) -> float:
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw_gb_per_s(self) -> float:
        return self.algbw_gb_per_s * bus_factor(self.collective, self.processes)

    def document(self) -> dict[str, object]:
        return {"collective": self.collective, "bytes": self.size_bytes, "time_us": round(self.seconds * 1e6, 2),
                "algbw_gb_per_s": round(self.algbw_gb_per_s, 4), "busbw_gb_per_s": round(self.busbw_gb_per_s, 4)}


@dataclass(frozen=True)
class Fit:
    """t = latency + S × factor ÷ bus bandwidth, for one collective."""

    collective: str
    latency_s: float
    bus_bytes_per_s: float

    def document(self) -> dict[str, object]:
        return {"collective": self.collective, "latency_us": round(self.latency_s * 1e6, 2),
                "bus_gb_per_s": round(self.bus_bytes_per_s / 1e9, 4)}


def fit(timings: Sequence[Timing]) -> Fit:
    """Latency and bus bandwidth of one collective's timings: weighted least squares of t = a + b·x over the bus
    bytes x = S × factor, each point weighted 1/t² (its relative error counts), so that a 4 KiB call's fixed cost
    is not lost in an 8 MiB call's milliseconds. Bus bandwidth = 1/b.

    Each time is first taken as no more than any larger message's: a smaller message does not take longer to move
    than a larger one over the same link, so a size timed slower than a larger one was slowed by something else
    (another process on a shared machine), and its excess would tilt the line."""
    collective = timings[0].collective
    ordered = sorted(timings, key=lambda t: t.size_bytes)
    points = [(t.size_bytes * bus_factor(t.collective, t.processes), min(u.seconds for u in ordered[i:]))
              for i, t in enumerate(ordered)]
    if len({x for x, _ in points}) < 2:
        raise TunecastError(f"the {collective} probe timed {len(points)} message size(s); a fit needs two",
                            field="--collectives", hint="run it again on an idle machine")
    weights = [1 / t**2 for _, t in points]
    sw = sum(weights)
    sx = sum(w * x for w, (x, _) in zip(weights, points, strict=True))
    sxx = sum(w * x * x for w, (x, _) in zip(weights, points, strict=True))
    st = sum(w * t for w, (_, t) in zip(weights, points, strict=True))
    sxt = sum(w * x * t for w, (x, t) in zip(weights, points, strict=True))
    determinant = sw * sxx - sx * sx
    latency = (sxx * st - sx * sxt) / determinant
    per_byte = (sw * sxt - sx * st) / determinant
    if latency <= 0 or per_byte <= 0:
        shown = ", ".join(f"{t.size_bytes:,} B in {t.seconds * 1e6:,.0f} µs" for t in timings)
        raise TunecastError(f"the {collective} times do not grow as latency + bytes ÷ bandwidth ({shown})",
                            field="--collectives",
                            hint="another process was busy during the probe: run it again on an idle machine")
    return Fit(collective, latency, 1 / per_byte)


@dataclass(frozen=True)
class CollectiveProbeResult:
    device: DeviceRow  # the device the rows belong to
    processes: int
    backend: str
    timings: list[Timing]
    fits: list[Fit]
    measurements: list[MeasurementRow]
    seconds: float

    @property
    def link(self) -> MeasuredLink:
        """What a plan of this many devices (or fewer) goes over: `DeviceFigures.measured_link` of these rows."""
        slowest = min(self.fits, key=lambda f: f.bus_bytes_per_s)
        longest = max(self.fits, key=lambda f: f.latency_s)
        return MeasuredLink(self.processes, self.device.kind, slowest.bus_bytes_per_s / 1e9,
                            longest.latency_s * 1e6, self.device.as_of)


def measurement_rows(device: DeviceRow, processes: int, backend: str, timings: Sequence[Timing],
                     fits: Sequence[Fit]) -> list[MeasurementRow]:
    """The probe's times and fits as rows of `device` (rounded to six significant digits, as the device probe's)."""
    rows = []

    def add(quantity: str, shape: str, value: float, unit: str, notes: str) -> None:
        rows.append(MeasurementRow.model_validate(
            {"device": device.slug, "quantity": quantity, "dtype": "fp32", "shape": shape,
             "value": float(f"{value:.6g}"), "unit": unit, "as_of": device.as_of, "source": device.source,
             "notes": notes}))

    for t in timings:
        add(t.collective, timing_shape(processes, t.size_bytes), t.seconds * 1e6, "us per call",
            f"{backend}: algbw {t.algbw_gb_per_s:.4g} GB/s, busbw {t.busbw_gb_per_s:.4g} GB/s")
    for f in fits:
        notes = f"{backend}, {processes} processes: time = latency + bytes × bus factor ÷ bus bandwidth"
        add("collective_bus_bandwidth", fit_shape(f.collective, processes), f.bus_bytes_per_s / 1e9, "GB/s", notes)
        add("collective_latency", fit_shape(f.collective, processes), f.latency_s * 1e6, "us", notes)
    return rows


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _worker_env(rank: int, processes: int, port: int, kind: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"WORLD_SIZE": str(processes), "RANK": str(rank), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(processes), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)})
    if kind == "cpu":  # the processes share the cores: an even share each, as `tunecast train --gpus N` gives them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    return env


def _last_words(log: Path) -> str:
    """The last line a worker wrote to stderr (a Python error's own line), shortened to one line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] \
        if log.is_file() else []
    return (lines[-1][:240] if lines else "it wrote nothing")


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _raise_first_failure(workers: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path]) -> None:
    """A worker that ended with an error: which, how, and the last line it wrote."""
    for rank, worker in enumerate(workers):
        if worker.returncode not in (None, 0):
            raise TunecastError(
                f"the collective probe's rank {rank} {_describe_exit(worker.returncode)}: {_last_words(logs[rank])}",
                field="--collectives",
                hint="fix what it says (another process on the loopback port or the GPUs: run it again), or probe "
                     "fewer devices with --gpus N")


def run_workers(processes: int, kind: str, sizes: Sequence[int], scratch: Path, timeout_s: float) -> dict[str, object]:
    """Start the workers, wait for all of them (at most `timeout_s`), and return rank 0's document; the first worker
    that fails, or the time limit, stops every worker and raises a one-line error saying which and why."""
    out = scratch / "times.json"
    argv = [*WORKER, "--device", kind, "--sizes", ",".join(str(s) for s in sizes), "--out", str(out),
            "--timeout-s", f"{timeout_s / 2:g}"]
    port = _free_port()
    logs = [scratch / f"rank-{rank}.log" for rank in range(processes)]
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for rank, log in enumerate(logs):
            with log.open("wb") as stderr:
                workers.append(subprocess.Popen(argv, env=_worker_env(rank, processes, port, kind),
                                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr))
        deadline = time.monotonic() + timeout_s
        while [worker.poll() for worker in workers].count(None):  # every worker polled, each turn
            _raise_first_failure(workers, logs)
            if time.monotonic() > deadline:
                waiting = [str(rank) for rank, w in enumerate(workers) if w.poll() is None]
                raise TunecastError(
                    f"the collective probe did not finish within {timeout_s:g} s (rank {', '.join(waiting)} still "
                    "running): every worker was stopped", field="--collectives",
                    hint="a device busy with another job, or a rank that cannot reach the others: free the "
                         "devices (nvidia-smi) and run it again, or probe fewer with --gpus N")
            time.sleep(POLL_S)
        _raise_first_failure(workers, logs)
        if not out.is_file():
            raise TunecastError("the collective probe's workers ended without writing their times",
                                field="--collectives", hint="run it again")
        document: dict[str, object] = json.loads(out.read_text())
        return document
    finally:
        for worker in workers:  # only the workers started here, by their handles
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def resolve_processes(device: str | None, processes: int | None) -> tuple[str, int]:
    """The device kind and process count to probe: every CUDA GPU by default, else 2 processes on the CPU."""
    if processes is not None and processes < 2:
        raise TunecastError(f"--gpus {processes}: a collective needs 2 processes at least", field="--gpus",
                            hint="give --gpus 2 or more (on a CPU: processes sharing it)")
    import torch  # only past the check above: a count wrong on its face is refused without loading torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = device or ("cuda" if cuda else "cpu")
    if kind == "cpu":
        return kind, processes or 2
    if cuda < 2:
        raise TunecastError(f"a collective needs 2 GPUs at least; PyTorch sees {cuda}", field="--device",
                            hint="probe processes sharing the CPU instead (--device cpu), or run it where there are "
                                 "several GPUs")
    if processes is not None and processes > cuda:
        raise TunecastError(f"--gpus {processes}: PyTorch sees {cuda} GPUs", field="--gpus",
                            hint=f"give --gpus {cuda} or fewer, or leave it out to probe all {cuda}")
    return kind, processes or cuda


def run_collective_probe(gpus: GpuIndex, *, device: str | None = None, processes: int | None = None,
                         timeout_s: float = TIMEOUT_S,
                         progress: Callable[[str], None] | None = None) -> CollectiveProbeResult:
    """Time the three collectives on `processes` devices (every CUDA GPU by default; `device="cpu"`: processes
    sharing the CPU, 2 by default) and fit each; the rows belong to this host's device as `tunecast probe` names it."""
    import torch

    from tunecast.plan.probe import device_row

    kind, processes = resolve_processes(device, processes)
    started = time.monotonic()
    if progress is not None:
        progress(f"all-reduce, all-gather, reduce-scatter on {processes} {'GPUs' if kind == 'cuda' else 'processes'}")
    with tempfile.TemporaryDirectory(prefix="tunecast-collectives-") as scratch:
        document = run_workers(processes, kind, SIZES[kind], Path(scratch), timeout_s)
    backend = str(document["backend"])
    raw = document["times"]
    assert isinstance(raw, list), "the worker writes a list of times"
    timings = [Timing(str(t["collective"]), int(t["bytes"]), float(t["seconds"]), processes) for t in raw]
    missing = [c for c in COLLECTIVES if not any(t.collective == c for t in timings)]
    if missing:
        raise TunecastError(f"the collective probe timed no {', '.join(missing)}: its smallest message took over "
                            "half a second", field="--collectives", hint="run it again on an idle machine")
    fits = [fit([t for t in timings if t.collective == c]) for c in COLLECTIVES]
    row = device_row(torch.device(kind), gpus)
    return CollectiveProbeResult(row, processes, backend, timings, fits,
                                 measurement_rows(row, processes, backend, timings, fits), time.monotonic() - started)
