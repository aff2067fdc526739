"""A validated RunSpec written back as an axolotl or LLaMA-Factory training config (`tunecast export axolotl|
llamafactory`): the same run, in that tool's keys, in the order its own examples use (axolotl examples/llama-3/
qlora.yml, LLaMA-Factory examples/train_lora/qwen3_lora_sft.yaml). A value the tool cannot express is a user error
naming the tunecast key; nothing is dropped silently. The readers (runners/axolotl.py, llamafactory.py) read these
documents back to the same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunecast.config.spec import DEEPSPEED_STRATEGIES, RunSpec
from tunecast.errors import TunecastError

# tunecast's optimizer → transformers' OptimizerNames, which both tools take.
HF_OPTIMIZER_NAMES = {"adamw": "adamw_torch_fused", "adamw-foreach": "adamw_torch", "adamw-8bit": "adamw_bnb_8bit",
                      "paged-adamw": "paged_adamw_32bit", "paged-adamw-8bit": "paged_adamw_8bit", "sgd": "sgd",
                      "adafactor": "adafactor"}
_AXOLOTL_ATTENTION = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
_AXOLOTL_TYPES = {"alpaca": "alpaca", "messages": "chat_template", "text": "completion"}
_LLAMAFACTORY_ATTENTION = {"flash": "fa2", "sdpa": "sdpa", "eager": "disabled"}
_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def to_axolotl(spec: RunSpec) -> dict[str, Any]:
    """`spec` as an axolotl config document."""
    _common(spec, "axolotl")
    doc: dict[str, Any] = {"base_model": spec.model}
    eight_bit = spec.method == "qlora" and spec.quantization.bits == 8
    if spec.method == "qlora":  # LoRA on an 8-bit base is axolotl's adapter lora (it refuses qlora in 8-bit)
        doc["load_in_8bit" if eight_bit else "load_in_4bit"] = True
    if spec.dataset.path is not None:
        doc["datasets"] = [_axolotl_dataset(spec)]
    if spec.dataset.train_on != "auto":
        doc["train_on_inputs"] = spec.dataset.train_on == "all"
    if spec.output is not None:
        doc["output_dir"] = spec.output
    if spec.method != "full":
        doc["adapter"] = "lora" if eight_bit else spec.method
    doc |= {"sequence_len": spec.seq_len, "sample_packing": spec.packing}
    if spec.method != "full":
        doc |= _axolotl_lora(spec)
    doc |= {"gradient_accumulation_steps": _grad_accum(spec, "axolotl"), "micro_batch_size": spec.micro_batch,
            "num_epochs": spec.epochs}
    if spec.max_steps is not None:
        doc["max_steps"] = spec.max_steps
    doc |= {"optimizer": HF_OPTIMIZER_NAMES[spec.optimizer], "lr_scheduler": spec.schedule,
            "learning_rate": spec.learning_rate}
    doc |= _axolotl_precision(spec)
    doc["gradient_checkpointing"] = "offload" if spec.activation_offload and spec.grad_checkpointing else \
        bool(spec.grad_checkpointing)
    if spec.activation_offload and not spec.grad_checkpointing:
        doc["activation_offloading"] = True
    doc["attn_implementation"] = _AXOLOTL_ATTENTION[spec.attention]
    if spec.loss == "chunked":
        doc |= {"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_fused_linear_cross_entropy": True}
    doc |= _warmup(spec) | _checkpoints(spec) | _eval_steps(spec, "axolotl")
    doc |= {"weight_decay": spec.weight_decay, "max_grad_norm": spec.max_grad_norm, "seed": spec.seed}
    if spec.compile:
        doc["torch_compile"] = True
    return doc | _axolotl_fsdp(spec)


def to_llamafactory(spec: RunSpec) -> dict[str, Any]:
    """`spec` as a LLaMA-Factory `llamafactory-cli train` config document (stage sft). With a dataset file, the
    dataset_info.json entry that names it is `llamafactory_dataset_info(spec)`, to be written in `dataset_dir`."""
    _common(spec, "LLaMA-Factory")
    if spec.loss == "chunked":
        raise _cannot("loss", "LLaMA-Factory", "its only chunked loss comes with enable_liger_kernel, which also swaps "
                      "the model's norm, MLP and RoPE kernels", "set loss: standard, or add enable_liger_kernel: true "
                      "to the exported file yourself")
    if spec.lora.modules_to_save and spec.method == "full":
        raise _cannot("lora.modules_to_save", "LLaMA-Factory", "it belongs to LoRA; full fine-tuning trains everything")
    doc: dict[str, Any] = {"model_name_or_path": spec.model}
    if spec.method == "qlora":
        doc |= {"quantization_bit": spec.quantization.bits, "quantization_method": "bnb"}
    doc["flash_attn"] = _LLAMAFACTORY_ATTENTION[spec.attention]
    doc |= _llamafactory_checkpointing(spec)
    doc |= {"stage": "sft", "do_train": True, "finetuning_type": "full" if spec.method == "full" else "lora"}
    if spec.method != "full":
        doc |= {"lora_rank": spec.lora.rank, "lora_alpha": spec.lora.alpha, "lora_dropout": spec.lora.dropout,
                "lora_target": "all" if spec.lora.targets == "all-linear" else ",".join(spec.lora.targets)}
        if spec.lora.modules_to_save:
            doc["additional_target"] = ",".join(spec.lora.modules_to_save)
        if spec.lora.dora:
            doc["use_dora"] = True
    doc |= _llamafactory_dataset(spec)
    doc |= {"cutoff_len": spec.seq_len, "packing": spec.packing}
    if spec.dataset.train_on != "auto":
        doc["train_on_prompt"] = spec.dataset.train_on == "all"
    if spec.output is not None:
        doc["output_dir"] = spec.output
    doc |= _checkpoints(spec)
    doc |= {"per_device_train_batch_size": spec.micro_batch,
            "gradient_accumulation_steps": _grad_accum(spec, "LLaMA-Factory"),
            "learning_rate": spec.learning_rate, "num_train_epochs": spec.epochs}
    if spec.max_steps is not None:
        doc["max_steps"] = spec.max_steps
    doc |= {"lr_scheduler_type": spec.schedule, **_warmup(spec), "weight_decay": spec.weight_decay,
            "max_grad_norm": spec.max_grad_norm, "optim": HF_OPTIMIZER_NAMES[spec.optimizer]}
    doc |= _llamafactory_precision(spec) | {"seed": spec.seed}
    if spec.gpus.strategy in DEEPSPEED_STRATEGIES:
        doc["deepspeed"] = deepspeed_document(spec)
    if spec.compile:
        doc["torch_compile"] = True
    if spec.eval.examples:
        doc |= {"val_size": spec.eval.examples, "eval_strategy": "steps" if spec.eval.every_steps else "epoch",
                **_eval_steps(spec, "LLaMA-Factory")}
    return doc


def llamafactory_dataset_info(spec: RunSpec) -> dict[str, Any]:
    """The dataset_info.json document that registers `spec`'s dataset file under the name to_llamafactory gives it
    (LLaMA-Factory reads datasets by name only)."""
    if spec.dataset.path is None:
        return {}
    path = Path(spec.dataset.path)
    entry: dict[str, Any] = {"file_name": str(path)}
    if spec.dataset.format == "prompt-completion":
        entry["columns"] = {"prompt": "prompt", "response": "completion"}
    elif spec.dataset.format == "sharegpt":
        entry["formatting"] = "sharegpt"
    elif spec.dataset.format == "messages":
        entry |= {"formatting": "sharegpt", "columns": {"messages": "messages"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant", "system_tag": "system"}}
    return {path.stem: entry}


def _cannot(key: str, tool: str, why: str, hint: str | None = None) -> TunecastError:
    return TunecastError(f"{key} cannot be written in {tool}'s config: {why}", field=key,
                         hint=hint or f"change {key}, or edit the {tool} config by hand after exporting")


def _common(spec: RunSpec, tool: str) -> None:
    """What neither tool's config can say."""
    if spec.optimizer_in_backward:
        raise _cannot("optimizer_in_backward", tool, f"{tool} steps the optimizer after the backward pass",
                      "set optimizer_in_backward: false")
    if spec.micro_batch == "auto":
        raise _cannot("micro_batch", tool, f"{tool} takes a fixed number",
                      "run `tunecast plan` and set the micro-batch it chooses")
    if spec.grad_checkpointing == "auto":
        raise _cannot("grad_checkpointing", tool, f"{tool} takes true or false", "run `tunecast plan` to see which "
                      "fits, and set grad_checkpointing to it")
    if spec.checkpoint.every_minutes is not None:
        raise _cannot("checkpoint.every_minutes", tool, f"{tool} saves every so many steps",
                      "set checkpoint.every_steps instead")
    if spec.warmup_steps and spec.warmup_ratio:
        raise _cannot("warmup_ratio", tool, "set with warmup_steps", "keep one of warmup_steps and warmup_ratio")
    if spec.max_steps is not None and spec.fixed("epochs"):
        # tunecast's max_steps with epochs ends the epochs' run early, on the epochs' schedule; the transformers
        # Trainer's max_steps (which both tools pass on) replaces the epochs and schedules over max_steps instead
        raise _cannot("max_steps", tool, f"with epochs set too it ends the run early on the epochs' schedule, while "
                      f"{tool}'s max_steps replaces num_epochs and sets the schedule over max_steps",
                      "export the whole run (--set max_steps=null), or a run of max_steps steps (--set epochs=null)")


def _grad_accum(spec: RunSpec, tool: str) -> int:
    if spec.global_batch is None:
        return spec.grad_accum
    per_step = spec.micro_batch_size * spec.gpus.count
    if spec.global_batch % per_step:
        raise _cannot("global_batch", tool, f"{spec.global_batch} is not a multiple of micro_batch × GPUs "
                      f"({per_step})", "set grad_accum instead of global_batch")
    return spec.global_batch // per_step


def _warmup(spec: RunSpec) -> dict[str, Any]:
    if spec.warmup_steps:
        return {"warmup_steps": spec.warmup_steps}
    return {"warmup_ratio": spec.warmup_ratio} if spec.warmup_ratio else {}


def _checkpoints(spec: RunSpec) -> dict[str, Any]:
    saved: dict[str, Any] = {}
    if spec.checkpoint.every_steps is not None:
        saved["save_steps"] = spec.checkpoint.every_steps
    if spec.fixed("checkpoint.keep"):
        saved["save_total_limit"] = spec.checkpoint.keep
    return saved


def _eval_steps(spec: RunSpec, tool: str) -> dict[str, Any]:
    if spec.eval.examples and tool == "axolotl":
        raise _cannot("eval.examples", tool, "axolotl holds out a fraction of the dataset (val_set_size), not a number "
                      "of examples", "set eval.examples to 0 and val_set_size in the axolotl config by hand")
    return {"eval_steps": spec.eval.every_steps} if spec.eval.every_steps is not None else {}


def _axolotl_dataset(spec: RunSpec) -> dict[str, Any]:
    path = str(spec.dataset.path)
    entry: dict[str, Any] = {"path": path}
    loader = _LOADERS.get(Path(path).suffix.lower())
    if loader is not None:
        entry["ds_type"] = loader
    if spec.dataset.format == "sharegpt":
        return entry | {"type": "chat_template", "field_messages": "conversations",
                        "message_property_mappings": {"role": "from", "content": "value"}}
    if spec.dataset.format not in _AXOLOTL_TYPES:
        raise _cannot("dataset.format", "axolotl", f"{spec.dataset.format!r} has no axolotl dataset type that "
                      "tunecast writes", "set dataset.format to alpaca, messages, sharegpt or text")
    return entry | {"type": _AXOLOTL_TYPES[spec.dataset.format]}


def _axolotl_lora(spec: RunSpec) -> dict[str, Any]:
    lora = spec.lora
    doc: dict[str, Any] = {"lora_r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout}
    doc |= {"lora_target_linear": True} if lora.targets == "all-linear" else {"lora_target_modules": list(lora.targets)}
    if lora.modules_to_save:
        doc["lora_modules_to_save"] = list(lora.modules_to_save)
    if lora.dora:
        doc["peft_use_dora"] = True
    if not lora.fp32_adapters:
        doc["peft_autocast_adapter_dtype"] = False
    return doc


def _axolotl_precision(spec: RunSpec) -> dict[str, Any]:
    """axolotl loads the weights in the dtype of its precision flag and trains them in it under autocast."""
    if spec.precision == "bf16-mixed":
        raise _cannot("precision", "axolotl", "bf16: true loads the weights in bf16; axolotl has no fp32 master "
                      "weights under bf16 autocast", "set precision to bf16 or fp32")
    return {"bf16": spec.precision == "bf16", "fp16": spec.precision == "fp16-mixed"} | (
        {"bf16": True, "fp8": True} if spec.precision == "fp8" else {})


def deepspeed_document(spec: RunSpec) -> dict[str, Any]:
    """The DeepSpeed JSON of a zero1/zero2/zero3 run, inline (axolotl's and LLaMA-Factory's `deepspeed` key takes a
    document as well as a path): its stage, offload and buffers, and `auto` for what the Trainer fills in."""
    stage = int(spec.gpus.strategy[-1])
    settings = spec.gpus.deepspeed
    zero: dict[str, Any] = {"stage": stage}
    if spec.gpus.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if spec.gpus.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero["reduce_bucket_size"] = settings.reduce_bucket_size
    if settings.overlap_comm is not None:
        zero["overlap_comm"] = settings.overlap_comm
    if stage == 3:
        zero |= {"stage3_prefetch_bucket_size": settings.stage3_prefetch_bucket_size,
                 "stage3_param_persistence_threshold": settings.stage3_param_persistence_threshold}
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto"}


def _axolotl_fsdp(spec: RunSpec) -> dict[str, Any]:
    strategy, offload = spec.gpus.strategy, spec.gpus.offload
    if strategy in DEEPSPEED_STRATEGIES:
        return {"deepspeed": deepspeed_document(spec)}
    if strategy == "ddp":
        if offload != "none":
            raise _cannot("gpus.offload", "axolotl", "offload needs a sharded strategy", "set gpus.strategy to fsdp")
        return {}
    if offload == "optimizer":
        raise _cannot("gpus.offload", "axolotl", "FSDP offloads parameters and optimizer states together",
                      "set gpus.offload to params or none")
    return {"fsdp_version": 2, "fsdp_config": {
        "offload_params": offload == "params", "state_dict_type": "SHARDED_STATE_DICT",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": strategy != "fsdp-grad-op"}}


def _llamafactory_checkpointing(spec: RunSpec) -> dict[str, Any]:
    if spec.activation_offload and not spec.grad_checkpointing:
        raise _cannot("activation_offload", "LLaMA-Factory", "it offloads only with gradient checkpointing "
                      "(use_unsloth_gc)", "set grad_checkpointing: true as well")
    if not spec.grad_checkpointing:
        return {"disable_gradient_checkpointing": True}
    return {"use_unsloth_gc": True} if spec.activation_offload else {}


def _llamafactory_dataset(spec: RunSpec) -> dict[str, Any]:
    if spec.dataset.path is None:
        return {}
    if spec.dataset.format in ("text", "auto"):
        raise _cannot("dataset.format", "LLaMA-Factory", f"{spec.dataset.format!r} has no dataset_info formatting "
                      "for stage sft", "set dataset.format to alpaca, prompt-completion, sharegpt or messages")
    path = Path(spec.dataset.path)
    return {"dataset": path.stem, "dataset_dir": str(path.parent)}


def _llamafactory_precision(spec: RunSpec) -> dict[str, Any]:
    """Full fine-tuning keeps fp32 master weights unless pure_bf16; LoRA trains fp32 adapters on bf16 weights unless
    pure_bf16 (LLaMA-Factory model/adapter.py)."""
    full, precision = spec.method == "full", spec.precision
    if precision == "fp8":
        raise _cannot("precision", "LLaMA-Factory", "tunecast does not write its fp8 settings", "set precision bf16")
    if precision == "fp16-mixed":
        return {"fp16": True}
    if precision == "fp32":
        return {"bf16": False}
    if precision == "bf16-mixed":
        if not full:
            raise _cannot("precision", "LLaMA-Factory", "LoRA loads the weights in their checkpoint dtype (bf16)",
                          "set precision: bf16")
        return {"bf16": True}
    pure = full or not spec.lora.fp32_adapters
    return {"bf16": True, "pure_bf16": True} if pure else {"bf16": True}
