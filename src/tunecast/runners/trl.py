"""Read a TRL SFT config (`trl sft --config config.yaml`) into a tunecast config.

The file holds TRL's ModelConfig, ScriptArguments and SFTConfig (with transformers' TrainingArguments) as flat keys.
Defaults are TRL's at 1.7-1.10, as listed in docs/research/runners.md section 2: max_length 1024,
gradient_checkpointing true, bf16 true, learning_rate 2e-5, the model loaded in float32 (dtype), LoRA r 16, alpha 32,
dropout 0.05 on peft's per-architecture targets; the Trainer's for the rest (batch 8, 3 epochs, linear schedule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunecast.config.imported import Imported
from tunecast.runners import mapping as mp
from tunecast.runners.mapping import LOGGING, NO_EFFECT, Mapper

LABEL = "TRL"
_ATTENTION = {"flash_attention_2": "flash", "sdpa": "sdpa", "eager": "eager"}
_DEFAULTS = {"method": "full", "seq_len": 1024, "grad_checkpointing": True, "learning_rate": 2e-5, "micro_batch": 8,
             "grad_accum": 1, "epochs": 3.0, "schedule": "linear", "optimizer": "adamw"}
_LORA_DEFAULTS = {"lora.rank": 16, "lora.alpha": 32, "lora.dropout": 0.05}
_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' loaders for local files


def read(path: Path) -> Imported:
    """`path`'s TRL SFT config as a tunecast config (runner trl), with every key accounted for."""
    m, data = mp.start("trl", LABEL, path)
    _check(m, data)
    script = _fsdp_qlora_script(data)
    handlers = _handlers(data, script)
    mp.run_handlers(m, data, handlers, _QUIET)
    mp.steps_replace_epochs(m, "num_train_epochs")
    _precision(m, data, "bfloat16" if script else "float32")
    if script:
        for key, value in _SCRIPT_DEFAULTS.items():
            m.default(key, value)
        m.note(f"model_id and dataset_path are the script arguments of {_SCRIPT}: estimated as that script trains "
               "(QLoRA r 16, alpha 8, dropout 0.05 on every linear layer, bf16 weights, packed, transformers' "
               "TrainingArguments defaults for the rest); set method and lora.* if your script differs")
        m.note("the script's notebook pins trl 0.8.6, whose SFTTrainer takes the loss from the full logits; the trl "
               "runner estimates today's fused head, lower by the logits' memory")
    elif m.mapped.get("model_id"):
        m.note("model_id is a training script's own argument, not TRL's (ModelConfig.model_name_or_path): read as the "
               "model; how the script loads and adapts it is in its code: set method and lora.* to match it")
    for key, value in _DEFAULTS.items():
        m.default(key, value)
    if m.get("method") in ("lora", "qlora"):
        for key, value in _LORA_DEFAULTS.items():
            m.default(key, value)
        mp.peft_default_targets(m, str(m.get("model") or ""))
    return m.finish(data, [*handlers, *_QUIET, "dtype", "torch_dtype", "bf16", "fp16", "model_init_kwargs"])


# Keys of TRL's DPOConfig that SFTConfig does not have (trl/trainer/dpo_config.py at f2cd577, and as it was before
# the DPO refactor e3b7897, huggingface/trl#3906: max_prompt_length, rpo_alpha, reference_free …), and the values of
# DPOConfig.loss_type (SFTConfig's are nll, chunked_nll and dft; "sft", which DPO can mix in, names no stage).
_DPO_KEYS = ("beta", "max_prompt_length", "max_completion_length", "precompute_ref_log_probs",
             "precompute_ref_batch_size", "ref_model_init_kwargs", "ref_adapter_name", "model_adapter_name",
             "force_use_ref_model", "reference_free", "rpo_alpha", "sync_ref_model", "ref_model_mixup_alpha",
             "ref_model_sync_steps", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau", "ld_alpha",
             "use_weighting", "loss_weights", "label_smoothing", "generate_during_eval")
_DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_pair",
               "aot_unpaired", "discopop", "apo_zero", "apo_down", "sigmoid_norm")
_DPO_HINT = "estimate the SFT run: a `trl sft --config` file (SFTConfig) without DPOConfig's keys"


def _check(m: Mapper, data: dict[str, Any]) -> None:
    for key, value in data.items():  # the first DPO key of the file names the refusal
        if key in _DPO_KEYS:
            raise m.error(key, f"{key} is a key of TRL's DPOConfig, not of SFTConfig: a DPO run (`trl dpo`), which "
                          "trains on pairs of answers against a reference model; tunecast estimates supervised "
                          "fine-tuning only", _DPO_HINT)
        losses = value if isinstance(value, list) else [value]
        if key == "loss_type" and any(str(loss) in _DPO_LOSSES for loss in losses):
            raise m.error(key, f"loss_type {value!r} is a loss of TRL's DPOTrainer (DPOConfig.loss_type), not of "
                          "SFTTrainer (nll, chunked_nll, dft): a DPO run, which trains on pairs of answers against a "
                          "reference model; tunecast estimates supervised fine-tuning only", _DPO_HINT)
    if data.get("load_in_8bit") and data.get("load_in_4bit"):
        raise m.error("load_in_8bit", "is set together with load_in_4bit, which TRL refuses (trl/trainer/"
                      "model_config.py ModelConfig.__post_init__)", "keep load_in_4bit for NF4 weights, or "
                      "load_in_8bit for LLM.int8 ones")
    for key, bits in (("load_in_4bit", 4), ("load_in_8bit", 8)):
        if data.get(key) and not data.get("use_peft"):
            raise m.error(key, f"{bits}-bit weights cannot be trained without adapters", "add use_peft: true")


def _use_peft(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "method", "qlora" if m.get("method") == "qlora" else "lora")
    else:
        m.put(key, "method", "full")


def _targets(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "lora.targets", "all-linear" if value in ("all-linear", ["all-linear"]) else value)


def _attention(m: Mapper, key: str, value: Any) -> None:
    if value in _ATTENTION:
        m.put(key, "attention", _ATTENTION[value])
    else:
        m.skip(key, value, f"attention {value!r} has no tunecast equivalent: estimated with sdpa")


@mp.takes_null
def _max_length(m: Mapper, key: str, value: Any) -> None:
    if value is None:
        m.skip(key, value, "null: TRL truncates nothing; tunecast needs the longest sequence: set seq_len")
    else:
        m.put(key, "seq_len", value)


def _completion_only(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "dataset.train_on", "completion" if value else "all")


def _assistant_only(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "dataset.train_on", "completion")
    else:
        m.skip(key, value, "false: completion_only_loss decides")


def _loss_type(m: Mapper, key: str, value: Any) -> None:
    if value in ("nll", "chunked_nll"):  # since TRL 1.15 both run the fused LM head the trl runner estimates
        m.skip(key, value, "TRL's default loss (its fused LM head): what the trl runner estimates")
    else:
        m.skip(key, value, f"loss_type {value!r}: the trl runner estimates TRL's default loss, the fused LM head "
                           "(the same logits tiles; this loss's own extra terms are not modelled)")


def _dataset_name(m: Mapper, key: str, value: Any) -> None:
    local = mp.dataset_file(m, value)
    if local is None:
        m.skip(key, value, mp.HUB)
    else:
        m.put(key, "dataset.path", local)


def _datasets(m: Mapper, key: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        m.skip(key, value, mp.SEVERAL)
        return
    entry = value[0]
    files = entry.get("data_files")
    if entry.get("path") in _BUILDERS and isinstance(files, str) and mp.dataset_file(m, files):
        m.put(f"{key}.0.data_files", "dataset.path", mp.dataset_file(m, files))
    elif mp.dataset_file(m, entry.get("path")) and files is None:
        m.put(f"{key}.0.path", "dataset.path", mp.dataset_file(m, entry.get("path")))
    else:
        m.skip(key, value, mp.HUB)
        return
    for name, item in entry.items():
        m.skip(f"{key}.0.{name}", item, "how the rows are loaded: " + NO_EFFECT)


def _fsdp(m: Mapper, key: str, value: Any) -> None:
    options = value if isinstance(value, list) else str(value).split()
    if not options or options == [""]:
        m.skip(key, value, "empty: no FSDP")
        return
    m.put(key, "gpus.strategy", "fsdp-grad-op" if "shard_grad_op" in options else "fsdp")
    if "offload" in options:
        m.put(key, "gpus.offload", "params")
    m.note(mp.LAUNCH_COUNT)


def _precision(m: Mapper, data: dict[str, Any], load_dtype: str) -> None:
    """The model's load dtype (ModelConfig.dtype or model_init_kwargs.dtype; float32 when TRL loads the model by its
    id) with the Trainer's autocast (bf16 true by default unless fp16)."""
    given = data.get("model_init_kwargs")
    init: dict[str, Any] = given if isinstance(given, dict) else {}
    # ModelConfig.torch_dtype: the name of `dtype` until TRL 0.27 (trl/trainer/model_config.py, removed in bfd25d1),
    # read only when dtype is not given (its __post_init__); the alignment-handbook's recipes write it.
    top = "torch_dtype" if "torch_dtype" in data and "dtype" not in data else "dtype"
    if top == "dtype" and "torch_dtype" in data:
        m.skip("torch_dtype", data["torch_dtype"], "dtype is given and wins (TRL's ModelConfig.__post_init__)")
    dtype_key = next((f"model_init_kwargs.{k}" for k in ("dtype", "torch_dtype") if k in init), top)
    dtype = str(init.get(dtype_key.rpartition(".")[2]) or data.get(top) or load_dtype)
    fp16 = bool(data.get("fp16"))
    bf16 = data.get("bf16") is not False and not fp16
    if fp16 or dtype == "float16":
        precision = "fp16-mixed"
        m.note("fp16: estimated as fp16-mixed (fp16 autocast)")
    elif dtype == "float32":
        precision = "bf16-mixed" if bf16 else "fp32"
    else:
        precision = "bf16"
        if dtype == "auto":
            m.note("dtype auto loads the checkpoint's dtype: estimated as bf16 weights")
    if dtype_key != top and top in data:
        m.skip(top, data[top], f"{dtype_key} is given and decides the load dtype")
    used = [key for key in ("bf16", "fp16", dtype_key) if key.partition(".")[0] in data]
    for key in used:
        m.put(key, "precision", precision)
    m.default("precision", precision)
    for key, value in init.items():
        m.skip(f"model_init_kwargs.{key}", value, "how the model is loaded: " + NO_EFFECT)


# A TRL script config without ModelConfig: philschmid's FSDP QLoRA script, whose ScriptArguments are model_id,
# dataset_path and max_seq_length (default 512); the rest of its file is transformers' TrainingArguments, not SFTConfig.
# It fixes in code what it trains: BitsAndBytesConfig 4-bit NF4 with bf16 compute and storage, torch_dtype bfloat16,
# LoraConfig(r=16, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear"), SFTTrainer(packing=True).
_SCRIPT = ("run_fsdp_qlora.py (github.com/philschmid/deep-learning-pytorch-huggingface training/scripts, commit "
           "4a0caadaf58e6f9ac64be95250ac5a49193b308b)")
_SCRIPT_DEFAULTS = {"method": "qlora", "lora.rank": 16, "lora.alpha": 8, "lora.dropout": 0.05,
                    "lora.targets": "all-linear", "packing": True, "seq_len": 512, "grad_checkpointing": False,
                    "learning_rate": 5e-5}


def _fsdp_qlora_script(data: dict[str, Any]) -> bool:
    """Whether the file holds that script's arguments (model_id with dataset_path) rather than TRL's ModelConfig."""
    return "model_name_or_path" not in data and "model_id" in data and "dataset_path" in data


def _dataset_path(m: Mapper, key: str, value: Any) -> None:
    """The script loads `dataset_path`/train_dataset.json, rows of chat messages."""
    local = mp.dataset_file(m, str(Path(str(value)) / "train_dataset.json"))
    if local is None or not Path(local).exists():
        m.skip(key, value, f"the script reads {value}/train_dataset.json, which is not next to the config: set "
                           "dataset.path, or dataset.examples and dataset.mean_tokens")
        return
    m.put(key, "dataset.path", local)
    m.put(key, "dataset.format", "messages")


def _script_seq_len(m: Mapper, key: str, value: Any) -> None:
    m.skip(key, value, "not a field of the script's ScriptArguments (max_seq_length is): the TRL its notebook pins, "
                       "0.8.6, sets fields only from the file (trl/commands/cli_utils.py YamlConfigParser."
                       "merge_dataclasses), so the run is max_seq_length's default, 512 tokens; set seq_len if yours "
                       "differs")
    m.note(f"{key}: {value} is not read by the script: the estimate is at max_seq_length's default, 512 tokens")


_SCRIPT_HANDLERS: dict[str, mp.Handler] = {"dataset_path": _dataset_path, "max_seq_len": _script_seq_len}


def _handlers(data: dict[str, Any], script: bool) -> dict[str, mp.Handler]:
    """TRL's keys, and `model_id` where the file has no model_name_or_path: no TRL key (ModelConfig names the model
    model_name_or_path) but a script's own argument, which such scripts load as the model."""
    if "model_name_or_path" in data:
        return _HANDLERS
    return {**_HANDLERS, "model_id": mp.to("model"), **(_SCRIPT_HANDLERS if script else {})}


_HANDLERS: dict[str, mp.Handler] = {
    "torch_compile": mp.flag("compile"),
    "model_name_or_path": mp.to("model"), "attn_implementation": _attention, "use_peft": _use_peft,
    "load_in_4bit": mp.four_bit, "load_in_8bit": mp.eight_bit, "lora_r": mp.to("lora.rank"),
    "lora_alpha": mp.to("lora.alpha"), "lora_dropout": mp.to("lora.dropout"), "lora_target_modules": _targets,
    "lora_modules_to_save": mp.to("lora.modules_to_save"), "use_dora": mp.flag("lora.dora"),
    "dataset_name": _dataset_name, "datasets": _datasets, "max_length": _max_length, "max_seq_length": _max_length,
    "packing": mp.flag("packing"), "completion_only_loss": _completion_only, "assistant_only_loss": _assistant_only,
    "loss_type": _loss_type, "activation_offloading": mp.flag("activation_offload"),
    "gradient_checkpointing": mp.flag("grad_checkpointing"), "learning_rate": mp.to("learning_rate", float),
    "per_device_train_batch_size": mp.to("micro_batch"), "gradient_accumulation_steps": mp.to("grad_accum"),
    "num_train_epochs": mp.to("epochs", float), "max_steps": mp.trainer_max_steps, "lr_scheduler_type": mp.schedule,
    "warmup_steps": mp.to("warmup_steps"), "warmup_ratio": mp.to("warmup_ratio", float),
    "weight_decay": mp.to("weight_decay", float), "max_grad_norm": mp.to("max_grad_norm", float),
    "seed": mp.to("seed"), "optim": lambda m, k, v: mp.hf_optimizer(m, k, v, "adamw_torch_fused"),
    "output_dir": mp.to("output"), "save_steps": mp.to("checkpoint.every_steps"),
    "save_total_limit": mp.to("checkpoint.keep"), "eval_steps": mp.to("eval.every_steps"),
    "fsdp": _fsdp, "deepspeed": mp.deepspeed,
}

_QUIET: dict[str, str] = {
    **dict.fromkeys(("model_revision", "trust_remote_code", "lora_task_type", "use_rslora", "bnb_4bit_quant_type",
                     "use_bnb_nested_quant", "bnb_4bit_quant_storage", "dataset_config", "dataset_train_split",
                     "dataset_test_split", "dataset_streaming", "streaming", "test_split_size",
                     "dataset_text_field", "dataset_kwargs", "dataset_num_proc", "eos_token", "pad_token",
                     "chat_template_path", "shuffle_dataset", "truncation_mode", "pad_to_multiple_of",
                     "packing_strategy", "eval_packing", "lr_scheduler_kwargs", "gradient_checkpointing_kwargs",
                     "torch_empty_cache_steps", "do_train", "do_eval", "overwrite_output_dir",
                     "resume_from_checkpoint", "save_strategy", "eval_strategy", "evaluation_strategy",
                     "per_device_eval_batch_size",
                     "dataloader_num_workers", "dataloader_pin_memory", "remove_unused_columns", "tf32",
                     "bf16_full_eval", "ddp_timeout", "ddp_find_unused_parameters", "push_to_hub", "hub_model_id",
                     "hub_strategy", "hub_private_repo", "save_only_model", "adam_beta1", "adam_beta2",
                     "adam_epsilon", "env", "ignore_bias_buffers", "router_aux_loss_coef",
                     "accelerator_config"), NO_EFFECT),
    "fsdp_config": "FSDP details tunecast does not model: the strategy comes from `fsdp`",
    **dict.fromkeys(("logging_steps", "logging_strategy", "logging_first_step", "report_to", "run_name",
                     "logging_dir", "include_tokens_per_second"), LOGGING),
    **dict.fromkeys(("use_liger_kernel", "lora_target_parameters"),
                    "a kernel or method tunecast does not model: the estimate is of the standard layers"),
    "padding_free": "padding-free batches hold no padding: tunecast estimates padded batches unless packing (high)",
    "log_level": LOGGING,
    # the alignment-handbook's own arguments beside TRL's (src/alignment/configs.py at 925acdf: SFTConfig.chat_template,
    # ScriptArguments.dataset_mixture), which its scripts/sft.py reads
    "chat_template": "the chat template the rows are rendered with: " + NO_EFFECT,
    "dataset_mixture": "the alignment-handbook's mixture of Hub datasets: " + mp.HUB,
}
