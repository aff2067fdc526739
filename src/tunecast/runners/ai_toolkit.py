"""Read an ai-toolkit job config (`python run.py FILE.yaml`) into a tunecast config.

The file is YAML (ai-toolkit's own examples: config/examples/train_lora_*.yaml): `job`, `config.name`, and
`config.process`, a list whose one training process holds the `network`, `train`, `model`, `datasets`, `save` and
`sample` sections, read as toolkit/config_modules.py reads them (NetworkConfig, TrainConfig, ModelConfig,
DatasetConfig). The run is a diffusion pipeline's (docs/diffusion.md), estimated with the `ai-toolkit` runner's
defaults (config/diffusion_runner.py) for what the file leaves unset, and ai-toolkit's own defaults for the run's
length: batch_size 1, steps 1000, lr 1e-6 (toolkit/config_modules.py TrainConfig, L380-393 at 27a03a91).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunecast.config.imported import Imported
from tunecast.runners import mapping as mp
from tunecast.runners.mapping import LOGGING, NO_EFFECT, Mapper

LABEL = "ai-toolkit"
_DEFAULTS = {"micro_batch": 1, "max_steps": 1000, "learning_rate": 1e-6}
_TRAINERS = ("sd_trainer", "ui_trainer")
_PRECISION = {"bf16": "bf16-mixed", "bfloat16": "bf16-mixed", "fp16": "fp16-mixed", "float16": "fp16-mixed",
              "fp32": "fp32", "float32": "fp32", "float": "fp32"}
# train.optimizer names (toolkit/optimizer.py get_optimizer, lower-cased) → tunecast's optimizer
_OPTIMIZERS = {"adamw": "adamw-foreach", "adamw8bit": "adamw-8bit", "adamw8": "adamw-8bit", "adafactor": "adafactor",
               "sgd": "sgd"}
_EIGHT_BIT = ("qfloat8", "float8", "qint8", "int8", "uint8")


def read(path: Path) -> Imported:
    """`path`'s ai-toolkit job as a tunecast config (runner ai-toolkit), with every key accounted for."""
    m, data = mp.start("ai-toolkit", LABEL, path)
    config: dict[str, Any] = data["config"] if isinstance(data.get("config"), dict) else {}
    processes = config.get("process")
    if not isinstance(processes, list) or not processes or not isinstance(processes[0], dict):
        raise m.error("config.process", "holds no process: an ai-toolkit job lists its training process there",
                      "give an ai-toolkit training config (config/examples/train_lora_*.yaml)")
    if len(processes) > 1:
        raise m.error("config.process", f"holds {len(processes)} processes, run one after another: tunecast "
                      "estimates one run", "estimate each process from a file of its own")
    process = processes[0]
    prefix = "config.process.0"
    _check(m, process, prefix)
    m.config["method"] = "lora"
    for section, handlers in (("network", _NETWORK), ("train", _TRAIN), ("model", _MODEL)):
        part = process.get(section)
        if isinstance(part, dict):
            mp.run_handlers(m, part, handlers, _QUIET, f"{prefix}.{section}.")
    _datasets(m, process.get("datasets"), f"{prefix}.datasets")
    for key, value in process.items():
        if key not in ("network", "train", "model", "datasets"):
            m.skip(f"{prefix}.{key}", value, _PROCESS.get(key, f"not a key of {LABEL}'s documented config "
                                                                "(misspelt?)"))
    for key, value in data.items():
        if key != "config":
            m.skip(key, value, "the job's kind and its metadata: " + NO_EFFECT)
    for key, value in config.items():
        if key != "process":
            m.skip(f"config.{key}", value, "the run's name: " + NO_EFFECT)
    for key, value in _DEFAULTS.items():
        m.default(key, value)
    return m.finish(data, [*_NETWORK, *_TRAIN, *_MODEL, *_QUIET, *_PROCESS])


def _check(m: Mapper, process: dict[str, Any], prefix: str) -> None:
    kind = process.get("type")
    if kind not in _TRAINERS:
        raise m.error(f"{prefix}.type", f"{kind!r} is not a training process ({', '.join(_TRAINERS)}): tunecast "
                      "estimates training", "give an ai-toolkit training config (type: sd_trainer)")
    network: dict[str, Any] | None = process["network"] if isinstance(process.get("network"), dict) else None
    if network is None:
        raise m.error(f"{prefix}.network", "is missing: a process without a network trains every weight, which "
                      "tunecast reads from ai-toolkit's LoRA configs only", "add network: {type: lora, linear: 16}")
    if str(network.get("type", "lora")).lower() != "lora":
        raise m.error(f"{prefix}.network.type", f"{network.get('type')!r} is not LoRA: ai-toolkit's other networks "
                      "(LoKr, LoRM, …) are not modelled", "use network type lora with the same rank")
    if network.get("conv"):
        raise m.error(f"{prefix}.network.conv", "LoRA on the convolutions is not modelled",
                      "remove conv to estimate the linear layers' LoRA")
    train: dict[str, Any] = process["train"] if isinstance(process.get("train"), dict) else {}
    if train.get("train_text_encoder"):
        raise m.error(f"{prefix}.train.train_text_encoder", "training the text encoders is not modelled",
                      "set train_text_encoder: false to estimate the denoiser's LoRA")
    model: dict[str, Any] = process["model"] if isinstance(process.get("model"), dict) else {}
    for key in ("layer_offloading", "auto_memory"):
        if model.get(key):
            raise m.error(f"{prefix}.model.{key}", "moving layers to the CPU is not modelled",
                          f"remove {key} to estimate the run with every layer on the GPU")
    qtype = model.get("qtype")
    if model.get("quantize") and qtype is not None and str(qtype).lower() not in _EIGHT_BIT:
        raise m.error(f"{prefix}.model.qtype", f"{qtype!r}: only 8-bit quantized weights are modelled",
                      "use qtype qfloat8 (ai-toolkit's default)")


def _rank(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "lora.rank", value)


def _alpha(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1 and float(value).is_integer():
        m.put(key, "lora.alpha", int(value))
    else:
        m.skip(key, value, "a scale of the adapters' output: " + NO_EFFECT)


def _dtype(m: Mapper, key: str, value: Any) -> None:
    name = str(value).lower()
    if name in _PRECISION:
        m.put(key, "precision", _PRECISION[name])
    else:
        m.skip(key, value, f"dtype {value!r} is none of bf16, fp16, fp32: {LABEL}'s default (fp32) applies")


def _optimizer(m: Mapper, key: str, value: Any) -> None:
    mp.put_optimizer(m, key, value, _OPTIMIZERS)


def _quantize(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "diffusion.base_8bit", True)
    else:
        m.skip(key, value, "false: the base weights in the train dtype")


def _quantize_te(m: Mapper, key: str, value: Any) -> None:
    if value and not m.get("diffusion.base_8bit"):
        m.skip(key, value, "the text encoders' 8-bit weights alone (the denoiser's not quantized): estimated in the "
                           "train dtype, high by half the resident encoders' bytes")
    else:
        m.skip(key, value, "as quantize, which decides" if value else "false: " + NO_EFFECT)


def _unload_text_encoder(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "diffusion.cache_text", True)
    else:
        m.skip(key, value, "false: the datasets' cache_text_embeddings decides")


def _ema(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, dict) and value.get("use_ema"):
        m.skip(key, value, "an EMA copy of the trained weights (the adapters): not counted, a few MiB for LoRA")
    else:
        m.skip(key, value, "no EMA: " + NO_EFFECT)


def _datasets(m: Mapper, value: Any, key: str) -> None:
    """Every dataset's resolutions (the largest sets the peak) and caching, which ai-toolkit requires the datasets
    to agree on for text (toolkit/config_modules.py L1495-1500)."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value) or not value:
        m.skip(key, value, "no datasets: the pipeline's own size is estimated")
        return
    sides: list[int] = []
    for index, item in enumerate(value):
        for name, setting in item.items():
            dotted = f"{key}.{index}.{name}"
            if name == "resolution":
                found = setting if isinstance(setting, list) else [setting]
                numbers = [int(side) for side in found if isinstance(side, int) and not isinstance(side, bool)]
                if numbers:
                    sides.append(max(numbers))
                    m.put(dotted, "diffusion.resolution", max(sides))
                else:
                    m.skip(dotted, setting, "not a number of pixels: the pipeline's own size is estimated")
            elif name in ("cache_latents", "cache_latents_to_disk"):
                cached = all(bool(d.get("cache_latents") or d.get("cache_latents_to_disk")) for d in value)
                m.put(dotted, "diffusion.cache_latents", cached)
            elif name == "cache_text_embeddings":
                m.put(dotted, "diffusion.cache_text", all(bool(d.get(name)) for d in value))
            elif name == "num_frames":
                m.put(dotted, "diffusion.frames", setting)
            else:
                m.skip(dotted, setting, "the images and their captions: " + NO_EFFECT + " of one step")
    if len(sides) > 1:
        m.note("several datasets: the largest resolution of them all sets the peak")


_NETWORK: dict[str, mp.Handler] = {"linear": _rank, "rank": _rank, "linear_alpha": _alpha, "alpha": _alpha}
_TRAIN: dict[str, mp.Handler] = {
    "batch_size": mp.to("micro_batch"), "steps": mp.to("max_steps"), "lr": mp.to("learning_rate", float),
    "gradient_accumulation_steps": mp.to("grad_accum"), "gradient_accumulation": mp.to("grad_accum"),
    "gradient_checkpointing": mp.flag("grad_checkpointing"), "optimizer": _optimizer, "dtype": _dtype,
    "max_grad_norm": mp.to("max_grad_norm", float), "unload_text_encoder": _unload_text_encoder,
    "ema_config": _ema,
}
_MODEL: dict[str, mp.Handler] = {"name_or_path": mp.to("model"), "quantize": _quantize,
                                 "quantize_te": _quantize_te}

_QUIET: dict[str, str] = {
    **dict.fromkeys(("type", "transformer_only", "dropout", "network_kwargs", "train_unet", "train_text_encoder",
                     "noise_scheduler", "timestep_type", "content_or_style", "optimizer_params", "lr_scheduler",
                     "lr_scheduler_params", "skip_first_sample", "disable_sampling", "linear_timesteps",
                     "noise_offset", "min_snr_gamma", "snr_gamma", "loss_type", "unet_lr", "text_encoder_lr",
                     "max_denoising_steps", "min_denoising_steps", "cache_text_embeddings", "bypass_guidance_embedding",
                     "qtype", "qtype_te", "low_vram", "layer_offloading", "auto_memory"), NO_EFFECT),
    **dict.fromkeys(("is_flux", "is_v3", "is_xl", "is_v2", "is_v_pred", "arch", "assistant_lora_path",
                     "inference_lora_path", "vae_path", "te_name_or_path", "model_kwargs", "extras_name_or_path"),
                    "a part of the model: the pipeline given as name_or_path decides"),
    **dict.fromkeys(("xformers", "sdp", "attention_backend"), "an attention kernel: estimated with SDPA"),
}
_PROCESS = {"type": "a training process (" + ", ".join(_TRAINERS) + ")", "training_folder": "where it saves: "
            + NO_EFFECT, "device": "the GPU it runs on: give --gpu", "trigger_word": "a word added to the captions: "
            + NO_EFFECT, "performance_log_every": LOGGING, "save": "when and how it saves: " + NO_EFFECT,
            "sample": "sample images during training (after the training step, its memory released): " + NO_EFFECT,
            "logging": LOGGING, "log_dir": LOGGING}
