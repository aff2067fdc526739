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
    ("model_name_or_path: m\nquantization_bit: 3\n", "3-bit bnb base weights cannot be estimated"),
    ("model_name_or_path: m\nquantization_bit: 8\nquantization_method: hqq\n", "8-bit hqq"),
    ("model_name_or_path: m\nquantization_bit: 8\nfinetuning_type: full\n", "8-bit weights need finetuning_type"),
    ("model_name_or_path: m\nquantization_method: gptq\n", r"`quantization_method`.*already quantized by GPTQ"),
    ("model_name_or_path: m\nquantization_method: awq\n", r"pre-quantized AWQ checkpoint's method"),
])
def test_runs_that_cannot_be_estimated(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match):
        llamafactory.read(path)


def test_8bit_bitsandbytes_is_qlora_on_8_bits(tmp_path: Path) -> None:
    path = tmp_path / "lora8.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen3-0.6B\nquantization_bit: 8\nquantization_method: bnb\n",
                    encoding="utf-8")
    imported = llamafactory.read(path)
    spec = checked(imported)
    assert (spec.method, spec.quantization.bits, spec.lora.rank) == ("qlora", 8, 8)
    assert imported.mapped["quantization_bit"] == ("method", "quantization.bits")
    assert "LLM.int8" in reason(imported, "quantization_method")


def test_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "scalar.yaml"
    path.write_text("just text\n", encoding="utf-8")
    with pytest.raises(TunecastError, match="must hold a mapping"):
        llamafactory.read(path)


V1 = DATA / "llamafactory" / "v1"  # LLaMA-Factory's own v1 examples (source line at the top of each)


def test_v1_lora_sft_example() -> None:
    imported = llamafactory.read(V1 / "train_lora_sft.yaml")
    spec = checked(imported)
    assert (spec.runner, spec.model, spec.method, spec.precision) == ("llamafactory", "Qwen/Qwen3-4B", "lora", "bf16")
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.targets) == (16, 32, 0.05, "all-linear")
    assert (spec.micro_batch, spec.grad_accum, spec.seq_len, spec.max_steps) == (1, 1, 2048, 10)
    assert "epochs" not in imported.config  # max_steps alone is the run, as v1's trainer counts it
    assert (spec.optimizer, spec.schedule, spec.weight_decay, spec.grad_checkpointing) == \
        ("adamw-foreach", "constant", 0.01, True)
    assert (spec.gpus.strategy, spec.attention) == ("fsdp", "sdpa")
    assert imported.mapped["peft_config.r"] == ("lora.rank",)
    assert imported.lines["lora.rank"] == 8
    assert "several datasets" in reason(imported, "train_dataset")
    assert "NPU" in reason(imported, "kernel_config")


def test_v1_qlora_example() -> None:
    imported = llamafactory.read(V1 / "quantization.yaml")
    spec = checked(imported)
    assert (spec.model, spec.method, spec.precision, spec.lora.rank) == ("Qwen/Qwen3-0.6B", "qlora", "bf16", 16)
    assert imported.mapped["quant_config.quantization_bit"] == ("method",)


def test_v1_8bit_bitsandbytes_is_qlora_on_8_bits(tmp_path: Path) -> None:
    path = tmp_path / "v1.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\npeft_config:\n  name: lora\nquant_config:\n  name: bnb\n"
                    "  quantization_bit: 8\n", encoding="utf-8")
    imported = llamafactory.read(path)
    spec = checked(imported)
    assert (spec.method, spec.quantization.bits) == ("qlora", 8)
    assert imported.mapped["quant_config.quantization_bit"] == ("method", "quantization.bits")


def test_v1_full_fsdp2_example() -> None:
    imported = llamafactory.read(V1 / "train_full_fsdp2.yaml")
    spec = checked(imported)
    assert (spec.method, spec.precision, spec.gpus.strategy, spec.learning_rate) == ("full", "bf16-mixed", "fsdp", 1e-4)
    assert "lora" not in imported.config
    assert any("skips the FSDP2 wrap" in note for note in imported.notes)


def test_v1_dpo_example_is_refused_for_its_preference_dataset() -> None:
    with pytest.raises(TunecastError, match=r"`train_dataset` \(line 23\): dataset 'dpo_zh_demo' .*converter: pair"):
        llamafactory.read(V1 / "train_lora_dpo.yaml")


def test_v1_batch_precision_and_sharding(tmp_path: Path) -> None:
    path = tmp_path / "v1.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\nmicro_batch_size: 2\nglobal_batch_size: 16\nbf16: false\n"
                    "enable_activation_checkpointing: false\ndist_config:\n  name: fsdp2\n"
                    "  reshard_after_forward: false\n  offload_params: true\n", encoding="utf-8")
    imported = llamafactory.read(path)
    spec = checked(imported)
    assert (spec.micro_batch, spec.global_batch, spec.epochs, spec.grad_checkpointing) == (2, 16, 3.0, False)
    assert "grad_accum" not in imported.config
    assert (spec.method, spec.precision, spec.gpus.strategy, spec.gpus.offload) == ("full", "fp32", "fsdp-grad-op", "params")


def test_v1_quantization_before_adapters_and_lora_defaults(tmp_path: Path) -> None:
    path = tmp_path / "v1.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\nquant_config:\n  name: bnb\npeft_config:\n  name: lora\n"
                    "  target_modules: q_proj\n", encoding="utf-8")
    spec = checked(llamafactory.read(path))
    assert (spec.method, spec.precision, spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.targets) == \
        ("qlora", "bf16", 8, 16, 0.05, ["q_proj"])


def test_v1_full_without_dist_config_is_fp32(tmp_path: Path) -> None:
    path = tmp_path / "v1.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\nbf16: true\nnum_train_epochs: 2\n", encoding="utf-8")
    imported = llamafactory.read(path)
    spec = checked(imported)
    assert (spec.method, spec.precision, spec.epochs) == ("full", "fp32", 2.0)
    assert "without autocast" in reason(imported, "bf16")


def test_v1_local_dataset_list(tmp_path: Path) -> None:
    (tmp_path / "rows.json").write_text('[{"instruction": "a", "output": "b"}]', encoding="utf-8")
    (tmp_path / "sft.yaml").write_text("mine:\n  path: rows.json\n  source: local\n  converter: alpaca\n",
                                       encoding="utf-8")
    path = tmp_path / "v1.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\npeft_config:\n  name: lora\ntrain_dataset: sft.yaml\n", encoding="utf-8")
    spec = checked(llamafactory.read(path))
    assert (spec.dataset.path, spec.dataset.format) == (str((tmp_path / "rows.json").resolve()), "alpaca")


def test_v1_unknown_plugin_key_and_odd_values_are_listed(tmp_path: Path) -> None:
    path = tmp_path / "v1.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\npeft_config:\n  name: lora\n  rank: 4\nflash_attn: [fa2]\n"
                    "cp_size: 2\n", encoding="utf-8")
    imported = llamafactory.read(path)
    assert "misspelt" in reason(imported, "peft_config.rank")
    assert "not one of v1's" in reason(imported, "flash_attn")
    assert "splits each sequence over 2 GPUs" in reason(imported, "cp_size")
    assert checked(imported).lora.rank == 8


@pytest.mark.parametrize(("text", "match"), [
    ("model: m\nmodel_class: cls\n", "model_class 'cls' trains a reward model"),
    ("model: m\npref_beta: 0.1\n", "pref_beta is a setting of DPO"),
    ("model: m\npeft_config:\n  name: freeze\n", "peft_config 'freeze'"),
    ("model: m\npeft_config:\n  name: lora\nquant_config:\n  name: bnb\n  quantization_bit: 2\n",
     "2-bit base weights cannot be estimated"),
    ("model: m\nquant_config:\n  name: bnb\n", "4-bit weights need adapters"),
    ("model: m\nquant_config:\n  name: bnb\n  quantization_bit: 8\n", "8-bit weights need adapters"),
    ("model: m\ndist_config:\n  name: megatron\n", "dist_config 'megatron'"),
    ("model: m\npeft_config: lora\n", "must be a mapping with a `name`"),
    ("model: m\npeft_config:\n  name: lora\nquant_config:\n  name: bnb\n  quantization_bit: four\n",
     "'four' is not a number of bits"),
])
def test_v1_runs_that_cannot_be_estimated(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match):
        llamafactory.read(path)


def test_v1_dataset_list_is_found_from_the_repository_root_above_the_config(tmp_path: Path) -> None:
    """LLaMA-Factory runs its examples/v1/… configs from the repository root, where their data/ is."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.json").write_text('[{"instruction": "a", "output": "b"}]', encoding="utf-8")
    (tmp_path / "data" / "sft.yaml").write_text("mine:\n  path: data/rows.json\n  source: local\n  converter: alpaca\n",
                                                encoding="utf-8")
    folder = tmp_path / "examples" / "v1" / "train_lora"
    folder.mkdir(parents=True)
    (folder / "v1.yaml").write_text("model: Qwen/Qwen3-0.6B\ntrain_dataset: data/sft.yaml\n", encoding="utf-8")
    imported = llamafactory.read(folder / "v1.yaml")
    spec = checked(imported)
    assert (spec.dataset.path, spec.dataset.format) == (str((tmp_path / "data" / "rows.json").resolve()), "alpaca")
    assert any(f"is read from {tmp_path.resolve()}, not the config's folder" in note for note in imported.notes)
    (tmp_path / "data" / "sft.yaml").write_text("pairs:\n  path: HuggingFaceH4/orca_dpo_pairs\n  converter: pair\n",
                                                encoding="utf-8")
    with pytest.raises(TunecastError, match=r"`train_dataset` \(line 2\): dataset 'pairs' holds chosen and rejected"):
        llamafactory.read(folder / "v1.yaml")
