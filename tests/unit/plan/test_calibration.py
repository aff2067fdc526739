"""Calibrations in the plan: which settings they hold to, the correction arithmetic, the basis of each option,
and the throughput model on a measured device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from tests.models import shallow_llama
from tests.unit.catalog.test_devices import cpu_rows, device

from tunecast.catalog.devices import DeviceFigures, as_gpu
from tunecast.catalog.gpus import GpuIndex
from tunecast.catalog.store import load_catalog
from tunecast.config.load import Override, load_spec
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.estimate.profiles import get_profiles
from tunecast.plan.calibrate import predict, whole_run
from tunecast.plan.calibration import (
    DATA_KEYS,
    Calibration,
    check_against,
    compare,
    selected,
    speed_hash,
    speed_settings,
)
from tunecast.plan.planner import Planner
from tunecast.plan.throughput import StepTime, step_time
from tunecast.plan.workload import workload_for
from tunecast.step.settings import TraceSettings

MODEL = shallow_llama()
RUN = {"model": "x", "method": "lora", "micro_batch": 4, "seq_len": 256, "lora": {"rank": 8}}


pytestmark = pytest.mark.usefixtures("profile_cache")


def spec(**changes: Any) -> RunSpec:
    return RunSpec.model_validate({**RUN, **changes})


def document(settings: RunSpec, *, measured: dict[str, float] | None = None,
             parts: dict[str, float] | None = None, memory_error: float | None = -0.2) -> dict[str, Any]:
    resolved = {"micro_batch": 4, "grad_accum": 1, "grad_checkpointing": False}
    return {
        "calibration_format": 1, "created": "2026-12-01T00:00:00+00:00",
        "device": {"slug": "cpu-test", "name": "Test CPU", "kind": "cpu", "count": 1, "memory_gib": 16.0,
                   "usable_memory_gib": 12.0, "threads": 2, "host": "test"},
        "config": {"speed": speed_settings(settings, MODEL, resolved),
                   "data": selected(settings.model_dump(mode="json"), DATA_KEYS), "resolved": resolved},
        "measured": measured or {"steps": 10, "padded_tokens": 10_000, "step_seconds": 2.0,
                                 "optimizer_seconds": 0.5, "tokens_per_second": 450.0},
        "predicted": {"parts_s": parts or {"compute": 0.5, "overhead": 0.25, "optimizer": 0.25},
                      "padded_tokens_per_step": 1000},
        "error": {"tokens_per_second": 0.0, "memory": memory_error},
        "probe": {"measurements": [r.document() for r in cpu_rows()]},
    }


def test_the_hash_covers_what_changes_a_steps_speed_and_nothing_else() -> None:
    base = speed_settings(spec(), MODEL)
    for harmless in ({"output": "elsewhere"}, {"max_steps": 7}, {"epochs": 9}, {"checkpoint": {"every_steps": 3}},
                     {"eval": {"examples": 5}}, {"pricing": {"usd_per_hour": 2.0}}, {"plan": {"memory_margin": 0.2}},
                     {"seed": 1}, {"learning_rate": 0.1}):
        assert speed_settings(spec(**harmless), MODEL) == base, harmless
    for changing in ({"lora": {"rank": 16}}, {"method": "full"}, {"precision": "fp32"}, {"optimizer": "sgd"},
                     {"micro_batch": 2}, {"seq_len": 512}, {"packing": True}, {"grad_checkpointing": True},
                     {"attention": "eager"}, {"loss": "chunked"}, {"gpus": {"strategy": "fsdp"}}):
        assert speed_hash(speed_settings(spec(**changing), MODEL)) != speed_hash(base), changing
    assert speed_settings(spec(), shallow_llama(hidden_size=128)) != base  # the model is its config


def test_a_calibration_of_another_configuration_is_refused_naming_the_keys() -> None:
    calibration = document(spec())
    with pytest.raises(TunecastError, match=r"lora\.rank \(8 → 16\)"):
        check_against(calibration, spec(lora={"rank": 16}), MODEL)
    assert check_against(calibration, spec(output="elsewhere", max_steps=3), MODEL) == []
    # only the data differs: used, with a warning
    warnings = check_against(calibration, spec(dataset={"path": "b.jsonl"}), MODEL)
    assert len(warnings) == 1 and "dataset.path" in warnings[0].message and warnings[0].severity == "warning"
    # `auto` is compared with what the calibrated run chose for it
    assert compare(calibration, spec(micro_batch="auto"), MODEL).refused == []


def test_correction_factors_are_measured_over_predicted_by_part() -> None:
    calibration = Calibration.from_document(document(spec()))
    # passes: (2.0 - 0.5) s for 1,000 padded tokens measured; (0.5 + 0.25) s for 1,000 predicted
    assert calibration.passes_factor == pytest.approx(2.0)
    assert calibration.optimizer_factor == pytest.approx(2.0)
    assert calibration.memory_factor == pytest.approx(1 / 0.8)  # the estimate was 20% low
    step = StepTime(1.0, 0.2, 0.1, 0.4, 0.3, 0.0, 1000)
    corrected = calibration.corrected(step)
    assert (corrected.compute_s, corrected.dequantize_s, corrected.dispatch_s) == pytest.approx((2.0, 0.4, 0.2))
    assert corrected.optimizer_s == pytest.approx(0.8) and corrected.communication_s == 0.3


def test_the_whole_run_is_extrapolated_from_the_measured_speed() -> None:
    run = spec(eval={"examples": 8, "every_steps": 10}, checkpoint={"every_steps": 10})
    predicted = {"tokens_per_second": 500.0, "steps": 40, "steps_per_epoch": 4, "processed_tokens": 360_000,
                 "padded_tokens": 400_000, "eval_hours": 0.1, "hours": 2.1}
    measured = {"tokens_per_second": 225.0, "padded_tokens_per_second": 250.0, "warmup_extra_seconds": 40.0,
                "eval_seconds": 30.0, "checkpoint_seconds": 5.0}
    whole = whole_run(run, predicted, measured, 2.0, interruptions_per_hour=0.5)
    # 400k padded tokens at 250/s and the warm-up's 40 s; evaluations at steps 10, 20, 30, 40; checkpoints
    # before steps 10, 20, 30 and at the end
    assert whole["train_hours"] == pytest.approx((1600 + 40) / 3600)
    assert (whole["evaluations"], whole["checkpoints"]) == (4, 4)
    assert whole["hours"] == pytest.approx((1600 + 40 + 4 * 30 + 4 * 5) / 3600)
    assert whole["tokens_per_second"] == pytest.approx(360_000 / 1640)  # what `tunecast train` will report
    assert whole["cost_usd"] == pytest.approx(2 * whole["hours"]) and whole["predicted_hours"] == 2.1
    # no evaluation timed (no held-out example in the slice): the plan's, scaled by measured ÷ predicted speed
    untimed = whole_run(run, predicted, {**measured, "eval_seconds": None}, 2.0, interruptions_per_hour=0.5)
    assert untimed["eval_hours"] == pytest.approx(0.1 * 500 / 225)


def test_the_whole_run_respects_max_steps(tmp_path: Path) -> None:
    """A 12-step run is 12 steps' tokens and time, not the epochs' (issue 29: 93,615 tokens said for ~11k)."""
    catalog = load_catalog(None)
    figures = DeviceFigures(device(), tuple(cpu_rows()))
    config = tmp_path / "model.json"
    config.write_text(json.dumps(MODEL))

    def length(**changes: Any) -> dict[str, Any]:
        values = {**RUN, "model": str(config), "dataset": {"examples": 1000, "mean_tokens": 200}, **changes}
        loaded = load_spec(None, [Override(k, v, "test") for k, v in values.items()], catalog)
        return predict(loaded, catalog, figures, {"micro_batch": 4, "grad_accum": 2, "grad_checkpointing": False})

    capped, epochs = length(max_steps=12), length(epochs=3)
    assert capped["steps"] == 12 and epochs["steps"] == 375  # 3 epochs of 1,000 examples, 8 a step
    assert capped["processed_tokens"] == pytest.approx(12 * 8 * 200)
    assert capped["hours"] == pytest.approx(epochs["hours"] * 12 / 375, rel=0.01)
    assert capped["padded_tokens"] == pytest.approx(epochs["padded_tokens"] * 12 / 375)


def _planner(tmp_path: Path, calibration: Calibration | None, **changes: Any) -> tuple[Planner, Any]:
    bundled = load_catalog(None)
    local = as_gpu(DeviceFigures(device(), tuple(cpu_rows())), None)
    catalog = dataclasses.replace(bundled, gpus=GpuIndex([local, bundled.gpus.get("h100-sxm")]), offers=())
    config = tmp_path / "model.json"
    config.write_text(json.dumps(MODEL))
    values = {**RUN, "model": str(config), "global_batch": 4, "grad_checkpointing": False,
              "dataset": {"examples": 1000, "mean_tokens": 200}, **changes}
    loaded = load_spec(None, [Override(k, v, "test") for k, v in values.items()], catalog)
    return Planner(loaded, catalog, workload_for(loaded, catalog), calibration), catalog


def test_the_calibrated_device_runs_at_the_measured_speed_and_the_others_are_corrected(tmp_path: Path) -> None:
    calibration = Calibration.from_document(document(spec()))
    planner, catalog = _planner(tmp_path, calibration)
    local = planner.configure(catalog.gpus.get("cpu-test"), 1)
    assert not isinstance(local, str)
    assert local.basis == "measured" and local.tokens_per_second == pytest.approx(450.0)
    plain, _ = _planner(tmp_path, None)
    h100 = planner.configure(catalog.gpus.get("h100-sxm"), 1)
    predicted = plain.configure(catalog.gpus.get("h100-sxm"), 1)
    assert not isinstance(h100, str) and not isinstance(predicted, str)
    assert h100.basis == "calibrated" and predicted.basis == "predicted"
    assert h100.step.compute_s == pytest.approx(2 * predicted.step.compute_s)
    assert h100.tokens_per_second < predicted.tokens_per_second
    # the measured device's memory is scaled by measured ÷ predicted
    assert local.memory.device_total_gib == pytest.approx(plain.configure(catalog.gpus.get("cpu-test"), 1)
                                                          .memory.device_total_gib / 0.8)


def test_on_a_cpu_host_time_adds_to_compute_and_measured_rates_set_the_matmuls() -> None:
    run = spec(precision="fp32")
    pair = get_profiles(MODEL, TraceSettings.from_spec(run, grad_checkpointing=False), 4, 256)
    constants = load_catalog(None).throughput

    def on(rows: list[Any]) -> StepTime:
        gpu = as_gpu(DeviceFigures(device(), tuple(rows)), None)
        return step_time(run, pair, gpu, constants, micro_batch=4, seq=256, grad_accum=1, gpu_count=1,
                         grad_checkpointing=False)

    slow = on(cpu_rows())
    assert slow.dispatch_s > 0 and slow.dispatch_s == pytest.approx(
        pair.deeper.flops_at(4, 256)["kernels"] * 50e-6 * pair.layers / pair.deeper.layers, rel=0.5)
    doubled = [r.model_copy(update={"value": r.value * 2}) if r.quantity == "matmul" else r for r in cpu_rows()]
    fast = on(doubled)
    assert fast.compute_s < slow.compute_s and fast.dispatch_s == pytest.approx(slow.dispatch_s)
    # the optimizer as the probe timed it: per parameter plus per tensor
    facts = pair.deeper.facts
    assert slow.optimizer_s >= facts.trainable_numel * 1e-9
