from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.runners.helpers import DATA, checked, reason

from tunecast.errors import TunecastError
from tunecast.runners import trl


def test_sft_with_peft_takes_trls_lora_defaults() -> None:
    imported = trl.read(DATA / "trl" / "sft_peft.yaml")
    spec = checked(imported)
    assert (spec.runner, spec.model, spec.method) == ("trl", "Qwen/Qwen2.5-7B", "lora")
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.targets) == \
        (32, 32, 0.05, ["q_proj", "v_proj"])
    assert (spec.seq_len, spec.packing, spec.grad_checkpointing, spec.attention) == (2048, True, True, "flash")
    assert (spec.micro_batch, spec.grad_accum, spec.epochs, spec.learning_rate) == (4, 2, 1.0, 1e-4)
    assert (spec.precision, spec.schedule, spec.warmup_ratio) == ("bf16-mixed", "cosine", 0.03)
    assert spec.dataset.path == str((DATA / "trl" / "data" / "chat.jsonl").resolve())
    assert "logging" in reason(imported, "report_to")


def test_sft_qlora_in_bfloat16() -> None:
    imported = trl.read(DATA / "trl" / "sft_qlora.yaml")
    spec = checked(imported)
    assert (spec.method, spec.lora.targets, spec.lora.rank, spec.lora.alpha) == ("qlora", "all-linear", 16, 16)
    assert (spec.precision, spec.optimizer, spec.max_steps, spec.seq_len) == ("bf16", "paged-adamw", 500, 1024)
    assert (spec.learning_rate, spec.micro_batch, spec.seed) == (2e-5, 2, 3)
    assert imported.mapped["dtype"] == ("precision",)
    assert "Hub dataset" in reason(imported, "dataset_name")


def test_full_fine_tuning_defaults(tmp_path: Path) -> None:
    path = tmp_path / "full.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen3-0.6B\nbf16: false\n", encoding="utf-8")
    spec = checked(trl.read(path))
    assert (spec.method, spec.precision, spec.seq_len, spec.grad_checkpointing) == ("full", "fp32", 1024, True)


@pytest.mark.parametrize(("text", "match"), [
    ("model_name_or_path: m\nuse_peft: true\nload_in_8bit: true\n", "8-bit"),
    ("model_name_or_path: m\nload_in_4bit: true\n", "without adapters"),
])
def test_runs_that_cannot_be_estimated(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match):
        trl.read(path)
