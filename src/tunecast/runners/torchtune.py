"""Read a torchtune recipe config (`tune run <recipe> --config config.yaml`) into a tunecast config.

The model is the `model._component_` builder (`lora_`/`qlora_` prefixes give the method); its Hugging Face model is
taken from the builder table of docs/research/runners.md section 6, preferring the catalog's model of the same
architecture. Recipe defaults (torchtune 0.6-0.7 recipes/lora_finetune_single_device.py): dtype fp32 when unset,
activation checkpointing and offloading off; LoRA builder defaults apply_lora_to_mlp and apply_lora_to_output false,
lora_rank 8, lora_alpha 16, lora_dropout 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunecast.config.imported import Imported
from tunecast.errors import suggestion_text
from tunecast.runners import mapping as mp
from tunecast.runners.mapping import LOGGING, NO_EFFECT, Mapper

LABEL = "torchtune"
_QWEN25 = {f"qwen2_5_{size.lower().replace('.', '_')}_{kind}": f"Qwen/Qwen2.5-{size}{suffix}"
           for size in ("1.5B", "7B", "14B", "32B", "72B")
           for kind, suffix in (("base", ""), ("instruct", "-Instruct"))}
# Qwen3's -Base and post-trained checkpoints share one architecture: the catalog holds the post-trained ids.
_QWEN3 = {f"qwen3_{size.lower().replace('.', '_')}_{kind}": f"Qwen/Qwen3-{size}"
          for size in ("0.6B", "1.7B", "4B", "8B", "14B") for kind in ("base", "instruct")}
# torchtune builder → the Hugging Face model of its architecture (base and instruct checkpoints share it).
BUILDERS = {
    "llama2_7b": "meta-llama/Llama-2-7b-hf", "llama2_13b": "meta-llama/Llama-2-13b-hf",
    "llama2_70b": "meta-llama/Llama-2-70b-hf", "llama3_8b": "meta-llama/Meta-Llama-3-8B",
    "llama3_70b": "meta-llama/Meta-Llama-3-70B-Instruct", "llama3_1_8b": "meta-llama/Llama-3.1-8B",
    "llama3_1_70b": "meta-llama/Llama-3.1-70B", "llama3_1_405b": "meta-llama/Llama-3.1-405B",
    "llama3_2_1b": "meta-llama/Llama-3.2-1B", "llama3_2_3b": "meta-llama/Llama-3.2-3B",
    "llama3_3_70b": "meta-llama/Llama-3.3-70B-Instruct",
    "llama4_scout_17b_16e": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "llama4_maverick_17b_128e": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    "qwen2_0_5b": "Qwen/Qwen2-0.5B-Instruct", "qwen2_1_5b": "Qwen/Qwen2-1.5B-Instruct", "qwen2_7b": "Qwen/Qwen2-7B",
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B", "qwen2_5_3b": "Qwen/Qwen2.5-3B", **_QWEN25, **_QWEN3,
    "qwen3_32b": "Qwen/Qwen3-32B",
    "gemma_2b": "google/gemma-2b", "gemma_7b": "google/gemma-7b", "gemma2_2b": "google/gemma-2-2b",
    "gemma2_9b": "google/gemma-2-9b", "gemma2_27b": "google/gemma-2-27b", "mistral_7b": "mistralai/Mistral-7B-v0.1",
    "phi3_mini": "microsoft/Phi-3-mini-4k-instruct", "phi4_14b": "microsoft/phi-4",
}
_OPTIMIZERS = {"torch.optim.AdamW": "adamw-foreach", "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw-8bit",
               "bitsandbytes.optim.PagedAdamW": "paged-adamw", "bitsandbytes.optim.AdamW8bit": "adamw-8bit",
               "torch.optim.SGD": "sgd"}
_SCHEDULES = {"get_cosine_schedule_with_warmup": "cosine", "get_linear_schedule_with_warmup": "linear",
              "get_constant_schedule_with_warmup": "constant_with_warmup", "get_constant_schedule": "constant"}
_DATASET_FORMATS = {"alpaca_dataset": "alpaca", "alpaca_cleaned_dataset": "alpaca",
                    "text_completion_dataset": "text"}
_CHAT_STYLES = {"sharegpt": "sharegpt", "openai": "messages"}
_ATTN = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
_MLP = ["gate_proj", "up_proj", "down_proj"]
# Builders of the Phi-3 architecture (torchtune/models/phi3/_component_builders.py; phi4's builders call it too):
# torchtune splits the checkpoint's fused qkv_proj and gate_up_proj into q/k/v_proj and w1/w3
# (phi3/_convert_weights.py); the Hugging Face model keeps them fused (catalog/data/modules.json, phi3).
_FUSED_BUILDERS = ("phi3_mini", "phi4_14b")
_FUSED_ATTN = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "output_proj": "o_proj"}
_FUSED_MLP = ["gate_up_proj", "down_proj"]
_DTYPES = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16-mixed"}
_LOSSES = ("LinearCrossEntropyLoss", "CEWithChunkedOutputLoss")


def read(path: Path) -> Imported:
    """`path`'s torchtune config as a tunecast config (runner torchtune), with every key accounted for."""
    m, data = mp.start("torchtune", LABEL, path)
    _check_stage(m, data)
    _model(m, data.get("model"))
    mp.run_handlers(m, data, _HANDLERS, _QUIET)
    m.default("precision", "fp32")
    m.default("grad_checkpointing", False)
    m.default("activation_offload", False)
    _steps_per_epoch(m, data)
    return m.finish(data, [*_HANDLERS, *_QUIET, "max_steps_per_epoch"])


def _steps_per_epoch(m: Mapper, data: dict[str, Any]) -> None:
    if "max_steps_per_epoch" not in data:
        return
    steps = data["max_steps_per_epoch"]
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        m.put("max_steps_per_epoch", "max_steps", int(steps * float(m.get("epochs") or 1)))
        m.note("max_steps_per_epoch × epochs gives max_steps beside epochs: the run has torchtune's number of steps "
               "(the epochs' steps, capped at that); torchtune ends each epoch early where tunecast ends the run, and "
               "its learning-rate schedule spans the capped steps where tunecast's spans the epochs'")
    else:
        m.skip("max_steps_per_epoch", steps, "null: every epoch runs to the end of the data")


# Losses of the recipes that are not supervised fine-tuning (pytorch/torchtune at bd2a0fc: torchtune/rlhf/loss/
# dpo.py DPOLoss, RSOLoss and ppo.py PPOLoss; GRPO's dev/grpo/loss.py GRPO*Loss and dev/rl/ LinearGRPOLoss), by the
# stage their class names hold.
_STAGE_LOSSES = {"DPO": "DPO, on pairs of answers against a reference model (recipe lora_dpo_single_device or "
                        "*_dpo_distributed)",
                 "RSO": "RSO, on pairs of answers against a reference model (the DPO recipes)",
                 "PPO": "PPO, reinforcement learning on answers the model generates, with value, reward and "
                        "reference models (recipe ppo_full_finetune_single_device)",
                 "GRPO": "GRPO, reinforcement learning on answers the model generates (the dev GRPO recipes)"}
_STAGE_MODULES = ("torchtune.rlhf.", "torchtune.dev.grpo.", "torchtune.dev.rl.")
_SFT_HINT = ("estimate the supervised fine-tuning run: a config of lora_finetune_single_device or full_finetune_* "
             "(model: with a builder, loss torchtune.modules.loss.LinearCrossEntropyLoss)")


def _check_stage(m: Mapper, data: dict[str, Any]) -> None:
    """A recipe that trains otherwise than supervised fine-tuning, told by its keys (recipes/ at bd2a0fc):
    ppo_full_finetune_single_device.py builds `policy_model` and `reward_and_value_model`;
    knowledge_distillation_{single_device,distributed}.py a `teacher_model` beside the student, with `kd_loss` and
    `kd_ratio`; the DPO and GRPO recipes take a loss of torchtune.rlhf or torchtune.dev."""
    if "policy_model" in data:
        raise m.error("policy_model", "policy_model is the policy of PPO (recipe ppo_full_finetune_single_device), "
                      "trained on answers it generates beside a value model, against reward and reference models: "
                      "tunecast estimates supervised fine-tuning only", _SFT_HINT)
    for key in ("teacher_model", "kd_loss", "kd_ratio"):
        if key in data:
            raise m.error(key, f"{key} is a key of knowledge distillation (recipe knowledge_distillation_single_device "
                          "or _distributed), which runs a teacher model beside the student: tunecast estimates "
                          "supervised fine-tuning of one model only", "estimate the student's supervised fine-tuning: "
                          "the config without teacher_model, teacher_checkpointer, kd_loss and kd_ratio")
    loss = data.get("loss")
    component = loss.get("_component_") if isinstance(loss, dict) else None
    if isinstance(component, str) and component.startswith(_STAGE_MODULES):
        name = component.rpartition(".")[2]
        stage = next((stage for stage in _STAGE_LOSSES if stage in name), None)
        what = _STAGE_LOSSES[stage] if stage else "a stage other than supervised fine-tuning"
        raise m.error("loss._component_", f"loss {component!r} trains by {what}: tunecast estimates supervised "
                      "fine-tuning only", _SFT_HINT)


def _model(m: Mapper, model: Any) -> None:
    """model._component_ → model and method; the LoRA arguments → lora.*."""
    component = model.get("_component_") if isinstance(model, dict) else None
    if not isinstance(component, str):
        raise m.error("model._component_", "the model builder is missing",
                      "set model._component_ to a torchtune builder such as torchtune.models.llama3_1.lora_llama3_1_8b")
    name = component.rpartition(".")[2]
    method = "qlora" if name.startswith("qlora_") else "lora" if name.startswith("lora_") else "full"
    builder = name.removeprefix("qlora_").removeprefix("lora_")
    if builder not in BUILDERS:
        close = suggestion_text(builder, BUILDERS)
        raise m.error("model._component_", f"builder {component!r} is not one tunecast maps to a model",
                      (f"{close} " if close else "") + "use a Llama, Qwen, Gemma, Mistral or Phi text builder, or "
                      "estimate with tunecast's own config (--model with a Hugging Face id)")
    m.put("model._component_", "model", BUILDERS[builder])
    m.put("model._component_", "method", method)
    m.note(f"builder {builder} is the architecture of {BUILDERS[builder]} (base and instruct checkpoints alike)")
    if method != "full":
        _lora(m, model, builder in _FUSED_BUILDERS)


def _lora(m: Mapper, model: dict[str, Any], fused: bool) -> None:
    attention = model.get("lora_attn_modules") or []
    names = _FUSED_ATTN if fused else _ATTN
    targets = list(dict.fromkeys(names.get(str(name), str(name)) for name in attention))
    if fused and any(str(name) in ("q_proj", "k_proj", "v_proj") for name in attention):
        m.note("LoRA on torchtune's q_proj/k_proj/v_proj of a Phi-3 builder is estimated on the Hugging Face "
               "model's fused qkv_proj: one adapter over the three projections, where torchtune has one per "
               "projection named (the adapters differ by a few rank × hidden matrices per layer)")
    if model.get("apply_lora_to_mlp"):
        targets += _FUSED_MLP if fused else _MLP
    if model.get("apply_lora_to_output"):
        targets.append("lm_head")
    for key in ("lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output"):
        if key in model:
            m.put(f"model.{key}", "lora.targets", targets)
    m.default("lora.targets", targets)
    for key, target, default in (("lora_rank", "lora.rank", 8), ("lora_alpha", "lora.alpha", 16),
                                 ("lora_dropout", "lora.dropout", 0.0)):
        if key in model:
            m.put(f"model.{key}", target, model[key])
        m.default(target, default)
    if model.get("use_dora") is not None:
        m.put("model.use_dora", "lora.dora", bool(model["use_dora"]))
    if model.get("quantize_base"):
        m.put("model.quantize_base", "method", "qlora")
    m.default("lora.fp32_adapters", False)


def _model_section(m: Mapper, key: str, value: Any) -> None:
    for name, item in _items(m, key, value):
        if name == "quantize_base" and not item:
            m.skip(f"{key}.{name}", item, "false: the base weights are not quantized")


@mp.takes_null
def _tokenizer(m: Mapper, key: str, value: Any) -> None:
    for name, item in _items(m, key, value):
        if name == "max_seq_len" and item is not None:
            m.put(f"{key}.{name}", "seq_len", item)
        elif name == "max_seq_len":
            m.skip(f"{key}.{name}", item, "null: torchtune truncates nothing and pads each batch to its longest "
                                          "example; tunecast needs a maximum: set seq_len")
        else:
            m.skip(f"{key}.{name}", item, "the tokenizer: " + NO_EFFECT)


def _dataset(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, list):
        m.skip(key, value, mp.SEVERAL)
        return
    if not _items(m, key, value):
        return
    files = value.get("data_files")
    local = mp.dataset_file(m, files) if value.get("source") in ("json", "csv", "parquet", "text") else None
    for name, item in value.items():
        sub = f"{key}.{name}"
        if name == "packed":
            m.put(sub, "packing", bool(item))
        elif name == "train_on_input":
            m.put(sub, "dataset.train_on", "all" if item else "completion")
        elif name == "data_files" and local is not None:
            m.put(sub, "dataset.path", local)
            _dataset_format(m, f"{key}._component_", value)
        else:
            m.skip(sub, item, mp.HUB if local is None and name in ("_component_", "source") else
                   "how the rows are loaded: " + NO_EFFECT)


def _dataset_format(m: Mapper, key: str, value: dict[str, Any]) -> None:
    name = str(value.get("_component_", "")).rpartition(".")[2]
    if name in _DATASET_FORMATS:
        m.put(key, "dataset.format", _DATASET_FORMATS[name])
    elif name == "chat_dataset" and value.get("conversation_style") in _CHAT_STYLES:
        m.put(key, "dataset.format", _CHAT_STYLES[value["conversation_style"]])


def _optimizer(m: Mapper, key: str, value: Any) -> None:
    for name, item in _items(m, key, value):
        sub = f"{key}.{name}"
        if name == "_component_" and item in _OPTIMIZERS:
            fused = item == "torch.optim.AdamW" and value.get("fused") is True
            m.put(sub, "optimizer", "adamw" if fused else _OPTIMIZERS[item])
            if fused:
                m.put(f"{key}.fused", "optimizer", "adamw")
        elif name == "_component_":
            m.skip(sub, item, f"optimizer {item!r} has no tunecast equivalent: estimated with torchtune's default")
        elif name == "lr":
            m.put(sub, "learning_rate", float(item))
        elif name == "weight_decay":
            m.put(sub, "weight_decay", float(item))
        else:
            m.skip(sub, item, "an optimizer setting: " + NO_EFFECT)


def _scheduler(m: Mapper, key: str, value: Any) -> None:
    for name, item in _items(m, key, value):
        sub = f"{key}.{name}"
        short = str(item).rpartition(".")[2]
        if name == "_component_" and short in _SCHEDULES:
            m.put(sub, "schedule", _SCHEDULES[short])
        elif name == "num_warmup_steps":
            m.put(sub, "warmup_steps", int(item))
        else:
            m.skip(sub, item, "the learning rate's shape: " + NO_EFFECT)


def _loss(m: Mapper, key: str, value: Any) -> None:
    for name, item in _items(m, key, value):
        if name == "_component_" and str(item).rpartition(".")[2] in _LOSSES:
            m.skip(f"{key}.{name}", item, "the torchtune runner's own loss (output in 8 chunks): no key to set")
        elif name == "_component_":
            m.skip(f"{key}.{name}", item, f"loss {item!r} is estimated as LinearCrossEntropyLoss (8 chunks)")
        else:
            m.skip(f"{key}.{name}", item, "a loss setting: " + NO_EFFECT)


def _items(m: Mapper, key: str, value: Any) -> list[tuple[str, Any]]:
    """A section's keys; a section that is not a mapping is reported and has none."""
    if isinstance(value, dict):
        return list(value.items())
    m.skip(key, value, f"not a section: torchtune expects {key}._component_ and its arguments")
    return []


def _dtype(m: Mapper, key: str, value: Any) -> None:
    if value in _DTYPES:
        m.put(key, "precision", _DTYPES[value])
        if value == "fp16":
            m.note("dtype fp16 trains fp16 weights; estimated as fp16-mixed")
    else:
        m.skip(key, value, f"dtype {value!r} has no tunecast precision: estimated as fp32")


@mp.takes_null
def _clip(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "max_grad_norm", 0.0 if value is None else float(value))


def _cpu_offload(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "gpus.strategy", "fsdp")
        m.put(key, "gpus.offload", "params")
        m.note(mp.LAUNCH_COUNT)
    else:
        m.skip(key, value, "false: nothing offloaded")


_HANDLERS: dict[str, mp.Handler] = {
    "model": _model_section, "tokenizer": _tokenizer, "dataset": _dataset, "optimizer": _optimizer,
    "lr_scheduler": _scheduler, "batch_size": mp.to("micro_batch"), "gradient_accumulation_steps": mp.to("grad_accum"),
    "epochs": mp.to("epochs", float), "optimizer_in_bwd": mp.flag("optimizer_in_backward"), "dtype": _dtype,
    "compile": mp.flag("compile"),
    "enable_activation_checkpointing": mp.flag("grad_checkpointing"),
    "enable_activation_offloading": mp.flag("activation_offload"), "clip_grad_norm": _clip, "seed": mp.to("seed"),
    "output_dir": mp.to("output"), "save_every_n_steps": mp.to("checkpoint.every_steps"),
    "fsdp_cpu_offload": _cpu_offload, "loss": _loss,
}

_QUIET: dict[str, str] = {
    **dict.fromkeys(("checkpointer", "resume_from_checkpoint", "save_adapter_weights_only", "shuffle", "device",
                     "low_cpu_ram", "collate_fn", "cudnn_deterministic_mode", "enable_async_checkpointing",
                     "custom_sharded_layers", "fsdp_reshard_after_forward", "tensor_parallel_dim",
                     "tensor_parallel_plan", "data_parallel_shard_dim", "data_parallel_replicate_dim"),
                    NO_EFFECT),
    **dict.fromkeys(("metric_logger", "log_every_n_steps", "log_peak_memory_stats", "log_level", "profiler"),
                    LOGGING),
    **dict.fromkeys(("run_val_every_n_steps", "dataset_val", "batch_size_val"),
                    "validation on a dataset of its own: tunecast's evaluation holds out eval.examples of the "
                    "training file (set eval.examples and eval.every_steps to count its time)"),
}
