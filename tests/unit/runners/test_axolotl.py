from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.runners.helpers import DATA, checked, reason

from tunecast.errors import TunecastError
from tunecast.runners import axolotl


def test_lora_with_packing_and_a_local_dataset() -> None:
    imported = axolotl.read(DATA / "axolotl" / "lora.yml")
    spec = checked(imported)
    assert spec.runner == "axolotl"
    assert (spec.model, spec.method, spec.seq_len, spec.packing) == ("meta-llama/Llama-3.1-8B", "lora", 2048, True)
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout) == (16, 32, 0.05)
    assert spec.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (spec.micro_batch, spec.grad_accum, spec.epochs) == (2, 4, 2.0)
    assert (spec.optimizer, spec.schedule, spec.learning_rate) == ("adamw-foreach", "linear", 1e-4)
    assert (spec.precision, spec.grad_checkpointing, spec.activation_offload) == ("bf16", True, True)
    assert (spec.attention, spec.warmup_steps, spec.weight_decay, spec.seed) == ("flash", 20, 0.01, 7)
    assert spec.dataset.path == str((DATA / "axolotl" / "data" / "train.jsonl").resolve())
    assert (spec.dataset.format, spec.dataset.train_on) == ("alpaca", "completion")
    assert spec.checkpoint.every_steps == 200
    assert imported.mapped["gradient_checkpointing"] == ("grad_checkpointing", "activation_offload")
    assert imported.lines["seq_len"] == 14  # sequence_len: 2048
    assert "no effect" in reason(imported, "tf32")
    assert "default applies" in reason(imported, "wandb_project")


def test_qlora_with_a_hub_dataset_and_deepspeed() -> None:
    imported = axolotl.read(DATA / "axolotl" / "qlora.yml")
    spec = checked(imported)
    assert (spec.model, spec.method, spec.lora.targets) == ("mistralai/Mistral-7B-v0.1", "qlora", "all-linear")
    assert (spec.seq_len, spec.packing, spec.micro_batch, spec.epochs) == (4096, True, 1, 1.0)
    assert (spec.optimizer, spec.precision, spec.attention) == ("paged-adamw-8bit", "bf16", "sdpa")
    assert (spec.gpus.strategy, spec.gpus.offload) == ("zero2", "optimizer")
    assert spec.dataset.path is None
    assert "Hub dataset" in reason(imported, "datasets")
    assert "misspelt" in reason(imported, "unknown_knob")
    assert any("gpus.count" in note for note in imported.notes)


def test_unset_keys_take_axolotls_defaults(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yml"
    path.write_text("base_model: Qwen/Qwen3-0.6B\nlearning_rate: 0.0001\n", encoding="utf-8")
    imported = axolotl.read(path)
    spec = checked(imported)
    assert (spec.method, spec.seq_len, spec.micro_batch, spec.epochs) == ("full", 512, 1, 1.0)
    assert (spec.optimizer, spec.schedule, spec.precision) == ("adamw", "cosine", "bf16")
    assert imported.config.get("grad_checkpointing") is False
    assert "lora" not in imported.config and "warmup_steps" not in imported.config


def test_lora_without_targets_takes_peft_defaults(tmp_path: Path) -> None:
    path = tmp_path / "lora.yml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nlora_r: 8\nlearning_rate: 1e-4\n"
                    "optimizer: lion_8bit\n", encoding="utf-8")
    imported = axolotl.read(path)
    spec = checked(imported)
    assert spec.lora.targets == ["q_proj", "v_proj"]
    assert spec.optimizer == "adamw"
    assert "no tunecast equivalent" in reason(imported, "optimizer")


@pytest.mark.parametrize("text", [
    "base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nload_in_8bit: true\n",
    "base_model: meta-llama/Llama-3.1-8B\nload_in_8bit: true\nadapter: lora\n",  # either order
])
def test_lora_on_an_8bit_base_is_qlora_on_8_bits(tmp_path: Path, text: str) -> None:
    path = tmp_path / "lora8.yml"
    path.write_text(text + "load_in_4bit: false\n", encoding="utf-8")
    imported = axolotl.read(path)
    spec = checked(imported)
    assert (spec.method, spec.quantization.bits, spec.fixed("quantization.bits")) == ("qlora", 8, True)
    assert imported.mapped["load_in_8bit"] == ("method", "quantization.bits")
    assert imported.lines["quantization.bits"] == text.splitlines().index("load_in_8bit: true") + 1
    assert "not 4-bit" in reason(imported, "load_in_4bit")


@pytest.mark.parametrize(("text", "match"), [
    ("base_model: m\nadapter: qlora\nload_in_8bit: true\n", r"`load_in_8bit`.*refuses adapter: qlora in 8-bit"),
    ("base_model: m\nload_in_8bit: true\n", r"`load_in_8bit`.*quantized weights without an adapter"),
    ("base_model: m\nadapter: lora\ngptq: true\n", r"`gptq`.*already quantized by GPTQ"),
    ("base_model: m\nadapter: llama-adapter\n", "llama-adapter"),
    ("base_model: m\nadapter: qlora\n", "load_in_4bit"),
])
def test_runs_that_cannot_be_estimated(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match):
        axolotl.read(path)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TunecastError, match="does not exist"):
        axolotl.read(tmp_path / "missing.yml")
    (tmp_path / "list.yml").write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(TunecastError, match="mapping"):
        axolotl.read(tmp_path / "list.yml")
    (tmp_path / "broken.yml").write_text("base_model: [a\n", encoding="utf-8")
    with pytest.raises(TunecastError, match="YAML"):
        axolotl.read(tmp_path / "broken.yml")


def test_a_key_written_twice_is_read_as_axolotl_reads_it(tmp_path: Path) -> None:
    """PyYAML, which the tools load their files with, keeps a repeated key's last value: so does tunecast, and says so."""
    config = tmp_path / "twice.yml"
    config.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nsequence_len: 1024\nmicro_batch_size: 2\n"
                      "lora_r: 8\nsequence_len: 2048\nlora_target_modules:\n  - q_proj\nlora_target_modules:\n"
                      "  - v_proj\n")
    imported = axolotl.read(config)
    spec = checked(imported)
    assert (spec.seq_len, spec.lora.targets) == (2048, ["v_proj"])
    assert imported.lines["seq_len"] == 6
    assert "sequence_len appears twice (lines 3 and 6): the last value is read, as the tool reads it" in imported.notes


def test_yes_no_words_in_quotes_are_read_as_the_tool_reads_them(tmp_path: Path) -> None:
    config = tmp_path / "quoted.yml"
    config.write_text('base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nsequence_len: 1024\nmicro_batch_size: 2\n'
                      'sample_packing: "True"\ngradient_checkpointing: "false"\nbf16: "yes"\n')
    imported = axolotl.read(config)
    spec = checked(imported)
    assert (spec.packing, spec.grad_checkpointing, spec.precision) == (True, False, "bf16")
    assert any(note.startswith("sample_packing, gradient_checkpointing, bf16: a yes/no word in quotes")
               for note in imported.notes)


@pytest.mark.parametrize(("text", "match"), [
    ("rl: dpo\n", r"`rl` \(line 3\): rl 'dpo' trains by DPO, on pairs of answers"),
    ("rl: grpo\n", "rl 'grpo' trains by GRPO, reinforcement learning"),
    ("rl: orpo\n", "rl 'orpo' trains by ORPO"),
    ("rl: simpo\n", "rl 'simpo' trains by SimPO"),
    ("rl: some_new_trainer\n", "rl 'some_new_trainer' trains by a training stage of axolotl's RL trainers"),
    ("reward_model: true\n", r"`reward_model` \(line 3\): reward_model: true trains a reward model"),
    ("process_reward_model: true\n", "process_reward_model: true trains a process reward model"),
])
def test_stages_other_than_supervised_fine_tuning_are_refused(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "stage.yml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\n" + text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match) as refused:
        axolotl.read(path)
    assert refused.value.problems[0].field == text.partition(":")[0]


def test_stage_keys_left_off_are_supervised_fine_tuning(tmp_path: Path) -> None:
    path = tmp_path / "sft.yml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nrl:\nreward_model: false\n"
                    "process_reward_model: false\n", encoding="utf-8")
    imported = axolotl.read(path)
    assert checked(imported).method == "lora"
    assert "default applies" in reason(imported, "rl")
    assert "supervised fine-tuning" in reason(imported, "reward_model")
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nrl: false\n", encoding="utf-8")
    assert "supervised fine-tuning" in reason(axolotl.read(path), "rl")


def test_a_processor_makes_the_run_multimodal_and_refused(tmp_path: Path) -> None:
    path = tmp_path / "vision.yml"
    path.write_text("base_model: Qwen/Qwen2.5-VL-7B-Instruct\nprocessor_type: AutoProcessor\nadapter: lora\n",
                    encoding="utf-8")
    with pytest.raises(TunecastError, match=r"`processor_type` \(line 2\): processor_type 'AutoProcessor' trains a "
                                            "multimodal model") as refused:
        axolotl.read(path)
    assert [problem.field for problem in refused.value.problems] == ["processor_type"]
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nprocessor_type:\nadapter: lora\n", encoding="utf-8")
    imported = axolotl.read(path)
    assert checked(imported).method == "lora"
    assert "default applies" in reason(imported, "processor_type")


def test_parallelism_kernels_and_loading_keys(tmp_path: Path) -> None:
    path = tmp_path / "nd.yml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\ntensor_parallel_size: 1\ncontext_parallel_size: 4\n"
                    "dp_replicate_size: 2\ntiled_mlp: true\nuse_kernels: true\nmodel_config:\n"
                    "  output_router_logits: true\n  num_hidden_layers: 2\nmodel_quantization_config: Mxfp4Config\n",
                    encoding="utf-8")
    imported = axolotl.read(path)
    assert checked(imported).method == "full"
    assert reason(imported, "tensor_parallel_size") == "1: no tensor parallelism"
    assert "splits each sequence over 4 GPUs: tunecast estimates no" in reason(imported, "context_parallel_size")
    assert "one replica's GPUs" in reason(imported, "dp_replicate_size")
    assert "(high)" in reason(imported, "tiled_mlp") and "(high)" in reason(imported, "use_kernels")
    assert "load-balancing loss" in reason(imported, "model_config.output_router_logits")
    assert "without it" in reason(imported, "model_config.num_hidden_layers")
    assert "kept quantized" in reason(imported, "model_quantization_config")
