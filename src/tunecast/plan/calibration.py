"""A calibration (`tunecast calibrate`) carried into the plan.

The calibrated device at the calibrated batch shape runs at the measured tokens/s (basis `measured`). Every
other option keeps the throughput model's prediction corrected part by part (basis `calibrated`), by what the
measured step says about the model's error:

* forward and backward passes (compute and host overhead together): measured seconds per computed token
  (padding included) ÷ predicted seconds per computed token — the passes scale with tokens;
* the optimizer step (clipping included): measured seconds per step ÷ predicted — it scales with parameters.

The two parts are timed apart by the loop (`optimizer_seconds`: from the end of the last pass to the end of
the step). Compute and host overhead cannot be told apart in one measured shape, so they share their factor.
Memory predictions for the measured device are scaled by measured ÷ predicted peak (reserved on CUDA,
resident growth on a CPU); other devices keep the estimate, which calibration cannot see.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

from tunecast.catalog.devices import DeviceRow, MeasurementRow, as_gpu, figures_by_slug
from tunecast.catalog.gpus import Gpu
from tunecast.catalog.store import Catalog
from tunecast.config.load import flatten
from tunecast.config.spec import RunSpec
from tunecast.errors import Problem, TunecastError
from tunecast.plan.throughput import StepTime

CALIBRATION_FORMAT = 1
# Settings that change the speed of a step, flattened as dotted keys (a key covers those below it). The
# dataset changes the padding, not the step: a calibration of other data is used with a warning.
SPEED_KEYS = ("model", "method", "lora", "quantization", "precision", "optimizer", "optimizer_in_backward",
              "micro_batch", "seq_len", "packing", "grad_checkpointing", "attention", "loss", "gpus.strategy",
              "gpus.offload", "activation_offload")
DATA_KEYS = ("dataset",)


def selected(spec_document: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    flat = flatten(spec_document)
    return {key: value for key, value in sorted(flat.items())
            if any(key == wanted or key.startswith(wanted + ".") for wanted in keys)}


def speed_settings(spec: RunSpec, model_data: dict[str, Any], resolved: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The settings a step's speed depends on, as dotted keys; `resolved` replaces what the run chose for
    `auto` (micro_batch, grad_checkpointing). The model is its config's hash: the same model named another
    way (a catalog name, a folder) is the same model."""
    document = spec.model_dump(mode="json")
    document.update(resolved or {})
    document["model"] = hashlib.sha256(json.dumps(model_data, sort_keys=True).encode()).hexdigest()[:16]
    return selected(document, SPEED_KEYS)


def speed_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Comparison:
    refused: list[str]  # keys that change the speed of a step
    data: list[str]  # dataset keys: the speed of a step holds; the padding may not


def compare(calibration: dict[str, Any], spec: RunSpec, model_data: dict[str, Any]) -> Comparison:
    """How the run `spec` (of the model `model_data`) differs from the one calibrated."""
    then = calibration["config"]["speed"]
    now = speed_settings(spec, model_data, {key: then[key] for key in ("micro_batch", "grad_checkpointing")
                                            if key in then and _open(spec, key)})
    refused = sorted(key for key in set(then) | set(now) if then.get(key) != now.get(key))
    data_then = calibration["config"]["data"]
    data_now = selected(spec.model_dump(mode="json"), DATA_KEYS)
    data = sorted(key for key in set(data_then) | set(data_now) if data_then.get(key) != data_now.get(key))
    return Comparison(refused, data)


def _open(spec: RunSpec, key: str) -> bool:
    """Whether `key` was left for the run to choose (auto)."""
    value = getattr(spec, key)
    return value == "auto" or (key == "grad_checkpointing" and not spec.fixed("grad_checkpointing"))




@dataclass(frozen=True)
class Calibration:
    device_slug: str
    micro_batch: int
    grad_checkpointing: bool
    tokens_per_second: float  # measured, real tokens
    passes_factor: float  # measured ÷ predicted seconds per computed token of the forward and backward passes
    optimizer_factor: float  # measured ÷ predicted seconds of the optimizer step
    memory_factor: float  # measured ÷ predicted peak memory on the calibrated device

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Calibration:
        measured, predicted = document["measured"], document["predicted"]
        resolved = document["config"]["resolved"]
        per_step_measured = measured["padded_tokens"] / measured["steps"]
        passes_measured = (measured["step_seconds"] - measured["optimizer_seconds"]) / per_step_measured
        parts = predicted["parts_s"]
        passes_predicted = (parts["compute"] + parts["overhead"]) / predicted["padded_tokens_per_step"]
        optimizer_factor = (measured["optimizer_seconds"] / parts["optimizer"]
                            if parts["optimizer"] > 0 and measured["optimizer_seconds"] > 0 else 1.0)
        memory_error = document["error"]["memory"]
        return cls(document["device"]["slug"], int(resolved["micro_batch"]), bool(resolved["grad_checkpointing"]),
                   float(measured["tokens_per_second"]), passes_measured / passes_predicted, optimizer_factor,
                   1.0 / (1.0 + memory_error) if memory_error is not None else 1.0)

    def is_measured(self, gpu_slug: str, count: int, micro_batch: int, checkpointing: bool) -> bool:
        """Whether this option is the calibrated run itself."""
        return (gpu_slug == self.device_slug and count == 1 and micro_batch == self.micro_batch
                and checkpointing == self.grad_checkpointing)

    def corrected(self, step: StepTime) -> StepTime:
        return replace(step, compute_s=step.compute_s * self.passes_factor,
                       dequantize_s=step.dequantize_s * self.passes_factor,
                       dispatch_s=step.dispatch_s * self.passes_factor,
                       optimizer_s=step.optimizer_s * self.optimizer_factor)

    def describe(self) -> str:
        return (f"calibrated: forward/backward ×{self.passes_factor:.2f}, optimizer ×{self.optimizer_factor:.2f} "
                f"(measured ÷ predicted on {self.device_slug})")


def read_calibration(path: Path) -> dict[str, Any]:
    """A calibration file, checked for the fields a plan uses."""
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise TunecastError(f"cannot read {path}: {error.strerror}", field="--calibration",
                            hint="give the calibration.json that `tunecast calibrate` wrote") from None
    except json.JSONDecodeError as error:
        raise TunecastError(f"{path} is not JSON ({error.msg}, line {error.lineno})", field="--calibration",
                            hint="give the calibration.json that `tunecast calibrate` wrote") from None
    if not isinstance(document, dict) or document.get("calibration_format") != CALIBRATION_FORMAT:
        raise TunecastError(f"{path} is not a tunecast calibration (format {CALIBRATION_FORMAT})",
                            field="--calibration", hint="run `tunecast calibrate CONFIG` to make one")
    return document


def check_against(calibration: dict[str, Any], spec: RunSpec, model_data: dict[str, Any]) -> list[Problem]:
    """Refuse a calibration of another configuration; warn when only the data differs."""
    found = compare(calibration, spec, model_data)
    if found.refused:
        then = calibration["config"]["speed"]
        now = speed_settings(spec, model_data)
        listed = ", ".join(f"{key} ({then.get(key)!r} → {now.get(key)!r})" for key in found.refused[:6])
        raise TunecastError(f"the calibration is of another configuration: {listed}", field="--calibration",
                            hint="calibrate this config (`tunecast calibrate CONFIG`), or plan the calibrated one")
    if found.data:
        return [Problem("--calibration", f"calibrated on other data ({', '.join(found.data)}): the step's speed "
                        "holds, the padding of this dataset may differ", "calibrate on this dataset to be sure",
                        severity="warning")]
    return []


def calibrated_device(document: dict[str, Any], catalog: Catalog) -> Gpu:
    """The calibrated device as the planner sees it: its catalog row (a known GPU) or its probed row, with the
    figures its calibration's probe measured."""
    device = document["device"]
    when = date.fromisoformat(document["created"][:10])
    source = f"tunecast calibrate on {device['host']}"
    row = DeviceRow(slug=device["slug"], name=device["name"], kind=device["kind"], host=device["host"],
                    count=device["count"], memory_gib=device["memory_gib"],
                    usable_memory_gib=device["usable_memory_gib"], threads=device["threads"],
                    torch_version=document["probe"].get("torch_version", "unknown"), as_of=when, source=source)
    rows = [MeasurementRow.model_validate(m) for m in document["probe"]["measurements"]]
    figures = figures_by_slug([row], rows)[row.slug]
    return as_gpu(figures, catalog.gpus.find(row.slug) if row.kind == "cuda" else None)
