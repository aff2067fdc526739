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


def test_peft_on_an_8bit_base_is_qlora_on_8_bits(tmp_path: Path) -> None:
    path = tmp_path / "sft8.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-7B\nload_in_8bit: true\nuse_peft: true\n", encoding="utf-8")
    imported = trl.read(path)
    spec = checked(imported)
    assert (spec.method, spec.quantization.bits, spec.lora.rank) == ("qlora", 8, 16)
    assert imported.mapped["load_in_8bit"] == ("method", "quantization.bits")


@pytest.mark.parametrize(("text", "match"), [
    ("model_name_or_path: m\nuse_peft: true\nload_in_8bit: true\nload_in_4bit: true\n",
     r"`load_in_8bit`.*together with load_in_4bit"),
    ("model_name_or_path: m\nload_in_8bit: true\n", r"`load_in_8bit`.*8-bit weights cannot be trained without"),
    ("model_name_or_path: m\nload_in_4bit: true\n", "without adapters"),
])
def test_runs_that_cannot_be_estimated(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match):
        trl.read(path)


def test_fsdp_qlora_script_config_with_model_id() -> None:
    """A config for philschmid's run_fsdp_qlora.py (source line at the top of the file): its model key is model_id."""
    imported = trl.read(DATA / "trl" / "llama_3_70b_fsdp_qlora.yaml")
    spec = checked(imported)
    assert (spec.model, spec.method, spec.precision) == ("meta-llama/Meta-Llama-3-70b", "qlora", "bf16")
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.targets) == (16, 8, 0.05, "all-linear")
    assert (spec.seq_len, spec.packing, spec.micro_batch, spec.grad_accum) == (512, True, 1, 2)
    assert (spec.gpus.strategy, spec.gpus.offload, spec.optimizer) == ("fsdp", "params", "adamw-foreach")
    assert imported.mapped["model_id"] == ("model",)
    assert "max_seq_length's default, 512" in reason(imported, "max_seq_len")
    assert "train_dataset.json" in reason(imported, "dataset_path")


def test_model_id_script_dataset_and_trainer_defaults(tmp_path: Path) -> None:
    (tmp_path / "train_dataset.json").write_text('{"messages": []}\n', encoding="utf-8")
    path = tmp_path / "script.yaml"
    path.write_text("model_id: Qwen/Qwen2.5-7B\ndataset_path: .\nmax_seq_length: 2048\n", encoding="utf-8")
    spec = checked(trl.read(path))
    assert (spec.method, spec.seq_len, spec.grad_checkpointing, spec.learning_rate) == ("qlora", 2048, False, 5e-5)
    assert (spec.dataset.path, spec.dataset.format) == (str((tmp_path / "train_dataset.json").resolve()), "messages")


def test_model_id_alone_names_the_model(tmp_path: Path) -> None:
    path = tmp_path / "script.yaml"
    path.write_text("model_id: Qwen/Qwen3-0.6B\n", encoding="utf-8")
    imported = trl.read(path)
    spec = checked(imported)
    assert (spec.model, spec.method, spec.precision) == ("Qwen/Qwen3-0.6B", "full", "bf16-mixed")
    assert any("model_id is a training script's own argument" in note for note in imported.notes)


def test_model_id_beside_model_name_or_path_is_not_a_trl_key(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen3-0.6B\nmodel_id: Qwen/Qwen2.5-7B\n", encoding="utf-8")
    imported = trl.read(path)
    assert checked(imported).model == "Qwen/Qwen3-0.6B"
    assert "misspelt" in reason(imported, "model_id")


@pytest.mark.parametrize(("text", "field", "match"), [
    ("max_prompt_length: 512\nbeta: 0.1\n", "max_prompt_length", r"\(line 2\): max_prompt_length is a key of TRL's "
                                                                  "DPOConfig, not of SFTConfig: a DPO run"),
    ("loss_type: sigmoid\n", "loss_type", "loss_type 'sigmoid' is a loss of TRL's DPOTrainer"),
    ("loss_type:\n- sft\n- apo_zero\n", "loss_type", r"loss_type \['sft', 'apo_zero'\] is a loss of TRL's DPOTrainer"),
    ("rpo_alpha: 1.0\n", "rpo_alpha", "a DPO run"),
])
def test_dpo_configs_are_refused(tmp_path: Path, text: str, field: str, match: str) -> None:
    path = tmp_path / "dpo.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen3-0.6B\n" + text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match) as refused:
        trl.read(path)
    assert refused.value.problems[0].field == field


@pytest.mark.parametrize("loss", ["nll", "chunked_nll", "dft"])
def test_sft_losses_are_read(tmp_path: Path, loss: str) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text(f"model_name_or_path: Qwen/Qwen3-0.6B\nloss_type: {loss}\n", encoding="utf-8")
    imported = trl.read(path)
    assert checked(imported).method == "full"
    assert "loss" in reason(imported, "loss_type")


@pytest.mark.parametrize(("text", "precision", "decides"), [
    ("torch_dtype: bfloat16\n", "bf16", "torch_dtype"),
    ("torch_dtype: float32\n", "bf16-mixed", "torch_dtype"),
    ("dtype: float32\ntorch_dtype: bfloat16\n", "bf16-mixed", "dtype"),
])
def test_torch_dtype_is_the_old_name_of_dtype(tmp_path: Path, text: str, precision: str, decides: str) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen3-0.6B\n" + text, encoding="utf-8")
    imported = trl.read(path)
    assert checked(imported).precision == precision
    assert imported.mapped[decides] == ("precision",)
    if decides == "dtype":
        assert "dtype is given and wins" in reason(imported, "torch_dtype")
