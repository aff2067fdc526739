"""Estimate before you start: a short run of the real training loop on this device, measured until its speed is
steady, next to what the plan predicts for it — and the whole run projected from what was measured.

What runs. `tunecast train`'s own set-up and loop (same model set-up, data pipeline, precision, optimizer,
batch shape chosen from the memory estimate, the same examples held out) on the first `data_limit` examples of
the user's dataset, in a scratch directory that is removed afterwards: no `final/`, no saved base. Before it,
nothing; after it, one evaluation and one checkpoint write are timed (both are part of the run's time), then the
device probe (probe.py) measures the device, and its figures are kept in the user catalog (`--gpu local`).

When it stops (steady.py). Each step's speed is its padded tokens ÷ its seconds (a step's work grows with its
padded tokens). After every step: the warm-up left out, the median speed of the rest, its distribution-free
95% interval and whether the speed still drifts. The loop stops once the interval is within ±5% and nothing
drifts (steady), or when the time budget (`--seconds`) or the step limit (`--steps`, measured steps at most) is
reached — then it says the measurement is not steady, and why.

What is measured. Real (non-padding) tokens per second: the median speed × the real share of the kept steps'
tokens — the quantity `tunecast train` reports per step and `tunecast plan` predicts — with its interval and
quartiles; the typical step (the median speed at the kept steps' mean padded tokens) and the optimizer's share
of it (clipping and the optimizer step, timed apart); the time the first two steps took beyond that speed; one
evaluation; one checkpoint write; the peak memory (CUDA `max_memory_allocated`/`max_memory_reserved`; on the
CPU the growth of resident memory from before the model was built, which is what `tunecast memory --device cpu`
estimates).

The whole run (what `tunecast train` of this config will take). Its optimizer steps are the plan's
(`plan.workload.Workload.length`: `max_steps` caps the epochs), its padded tokens those of the whole dataset at
the run's micro-batch; its time is those tokens at the measured speed, plus the first steps' extra time, plus its
evaluations and its checkpoints (counted as the loop schedules them) at their measured times. Its tokens/s —
real tokens over the steps' seconds, warm-up included — is the figure `tunecast train` prints at the end.

What is predicted. The planner's own configuration of this device (its probed row), at the batch shape the run
used, for the whole run: tokens/s with the step's parts (compute, host overhead, optimizer), and the memory
estimate. The calibration file keeps both, the probe's figures, and the hash of the settings that change the
speed of a step (`speed_hash`): a plan refuses a calibration of a different configuration, and warns when only
the dataset differs.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.plan.calibration import CALIBRATION_FORMAT, DATA_KEYS, selected, speed_hash, speed_settings
from tunecast.train.policy import checkpoints_in_run, evaluations_in_run
from tunecast.train.steady import (
    CONFIDENCE,
    MIN_INTERVAL_STEPS,
    MIN_WARMUP_STEPS,
    TARGET_RELATIVE_CI,
    steadiness,
    warmup_floor,
)
from tunecast.units import BYTES_PER_GIB, SECONDS_PER_HOUR

CALIBRATION_FILE = "calibration.json"
DEFAULT_SECONDS = 120.0  # the measured steps' time budget when none is given
DEFAULT_MAX_STEPS = 300  # measured steps at most when --steps is not given
# The slice of the dataset read: enough examples for a few hundred steps' lengths, few enough to tokenize fast.
SLICE_EXAMPLES = (2_000, 20_000)
# One checkpoint is written to time it when it is at most this large (a full model's can be tens of GiB: its
# time is then the catalog's write rate's).
MEASURED_CHECKPOINT_GIB = 4.0


@dataclass(frozen=True)
class CalibrationRequest:
    steps: int | None = None  # measured steps at most
    seconds: float | None = None  # time budget of the measured steps
    target: float = TARGET_RELATIVE_CI
    offline: bool = False  # `--offline`: the base's weights only from disk or the local cache


@dataclass
class Collected:
    """The measured steps, as the loop reports them, and why measuring stopped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    stop_reason: str = "the step limit"  # the loop ran every step it was given (the rule never stopped it)
    loop_started: float | None = None  # monotonic time the first step began
    eval_seconds: float | None = None
    checkpoint: dict[str, Any] = field(default_factory=dict)


def speeds(records: list[dict[str, Any]]) -> list[float]:
    """Each step's speed: padded tokens per second."""
    return [r["padded_tokens"] / r["step_seconds"] if r["step_seconds"] > 0 else math.inf for r in records]


def run_calibration(loaded: LoadedSpec, catalog: Catalog, request: CalibrationRequest, flag: Any, reporter: Any,
                    *, user_dir: Path, progress: Any = None, before_probe: Any = None,
                    on_probed: Any = None) -> dict[str, Any]:
    """Run the loop until its speed is steady, probe the device, and return the calibration document.
    `progress` hears what the probe measures; `before_probe` and `on_probed` are called around the probe."""
    from tunecast.catalog.devices import figures_by_slug, merge_device
    from tunecast.plan.probe import run_probe

    if request.steps is not None and request.steps < MIN_INTERVAL_STEPS:
        raise TunecastError(f"--steps {request.steps} leaves too few steps to measure", field="--steps",
                            hint=f"give at least {MIN_INTERVAL_STEPS}: the fewest a {CONFIDENCE:.0%} interval of the "
                                 "median can be given on (warm-up steps are added and left out)")
    if request.seconds is not None and not request.seconds > 0:
        raise TunecastError(f"--seconds {request.seconds:g} is not a positive number", field="--seconds",
                            hint="for example --seconds 120")
    flag.check()
    # the loop first, the probe after: the probe's large allocations and frees raise glibc's mmap threshold, which
    # would make a CPU loop run after it faster than the same loop in `tunecast train` (measured: 1.4×)
    collected, session_info, spent = _measure(loaded, request, flag, reporter, catalog)
    flag.check()
    if before_probe is not None:
        before_probe()
    probed = run_probe(catalog.gpus, progress=progress)
    merge_device(user_dir, probed.device, probed.measurements)
    figures = figures_by_slug([probed.device], probed.measurements)[probed.device.slug]
    if on_probed is not None:
        on_probed()
    return _document(loaded, catalog, figures, collected, session_info, spent, probed.seconds, request.target)


def _measure(loaded: LoadedSpec, request: CalibrationRequest, flag: Any, reporter: Any, catalog: Catalog
             ) -> tuple[Collected, dict[str, Any], float]:
    from tunecast.storage.store import CheckpointStore, Storage, locked
    from tunecast.train.loop import evaluate, save_checkpoint, train
    from tunecast.train.run import TrainRequest, TrainResult, output_url
    from tunecast.train.session import build_session

    spec = loaded.spec
    most = request.steps if request.steps is not None else DEFAULT_MAX_STEPS
    budget = request.seconds if request.seconds is not None else DEFAULT_SECONDS
    # the warm-up may grow to half the steps run (steady.py): room for it beyond the measured steps
    planned = 2 * most + 2
    per_step = spec.global_batch or spec.micro_batch_size * spec.grad_accum
    limit = min(max(SLICE_EXAMPLES[0], planned * per_step), SLICE_EXAMPLES[1])
    # `epochs` as large as the steps: the loop runs until `stop` says so, under any rule joining max_steps and
    # epochs (the first to end ends the run)
    measured_spec = spec.with_changes({"max_steps": planned, "epochs": float(planned)})
    collected = Collected()
    checked = [0]

    class Collector:
        def event(self, kind: str, message: str) -> None:
            collected.events.append((kind, message))
            reporter.event(kind, message)

        def step(self, record: dict[str, Any], total_steps: int, eta_s: float, cost_at_end_usd: float) -> None:
            if collected.loop_started is None:
                collected.loop_started = time.monotonic() - record["step_seconds"]
            collected.records.append(record)
            # the bar's end: the step limit and its warm-up (the run stops sooner once steady)
            reporter.step(record, most + warmup_floor(most), 0.0, cost_at_end_usd)

    def stop(progress: Any) -> bool:
        measured = len(collected.records)
        # the rule sorts every step's speed: past a hundred steps it is asked every few steps
        if measured - checked[0] < max(1, measured // 50):
            return False
        checked[0] = measured
        state = steadiness(speeds(collected.records), target=request.target)
        if state.steady:
            collected.stop_reason = "steady"
        elif state.kept >= most:
            collected.stop_reason = f"the step limit (--steps {most})"
        elif (collected.loop_started is not None and time.monotonic() - collected.loop_started >= budget
              and state.kept >= MIN_INTERVAL_STEPS):
            collected.stop_reason = f"the time budget ({budget:g} s)"
        else:
            return False
        return True

    scratch = Path(tempfile.mkdtemp(prefix="tunecast-calibrate-"))
    started = time.monotonic()
    try:
        storage = Storage(str(scratch))
        measuring = LoadedSpec(spec=measured_spec.with_changes({"output": str(scratch)}), source=loaded.source,
                               model=loaded.model, gpu=loaded.gpu, warnings=loaded.warnings)
        result = TrainResult(output=str(scratch), finished=False)
        with locked(storage) as lock:
            session = build_session(measuring, catalog,
                                    TrainRequest(offline=request.offline, measuring=True,
                                                 data_limit=limit),
                                    flag, Collector(), storage=storage, store=CheckpointStore(storage), lock=lock,
                                    found=None, resolved_then=None, result=result)
            session.checkpoints = False
            session.stop = stop
            # the run's held-out examples stay held out (the same training data as `tunecast train`), but the loop
            # evaluates nothing: one evaluation is timed after the steps, whatever the run's schedule
            session.spec = session.spec.with_changes({"eval.examples": 0})
            data = session.data
            train(session)
            flag.check()
            if data.eval_units:
                began = time.monotonic()
                evaluate(session)
                collected.eval_seconds = time.monotonic() - began
            collected.checkpoint = _time_checkpoint(session, save_checkpoint, catalog, output_url(spec))
            session.metrics.close()
        start = _start_event(scratch)
        info = {"micro_batch": session.micro_batch, "grad_accum": session.grad_accum,
                "grad_checkpointing": bool(start.get("grad_checkpointing", False)), "examples": data.examples,
                "units": len(data.units), "eval_units": len(data.eval_units), "usd_per_hour": session.usd_per_hour,
                "rss_before_model_gib": start.get("rss_before_model_gib"),
                "warnings": [w.as_dict() for w in result.warnings],
                "real_tokens": sum(len(unit.input_ids) for unit in data.units),
                "startup_seconds": (collected.loop_started - started) if collected.loop_started else None}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return collected, info, time.monotonic() - started


def _time_checkpoint(session: Any, save: Any, catalog: Catalog, output: str) -> dict[str, Any]:
    """One checkpoint of the run's state, written into the scratch folder and timed where the run writes to a
    local folder and the checkpoint is small enough; else its size at the catalog's object-storage write rate."""
    trainable = sum(p.numel() * p.element_size() for p in session.trainable)
    estimated = 3 * trainable  # the weights and two optimizer states
    rate = catalog.throughput.get("checkpoint_write_mib_per_s") * 2**20
    if "://" in output or estimated > MEASURED_CHECKPOINT_GIB * BYTES_PER_GIB:
        return {"seconds": estimated / rate, "bytes": estimated,
                "basis": "estimated: weights and two optimizer states at the catalog's checkpoint_write_mib_per_s"}
    seconds = save(session, "calibration")
    written = session.store.storage
    folder = Path(written.path("checkpoints"))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else estimated
    return {"seconds": seconds, "bytes": size, "basis": "measured: one checkpoint written to a local folder"}


def _start_event(scratch: Path) -> dict[str, Any]:
    path = scratch / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record.get("event") == "start":
            return dict(record)
    return {}


def measurement(records: list[dict[str, Any]], target: float = TARGET_RELATIVE_CI) -> dict[str, Any]:
    """The measured speed of `records` (the loop's step records, in order): the steady rule's verdict, the real
    tokens/s with its interval and quartiles, the typical step and the warm-up's extra time."""
    state = steadiness(speeds(records), target=target)
    if state.interval is None or state.kept < MIN_INTERVAL_STEPS:
        raise TunecastError(f"only {len(records)} steps ran: too few to measure after {state.warmup} warm-up steps",
                            field="--seconds", hint="give more time (--seconds) or steps (--steps)")
    warm, kept = records[:state.warmup], records[state.warmup:]
    tokens = sum(r["tokens"] for r in kept)
    padded = sum(r["padded_tokens"] for r in kept)
    real = tokens / padded  # the kept steps' real share of their tokens
    interval = state.interval
    median = interval.median  # padded tokens per second
    seconds = sum(r["step_seconds"] for r in kept)
    # what the first steps took beyond the steady speed: every run pays its lazy initialisation (allocator, kernels,
    # the optimizer's states) there. Only the first MIN_WARMUP_STEPS: later slow steps of a longer warm-up are as
    # often another process's (a shared machine's slow spell), which the run will not meet again
    warmup_extra = sum(max(0.0, r["step_seconds"] - r["padded_tokens"] / median) for r in warm[:MIN_WARMUP_STEPS])
    return {
        "steps": len(kept), "steps_measured": len(kept), "warmup_steps_excluded": state.warmup,
        "stable": state.steady, "why_not_stable": state.why_not(),
        "confidence": CONFIDENCE, "coverage": interval.confidence, "target_relative_ci": target,
        "tokens_per_second": median * real, "ci_low": interval.low * real, "ci_high": interval.high * real,
        "relative_ci": interval.relative_half_width, "iqr_low": state.q1 * real, "iqr_high": state.q3 * real,
        "drift": state.drift,
        "padded_tokens_per_second": median, "real_share": real,
        "step_seconds": padded / len(kept) / median,
        "optimizer_seconds": statistics.median(r.get("optimizer_seconds", 0.0) for r in kept),
        "warmup_extra_seconds": warmup_extra,
        "seconds": seconds, "mean_tokens_per_second": tokens / seconds,
        "tokens": tokens, "padded_tokens": padded,
        # every step run, warm-up included, for a second look at the rule's verdict
        "each_step": {"seconds": [round(r["step_seconds"], 6) for r in records],
                      "padded_tokens": [r["padded_tokens"] for r in records],
                      "tokens": [r["tokens"] for r in records]},
    }


def _document(loaded: LoadedSpec, catalog: Catalog, figures: Any, collected: Collected, info: dict[str, Any],
              spent_s: float, probe_s: float, target: float) -> dict[str, Any]:
    records = collected.records
    speed = measurement(records, target)
    kept = records[speed["warmup_steps_excluded"]:]
    tokens_per_example = info["real_tokens"] / max(1, info["examples"])
    spec = loaded.spec
    resolved = {"micro_batch": info["micro_batch"], "grad_accum": info["grad_accum"],
                "grad_checkpointing": info["grad_checkpointing"]}
    kind = figures.device.kind
    if kind == "cuda":
        memory = {"peak_allocated_gib": max(r["peak_allocated_gib"] for r in kept),
                  "peak_reserved_gib": max(r["peak_reserved_gib"] for r in kept)}
    else:
        peak = max(r["peak_rss_gib"] for r in records)
        memory = {"peak_rss_gib": peak, "growth_gib": peak - (info["rss_before_model_gib"] or 0.0)}
    measured = {
        **speed, "stop_reason": collected.stop_reason,
        "examples_per_second": speed["tokens_per_second"] / tokens_per_example,
        "eval_seconds": collected.eval_seconds, "eval_examples": info["eval_units"],
        "checkpoint_seconds": collected.checkpoint.get("seconds"),
        "checkpoint_bytes": collected.checkpoint.get("bytes"), "checkpoint_basis": collected.checkpoint.get("basis"),
        "startup_seconds": info["startup_seconds"],
        "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"], **memory,
    }
    predicted = predict(loaded, catalog, figures, resolved)
    interruptions = catalog.throughput.get("spot_interruptions_per_hour")
    whole = whole_run(spec, predicted, measured, info["usd_per_hour"], interruptions_per_hour=interruptions)
    device = figures.device
    settings = speed_settings(spec, loaded.model.data, resolved)
    return {
        "calibration_format": CALIBRATION_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": {"slug": device.slug, "name": device.name, "kind": device.kind, "count": device.count,
                   "memory_gib": device.memory_gib, "usable_memory_gib": device.usable_memory_gib,
                   "threads": device.threads, "host": device.host},
        "config": {"hash": speed_hash(settings), "speed": settings, "model": loaded.model.name,
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
    """What the plan predicts on this device for the whole run, at the batch shape the run used; and the run's
    length: its optimizer steps (max_steps caps the epochs), tokens, padded tokens and steps per epoch."""
    from tunecast.catalog.devices import as_gpu
    from tunecast.plan.planner import Planner
    from tunecast.plan.workload import workload_for

    gpu = as_gpu(figures, catalog.gpus.find(figures.device.slug) if figures.device.kind == "cuda" else None)
    spec = loaded.spec
    global_batch = resolved["micro_batch"] * resolved["grad_accum"]
    fixed = spec.with_changes({"micro_batch": resolved["micro_batch"],
                               "grad_checkpointing": resolved["grad_checkpointing"],
                               "global_batch": global_batch, "gpus.count": 1, "plan.memory_margin": 0.0})
    pinned = LoadedSpec(spec=fixed, source=loaded.source, model=loaded.model, gpu=gpu, warnings=())
    workload = workload_for(loaded, catalog)
    planner = Planner(pinned, catalog, workload)
    configured = planner.configure(gpu, 1)
    if isinstance(configured, str):
        raise TunecastError(f"the plan cannot configure this run on {figures.device.name}: {configured}",
                            field="micro_batch", hint="check the run's batch shape with `tunecast memory`")
    step = configured.step
    length = workload.length(global_batch, spec.max_steps)  # the steps `tunecast train` runs (train/run.py)
    steps = length.steps
    sequences = steps * global_batch
    real_per_sequence = workload.processed_tokens / workload.sequences()
    return {
        "tokens_per_second": configured.tokens_per_second,
        "step_seconds": step.total_s,
        "padded_tokens_per_step": step.tokens_per_step,
        "parts_s": {"compute": step.compute_s + step.dequantize_s + step.offload_s, "overhead": step.dispatch_s,
                    "optimizer": step.optimizer_s},
        "hours": configured.hours,
        "eval_hours": configured.eval_hours,
        "steps": steps,
        "steps_per_epoch": length.per_epoch,
        "processed_tokens": sequences * real_per_sequence,
        "padded_tokens": sequences * workload.tokens_per_sequence(resolved["micro_batch"]),
        "memory": {"device_total_gib": configured.memory.device_total_gib,
                   "peak_reserved_gib": configured.memory.peak_reserved_gib,
                   "peak_allocated_gib": configured.memory.peak_allocated_gib},
    }


def whole_run(spec: RunSpec, predicted: dict[str, Any], measured: dict[str, Any], usd_per_hour: float, *,
              interruptions_per_hour: float) -> dict[str, Any]:
    """The whole run on this device at the measured speed: its padded tokens at the measured padded tokens/s, the
    warm-up's extra time, and its evaluations and checkpoints at their measured times (evaluations the slice
    could not time: the plan's, scaled by measured ÷ predicted speed)."""
    steps = predicted["steps"]
    train_s = predicted["padded_tokens"] / measured["padded_tokens_per_second"] + measured["warmup_extra_seconds"]
    evaluations = (evaluations_in_run(steps, predicted["steps_per_epoch"], spec.eval.every_steps)
                   if spec.eval.examples else 0)
    if measured.get("eval_seconds") is not None:
        eval_s = evaluations * measured["eval_seconds"]
    else:
        eval_s = predicted["eval_hours"] * SECONDS_PER_HOUR * predicted["tokens_per_second"] / measured[
            "tokens_per_second"]
    write_s = measured.get("checkpoint_seconds") or 0.0
    checkpoints = checkpoints_in_run(spec, steps, train_s, write_s, interruptions_per_hour)
    checkpoint_s = checkpoints * write_s
    hours = (train_s + eval_s + checkpoint_s) / SECONDS_PER_HOUR
    return {"steps": steps, "tokens": predicted["processed_tokens"], "padded_tokens": predicted["padded_tokens"],
            "tokens_per_second": predicted["processed_tokens"] / train_s,
            "train_hours": train_s / SECONDS_PER_HOUR, "evaluations": evaluations,
            "eval_hours": eval_s / SECONDS_PER_HOUR, "checkpoints": checkpoints,
            "checkpoint_hours": checkpoint_s / SECONDS_PER_HOUR, "hours": hours,
            "usd_per_hour": usd_per_hour, "cost_usd": hours * usd_per_hour,
            "predicted_hours": predicted["hours"]}


def write_calibration(document: dict[str, Any], target: str) -> str:
    """Write the calibration atomically (a local path or a storage URL); returns where."""
    from tunecast.storage.store import Storage

    if "://" in target:
        parent, _, name = target.rstrip("/").rpartition("/")
        Storage(parent).write(name, (json.dumps(document, indent=2) + "\n").encode())
        return target
    from tunecast.atomic import write_text_atomic

    path = Path(target)
    write_text_atomic(path, json.dumps(document, indent=2) + "\n")
    return str(path)
