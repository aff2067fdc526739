"""`tunecast probe` and `tunecast calibrate` on this CPU, and the plan that uses them (`--gpu local`,
`--calibration`). The device is probed for real once per module (about 30 s); the commands reuse its
figures."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tests.trainruns import tiny_run

from tunecast.catalog.store import load_catalog
from tunecast.plan import probe

# The probe's promise: under a minute on an idle machine (about 30 s on this 2-core VM); the suite's other
# worker shares the two cores, which can double it.
PROBE_S_LIMIT = 60 * (2 if os.environ.get("PYTEST_XDIST_WORKER") else 1)


@pytest.fixture(scope="module")
def measured() -> probe.ProbeResult:
    return probe.run_probe(load_catalog(None).gpus, device="cpu")


@pytest.fixture(autouse=True)
def _reuse_probe(measured: probe.ProbeResult, monkeypatch: pytest.MonkeyPatch, shared_cache: Path) -> None:
    monkeypatch.setattr(probe, "run_probe", lambda *args, **kwargs: measured)
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))


def test_the_probe_measures_what_the_throughput_model_needs(measured: probe.ProbeResult) -> None:
    quantities = {row.quantity for row in measured.measurements}
    assert {"matmul", "matmul_forward", "matmul_input_grad", "matmul_weight_grad", "attention", "bandwidth", "random",
            "elementwise", "op_overhead", "optimizer", "optimizer_tensor"} <= quantities
    assert measured.device.kind == "cpu" and measured.device.count == 1 and measured.seconds < PROBE_S_LIMIT
    fp32 = {row.shape: row.value for row in measured.measurements if row.quantity == "matmul" and row.dtype == "fp32"}
    assert fp32["16x512x512"] < max(fp32.values())  # a handful of tokens is slower per FLOP than many
    # a small model's shapes are timed at their size: a LoRA adapter's, a 128-wide layer's, a small attention call
    assert {"16x128x8", "1024x128x8", "16x128x128", "1024x128x128"} <= set(fp32)
    attention = {row.shape for row in measured.measurements if row.quantity == "attention" and row.dtype == "fp32"}
    assert attention == {"x".join(map(str, shape)) for shape in probe.SHAPES["cpu"].attention}
    sizes = {row.shape for row in measured.measurements if row.quantity == "elementwise" and row.dtype == "fp32"}
    assert sizes == {str(size) for size in probe.ELEMENTWISE_SIZES}
    overhead = {row.shape: row.value for row in measured.measurements if row.quantity == "op_overhead"}
    assert 0 < overhead["full"] < 10_000 and 0 < overhead["lora"] < 10_000  # microseconds


def test_probe_saves_a_device_that_plan_and_memory_use_as_local(cli, isolated_home: Path) -> None:
    saved = cli("probe", "--json")
    assert saved.code == 0, saved.stderr
    assert (isolated_home / "catalog" / "devices.csv").is_file()
    config = tiny_run(isolated_home)
    plan = cli("plan", str(config), "--gpu", "local", "--json")
    assert plan.code == 0, plan.stderr
    options = plan.json()["options"]
    assert [o["gpu_count"] for o in options] == [1] and options[0]["fits"]  # one CPU: one device
    assert options[0]["tokens_per_second"] > 0 and options[0]["basis"] == "predicted"
    memory = cli("memory", str(config), "--gpu", "local", "--json")
    assert memory.code == 0, memory.stderr
    assert memory.json()["device"] == "cpu" and memory.json()["fits"]


def test_calibrate_measures_extrapolates_and_the_plan_uses_it(cli, isolated_home: Path, tmp_path: Path) -> None:
    # a 12-step run of 2 epochs' data: the whole run is its 12 steps, not the epochs'
    config = tiny_run(tmp_path, eval={"examples": 4, "every_steps": 5}, max_steps=12)
    target = tmp_path / "calibration.json"
    result = cli("calibrate", str(config), "--steps", "8", "-o", str(target))
    assert result.code == 0, result.stderr
    document: dict[str, Any] = json.loads(target.read_text())
    measured, predicted, whole = document["measured"], document["predicted"], document["whole_run"]
    assert measured["steps_measured"] <= 8 and measured["warmup_steps_excluded"] >= 2
    ran = measured["steps_measured"] + measured["warmup_steps_excluded"]
    assert len(measured["each_step"]["seconds"]) == ran
    assert measured["ci_low"] <= measured["tokens_per_second"] <= measured["ci_high"]
    assert measured["relative_ci"] > 0 and isinstance(measured["stable"], bool) and measured["stop_reason"]
    assert measured["growth_gib"] > 0 and measured["eval_seconds"] > 0 and measured["checkpoint_seconds"] > 0
    assert predicted["tokens_per_second"] > 0 and document["config"]["resolved"]["micro_batch"] == 2
    assert whole["steps"] == 12 and whole["evaluations"] == 3 and whole["checkpoints"] == 6  # every 2 steps
    assert whole["tokens"] == pytest.approx(predicted["processed_tokens"])
    assert whole["hours"] == pytest.approx(whole["train_hours"] + whole["eval_hours"] + whole["checkpoint_hours"])
    assert "tokens/s" in result.stdout and "whole run (12 steps" in result.stdout and "interval" in result.stdout
    assert not (tmp_path / "out").exists()  # nothing left behind: no checkpoints, no final model

    plan = cli("plan", str(config), "--calibration", str(target), "--gpu", "h100", "--json")
    assert plan.code == 0, plan.stderr
    options = plan.json()["options"]
    local = [o for o in options if o["gpu"] == document["device"]["slug"]]
    assert len(local) == 1 and local[0]["basis"] == "measured"  # always among the options
    assert local[0]["tokens_per_second"] == pytest.approx(measured["tokens_per_second"], rel=0.01)
    assert {o["basis"] for o in options if o["gpu"] == "h100-sxm" and o["fits"]} == {"calibrated"}

    refused = cli("plan", str(config), "--calibration", str(target), "--set", "lora.rank=8")
    assert refused.code == 2 and "lora.rank" in refused.stderr


def test_an_interrupted_calibration_writes_nothing(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tunecast.cli import train_cmds

    config = tiny_run(tmp_path)
    target = tmp_path / "calibration.json"
    original = train_cmds.ConsoleReporter.step

    def interrupt(self: Any, record: dict[str, Any], *args: Any) -> None:
        original(self, record, *args)
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the measured steps

    monkeypatch.setattr(train_cmds.ConsoleReporter, "step", interrupt)
    result = cli("calibrate", str(config), "--steps", "20", "-o", str(target))
    assert result.code == 130 and "nothing written" in result.stderr
    assert not target.exists() and not list(tmp_path.glob("*.tmp*"))


def test_local_before_any_probe_says_to_probe(cli, isolated_home: Path) -> None:
    planned = cli("plan", str(tiny_run(isolated_home)), "--gpu", "local")
    assert planned.code == 2 and "unknown GPU 'local'" in planned.stderr
    assert "run `tunecast probe` first" in planned.stderr
