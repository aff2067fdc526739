from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.runners.helpers import DATA, checked, reason

from tunecast.errors import TunecastError
from tunecast.runners import torchtune


def test_lora_single_device_with_a_local_dataset() -> None:
    imported = torchtune.read(DATA / "torchtune" / "lora_single_device.yaml")
    spec = checked(imported)
    assert (spec.runner, spec.model, spec.method) == ("torchtune", "Qwen/Qwen2.5-7B", "lora")
    assert spec.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.fp32_adapters) == (16, 32, 0.05, False)
    assert (spec.seq_len, spec.packing, spec.micro_batch, spec.grad_accum) == (2048, True, 4, 4)
    assert (spec.optimizer, spec.learning_rate, spec.weight_decay) == ("adamw", 2e-4, 0.01)
    assert (spec.schedule, spec.warmup_steps, spec.epochs, spec.max_steps) == ("cosine", 50, 2.0, 200)
    assert (spec.precision, spec.grad_checkpointing, spec.activation_offload) == ("bf16", True, True)
    assert (spec.dataset.path, spec.dataset.format, spec.dataset.train_on) == \
        (str((DATA / "torchtune" / "data" / "alpaca.jsonl").resolve()), "alpaca", "completion")
    assert (spec.max_grad_norm, spec.seed) == (1.0, 11)


def test_qlora_single_device() -> None:
    imported = torchtune.read(DATA / "torchtune" / "qlora_single_device.yaml")
    spec = checked(imported)
    assert (spec.model, spec.method) == ("meta-llama/Llama-3.1-8B", "qlora")
    assert spec.lora.targets == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (spec.optimizer, spec.lora.dropout) == ("adamw-foreach", 0.0)
    assert "set seq_len" in reason(imported, "tokenizer.max_seq_len")
    assert "Hub dataset" in reason(imported, "dataset._component_")


def test_full_single_device() -> None:
    spec = checked(torchtune.read(DATA / "torchtune" / "full_single_device.yaml"))
    assert (spec.model, spec.method, spec.optimizer, spec.optimizer_in_backward) == \
        ("meta-llama/Llama-3.2-1B", "full", "paged-adamw-8bit", True)
    assert (spec.precision, spec.grad_checkpointing, spec.seq_len, spec.epochs) == ("bf16", False, 1024, 3.0)


def test_unknown_builder(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_9b\n", encoding="utf-8")
    with pytest.raises(TunecastError, match="lora_llama3_1_9b"):
        torchtune.read(path)


def test_missing_builder(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("batch_size: 2\n", encoding="utf-8")
    with pytest.raises(TunecastError, match="builder is missing"):
        torchtune.read(path)


@pytest.mark.parametrize(("text", "field", "match"), [
    ("policy_model:\n  _component_: torchtune.models.mistral.mistral_7b\n", "policy_model", "policy of PPO"),
    ("model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\nkd_ratio: 0.5\n", "kd_ratio",
     "knowledge distillation"),
    ("model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\nloss:\n"
     "  _component_: torchtune.rlhf.loss.DPOLoss\n", "loss._component_", r"\(line 4\): loss .*DPOLoss' trains by DPO"),
    ("model:\n  _component_: torchtune.models.llama3_1.llama3_1_8b\nloss:\n"
     "  _component_: torchtune.rlhf.loss.RSOLoss\n", "loss._component_", "trains by RSO"),
    ("model:\n  _component_: torchtune.models.llama3_1.llama3_1_8b\nloss:\n"
     "  _component_: torchtune.dev.rl.linear_grpo_loss.LinearGRPOLoss\n", "loss._component_", "trains by GRPO"),
])
def test_stages_other_than_supervised_fine_tuning_are_refused(tmp_path: Path, text: str, field: str,
                                                              match: str) -> None:
    path = tmp_path / "stage.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TunecastError, match=match) as refused:
        torchtune.read(path)
    assert refused.value.problems[0].field == field


def test_a_supervised_loss_outside_the_stage_modules_is_read(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text("model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n  lora_attn_modules: [q_proj]\n"
                    "loss:\n  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss\n", encoding="utf-8")
    imported = torchtune.read(path)
    assert checked(imported).method == "lora"
    assert "own loss" in reason(imported, "loss._component_")


@pytest.mark.parametrize(("builder", "attention", "mlp", "targets"), [
    ("lora_phi3_mini", "[k_proj, output_proj]", "False", ["qkv_proj", "o_proj"]),
    ("lora_phi4_14b", "[q_proj, v_proj]", "True", ["qkv_proj", "gate_up_proj", "down_proj"]),
    ("lora_llama3_2_1b", "[q_proj, v_proj]", "True", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
])
def test_phi3_builders_target_the_fused_hugging_face_modules(tmp_path: Path, builder: str, attention: str, mlp: str,
                                                            targets: list[str]) -> None:
    path = tmp_path / "lora.yaml"
    path.write_text(f"model:\n  _component_: torchtune.models.x.{builder}\n  lora_attn_modules: {attention}\n"
                    f"  apply_lora_to_mlp: {mlp}\n", encoding="utf-8")
    imported = torchtune.read(path)
    assert checked(imported).lora.targets == targets
    assert any("fused qkv_proj" in note for note in imported.notes) == ("qkv_proj" in targets)
