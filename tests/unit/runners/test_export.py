"""to_axolotl / to_llamafactory written to a file and read back give the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.unit.runners.helpers import checked

from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.runners import axolotl, llamafactory
from tunecast.runners.export import llamafactory_dataset_info, to_axolotl, to_llamafactory

COMPARED = ("model", "method", "lora.rank", "lora.alpha", "lora.dropout", "lora.targets", "seq_len", "micro_batch",
            "grad_accum", "epochs", "max_steps", "optimizer", "precision", "grad_checkpointing", "activation_offload",
            "attention", "packing", "learning_rate", "schedule", "warmup_steps", "warmup_ratio", "weight_decay",
            "seed", "gpus.strategy", "gpus.offload", "checkpoint.every_steps", "dataset.format", "dataset.train_on",
            "compile", "quantization.bits")

SPECS: dict[str, dict[str, Any]] = {
    "lora": {"model": "meta-llama/Llama-3.1-8B", "method": "lora", "lora": {"rank": 16, "alpha": 32, "dropout": 0.05,
             "targets": ["q_proj", "v_proj"]}, "seq_len": 2048, "micro_batch": 4, "grad_accum": 2, "epochs": 2,
             "optimizer": "adamw-8bit", "grad_checkpointing": True, "attention": "flash", "packing": True,
             "learning_rate": 2e-4, "schedule": "cosine", "warmup_steps": 10, "seed": 5,
             "checkpoint": {"every_steps": 100}, "dataset": {"format": "alpaca", "train_on": "completion"}},
    "qlora": {"model": "Qwen/Qwen2.5-7B", "method": "qlora", "lora": {"rank": 64, "alpha": 16},
              "seq_len": 4096, "micro_batch": 1, "grad_accum": 16, "max_steps": 400, "optimizer": "paged-adamw",
              "grad_checkpointing": True, "activation_offload": True, "learning_rate": 1e-4, "schedule": "constant",
              "warmup_ratio": 0.05, "dataset": {"format": "messages"}},
    # LoRA on an 8-bit base: axolotl's adapter lora with load_in_8bit, LLaMA-Factory's quantization_bit 8
    "qlora-8bit": {"model": "meta-llama/Llama-3.1-8B", "method": "qlora", "quantization": {"bits": 8},
                   "lora": {"rank": 32, "alpha": 16, "dropout": 0.05}, "seq_len": 4096, "micro_batch": 2,
                   "grad_accum": 4, "epochs": 4, "optimizer": "adamw-8bit", "grad_checkpointing": True,
                   "packing": True, "learning_rate": 2e-4, "schedule": "cosine", "warmup_ratio": 0.1,
                   "dataset": {"format": "alpaca"}},
    "full": {"model": "Qwen/Qwen3-0.6B", "method": "full", "seq_len": 1024, "micro_batch": 8, "grad_accum": 1,
             "epochs": 1, "optimizer": "adamw", "grad_checkpointing": False, "attention": "sdpa",
             "learning_rate": 1e-5, "schedule": "linear", "weight_decay": 0.1, "dataset": {"format": "alpaca"},
             "compile": True},
}
FSDP = {"model": "meta-llama/Llama-3.1-8B", "method": "full", "precision": "bf16", "micro_batch": 2,
        "grad_checkpointing": True, "gpus": {"count": 8, "strategy": "fsdp", "offload": "params"}}


def _spec(raw: dict[str, Any], data: Path) -> RunSpec:
    raw = json.loads(json.dumps(raw))
    if "dataset" in raw:
        raw["dataset"]["path"] = str(data)
    return RunSpec.model_validate(raw)


def _same(before: RunSpec, after: RunSpec, skip: tuple[str, ...] = ()) -> None:
    for key in COMPARED:
        if key in skip or (key.startswith("lora.") and before.method == "full"):
            continue
        assert _value(after, key) == _value(before, key), key


def _value(spec: RunSpec, key: str) -> Any:
    section, _, leaf = key.partition(".")
    return getattr(getattr(spec, section), leaf) if leaf else getattr(spec, key)


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"instruction": "a", "input": "", "output": "b"}\n', encoding="utf-8")
    return data


def _write(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(SPECS))
def test_axolotl_round_trip(tmp_path: Path, name: str) -> None:
    spec = _spec(SPECS[name] | {"precision": "bf16"}, _data(tmp_path))
    imported = axolotl.read(_write(tmp_path / "axolotl.yml", to_axolotl(spec)))
    back = checked(imported)
    _same(spec, back)
    assert back.dataset.path == spec.dataset.path
    assert not [item.key for item in imported.unmapped if "misspelt" in item.reason]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_llamafactory_round_trip(tmp_path: Path, name: str) -> None:
    spec = _spec(SPECS[name], _data(tmp_path))
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(llamafactory_dataset_info(spec)),
                                                        encoding="utf-8")
    imported = llamafactory.read(_write(tmp_path / "lf.yaml", to_llamafactory(spec)))
    back = checked(imported)
    _same(spec, back, skip=("gpus.strategy", "gpus.offload"))
    assert back.dataset.path == spec.dataset.path
    assert not [item.key for item in imported.unmapped if "misspelt" in item.reason]


def test_axolotl_fsdp_round_trip(tmp_path: Path) -> None:
    spec = RunSpec.model_validate(FSDP)
    document = to_axolotl(spec)
    assert document["fsdp_version"] == 2
    back = checked(axolotl.read(_write(tmp_path / "fsdp.yml", document)))
    _same(spec, back)
    zero2 = checked(axolotl.read(_write(tmp_path / "z2.yml", to_axolotl(spec.with_changes({"gpus.strategy": "fsdp-grad-op",
                                                                                            "gpus.offload": "none"})))))
    assert (zero2.gpus.strategy, zero2.gpus.offload) == ("fsdp-grad-op", "none")


def test_llamafactory_full_precisions(tmp_path: Path) -> None:
    for precision in ("bf16-mixed", "bf16", "fp32"):
        spec = RunSpec.model_validate(SPECS["full"] | {"dataset": {}, "precision": precision})
        back = checked(llamafactory.read(_write(tmp_path / "lf.yaml", to_llamafactory(spec))))
        assert back.precision == precision


def test_llamafactory_leaves_deepspeed_out() -> None:
    document = to_llamafactory(RunSpec.model_validate(FSDP | {"precision": "bf16-mixed"}))
    assert "deepspeed" not in document and document["finetuning_type"] == "full"


def test_key_order_follows_the_tools_examples() -> None:
    spec = RunSpec.model_validate(SPECS["lora"])
    axolotl_keys = list(to_axolotl(spec))
    order = ["base_model", "adapter", "sequence_len", "lora_r", "micro_batch_size", "optimizer", "bf16"]
    assert sorted(order, key=axolotl_keys.index) == order
    llamafactory_keys = list(to_llamafactory(spec))
    order = ["model_name_or_path", "stage", "finetuning_type", "lora_rank", "cutoff_len", "per_device_train_batch_size",
             "learning_rate", "bf16"]
    assert sorted(order, key=llamafactory_keys.index) == order


@pytest.mark.parametrize(("changes", "tool", "match"), [
    ({"loss": "chunked"}, "llamafactory", "loss"),
    ({"optimizer_in_backward": True}, "axolotl", "optimizer_in_backward"),
    ({"precision": "bf16-mixed"}, "axolotl", "precision"),
    ({"micro_batch": "auto"}, "llamafactory", "micro_batch"),
    ({"grad_checkpointing": "auto"}, "axolotl", "grad_checkpointing"),
    ({"checkpoint": {"every_minutes": 30}}, "axolotl", "every_minutes"),
    ({"activation_offload": True, "grad_checkpointing": False}, "llamafactory", "activation_offload"),
])
def test_values_the_tool_cannot_express(changes: dict[str, Any], tool: str, match: str) -> None:
    spec = RunSpec.model_validate(SPECS["full"] | {"dataset": {}} | changes)
    write = to_axolotl if tool == "axolotl" else to_llamafactory
    with pytest.raises(TunecastError, match=match):
        write(spec)


@pytest.mark.parametrize("export", [to_axolotl, to_llamafactory])
def test_max_steps_with_epochs_is_refused_where_the_tool_would_schedule_over_max_steps(export: Any) -> None:
    spec = RunSpec.model_validate({"model": "Qwen/Qwen3-0.6B", "epochs": 2, "max_steps": 6, "micro_batch": 4})
    with pytest.raises(TunecastError, match=r"max_steps cannot be written in .*replaces num_epochs"):
        export(spec)
    assert export(spec.with_changes({"max_steps": None}))  # the whole run of two epochs
