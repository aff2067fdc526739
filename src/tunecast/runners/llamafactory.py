"""Read a LLaMA-Factory training config (`llamafactory-cli train config.yaml`) into a tunecast config.

Keys, values and defaults are LLaMA-Factory's at 0.9.6 (`src/llamafactory/hparams/`), as listed in
docs/research/runners.md section 3: finetuning_type lora, lora_rank 8, lora_alpha 2 × rank, cutoff_len 2048,
gradient checkpointing on unless disable_gradient_checkpointing, full fine-tuning with fp32 master weights unless
pure_bf16, and the transformers Trainer's own defaults for the rest (batch 8, learning rate 5e-5, 3 epochs, linear).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunecast.config.imported import Imported
from tunecast.config.prequantized import PREQUANTIZED_METHODS
from tunecast.runners import llamafactory_v1
from tunecast.runners import mapping as mp
from tunecast.runners.mapping import LOGGING, NO_EFFECT, Mapper

LABEL = "LLaMA-Factory"
_STAGES = ("sft", "pt")
_ATTENTION = {"fa2": "flash", "fa3": "flash", "sdpa": "sdpa", "disabled": "eager"}
_DEFAULTS = {"method": "lora", "seq_len": 2048, "grad_checkpointing": True, "micro_batch": 8, "grad_accum": 1,
             "epochs": 3.0, "learning_rate": 5e-5, "schedule": "linear", "optimizer": "adamw"}


def read(path: Path) -> Imported:
    """`path`'s LLaMA-Factory config as a tunecast config (runner llamafactory), with every key accounted for. A
    file in LLaMA-Factory's v1 schema (`model:`, plugin sections) is read by llamafactory_v1."""
    m, data = mp.start("llamafactory", LABEL, path)
    if llamafactory_v1.is_v1(data):
        m.label = llamafactory_v1.LABEL
        return llamafactory_v1.read(m, data)
    _check(m, data)
    mp.run_handlers(m, data, _HANDLERS, _QUIET)
    mp.steps_replace_epochs(m, "num_train_epochs")
    _precision(m, data)
    _dataset(m, data)
    for key, value in _DEFAULTS.items():
        m.default(key, value)
    if data.get("stage") == "pt":
        m.default("packing", True)
    if m.get("method") in ("lora", "qlora"):
        m.default("lora.rank", 8)
        m.default("lora.alpha", 2 * int(m.get("lora.rank")))
        m.default("lora.dropout", 0.0)
        mp.peft_default_targets(m, str(m.get("model") or ""))
    return m.finish(data, [*_HANDLERS, *_QUIET, *_OWN])


def _check(m: Mapper, data: dict[str, Any]) -> None:
    """Values that make the run impossible to estimate."""
    stage = data.get("stage", "sft")
    if stage not in _STAGES:
        raise m.error("stage", f"stage {stage!r} trains more than one model or scores pairs: tunecast estimates "
                      "supervised fine-tuning (sft) and pre-training (pt) only", "estimate the sft stage of the run")
    kind = data.get("finetuning_type", "lora")
    if kind not in ("lora", "full"):
        raise m.error("finetuning_type", f"finetuning_type {kind!r} cannot be estimated: tunecast knows lora and "
                      "full", "use finetuning_type: lora or full")
    # On-the-fly quantization as LLaMA-Factory runs it (model/model_utils/quantization.py configure_quantization,
    # hiyouga/LLaMA-Factory 13e7388): bitsandbytes 8-bit is BitsAndBytesConfig(load_in_8bit=True), 4-bit NF4.
    bits, method = data.get("quantization_bit"), data.get("quantization_method", "bnb")
    if str(method).lower() in PREQUANTIZED_METHODS:
        label = PREQUANTIZED_METHODS[str(method).lower()]
        raise m.error("quantization_method", f"{method} is a pre-quantized {label} checkpoint's method: its weights "
                      f"are already quantized by {label}, which neither LoRA nor tunecast's QLoRA (bitsandbytes) can "
                      "train on", "point model_name_or_path at the unquantized model it was made from, with "
                      "quantization_bit: 4 or 8 and quantization_method: bnb")
    if (method, bits) not in (("bnb", None), ("bnb", 4), ("bnb", 8), ("hqq", None), ("hqq", 4)):
        what = f"{bits}-bit {method}" if bits is not None else f"quantization_method {method}"
        raise m.error("quantization_bit" if bits not in (None, 4, 8) or method == "hqq" else "quantization_method",
                      f"{what} base weights cannot be estimated: tunecast knows bitsandbytes' 4-bit NF4 and 8-bit "
                      "LLM.int8", "use quantization_bit: 4 or 8 with quantization_method: bnb, or no quantization")
    if bits in (4, 8) and kind != "lora":
        raise m.error("quantization_bit", f"{bits}-bit weights need finetuning_type: lora", "set finetuning_type: lora")


def _stage(m: Mapper, key: str, value: Any) -> None:
    if value == "pt":
        m.put(key, "dataset.train_on", "all")
    else:
        m.skip(key, value, "supervised fine-tuning: what tunecast estimates")


def _finetuning(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "method", "qlora" if m.get("method") == "qlora" else "full" if value == "full" else "lora")


def _quantization(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "method", "qlora")
    if value == 8:
        m.put(key, "quantization.bits", 8)


def _quantization_method(m: Mapper, key: str, value: Any) -> None:
    if value == "hqq":
        m.note("HQQ 4-bit weights are estimated as bitsandbytes NF4 (the same 4 bits per weight)")
    m.skip(key, value, "the quantization library: tunecast estimates 4-bit weights as bitsandbytes NF4 and 8-bit ones "
                       "as bitsandbytes LLM.int8")


def _targets(m: Mapper, key: str, value: Any) -> None:
    names = [part.strip() for part in str(value).split(",") if part.strip()]
    m.put(key, "lora.targets", "all-linear" if names == ["all"] else names)


def _attention(m: Mapper, key: str, value: Any) -> None:
    if value in _ATTENTION:
        m.put(key, "attention", _ATTENTION[value])
        if value == "fa3":
            m.note("flash_attn: fa3 (FlashAttention 3) is estimated as FlashAttention 2")
    else:
        m.skip(key, value, "auto: the kernel LLaMA-Factory finds installed; left to tunecast's attention default")


def _no_checkpointing(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "grad_checkpointing", not value)


def _unsloth_gc(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "grad_checkpointing", True)
        m.put(key, "activation_offload", True)
    else:
        m.skip(key, value, "false: checkpointing without offload")


def _liger(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "loss", "chunked")
        m.note("enable_liger_kernel: Liger's fused linear cross-entropy is estimated as tunecast's chunked loss; its "
               "other kernels (RMSNorm, SwiGLU, RoPE) are not modelled (the estimate is high by them)")
    else:
        m.skip(key, value, "false: the standard loss")


def _precision(m: Mapper, data: dict[str, Any]) -> None:
    """bf16, fp16 and pure_bf16 together: full fine-tuning keeps fp32 master weights unless pure_bf16, LoRA trains
    adapters in fp32 on bf16 weights (LLaMA-Factory model/adapter.py init_adapter)."""
    full = data.get("finetuning_type", "lora") == "full"
    if data.get("pure_bf16"):
        m.put("pure_bf16", "precision", "bf16")
        if not full:
            m.put("pure_bf16", "lora.fp32_adapters", False)
        for key in ("bf16", "fp16"):
            if key in data:
                m.skip(key, data[key], "pure_bf16 decides the precision")
    elif data.get("bf16"):
        m.put("bf16", "precision", "bf16-mixed" if full else "bf16")
    elif data.get("fp16"):
        m.put("fp16", "precision", "fp16-mixed")
        m.note("fp16: true trains under fp16 autocast; estimated as fp16-mixed")
    elif "bf16" in data or "fp16" in data:
        m.put("bf16" if "bf16" in data else "fp16", "precision", "fp32")
    else:
        m.default("precision", "fp32")
    for key in ("bf16", "fp16", "pure_bf16"):
        if key in data:
            m.skip(key, data[key], "false: another precision key decides")


def _dataset(m: Mapper, data: dict[str, Any]) -> None:
    """`dataset` names looked up in `dataset_dir`/dataset_info.json (dataset_dir "data" by default, relative to the
    config's folder) for a local file_name."""
    folder = data.get("dataset_dir") or "data"
    if "dataset_dir" in data:
        m.skip("dataset_dir", data["dataset_dir"], "the folder of dataset_info.json, read to find the dataset's file")
    value = data.get("dataset")
    if value is None:
        if "dataset" in data:
            m.skip("dataset", value, "left empty: no dataset")
        return
    names = [part.strip() for part in str(value).split(",") if part.strip()]
    if len(names) != 1:
        m.skip("dataset", value, mp.SEVERAL)
        return
    info_dir = m.base_dir / str(folder)
    info = _dataset_info(info_dir).get(names[0])
    local = None
    if isinstance(info, dict) and isinstance(info.get("file_name"), str):
        local = mp.dataset_file(m, info["file_name"], info_dir)
    if local is None or not isinstance(info, dict):
        m.skip("dataset", value, f"{names[0]!r} is not a local file in {folder}/dataset_info.json: " + mp.HUB)
        return
    m.put("dataset", "dataset.path", local)
    form = _format(info)
    if form is not None:
        m.put("dataset", "dataset.format", form)


def _dataset_info(folder: Path) -> dict[str, Any]:
    try:
        document = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _format(info: dict[str, Any]) -> str | None:
    """LLaMA-Factory's `formatting` (and columns) as tunecast's dataset.format."""
    columns = info.get("columns") or {}
    tags = info.get("tags") or {}
    if info.get("formatting", "alpaca") == "alpaca":
        if columns.get("prompt") == "prompt" and columns.get("response") == "completion":
            return "prompt-completion"
        return "alpaca"
    if info.get("formatting") == "sharegpt":
        return "messages" if tags.get("role_tag") == "role" else "sharegpt"
    return None


def _neat_packing(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "packing", True)
    else:
        m.skip(key, value, "false: `packing` decides")


def _train_on_prompt(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "dataset.train_on", "all" if value else "completion")


def _val_size(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, int) and value >= 1:
        m.put(key, "eval.examples", value)
    else:
        m.skip(key, value, "a fraction of the dataset held out: tunecast counts held-out examples (eval.examples); "
                           "set that once the dataset's size is known")


def _additional(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "lora.modules_to_save", [part.strip() for part in str(value).split(",") if part.strip()])


_HANDLERS: dict[str, mp.Handler] = {
    "torch_compile": mp.flag("compile"),
    "model_name_or_path": mp.to("model"), "stage": _stage, "finetuning_type": _finetuning,
    "quantization_bit": _quantization, "quantization_method": _quantization_method,
    "lora_rank": mp.to("lora.rank"), "lora_alpha": mp.to("lora.alpha"), "lora_dropout": mp.to("lora.dropout"),
    "lora_target": _targets, "additional_target": _additional, "use_dora": mp.flag("lora.dora"),
    "flash_attn": _attention, "disable_gradient_checkpointing": _no_checkpointing, "use_unsloth_gc": _unsloth_gc,
    "enable_liger_kernel": _liger, "cutoff_len": mp.to("seq_len"), "packing": mp.flag("packing"),
    "neat_packing": _neat_packing,
    "train_on_prompt": _train_on_prompt, "val_size": _val_size, "eval_steps": mp.to("eval.every_steps"),
    "per_device_train_batch_size": mp.to("micro_batch"), "gradient_accumulation_steps": mp.to("grad_accum"),
    "num_train_epochs": mp.to("epochs", float), "max_steps": mp.trainer_max_steps,
    "learning_rate": mp.to("learning_rate", float), "lr_scheduler_type": mp.schedule,
    "warmup_steps": mp.to("warmup_steps"), "warmup_ratio": mp.to("warmup_ratio", float),
    "weight_decay": mp.to("weight_decay", float), "max_grad_norm": mp.to("max_grad_norm", float),
    "seed": mp.to("seed"), "optim": lambda m, k, v: mp.hf_optimizer(m, k, v, "adamw_torch_fused"),
    "output_dir": mp.to("output"), "save_steps": mp.to("checkpoint.every_steps"),
    "save_total_limit": mp.to("checkpoint.keep"), "deepspeed": mp.deepspeed,
}
_OWN = ("bf16", "fp16", "pure_bf16", "dataset", "dataset_dir")  # read by read() itself

_QUIET: dict[str, str] = {
    **dict.fromkeys(("do_train", "do_eval", "do_predict", "template", "trust_remote_code", "adapter_name_or_path",
                     "model_revision", "cache_dir", "preprocessing_num_workers", "dataloader_num_workers",
                     "overwrite_cache", "overwrite_output_dir", "save_only_model", "ddp_timeout",
                     "resume_from_checkpoint", "save_strategy", "eval_strategy", "per_device_eval_batch_size",
                     "eval_dataset", "tokenized_path", "mix_strategy", "interleave_probs", "streaming",
                     "buffer_size", "default_system", "enable_thinking", "tool_format", "quantization_type",
                     "double_quantization", "upcast_layernorm", "upcast_lmhead_output", "use_reentrant_gc",
                     "use_rslora", "pissa_init", "pissa_iter", "pissa_convert", "create_new_adapter",
                     "new_special_tokens", "resize_vocab", "split_special_tokens", "use_fast_tokenizer",
                     "rope_scaling", "infer_backend", "infer_dtype", "compute_accuracy", "predict_with_generate",
                     "ddp_find_unused_parameters", "include_num_input_tokens_seen", "adam_beta1", "adam_beta2",
                     "adam_epsilon", "lr_scheduler_kwargs", "dataloader_pin_memory", "max_samples",
                     "disable_shuffling", "hf_hub_token", "push_to_hub", "hub_model_id", "low_cpu_mem_usage",
                     "image_max_pixels", "video_max_pixels", "media_dir"), NO_EFFECT),
    **dict.fromkeys(("logging_steps", "plot_loss", "report_to", "run_name", "logging_dir", "logging_first_step",
                     "include_tokens_per_second"), LOGGING),
    **dict.fromkeys(("use_galore", "use_apollo", "use_badam", "use_adam_mini", "use_muon", "use_llama_pro",
                     "use_unsloth", "loraplus_lr_ratio", "use_dft_loss", "use_eaft_loss", "use_asft_loss",
                     "freeze_vision_tower", "freeze_multi_modal_projector", "fp8"),
                    "a method or kernel tunecast does not model: the estimate is of plain LoRA or full training"),
}
_QUIET["max_samples"] = ("limits the examples read: tunecast counts the whole file; set dataset.examples and "
                         "dataset.mean_tokens to plan with fewer")
