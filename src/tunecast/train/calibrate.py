"""Estimate before you start: a short run of the real training loop on this device, measured, next to what the
plan predicts for it — and the whole run extrapolated from what was measured.

What runs. `tunecast train`'s own set-up and loop (same model set-up, data pipeline, precision, optimizer,
batch shape chosen from the memory estimate) on the first `data_limit` examples of the user's dataset, in a
scratch directory that is removed afterwards: no checkpoint, no `final/`, no saved base. Before it, the
device probe (probe.py) measures the device, and its figures are kept in the user catalog (`--gpu local`).

What is measured. The first steps are warm-up (allocator growth, lazy initialisation, caches): the first
`max(WARMUP_STEPS, 10%)` steps are left out. Over the rest: real (non-padding) tokens ÷ the seconds of the
steps — the quantity `tunecast train` reports per step and `tunecast plan` predicts — and padded tokens/s,
examples/s, the optimizer's share (clipping and the optimizer step, timed apart), and the peak memory
(CUDA `max_memory_allocated`/`max_memory_reserved`; on the CPU the growth of resident memory from before
the model was built, which is what `tunecast memory --device cpu` estimates).

What is predicted. The planner's own configuration of this device (its probed row), at the batch shape the
run used, for the whole dataset: tokens/s with the step's parts (compute, host overhead, optimizer), and the
memory estimate. The calibration file keeps both, the probe's figures, and the hash of the settings that
change the speed of a step (`speed_hash`): a plan refuses a calibration of a different configuration, and
warns when only the dataset differs.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec
from tunecast.errors import TunecastError
from tunecast.plan.calibration import CALIBRATION_FORMAT, DATA_KEYS, selected, speed_hash, speed_settings
from tunecast.units import SECONDS_PER_HOUR

CALIBRATION_FILE = "calibration.json"
WARMUP_STEPS = 2
DEFAULT_STEPS = 20
MIN_MEASURED_STEPS = 3
@dataclass(frozen=True)
class CalibrationRequest:
    steps: int | None = None
    minutes: float | None = None
    allow_download: bool = False


@dataclass
class Collected:
    """The measured steps, as the loop reports them."""

    records: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)


def warmup_steps(measured: int) -> int:
    return max(WARMUP_STEPS, math.ceil(0.1 * measured))


def run_calibration(loaded: LoadedSpec, catalog: Catalog, request: CalibrationRequest, flag: Any, reporter: Any,
                    *, user_dir: Path, progress: Any = None, before_probe: Any = None,
                    on_probed: Any = None) -> dict[str, Any]:
    """Run the loop briefly, probe the device, and return the calibration document. `progress` hears what the
    probe measures; `before_probe` and `on_probed` are called around the probe."""
    from tunecast.catalog.devices import figures_by_slug, merge_device
    from tunecast.train.probe import run_probe

    if request.steps is not None and request.minutes is not None:
        raise TunecastError("--steps and --minutes both set", field="--steps",
                            hint="give one: --steps N runs N measured steps, --minutes M runs for M minutes")
    steps = request.steps if request.steps is not None else (None if request.minutes is not None else DEFAULT_STEPS)
    if steps is not None and steps < MIN_MEASURED_STEPS:
        raise TunecastError(f"--steps {steps} leaves too few steps to measure", field="--steps",
                            hint=f"give at least {MIN_MEASURED_STEPS} (warm-up steps are added and left out)")
    if request.minutes is not None and not request.minutes > 0:
        raise TunecastError(f"--minutes {request.minutes:g} is not a positive number", field="--minutes",
                            hint="for example --minutes 5")
    flag.check()
    # the loop first, the probe after: the probe's large allocations and frees raise glibc's mmap threshold, which
    # would make a CPU loop run after it faster than the same loop in `tunecast train` (measured: 1.4×)
    collected, session_info, spent = _measure(loaded, catalog, request, flag, reporter, steps)
    flag.check()
    if before_probe is not None:
        before_probe()
    probed = run_probe(catalog.gpus, progress=progress)
    merge_device(user_dir, probed.device, probed.measurements)
    figures = figures_by_slug([probed.device], probed.measurements)[probed.device.slug]
    if on_probed is not None:
        on_probed()
    return _document(loaded, catalog, figures, collected, session_info, spent, probed.seconds)


def _measure(loaded: LoadedSpec, catalog: Catalog, request: CalibrationRequest, flag: Any, reporter: Any,
             steps: int | None) -> tuple[Collected, dict[str, Any], float]:
    from tunecast.train.loop import train
    from tunecast.train.run import TrainRequest, TrainResult
    from tunecast.train.session import build_session
    from tunecast.train.store import CheckpointStore, Storage, locked

    spec = loaded.spec
    planned = steps + warmup_steps(steps) if steps is not None else 1_000_000
    per_step = spec.global_batch or spec.micro_batch_size * spec.grad_accum
    # the slice: enough examples that no unit is trained twice in the steps measured (packed units hold several)
    limit = max(2_000, 2 * planned * per_step) if steps is not None else 50_000
    measured_spec = spec.with_changes({"max_steps": planned, "eval.examples": 0, "eval.every_steps": None})
    collected = Collected()
    deadline = time.monotonic() + request.minutes * 60 if request.minutes is not None else None

    class Collector:
        def event(self, kind: str, message: str) -> None:
            collected.events.append((kind, message))
            reporter.event(kind, message)

        def step(self, record: dict[str, Any], total_steps: int, eta_s: float, cost_at_end_usd: float) -> None:
            collected.records.append(record)
            shown = steps + warmup_steps(steps) if steps is not None else len(collected.records) + 1
            reporter.step(record, shown, eta_s if steps is not None else 0.0, cost_at_end_usd)

    def stop(progress: Any) -> bool:
        if deadline is not None:
            measured = len(collected.records)
            return time.monotonic() >= deadline and measured >= warmup_steps(measured) + MIN_MEASURED_STEPS
        return False

    scratch = Path(tempfile.mkdtemp(prefix="tunecast-calibrate-"))
    started = time.monotonic()
    try:
        storage = Storage(str(scratch))
        measuring = LoadedSpec(spec=measured_spec.with_changes({"output": str(scratch)}), source=loaded.source,
                               model=loaded.model, gpu=loaded.gpu, warnings=loaded.warnings)
        result = TrainResult(output=str(scratch), finished=False)
        with locked(storage) as lock:
            session = build_session(measuring, catalog,
                                    TrainRequest(allow_download=request.allow_download, measuring=True,
                                                 data_limit=limit),
                                    flag, Collector(), storage=storage, store=CheckpointStore(storage), lock=lock,
                                    found=None, resolved_then=None, result=result)
            session.checkpoints = False
            session.stop = stop
            data = session.data
            train(session)
            session.metrics.close()
        start = _start_event(scratch)
        info = {"micro_batch": session.micro_batch, "grad_accum": session.grad_accum,
                "grad_checkpointing": bool(start.get("grad_checkpointing", False)), "examples": data.examples,
                "units": len(data.units), "usd_per_hour": session.usd_per_hour,
                "rss_before_model_gib": start.get("rss_before_model_gib"),
                "warnings": [w.as_dict() for w in result.warnings],
                "real_tokens": sum(len(unit.input_ids) for unit in data.units)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return collected, info, time.monotonic() - started


def _start_event(scratch: Path) -> dict[str, Any]:
    path = scratch / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record.get("event") == "start":
            return dict(record)
    return {}


def _document(loaded: LoadedSpec, catalog: Catalog, figures: Any, collected: Collected, info: dict[str, Any],
              spent_s: float, probe_s: float) -> dict[str, Any]:
    records = collected.records
    skipped = warmup_steps(len(records))
    if len(records) - skipped < MIN_MEASURED_STEPS:
        raise TunecastError(f"only {len(records)} steps ran: too few to measure after {skipped} warm-up steps",
                            field="--minutes", hint="give more time (--minutes) or steps (--steps)")
    kept = records[skipped:]
    seconds = sum(r["step_seconds"] for r in kept)
    tokens = sum(r["tokens"] for r in kept)
    padded = sum(r["padded_tokens"] for r in kept)
    optimizer_s = sum(r.get("optimizer_seconds", 0.0) for r in kept)
    tokens_per_example = info["real_tokens"] / max(1, info["examples"])
    spec = loaded.spec
    resolved = {"micro_batch": info["micro_batch"], "grad_accum": info["grad_accum"],
                "grad_checkpointing": info["grad_checkpointing"]}
    last = kept[-1]
    kind = figures.device.kind
    if kind == "cuda":
        memory = {"peak_allocated_gib": max(r["peak_allocated_gib"] for r in kept),
                  "peak_reserved_gib": max(r["peak_reserved_gib"] for r in kept)}
    else:
        peak = max(r["peak_rss_gib"] for r in records)
        memory = {"peak_rss_gib": peak, "growth_gib": peak - (info["rss_before_model_gib"] or 0.0)}
    measured = {
        "steps": len(kept), "warmup_steps_excluded": skipped, "seconds": seconds,
        "tokens_per_second": tokens / seconds, "padded_tokens_per_second": padded / seconds,
        "examples_per_second": tokens / seconds / tokens_per_example,
        "step_seconds": seconds / len(kept), "optimizer_seconds": optimizer_s / len(kept),
        "tokens": tokens, "padded_tokens": padded, "loss_first": records[0]["loss"], "loss_last": last["loss"],
        **memory,
    }
    predicted = predict(loaded, catalog, figures, resolved)
    whole = whole_run(predicted, measured, info["usd_per_hour"])
    device = figures.device
    speed = speed_settings(spec, loaded.model.data, resolved)
    return {
        "calibration_format": CALIBRATION_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": {"slug": device.slug, "name": device.name, "kind": device.kind, "count": device.count,
                   "memory_gib": device.memory_gib, "usable_memory_gib": device.usable_memory_gib,
                   "threads": device.threads, "host": device.host},
        "config": {"hash": speed_hash(speed), "speed": speed, "model": loaded.model.name,
                   "data": selected(spec.model_dump(mode="json"), DATA_KEYS), "resolved": resolved},
        "slice": {"examples": info["examples"], "units": info["units"], "real_tokens": info["real_tokens"]},
        "measured": measured,
        "predicted": predicted,
        "error": {"tokens_per_second": predicted["tokens_per_second"] / measured["tokens_per_second"] - 1,
                  "memory": _memory_error(predicted, measured, kind)},
        "whole_run": whole,
        "probe": {"seconds": round(probe_s, 1), "torch_version": device.torch_version,
                  "measurements": [row.document() for row in figures.rows]},
        "seconds": round(spent_s, 1),
        "warnings": info["warnings"],
    }


def _memory_error(predicted: dict[str, Any], measured: dict[str, Any], kind: str) -> float | None:
    actual = measured["peak_reserved_gib"] if kind == "cuda" else measured["growth_gib"]
    estimate = predicted["memory"]["peak_reserved_gib" if kind == "cuda" else "device_total_gib"]
    return estimate / actual - 1 if actual > 0 else None


def predict(loaded: LoadedSpec, catalog: Catalog, figures: Any, resolved: dict[str, Any]) -> dict[str, Any]:
    """What the plan predicts on this device for the whole dataset, at the batch shape the run used."""
    from tunecast.catalog.devices import as_gpu
    from tunecast.plan.planner import Planner
    from tunecast.plan.workload import workload_for

    gpu = as_gpu(figures, catalog.gpus.find(figures.device.slug) if figures.device.kind == "cuda" else None)
    spec = loaded.spec
    fixed = spec.with_changes({"micro_batch": resolved["micro_batch"],
                               "grad_checkpointing": resolved["grad_checkpointing"],
                               "global_batch": resolved["micro_batch"] * resolved["grad_accum"],
                               "gpus.count": 1, "plan.memory_margin": 0.0})
    pinned = LoadedSpec(spec=fixed, source=loaded.source, model=loaded.model, gpu=gpu, warnings=())
    planner = Planner(pinned, catalog, workload_for(loaded, catalog))
    configured = planner.configure(gpu, 1)
    if isinstance(configured, str):
        raise TunecastError(f"the plan cannot configure this run on {figures.device.name}: {configured}",
                            field="micro_batch", hint="check the run's batch shape with `tunecast memory`")
    step = configured.step
    workload = planner.workload
    return {
        "tokens_per_second": configured.tokens_per_second,
        "step_seconds": step.total_s,
        "padded_tokens_per_step": step.tokens_per_step,
        "parts_s": {"compute": step.compute_s + step.dequantize_s + step.offload_s, "overhead": step.dispatch_s,
                    "optimizer": step.optimizer_s},
        "hours": configured.hours,
        "eval_hours": configured.eval_hours,
        "processed_tokens": workload.total_processed_tokens,
        "memory": {"device_total_gib": configured.memory.device_total_gib,
                   "peak_reserved_gib": configured.memory.peak_reserved_gib,
                   "peak_allocated_gib": configured.memory.peak_allocated_gib},
    }


def whole_run(predicted: dict[str, Any], measured: dict[str, Any], usd_per_hour: float) -> dict[str, Any]:
    """The whole run on this device at the measured speed: the dataset's tokens ÷ measured tokens/s, plus the
    evaluations (predicted, scaled by the same measured/predicted ratio)."""
    ratio = predicted["tokens_per_second"] / measured["tokens_per_second"]
    train_hours = predicted["processed_tokens"] / measured["tokens_per_second"] / SECONDS_PER_HOUR
    eval_hours = predicted["eval_hours"] * ratio
    hours = train_hours + eval_hours
    return {"tokens": predicted["processed_tokens"], "hours": hours, "eval_hours": eval_hours,
            "usd_per_hour": usd_per_hour, "cost_usd": hours * usd_per_hour,
            "predicted_hours": predicted["hours"]}


def write_calibration(document: dict[str, Any], target: str) -> str:
    """Write the calibration atomically (a local path or a storage URL); returns where."""
    from tunecast.train.store import Storage

    if "://" in target:
        parent, _, name = target.rstrip("/").rpartition("/")
        Storage(parent).write(name, (json.dumps(document, indent=2) + "\n").encode())
        return target
    from tunecast.atomic import write_text_atomic

    path = Path(target)
    write_text_atomic(path, json.dumps(document, indent=2) + "\n")
    return str(path)
