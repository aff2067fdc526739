"""What used to end a run with an internal error ("This is a bug", exit 1) is a one-line user error (exit 2),
said before anything is traced or loaded where it can be, and with the newest checkpoint intact where one was
written: a full disk while appending metrics.jsonl, a truncated model.safetensors, `attention: flash` without
flash-attn or a GPU, `precision: fp8` on the CPU, a model without weights (random weights are opt-in)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from tests.trainruns import NO_EVAL, TINY_MODEL, tiny_run

import tunecast.train.metrics as metrics
import tunecast.train.session as session


@pytest.fixture(autouse=True)
def shared_profiles(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))


@pytest.fixture
def nothing_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run must stop before the memory estimate (its trace takes 18 s on a real model) and before the data."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("reached the memory estimate")

    monkeypatch.setattr(session, "choose_batch", refuse)
    monkeypatch.setattr(session, "run_data", refuse)


def one_user_error(result: Any) -> str:
    assert result.code == 2, result.stderr[-3000:]
    assert "bug" not in result.stderr and "Traceback" not in result.stderr
    return " ".join(result.stderr.split())


class _FullAfter:
    """metrics.jsonl opened on a disk that fills up once `ready(line)` says so."""

    def __init__(self, handle: Any, ready: Any) -> None:
        self.handle, self.ready = handle, ready

    def write(self, data: Any) -> int:
        if self.ready(bytes(data)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return int(self.handle.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


def fill_disk_at(monkeypatch: pytest.MonkeyPatch, ready: Any) -> None:
    real = open

    def opened(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real(path, mode, *args, **kwargs)
        return _FullAfter(handle, ready) if mode == "ab" else handle

    monkeypatch.setattr(metrics, "open", opened, raising=False)


def test_a_full_disk_while_appending_metrics_keeps_the_checkpoint(cli, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_run(tmp_path, max_steps=4, **NO_EVAL)  # a checkpoint every 2 steps
    fill_disk_at(monkeypatch, lambda line: b'"kind": "train", "step": 3' in line)

    said = one_user_error(cli("train", str(config), "--no-memory-check"))

    assert f"cannot write {tmp_path}/out/metrics.jsonl: No space left on device" in said
    assert "the checkpoint of step 2 is intact: run the same command again to resume from it" in said
    monkeypatch.undo()
    resumed = cli("train", str(config), "--no-memory-check", "--json")
    assert resumed.code == 0, resumed.stderr[-3000:]
    assert resumed.json()["resumed_from_step"] == 2 and resumed.json()["steps"] == 4


def test_a_full_disk_before_any_checkpoint_does_not_claim_one(cli, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fill_disk_at(monkeypatch, lambda line: True)
    said = one_user_error(cli("train", str(tiny_run(tmp_path, max_steps=2, **NO_EVAL)), "--no-memory-check"))
    assert "No space left on device" in said
    assert "no checkpoint was written yet: the same command starts the run over" in said
    assert "intact" not in said


def test_a_truncated_weights_file_is_a_user_error(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY_MODEL))).save_pretrained(str(folder))
    for path in TINY_MODEL.iterdir():
        if path.name != "config.json":
            (folder / path.name).write_bytes(path.read_bytes())
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    config = tiny_run(tmp_path, model=str(folder), random_weights=None, max_steps=1, **NO_EVAL)

    said = one_user_error(cli("train", str(config), "--no-memory-check"))

    assert f"error: cannot read the weights in {folder}: Error while deserializing header" in said
    assert "truncated or damaged file" in said and "download the weights again" in said
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_model_without_weights_is_refused_unless_random_weights(cli, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   nothing_traced: None) -> None:
    config = tiny_run(tmp_path, random_weights=None, max_steps=1, **NO_EVAL)
    said = one_user_error(cli("train", str(config)))
    assert (f"error: the model folder {TINY_MODEL} has no weights: none of model.safetensors, "
            "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json is there") in said
    assert "random_weights: true (--random-weights)" in said
    catalog_file = json.loads((TINY_MODEL / "config.json").read_text())
    (tmp_path / "tiny.json").write_text(json.dumps(catalog_file))
    said = one_user_error(cli("train", str(tiny_run(tmp_path, model=str(tmp_path / "tiny.json"), random_weights=None,
                                                    max_steps=1, **{"dataset.tokenizer": str(TINY_MODEL)}))))
    assert f"the model {tmp_path / 'tiny.json'} is a config file, which holds no weights" in said


def test_random_weights_by_flag(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tiny_run(tmp_path, random_weights=None, max_steps=1, **NO_EVAL)
    result = cli("train", str(config), "--random-weights", "--no-memory-check")
    assert result.code == 0, result.stderr[-3000:]
    assert "random weights drawn from seed 7 (random_weights: true;" in " ".join(result.stderr.split())


def test_flash_attention_without_flash_attn_is_refused_before_the_trace(cli, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                        nothing_traced: None) -> None:
    said = one_user_error(cli("train", str(tiny_run(tmp_path, attention="flash", precision="bf16", max_steps=1))))
    assert "error: attention: flash runs flash-attn's CUDA kernels, and this machine has no CUDA GPU" in said
    assert "attention: sdpa" in said


def test_fp8_on_the_cpu_is_refused_before_the_trace(cli, tmp_path: Path, nothing_traced: None) -> None:  # type: ignore[no-untyped-def]
    said = one_user_error(cli("train", str(tiny_run(tmp_path, precision="fp8", max_steps=1))))
    assert "error: precision fp8 needs a GPU with FP8 tensor cores; this run is on the CPU" in said


def test_flash_and_fp8_need_the_right_gpu_and_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks for a CUDA machine, given its capability and what is installed."""
    import importlib.util

    from tunecast.config.spec import RunSpec
    from tunecast.errors import TunecastError
    from tunecast.train.preflight import check_attention, check_fp8

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TunecastError, match=r"^attention: flash needs the flash-attn package, which is not installed$"):
        check_attention(RunSpec(model="m", attention="flash"), cuda=True)
    fp8 = RunSpec(model="m", precision="fp8")
    with pytest.raises(TunecastError, match=r"compute capability 8\.9 or newer.*; NVIDIA A100 has 8\.0$"):
        check_fp8(fp8, cuda=True, capability=(8, 0), device_name="NVIDIA A100")
    with pytest.raises(TunecastError, match="torchao's float8 training, which is not installed"):
        check_fp8(fp8, cuda=True, capability=(9, 0), device_name="NVIDIA H100")
