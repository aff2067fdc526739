"""Read an axolotl training config (`axolotl train config.yml`) into a tunecast config.

Keys, values and defaults are axolotl's at v0.18 (`src/axolotl/utils/schemas/`), as listed in
docs/research/runners.md section 4: sequence_len 512, micro_batch_size 1, gradient_accumulation_steps 1,
num_epochs 1, optimizer adamw_torch_fused, lr_scheduler cosine, bf16 auto, gradient_checkpointing false.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunecast.config.imported import Imported
from tunecast.runners import mapping as mp
from tunecast.runners.mapping import LOGGING, NO_EFFECT, Mapper

LABEL = "axolotl"
_ATTENTION = {"flash_attention_2": "flash", "sdpa": "sdpa", "eager": "eager"}
# axolotl prompt formats (datasets.N.type) whose rows tunecast reads as one of its formats.
_FORMATS = {"alpaca": "alpaca", "chat_template": "messages", "messages": "messages", "completion": "text",
            "pretrain": "text"}
_DEFAULTS = {"seq_len": 512, "micro_batch": 1, "grad_accum": 1, "epochs": 1.0, "optimizer": "adamw",
             "schedule": "cosine", "precision": "bf16", "grad_checkpointing": False, "method": "full"}
_FSDP_QUIET = "an FSDP setting tunecast does not model: " + NO_EFFECT + " of the estimate"


def read(path: Path) -> Imported:
    """`path`'s axolotl config as a tunecast config (runner axolotl), with every key accounted for."""
    m, data = mp.start("axolotl", LABEL, path)
    _check(m, data)
    mp.run_handlers(m, data, _HANDLERS, _QUIET)
    _model_quantization(m, data)
    mp.steps_replace_epochs(m, "num_epochs")
    for key, value in _DEFAULTS.items():
        m.default(key, value)
    if m.get("method") in ("lora", "qlora"):
        m.default("lora.dropout", 0.0)
        mp.peft_default_targets(m, str(m.get("model") or ""))
    elif m.has("lora"):
        m.note("LoRA settings given without an adapter: full fine-tuning ignores them")
    if data.get("bf16", "auto") == "auto" and not data.get("fp16") and not data.get("fp8"):
        m.note("bf16: auto is bf16 on GPUs that support it (Ampere and newer); estimated as bf16")
    return m.finish(data, [*_HANDLERS, *_QUIET, *_OWN])


# axolotl's `rl` values (utils/schemas/enums.py RLType, at 067b021): each runs a TRL trainer of its own
# (core/builders/rl.py), not supervised fine-tuning.
_RL = {"dpo": "DPO, on pairs of answers against a reference model", "ipo": "IPO, on pairs of answers against a "
       "reference model", "kto": "KTO, on answers labelled good or bad against a reference model",
       "orpo": "ORPO, on pairs of answers", "simpo": "SimPO, on pairs of answers",
       "grpo": "GRPO, reinforcement learning on answers the model generates and a reward scores",
       "gdpo": "GDPO, reinforcement learning on answers the model generates and rewards score",
       "ebft": "energy-based fine-tuning on answers the model generates"}


def _check(m: Mapper, data: dict[str, Any]) -> None:
    """Values that make the run impossible to estimate, or that axolotl itself refuses (utils/schemas/validation.py:
    quantized weights without an adapter, validate_qlora's "Can't load qlora in 8bit")."""
    _check_stage(m, data)
    processor = data.get("processor_type")
    if processor is not None and processor != "":
        # A processor makes the run multimodal: axolotl loads it (loaders/processor.py, transformers' processor class
        # by that name) and batches images with MultiModalChatDataCollator (core/builders/causal.py).
        raise m.error("processor_type", f"processor_type {processor!r} trains a multimodal model (its processor "
                      "feeds images beside the text): tunecast estimates text-only language models",
                      "estimate a text model: a text-only base_model without processor_type")
    if data.get("gptq") is True:
        raise m.error("gptq", "gptq: true trains adapters on a GPTQ checkpoint, whose weights are already quantized "
                      "by GPTQ: neither LoRA nor tunecast's QLoRA (bitsandbytes) can train on them",
                      "point base_model at the unquantized model it was made from, with adapter: lora and "
                      "load_in_8bit: true, or adapter: qlora and load_in_4bit: true")
    adapter = data.get("adapter")
    if adapter not in (None, "lora", "qlora"):
        raise m.error("adapter", f"adapter {adapter!r} cannot be estimated: tunecast knows lora and qlora",
                      "use adapter: lora or qlora, or leave it out for full fine-tuning")
    if data.get("load_in_8bit") is True and adapter != "lora":
        raise m.error("load_in_8bit", "8-bit base weights are trained through adapter: lora (axolotl refuses "
                      + ("adapter: qlora in 8-bit" if adapter == "qlora" else "quantized weights without an adapter")
                      + ")", "set adapter: lora for LoRA on the 8-bit base, or load_in_4bit: true with adapter: qlora")
    if adapter == "qlora" and data.get("load_in_4bit") is not True:
        raise m.error("adapter", "adapter: qlora needs load_in_4bit: true", "add load_in_4bit: true")
    if data.get("load_in_4bit") is True and adapter != "qlora":
        raise m.error("load_in_4bit", "4-bit weights need adapter: qlora", "set adapter: qlora")


def _check_stage(m: Mapper, data: dict[str, Any]) -> None:
    """A stage other than supervised fine-tuning (utils/schemas/config.py `rl`, `reward_model`,
    `process_reward_model`; core/builders/causal.py trains those two with AxolotlRewardTrainer, AxolotlPRMTrainer)."""
    rl = data.get("rl")
    if rl not in (None, "", False):
        what = _RL.get(str(rl).lower(), "a training stage of axolotl's RL trainers")
        raise m.error("rl", f"rl {rl!r} trains by {what}: tunecast estimates supervised fine-tuning only",
                      "estimate the supervised fine-tuning run: remove rl (and its rl_beta, dpo_*, kto_* keys)")
    for key, what in (("reward_model", "a reward model (a scoring head trained on pairs of answers, TRL's "
                                       "RewardTrainer)"),
                      ("process_reward_model", "a process reward model (a head scoring each step of an answer, "
                                               "TRL's PRMTrainer)")):
        if data.get(key) is True:
            raise m.error(key, f"{key}: true trains {what}: tunecast estimates supervised fine-tuning of a causal "
                          "language model only", f"estimate the supervised fine-tuning run: remove {key} (and "
                          "model_type AutoModelForSequenceClassification or AutoModelForTokenClassification)")


def _adapter(m: Mapper, key: str, value: Any) -> None:
    # LoRA on an 8-bit base is tunecast's qlora with quantization.bits 8, whichever of the two keys comes first
    m.put(key, "method", "qlora" if value == "qlora" or m.get("quantization.bits") == 8 else "lora")


def _targets_linear(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "lora.targets", "all-linear")
    else:
        m.skip(key, value, "false: lora_target_modules names the targets")


def _targets(m: Mapper, key: str, value: Any) -> None:
    if m.get("lora.targets") == "all-linear":
        m.skip(key, value, "lora_target_linear: true adds every linear layer; these are among them")
    else:
        m.put(key, "lora.targets", value)


def _precision(m: Mapper, key: str, value: Any) -> None:
    if key == "bf16" and value in (True, "auto", "full"):
        m.put(key, "precision", "bf16")
    elif key == "fp16" and value:
        m.put(key, "precision", "fp16-mixed")
        m.note("fp16: true loads the weights in fp16 under fp16 autocast; estimated as fp16-mixed")
    elif key == "fp8" and value:
        m.put(key, "precision", "fp8")
        m.note("fp8: true (torchao float8 training) is estimated as tunecast's fp8: FP8 matmuls, bf16 weights")
    elif not value and key == "bf16" and not m.has("precision"):
        m.put(key, "precision", "fp32")
    else:
        m.skip(key, value, "false: another precision key decides")


def _checkpointing(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "grad_checkpointing", bool(value))
    if value in ("offload", "offload_disk"):
        m.put(key, "activation_offload", True)
        if value == "offload_disk":
            m.note("gradient_checkpointing: offload_disk keeps activations on disk; estimated as CPU offload")


def _offloading(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "activation_offload", bool(value))
    if value not in (True, False):
        m.note(f"activation_offloading: {value} estimated as offload to CPU memory")


def _attention(m: Mapper, key: str, value: Any) -> None:
    if key == "attn_implementation":
        if value in _ATTENTION:
            m.put(key, "attention", _ATTENTION[value])
        else:
            m.skip(key, value, f"attention {value!r} has no tunecast equivalent: estimated with sdpa")
        return
    names = {"flash_attention": "flash", "sdp_attention": "sdpa", "eager_attention": "eager"}
    if value and key in names:
        m.put(key, "attention", names[key])
    else:
        m.skip(key, value, "off: another attention key decides" if not value else
               f"{key} has no tunecast equivalent: estimated with sdpa")


def _datasets(m: Mapper, key: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        m.skip(key, value, mp.SEVERAL)
        return
    entry = value[0]
    local = mp.dataset_file(m, entry.get("path"))
    files = entry.get("data_files")
    if local is None and isinstance(files, str):
        local = mp.dataset_file(m, files)
        if local is not None:
            m.put(f"{key}.0.data_files", "dataset.path", local)
    elif local is not None:
        m.put(f"{key}.0.path", "dataset.path", local)
    if local is None:
        m.skip(key, value, mp.HUB)
        return
    _dataset_type(m, f"{key}.0.type", entry)
    for name, item in entry.items():
        m.skip(f"{key}.0.{name}", item, "how the rows are loaded and templated: " + NO_EFFECT)


def _dataset_type(m: Mapper, key: str, entry: dict[str, Any]) -> None:
    kind = entry.get("type")
    if kind == "chat_template" and entry.get("field_messages") == "conversations":
        m.put(key, "dataset.format", "sharegpt")
    elif isinstance(kind, str) and kind in _FORMATS:
        m.put(key, "dataset.format", _FORMATS[kind])
    elif kind is not None:
        m.skip(key, kind, f"axolotl prompt format {kind!r} has no tunecast equivalent: dataset.format left auto "
                          "(detected from the rows)")


def _train_on_inputs(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "dataset.train_on", "all" if value else "completion")


def _batch_size(m: Mapper, key: str, value: Any) -> None:
    if "gradient_accumulation_steps" in m.tool_lines:
        m.skip(key, value, "gradient_accumulation_steps is given and wins")
        return
    micro = m.get("micro_batch") or 1
    m.put(key, "grad_accum", max(1, int(value) // int(micro)))
    m.note("batch_size sets gradient_accumulation_steps = batch_size / micro_batch_size, as axolotl does")


def _fsdp(m: Mapper, key: str, value: Any) -> None:
    options = value if isinstance(value, list) else str(value).split()
    if not options:
        m.skip(key, value, "empty: no FSDP")
        return
    m.put(key, "gpus.strategy", "fsdp-grad-op" if "shard_grad_op" in options else "fsdp")
    if "offload" in options:
        m.put(key, "gpus.offload", "params")
    m.note(mp.LAUNCH_COUNT)


def _fsdp_config(m: Mapper, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        m.skip(key, value, _FSDP_QUIET)
        return
    if not m.has("gpus.strategy"):
        m.put(key, "gpus.strategy", "fsdp")
        m.note(mp.LAUNCH_COUNT)
    for name, item in value.items():
        _fsdp_setting(m, f"{key}.{name}", name.removeprefix("fsdp_"), item)


def _fsdp_setting(m: Mapper, key: str, name: str, value: Any) -> None:
    if name == "offload_params":
        m.put(key, "gpus.offload", "params" if value else "none")
    elif (name, value) in (("reshard_after_forward", False), ("sharding_strategy", "SHARD_GRAD_OP")):
        m.put(key, "gpus.strategy", "fsdp-grad-op")
    elif name == "activation_checkpointing" and value:
        m.put(key, "grad_checkpointing", True)
    elif name in ("version", "fsdp_version"):
        _fsdp_version(m, key, value)
    else:
        m.skip(key, value, _FSDP_QUIET)


def _fsdp_version(m: Mapper, key: str, value: Any) -> None:
    m.skip(key, value, "FSDP version: tunecast estimates FSDP2" + ("" if str(value) == "2" else
                                                                   "; FSDP1 is estimated alike"))


def _peft_dtype(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "lora.fp32_adapters", bool(value))


def _liger_loss(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "loss", "chunked")
        m.note("Liger's fused linear cross-entropy never holds the whole logits: estimated as tunecast's chunked loss")
    else:
        m.skip(key, value, "false: the standard loss")


def _parallel(m: Mapper, key: str, value: Any) -> None:
    """axolotl's N-D parallelism (utils/schemas/config.py; accelerate's ParallelismConfig builds the mesh, and FSDP
    shards over dp_shard × cp, accelerate parallelism_config.py fsdp_dim_names): tensor and context parallelism
    split each GPU's share further, which tunecast does not model: the estimate per GPU is high, the safe side."""
    size = value if isinstance(value, int) and not isinstance(value, bool) else None
    if size is not None and size <= 1:
        m.skip(key, value, f"{value}: no {_PARALLEL[key][0]}")
    elif key == "dp_replicate_size":
        m.skip(key, value, f"{value} replicas of the sharded model (HSDP): each shards over dp_shard_size × "
                           "context_parallel_size GPUs, where tunecast's fsdp shards over gpus.count: give gpus.count "
                           "as one replica's GPUs (dp_shard × cp × tp) for the per-GPU estimate")
    elif key == "dp_shard_size":
        m.skip(key, value, f"FSDP shards the weights, gradients and optimizer states over {value} × "
                           "context_parallel_size GPUs, as tunecast's fsdp shards them over gpus.count; the GPU count "
                           "is the product of the parallel sizes, chosen at launch: give gpus.count (--gpus)")
    else:
        m.skip(key, value, f"{_PARALLEL[key][1]} over {value} GPUs: tunecast estimates no tensor or context "
                           "parallelism, so the estimate per GPU runs high; the GPU count is the product of the "
                           "parallel sizes, chosen at launch: give gpus.count (--gpus) for a multi-GPU estimate")


_PARALLEL = {"tensor_parallel_size": ("tensor parallelism", "tensor parallelism splits each layer's weights and "
                                      "activations"),
             "context_parallel_size": ("context parallelism", "context parallelism splits each sequence"),
             "sequence_parallel_degree": ("context parallelism", "context parallelism (sequence_parallel_degree, "
                                          "the old name of context_parallel_size) splits each sequence"),
             "dp_shard_size": ("sharding", ""), "dp_replicate_size": ("replication", "")}


def _use_kernels(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.skip(key, value, "transformers' Hub kernels (utils/schemas/model.py: MegaBlocks for experts …): "
                           f"{_NOT_MODELLED}, the estimate is of the standard layers (high)")
    else:
        m.skip(key, value, "false: the standard layers")


def _tiled_mlp(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.skip(key, value, "ALST's tiled MLP runs each MLP over slices of the sequence (monkeypatch/tiled_mlp), "
                           "holding one slice's intermediate activations: not modelled, the estimate holds the whole "
                           "sequence's (high)")
    else:
        m.skip(key, value, "false: the standard MLP")


def _model_config(m: Mapper, key: str, value: Any) -> None:
    """`model_config` (axolotl's alias of overrides_of_model_config, utils/schemas/deprecated.py): values set on the
    model's config before loading (loaders/utils.py)."""
    if not isinstance(value, dict):
        m.skip(key, value, "overrides of the model's config.json: not applied to the estimate")
        return
    for name, item in value.items():
        if name == "output_router_logits":
            m.skip(f"{key}.{name}", item, "a mixture-of-experts router's logits kept for its load-balancing loss "
                                          "(tokens × experts per layer, small beside the activations): not modelled")
        else:
            m.skip(f"{key}.{name}", item, "overrides the model's config.json before loading: the estimate is of the "
                                          "model's own config, without it")


def _model_quantization(m: Mapper, data: dict[str, Any]) -> None:
    """`model_quantization_config` (utils/schemas/model.py: Mxfp4Config or FineGrainedFP8Config, built with
    model_quantization_config_kwargs by loaders/model.py _set_quantization_config): a checkpoint stored in MXFP4 or
    FP8, as gpt-oss is. With `dequantize: true` transformers unpacks it to bf16 while loading."""
    name = data.get("model_quantization_config")
    kwargs = data.get("model_quantization_config_kwargs")
    dequantize = isinstance(kwargs, dict) and kwargs.get("dequantize") is True
    if name is None:
        for key in ("model_quantization_config", "model_quantization_config_kwargs"):
            if key in data:
                m.skip(key, data[key], "empty: the checkpoint's weights load as stored")
        return
    m.skip("model_quantization_config", name, "the checkpoint's own quantization, unpacked to bf16 while loading "
           "(dequantize: true): the estimate's bf16 weights" if dequantize else "weights kept quantized by "
           f"transformers' {name} where it has the kernels: estimated as bf16 weights (high)")
    if "model_quantization_config_kwargs" in data:
        m.skip("model_quantization_config_kwargs", kwargs, f"the arguments of {name}: see model_quantization_config")


_OWN = ("model_quantization_config", "model_quantization_config_kwargs")  # read by read() itself

_HANDLERS: dict[str, mp.Handler] = {
    "torch_compile": mp.flag("compile"),
    "base_model": mp.to("model"), "adapter": _adapter, "load_in_4bit": mp.four_bit, "load_in_8bit": mp.eight_bit,
    "lora_r": mp.to("lora.rank"), "lora_alpha": mp.to("lora.alpha"), "lora_dropout": mp.to("lora.dropout"),
    "lora_target_linear": _targets_linear, "lora_target_modules": _targets,
    "lora_modules_to_save": mp.to("lora.modules_to_save"), "peft_use_dora": mp.flag("lora.dora"),
    "peft_autocast_adapter_dtype": _peft_dtype,
    "sequence_len": mp.to("seq_len"), "sample_packing": mp.flag("packing"),
    "micro_batch_size": mp.to("micro_batch"), "gradient_accumulation_steps": mp.to("grad_accum"),
    "batch_size": _batch_size, "num_epochs": mp.to("epochs", float), "max_steps": mp.trainer_max_steps,
    "optimizer": lambda m, k, v: mp.hf_optimizer(m, k, v, "adamw_torch_fused"), "lr_scheduler": mp.schedule,
    "learning_rate": mp.to("learning_rate", float), "warmup_steps": mp.to("warmup_steps"),
    "warmup_ratio": mp.to("warmup_ratio", float), "weight_decay": mp.to("weight_decay", float),
    "max_grad_norm": mp.to("max_grad_norm", float), "seed": mp.to("seed"),
    "bf16": _precision, "fp16": _precision, "fp8": _precision,
    "gradient_checkpointing": _checkpointing, "activation_offloading": _offloading,
    "attn_implementation": _attention, "flash_attention": _attention, "sdp_attention": _attention,
    "eager_attention": _attention, "liger_fused_linear_cross_entropy": _liger_loss,
    "datasets": _datasets, "train_on_inputs": _train_on_inputs, "output_dir": mp.to("output"),
    "save_steps": mp.to("checkpoint.every_steps"), "save_total_limit": mp.to("checkpoint.keep"),
    "eval_steps": mp.to("eval.every_steps"),
    "fsdp": _fsdp, "fsdp_config": _fsdp_config, "fsdp_version": _fsdp_version, "deepspeed": mp.deepspeed,
    **dict.fromkeys(_PARALLEL, _parallel), "tiled_mlp": _tiled_mlp, "model_config": _model_config,
    "use_kernels": _use_kernels,
}

_NOT_MODELLED = "not modelled by tunecast's estimate"
_QUIET: dict[str, str] = {
    **dict.fromkeys(("base_model_config", "model_type", "tokenizer_type", "tokenizer_config", "tokenizer_use_fast",
                     "tokenizer_legacy", "trust_remote_code", "revision_of_model", "special_tokens", "tokens",
                     "chat_template", "chat_template_jinja", "default_system_message", "strict",
                     "resize_token_embeddings_to_32x",
                     "dataset_prepared_path", "push_dataset_to_hub", "dataset_processes", "dataset_num_proc",
                     "shuffle_merged_datasets", "dataset_exact_deduplication", "is_preprocess", "ddp_timeout",
                     "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "tf32", "debug",
                     "resume_from_checkpoint", "auto_resume_from_checkpoints", "lora_model_dir", "save_safetensors",
                     "save_strategy", "save_only_model", "save_first_step", "hub_model_id", "hub_strategy",
                     "hf_use_auth_token", "group_by_length", "pad_to_sequence_len", "eval_sample_packing",
                     "sample_packing_eff_est", "sample_packing_group_size", "sample_packing_bin_size",
                     "embeddings_skip_upcast", "lora_fan_in_fan_out", "peft_use_rslora", "peft_init_lora_weights",
                     "gradient_checkpointing_kwargs", "loss_watchdog_threshold", "loss_watchdog_patience",
                     "early_stopping_patience", "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_prefetch_factor", "bfloat16", "float16", "unfrozen_parameters", "plugins",
                     "cosine_min_lr_ratio", "lr_scheduler_kwargs", "adam_beta1", "adam_beta2", "adam_epsilon",
                     "optim_args", "test_datasets", "do_causal_lm_eval", "eval_causal_lm_metrics",
                     "eval_table_size", "eval_max_new_tokens", "eval_strategy", "evaluation_strategy",
                     "evals_per_epoch", "saves_per_epoch", "include_tokens_per_second", "torch_compile_backend",
                     "lora_on_cpu", "gpu_memory_limit", "low_cpu_mem_usage", "chat_template_kwargs",
                     "heads_k_stride", "ring_attn_func"), NO_EFFECT),
    "eot_tokens": "the chat template's end-of-turn tokens, which decide the tokens trained on: " + NO_EFFECT,
    "eval_batch_size": "evaluation's micro-batch (forward passes only, below the training step's memory): tunecast "
                       "times evaluation at micro_batch",
    "experimental_skip_move_to_device": "where the weights are placed while loading, before FSDP shards them: "
                                        "no effect on the training step",
    "min_sample_len": "drops examples shorter than this many tokens (utils/data/utils.py): tunecast counts the whole "
                      "file; set dataset.examples and dataset.mean_tokens to plan with the examples kept",
    **dict.fromkeys(("tiled_mlp_num_shards", "tiled_mlp_use_original_mlp"), "how ALST's tiled MLP slices: see "
                                                                               "tiled_mlp"),
    **dict.fromkeys(("logging_steps", "wandb_project", "wandb_entity", "wandb_watch", "wandb_name",
                     "wandb_run_id", "wandb_log_model", "wandb_mode", "mlflow_tracking_uri", "mlflow_experiment_name",
                     "use_tensorboard", "comet_api_key", "comet_workspace", "comet_project_name",
                     "use_wandb", "use_mlflow", "use_comet", "profiler_steps", "use_trackio",
                     "trackio_project_name", "trackio_run_name", "trackio_space_id"), LOGGING),
    **dict.fromkeys(("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel",
                     "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm",
                     "liger_cross_entropy", "cut_cross_entropy", "unsloth_lora_mlp",
                     "unsloth_lora_qkv", "unsloth_lora_o", "unsloth_cross_entropy_loss",
                     "unsloth_rms_norm", "unsloth_rope", "xformers_attention", "flex_attention",
                     "s2_attention"),
                    "a kernel " + _NOT_MODELLED + ": the estimate is of the standard layers (high)"),
    "chunked_cross_entropy": "axolotl's chunked cross-entropy still computes the whole logits: estimated as the "
                             "standard loss (a little high)",
    "chunked_cross_entropy_num_chunks": "axolotl's chunked cross-entropy: estimated as the standard loss",
    "val_set_size": "a fraction of the dataset held out: tunecast counts held-out examples (eval.examples); set "
                    "that once the dataset's size is known",
    "gptq": "false: the base weights are not GPTQ's",
    **dict.fromkeys(("rl", "reward_model", "process_reward_model"), "off: supervised fine-tuning, what tunecast "
                                                                   "estimates"),
    "processor_type": "empty: a text-only model, what tunecast estimates",
    "bnb_config_kwargs": "4-bit quantization details: tunecast estimates NF4 with double quantization",
}
