from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.runners.helpers import DATA, checked, reason

from tunecast.errors import TunecastError
from tunecast.runners import llamafactory


def test_lora_sft_with_a_dataset_from_dataset_info() -> None:
    imported = llamafactory.read(DATA / "llamafactory" / "lora_sft.yaml")
    spec = checked(imported)
    assert (spec.runner, spec.model, spec.method) == ("llamafactory", "meta-llama/Llama-3.1-8B", "lora")
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.targets) == (16, 32, 0.0, "all-linear")
    assert (spec.seq_len, spec.packing, spec.attention, spec.grad_checkpointing) == (4096, True, "flash", True)
    assert (spec.micro_batch, spec.grad_accum, spec.epochs, spec.learning_rate) == (2, 8, 2.0, 1e-4)
    assert (spec.schedule, spec.warmup_ratio, spec.optimizer, spec.precision) == ("cosine", 0.1, "adamw-foreach", "bf16")
    assert spec.dataset.path == str((DATA / "llamafactory" / "data" / "alpaca_local.json").resolve())
    assert spec.dataset.format == "alpaca"
    assert imported.lines["dataset.path"] == 14
    assert "no effect" in reason(imported, "template")


def test_qlora_with_several_datasets() -> None:
    imported = llamafactory.read(DATA / "llamafactory" / "qlora.yaml")
    spec = checked(imported)
    assert (spec.model, spec.method, spec.lora.targets) == ("Qwen/Qwen2.5-7B", "qlora", ["q_proj", "v_proj"])
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout) == (8, 32, 0.05)
    assert (spec.seq_len, spec.max_steps, spec.schedule, spec.warmup_steps) == (1024, 300, "constant_with_warmup", 10)
    assert (spec.optimizer, spec.precision) == ("paged-adamw-8bit", "bf16")
    assert "several datasets" in reason(imported, "dataset")


def test_full_keeps_fp32_master_weights_and_defaults() -> None:
    imported = llamafactory.read(DATA / "llamafactory" / "full.yaml")
    spec = checked(imported)
    assert (spec.method, spec.precision, spec.grad_checkpointing) == ("full", "bf16-mixed", False)
    assert (spec.micro_batch, spec.grad_accum, spec.seq_len, spec.schedule) == (8, 1, 512, "linear")
    assert spec.optimizer == "adamw"
    assert "lion_32bit" in reason(imported, "optim")
    assert "lora" not in imported.config


def test_defaults_when_unset(tmp_path: Path) -> None:
    path = tmp_path / "min.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen3-0.6B\nlora_rank: 4\npure_bf16: true\n", encoding="utf-8")
    spec = checked(llamafactory.read(path))
    assert (spec.method, spec.seq_len, spec.lora.rank, spec.lora.alpha, spec.grad_checkpointing) == \
        ("lora", 2048, 4, 8, True)
    assert (spec.precision, spec.lora.fp32_adapters, spec.lora.targets) == ("bf16", False, ["q_proj", "v_proj"])


@pytest.mark.parametrize(("text", "match"), [
    ("model_name_or_path: m\nstage: dpo\n", "stage 'dpo'"),
    ("model_name_or_path: m\nstage: ppo\n", "stage 'ppo'"),
    ("model_name_or_path: m\nfinetuning_type: freeze\n", "freeze"),
    ("model_name_or_path: m\nfinetuning_type: oft\n", "oft"),
    ("model_name_or_path: m\nquantization_bit: 8\n", "8-bit"),
    ("model_name_or_path: m\nquantization_method: gptq\n", "pre-quantized"),
])
def test_runs_that_cannot_be_estimated(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match):
        llamafactory.read(path)


def test_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "scalar.yaml"
    path.write_text("just text\n", encoding="utf-8")
    with pytest.raises(TunecastError, match="must hold a mapping"):
        llamafactory.read(path)
