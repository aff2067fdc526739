"""Read a LLaMA-Factory v1 config (`USE_V1=1 llamafactory-cli sft config.yaml`) into a tunecast config.

v1 is LLaMA-Factory's new trainer (src/llamafactory/v1/), with its own keys: `model` (not `model_name_or_path`),
plugin sections (`peft_config`, `quant_config`, `dist_config`, `kernel_config`, …, each with a `name`) and
`micro_batch_size` / `global_batch_size`. Keys, values and defaults are those of hiyouga/LLaMA-Factory at commit
ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30 (v1/config/{model,training,data,sample}_args.py; the plugins'
dataclasses in v1/plugins/), as the model engine and trainer use them (v1/core/model_engine.py, base_trainer.py):

* no `peft_config` is full fine-tuning: the model is cast to float32 (ModelEngine._init_model) and FSDP2 computes in
  bf16 when `bf16` (default true; FSDP2Engine.get_mp_policy); DeepSpeed takes its precision from its JSON;
* LoRA trains on the weights in the checkpoint's dtype (`dtype="auto"`), with peft's fp32 adapters; defaults r 8,
  alpha 16, dropout 0.05, target_modules `all` (every linear layer but the head; plugins/model_plugins/peft.py);
* the optimizer is `torch.optim.AdamW(params, lr)` (multi-tensor on a GPU; weight decay 0.01, torch's default) on a
  constant schedule unless `optim_config` / `lr_scheduler_config` name a plugin (BaseTrainer._init_optimizer);
* activation checkpointing is on (`enable_activation_checkpointing: true`), micro_batch_size 1, cutoff_len 2048,
  learning rate 1e-4, 3 epochs unless max_steps; `global_batch_size` is micro × accumulation × data-parallel GPUs
  (core/utils/batching.py BatchGenerator), tunecast's `global_batch`.

The training stage is the command (`sft`, `dpo`, `rm`; v1/launcher.py), not a key: a file that holds DPO's keys or a
preference dataset, or the reward model's `model_class: cls`, is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tunecast.config.imported import Imported
from tunecast.runners import mapping as mp
from tunecast.runners.mapping import LOGGING, NO_EFFECT, Mapper

LABEL = "LLaMA-Factory v1"
# Keys only v1 has; with `model` and no `model_name_or_path` they tell a v1 file from a v0 one.
MARKERS = ("model", "model_class", "peft_config", "quant_config", "dist_config", "kernel_config", "init_config",
           "train_dataset", "micro_batch_size", "global_batch_size", "enable_activation_checkpointing",
           "batching_strategy", "optim_config", "lr_scheduler_config")
_DEFAULT_MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # ModelArguments.model's default
_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash"}
_FORMATS = {"alpaca": "alpaca", "sharegpt": "sharegpt"}  # v1 converters → tunecast's dataset.format
# A dataset list's file name that names a preference stage (v1_dpo_demo.yaml, kto_pairs.yaml).
_PREFERENCE_NAME = re.compile(r"(?:^|[_\-.])(dpo|kto|orpo|simpo|rm|reward|pref|preference)(?=$|[_\-.])", re.I)
_DPO_KEYS = ("pref_loss", "pref_beta", "pref_ftx", "simpo_gamma", "dpo_label_smoothing", "ld_alpha")
_DEFAULTS = {"seq_len": 2048, "grad_checkpointing": True, "micro_batch": 1, "epochs": 3.0, "learning_rate": 1e-4,
             "schedule": "constant", "optimizer": "adamw-foreach", "weight_decay": 0.01, "max_grad_norm": 1.0,
             "attention": "sdpa"}
_LORA_DEFAULTS = {"lora.rank": 8, "lora.alpha": 16, "lora.dropout": 0.05, "lora.targets": "all-linear"}


def is_v1(data: dict[str, Any]) -> bool:
    """Whether a LLaMA-Factory file is in the v1 schema: v0 names its model `model_name_or_path`."""
    return "model_name_or_path" not in data and any(key in data for key in MARKERS)


def read(m: Mapper, data: dict[str, Any]) -> Imported:
    """The v1 file `data`, opened by llamafactory.read, as a tunecast config (runner llamafactory)."""
    _check(m, data)
    mp.run_handlers(m, data, _HANDLERS, _QUIET)
    mp.steps_replace_epochs(m, "num_train_epochs")
    _precision(m, data)
    if not m.has("model"):
        m.default("model", _DEFAULT_MODEL)
        m.note(f"model not given: LLaMA-Factory v1's default, {_DEFAULT_MODEL}")
    for key, value in _DEFAULTS.items():
        m.default(key, value)
    if not m.has("global_batch"):
        m.default("grad_accum", 1)  # global_batch_size unset: one micro-batch per step (BatchGenerator)
    if m.get("method") in ("lora", "qlora"):
        for key, value in _LORA_DEFAULTS.items():
            m.default(key, value)
    else:
        m.default("method", "full")
    m.note("LLaMA-Factory v1 is estimated with the llamafactory runner's step (LLaMA-Factory 0.9.6's Trainer): v1's "
           "own loop also takes the loss from fp32 logits (core/base_trainer.py compute_log_probs)")
    known = [*_HANDLERS, *_QUIET, *_PEFT, *_PEFT_QUIET, *_QUANT, *_DIST, "bf16"]
    return m.finish(data, known)


def _check(m: Mapper, data: dict[str, Any]) -> None:
    """What makes the run one tunecast cannot estimate, named by its key."""
    for key in _DPO_KEYS:
        if key in data:
            raise m.error(key, f"{key} is a setting of DPO (`llamafactory-cli dpo`), which trains on pairs of answers "
                          "against a reference model: tunecast estimates supervised fine-tuning only",
                          "estimate the sft run: remove the pref_* and DPO keys")
    kind = data.get("model_class", "llm")
    if kind != "llm":
        what = "a reward model (a scoring head, `llamafactory-cli rm`)" if kind == "cls" else "the model without a head"
        raise m.error("model_class", f"model_class {kind!r} trains {what}: tunecast estimates causal language "
                      "models (model_class: llm)", "use model_class: llm for supervised fine-tuning")
    peft = _section(m, data, "peft_config")
    name = peft.get("name")
    if peft and name != "lora":
        raise m.error("peft_config.name", f"peft_config {name!r} cannot be estimated: tunecast knows LoRA and full "
                      "fine-tuning", "use peft_config name: lora, or no peft_config for full fine-tuning")
    quant = _section(m, data, "quant_config")
    bits = _bits(quant)
    if bits is not None and bits not in (4, 8):
        problem = (f"{bits}-bit base weights cannot be estimated" if bits > 0 else
                   f"quantization_bit {quant.get('quantization_bit')!r} is not a number of bits")
        raise m.error("quant_config.quantization_bit", f"{problem}: tunecast knows bitsandbytes' 4-bit NF4 and "
                      "8-bit LLM.int8", "use quantization_bit: 4 or 8, or no quant_config")
    if bits is not None and not peft:
        raise m.error("quant_config.quantization_bit", f"{bits}-bit weights need adapters: LLaMA-Factory v1 trains "
                      "a quantized model through LoRA only", "add peft_config with name: lora")
    for key in ("kernel_config", "init_config", "optim_config", "lr_scheduler_config"):
        _section(m, data, key)
    dist = _section(m, data, "dist_config")
    if dist and dist.get("name") not in ("fsdp2", "fsdpturbo", "deepspeed"):
        raise m.error("dist_config.name", f"dist_config {dist.get('name')!r} is not one of LLaMA-Factory v1's "
                      "backends", "use fsdp2, fsdpturbo or deepspeed")


def _section(m: Mapper, data: dict[str, Any], key: str) -> dict[str, Any]:
    """A plugin section as a mapping ({} when absent or null): v1 requires its `name` (arg_utils.py
    get_plugin_config)."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or "name" not in value:
        raise m.error(key, f"{key} must be a mapping with a `name` (LLaMA-Factory v1's plugin configs)",
                      f"write {key} as `name: …` with the plugin's keys under it")
    return value


def _bits(quant: dict[str, Any]) -> int | None:
    """The quantization the plugin applies: bnb defaults to 4 bits, auto to none; 8 bits is BitsAndBytesConfig(
    load_in_8bit=True), without the 4-bit keys (plugins/model_plugins/quantization.py quantization_with_bnb, read at
    hiyouga/LLaMA-Factory 1bc8a83)."""
    if not quant:
        return None
    bits = quant.get("quantization_bit")
    if bits is None and quant.get("name") == "bnb":
        return 4
    if bits is None or (isinstance(bits, int) and not isinstance(bits, bool)):
        return bits
    return -1  # not a bit count: refused by _check


def _model_class(m: Mapper, key: str, value: Any) -> None:
    m.skip(key, value, "llm: a causal language model, what tunecast estimates (a multimodal checkpoint loads as an "
                       "image-text model, which the model catalog decides)")


def _attention(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, str) and value in _ATTENTION:
        m.put(key, "attention", _ATTENTION[value])
    else:
        m.skip(key, value, f"attention {value!r} is not one of v1's (eager, sdpa, flash_attention_2)")


def _peft(m: Mapper, key: str, value: Any) -> None:
    # quant_config may come before or after peft_config in the file: whichever runs second keeps qlora
    m.put(f"{key}.name", "method", "qlora" if m.get("method") == "qlora" else "lora")
    mp.run_handlers(m, value, _PEFT, _PEFT_QUIET, prefix=f"{key}.")
    if value.get("adapter_name_or_path"):
        m.note("peft_config.adapter_name_or_path resumes that adapter: its own rank and targets apply, not this "
               "file's (LLaMA-Factory v1 plugins/model_plugins/peft.py load_adapter)")


def _targets(m: Mapper, key: str, value: Any) -> None:
    """`all` is every linear layer but the head (peft.py _find_all_linear_modules); one name is one module (v1
    does not split a comma list)."""
    if value == "all":
        m.put(key, "lora.targets", "all-linear")
    else:
        m.put(key, "lora.targets", [str(name) for name in value] if isinstance(value, list) else [str(value)])


@mp.takes_null
def _quant(m: Mapper, key: str, value: Any) -> None:
    bits = _bits(value or {})
    if bits is None:
        m.skip(key, value, "the base weights are not quantized" + ("" if value is None else
                                                                   " (name auto without quantization_bit)"))
        return
    source = f"{key}.quantization_bit" if "quantization_bit" in value else f"{key}.name"
    m.put(source, "method", "qlora")
    if bits == 8:  # BitsAndBytesConfig(load_in_8bit=True): compute_dtype and the 4-bit keys are not passed
        m.put(source, "quantization.bits", 8)
    mp.run_handlers(m, value, {}, _QUANT, prefix=f"{key}.")
    if bits == 4 and str(value.get("compute_dtype", "float16")) == "float32":
        m.note("quant_config.compute_dtype float32 dequantizes to fp32 for each matmul: estimated as bf16 (low)")


@mp.takes_null
def _dist(m: Mapper, key: str, value: Any) -> None:
    if value is None:
        m.skip(key, value, "null: one GPU, or DDP over the GPUs the launch gives")
        return
    if value["name"] == "deepspeed":
        mp.deepspeed(m, f"{key}.config_file", value.get("config_file"))
        mp.run_handlers(m, value, {}, _DIST, prefix=f"{key}.")
        return
    # FSDP2 keeps the parameters gathered between forward and backward when reshard_after_forward is false: only
    # gradients and optimizer states stay sharded, tunecast's fsdp-grad-op.
    keep = value.get("reshard_after_forward") is False
    m.put(f"{key}.reshard_after_forward" if keep else f"{key}.name", "gpus.strategy",
          "fsdp-grad-op" if keep else "fsdp")
    if value.get("offload_params"):
        m.put(f"{key}.offload_params", "gpus.offload", "params")  # CPUOffloadPolicy: parameters, gradients, states
    if value["name"] == "fsdpturbo" and value.get("ep_size", 1) != 1:
        m.note(f"dist_config fsdpturbo with ep_size {value['ep_size']}: expert parallelism is not modelled; the "
               "experts are estimated as sharded by FSDP2 like the other weights")
    mp.run_handlers(m, value, {}, _DIST, prefix=f"{key}.")
    m.note(mp.LAUNCH_COUNT)


def _kernels(m: Mapper, key: str, value: Any) -> None:
    names = [part.strip() for part in str(value.get("name", "")).split(",") if part.strip()]
    if "liger_kernel" in names:
        m.note("kernel_config liger_kernel: Liger's RMSNorm, SwiGLU and RoPE kernels are not modelled (the estimate "
               "is high by them); v1 training keeps the logits, so the loss is the standard one (liger_kernel_ops.py, "
               "require_logits)")
    if names == ["auto"]:
        m.skip(key, value, "auto: LLaMA-Factory v1's automatic kernels are Ascend NPU ones (kernels/interface.py "
                           "_AUTO_KERNELS), none on a CUDA GPU")
    else:
        m.skip(key, value, "kernels tunecast does not model: the estimate is of the standard layers")


def _optim(m: Mapper, key: str, value: Any) -> None:
    m.skip(key, value, f"optimizer plugin {value.get('name')!r} has no tunecast equivalent: estimated with v1's "
                       "default torch AdamW (two states per trained weight; Muon keeps one for the hidden matrices, "
                       "so the estimate is high for it)")


def _batching(m: Mapper, key: str, value: Any) -> None:
    """v1's batching strategies (plugins/trainer_plugins/batching.py): each micro-batch holds at most
    micro_batch_size × cutoff_len tokens."""
    if value == "dynamic_padding_free":
        m.put(key, "packing", True)
        m.note("batching_strategy dynamic_padding_free packs examples into one row of up to micro_batch_size × "
               "cutoff_len tokens: estimated as packed rows of cutoff_len tokens")
    elif value == "normal":
        m.skip(key, value, "normal: each micro-batch padded to its longest example, as tunecast estimates")
    else:
        m.skip(key, value, f"{value}: at most micro_batch_size × cutoff_len tokens per micro-batch; estimated as "
                           "padded batches of that size (high when examples are shorter)")


def _context_parallel(m: Mapper, key: str, value: Any) -> None:
    if value != 1:
        m.skip(key, value, f"context parallelism splits each sequence over {value} GPUs: not modelled, the estimate "
                           "holds whole sequences on each GPU (high)")
    else:
        m.skip(key, value, "1: no context parallelism")


def _train_dataset(m: Mapper, key: str, value: Any) -> None:
    """`train_dataset` as v1's DataEngine reads it: a local YAML of named datasets, a YAML on the Hub, a local file,
    or a Hub dataset (core/data_engine.py _get_dataset_info). v1 opens a relative path from the folder it runs in
    (os.path.isfile), the repository root for its own examples (examples/v1/… name data/v1_*_demo.yaml): a dataset
    list is looked for next to the config, then in the folders above it, then in the current directory, and the
    list's own relative paths are taken from the folder it was found from."""
    text = str(value)
    local = mp.dataset_file(m, text)
    if text.endswith(".yaml"):
        run_folder = mp.run_folder(m, text)
        infos = _dataset_list(run_folder / Path(text).expanduser()) if run_folder else None
        if run_folder is None or infos is None:
            m.skip(key, value, f"{text} is not a local dataset list (looked for from the config's folder and the "
                               "folders above it): " + mp.HUB)
            stage = _PREFERENCE_NAME.search(Path(text).stem)
            if stage:  # v1's own examples name their lists so: data/v1_dpo_demo.yaml
                m.note(f"train_dataset {text}: its name says {stage.group(1).lower()}, and its converter cannot be "
                       "read here; the stage is the command you run, and this estimates `llamafactory-cli sft`. A "
                       "preference run (`llamafactory-cli dpo`) also scores a reference model: put the list beside "
                       "the config for tunecast to read it")
            return
        if Path(text).expanduser().is_absolute():
            run_folder = m.base_dir  # where v1 runs is unknown: the list's relative paths from the config's folder
        elif run_folder != m.base_dir:
            m.note(f"train_dataset {text} is read from {run_folder}, not the config's folder: LLaMA-Factory v1 opens "
                   "it from the folder it runs in (core/data_engine.py); run from elsewhere, it reads another file or "
                   "none")
        _dataset_entries(m, key, value, infos, run_folder)
    elif local is not None:
        m.put(key, "dataset.path", local)
    else:
        m.skip(key, value, mp.HUB)


def _dataset_list(path: Path) -> dict[str, Any] | None:
    from tunecast.config.yamlfile import read_yaml

    try:
        document, _, _ = read_yaml(path.read_text(encoding="utf-8"), last_wins=True)
    except (OSError, UnicodeDecodeError):
        return None
    return document if isinstance(document, dict) else None


def _dataset_entries(m: Mapper, key: str, value: Any, infos: dict[str, Any], run_folder: Path) -> None:
    for name, info in infos.items():
        if isinstance(info, dict) and info.get("converter") == "pair":
            raise m.error(key, f"dataset {name!r} holds chosen and rejected answers (converter: pair): a DPO run "
                          "(`llamafactory-cli dpo`), and tunecast estimates supervised fine-tuning only",
                          "estimate the sft run with a supervised dataset")
    if len(infos) != 1:
        m.skip(key, value, mp.SEVERAL)
        return
    name, info = next(iter(infos.items()))
    local = None
    if isinstance(info, dict) and info.get("source") == "local":  # v1's default source is the Hub
        local = mp.dataset_file(m, info.get("path"), run_folder)
    if local is None or not isinstance(info, dict):
        m.skip(key, value, f"{name!r} is not a local file: " + mp.HUB)
        return
    m.put(key, "dataset.path", local)
    if info.get("converter") in _FORMATS:
        m.put(key, "dataset.format", _FORMATS[info["converter"]])
    if info.get("size") or info.get("weight"):
        m.note(f"dataset {name!r} is resampled (size/weight): tunecast counts the whole file; set dataset.examples "
               "to plan with the resampled count")


def _precision(m: Mapper, data: dict[str, Any]) -> None:
    """Full fine-tuning casts the model to float32 (ModelEngine._init_model); FSDP2 then computes in bf16 when
    `bf16` (FSDP2Engine.get_mp_policy), DeepSpeed as its JSON says (bf16 unless it turns it off; deepspeed_utils.py
    infer_deepspeed_mixed_precision), and without dist_config nothing casts: fp32. LoRA trains the checkpoint's
    dtype (`dtype="auto"`)."""
    bf16 = data.get("bf16", True) is not False
    dist = (data.get("dist_config") or {}).get("name")
    if m.get("method") in ("lora", "qlora"):
        m.default("precision", "bf16")
        m.note("LoRA trains on the weights in the checkpoint's dtype (v1 loads with dtype auto): estimated as bf16")
        if "bf16" in data:
            m.skip("bf16", data["bf16"], "LoRA keeps the checkpoint's dtype; bf16 sets FSDP2's compute dtype only")
    elif dist in ("fsdp2", "fsdpturbo"):
        precision = "bf16-mixed" if bf16 else "fp32"
        if "bf16" in data:
            m.put("bf16", "precision", precision)
        m.default("precision", precision)
        if bf16:
            m.note("full fine-tuning under FSDP2 with bf16: fp32 weights computed in bf16, estimated as bf16-mixed. "
                   "On one GPU, v1 starts without torchrun and skips the FSDP2 wrap (FSDP2Engine.prepare_model: no "
                   "device mesh): that run trains in fp32; set precision: fp32 to estimate it")
    else:
        precision = "bf16-mixed" if dist == "deepspeed" else "fp32"
        m.default("precision", precision)
        if "bf16" in data:
            m.skip("bf16", data["bf16"], "DeepSpeed's JSON decides the precision (bf16 unless it turns it off)"
                   if dist == "deepspeed" else "full fine-tuning without dist_config trains the float32 model "
                   "without autocast: fp32")


_HANDLERS: dict[str, mp.Handler] = {
    "model": mp.to("model"), "model_class": _model_class, "flash_attn": _attention,
    "quant_config": _quant, "peft_config": _peft, "kernel_config": _kernels, "dist_config": _dist,
    "optim_config": _optim, "train_dataset": _train_dataset, "micro_batch_size": mp.to("micro_batch"),
    "global_batch_size": mp.to("global_batch"), "cutoff_len": mp.to("seq_len"),
    "learning_rate": mp.to("learning_rate", float), "num_train_epochs": mp.to("epochs", float),
    "max_steps": mp.trainer_max_steps, "max_grad_norm": mp.to("max_grad_norm", float),
    "batching_strategy": _batching, "enable_activation_checkpointing": mp.flag("grad_checkpointing"),
    "cp_size": _context_parallel, "seed": mp.to("seed"), "output_dir": mp.to("output"),
    "save_steps": mp.to("checkpoint.every_steps"), "save_total_limit": mp.to("checkpoint.keep"),
}

_PEFT: dict[str, mp.Handler] = {
    "r": mp.to("lora.rank"), "lora_alpha": mp.to("lora.alpha"), "lora_dropout": mp.to("lora.dropout", float),
    "target_modules": _targets, "use_dora": mp.flag("lora.dora"), "modules_to_save": mp.to("lora.modules_to_save"),
}
_PEFT_QUIET: dict[str, str] = {
    "name": "lora: method lora", "use_rslora": "rank-stabilised scaling: " + NO_EFFECT,
    "adapter_name_or_path": "the adapter training resumes from: " + NO_EFFECT,
    **dict.fromkeys(("export_dir", "export_size", "export_hub_model_id", "infer_dtype", "export_legacy_format"),
                    "for `llamafactory-cli merge`: " + NO_EFFECT),
}
_QUANT: dict[str, str] = {
    "name": "bitsandbytes, which v1 quantizes with", "quantization_bit": "4 or 8: method qlora",
    "compute_dtype": "the dtype 4-bit weights are dequantized to for each matmul: bf16 in the estimate (float16, "
                     "v1's default, is the same size)",
    "double_quantization": "the 4-bit constants' own quantization: under 0.1% of the weights (8-bit: not used)",
    "quantization_type": "nf4 or fp4: the same 4 bits per weight (8-bit: not used)",
}
_DIST: dict[str, str] = {
    "name": "the backend: gpus.strategy", "config_file": "the DeepSpeed JSON: gpus.strategy",
    "reshard_after_forward": "true: parameters resharded after forward (full shard)",
    "offload_params": "false: nothing in CPU memory", "pin_memory": NO_EFFECT, "dcp_path": "where sharded weights "
    "are loaded from: " + NO_EFFECT, "ep_size": "expert parallelism: see notes", "ep_dispatcher": NO_EFFECT,
    "fsdp_ignored_modules": NO_EFFECT, "hook_modules": NO_EFFECT, "fsdp_implementation": NO_EFFECT,
}
_QUIET: dict[str, str] = {
    **dict.fromkeys(("trust_remote_code", "custom_chat_template", "batching_workers", "dist_timeout",
                     "full_determinism", "resume_from_checkpoint"), NO_EFFECT),
    "init_config": "where the weights are first placed while loading: " + NO_EFFECT + " of the training step",
    "lr_scheduler_config": "the learning rate's shape only: " + NO_EFFECT,
    "eval_dataset": "v1's trainer does not evaluate during training (core/base_trainer.py fit): " + NO_EFFECT,
    **dict.fromkeys(("dp_size", "mp_replicate_size", "mp_shard_size"), mp.LAUNCH_COUNT),
    "cp_mode": "the context-parallel implementation: see cp_size",
    "save_epochs": "tunecast saves every N steps or minutes: set checkpoint.every_steps",
    "save_ckpt_as_hf": "checkpoint format: the extra memory while saving (LLaMA-Factory's warning) is not modelled",
    "logging_steps": LOGGING,
    **dict.fromkeys(("sample_backend", "max_new_tokens"), "sampling for `llamafactory-cli chat`: " + NO_EFFECT),
}
