"""Read a kohya sd-scripts training config (`train_network.py --config_file FILE.toml`) into a tunecast config.

The file is TOML; sd-scripts reads it by merging every table into one namespace of its command-line arguments,
a key of a later table replacing the same key of an earlier one (library/train_util.py read_config_from_file,
L4746-4760 at 48d368fa), so the tables' names mean nothing and each key is read as the flag of that name. The run is
a diffusion pipeline's (docs/diffusion.md), estimated with the `kohya` runner's defaults (config/diffusion_runner.py)
for what the file leaves unset, and kohya's own argparse defaults for the run's length: train_batch_size 1,
max_train_steps 1600, learning_rate 2e-6 (library/train_util.py L3900, L3952, L3701).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from tunecast.config.imported import Imported
from tunecast.errors import TunecastError
from tunecast.runners import mapping as mp
from tunecast.runners.mapping import LOGGING, NO_EFFECT, Mapper

LABEL = "kohya sd-scripts"
_DEFAULTS = {"micro_batch": 1, "max_steps": 1600, "learning_rate": 2e-6}
_PRECISION = {"no": "fp32", "fp16": "fp16-mixed", "bf16": "bf16-mixed"}
# optimizer_type names (library/train_util.py get_optimizer, case-insensitive) → tunecast's optimizer
_OPTIMIZERS = {"adamw": "adamw-foreach", "adamw8bit": "adamw-8bit", "pagedadamw": "paged-adamw",
               "pagedadamw32bit": "paged-adamw", "pagedadamw8bit": "paged-adamw-8bit", "adafactor": "adafactor",
               "sgdnesterov": "sgd"}
_LORA_MODULES = ("networks.lora", "networks.lora_flux", "networks.lora_sd3")
_PIPELINE = ("the diffusers pipeline the checkpoint is of, for example --set "
             "model=stabilityai/stable-diffusion-xl-base-1.0")


def read(path: Path) -> Imported:
    """`path`'s kohya TOML as a tunecast config (runner kohya), with every key accounted for."""
    data, lines = _read_toml(path)
    m = Mapper("kohya", LABEL, path, lines)
    m.config["method"] = "lora" if "network_module" in data or "network_dim" in data else "full"
    if m.config["method"] == "full":
        m.note("no network_module: a fine-tune of every weight (fine_tune.py, sdxl_train.py), estimated as method full")
    _check(m, data)
    mp.run_handlers(m, data, _HANDLERS, _QUIET)
    if m.has("epochs") and m.has("max_steps"):
        m.drop("max_steps", "max_train_steps", "max_train_epochs replaces max_train_steps in sd-scripts "
                                               "(library/train_util.py, max_train_epochs)")
    for key, value in _DEFAULTS.items():
        if key != "max_steps" or not m.has("epochs"):
            m.default(key, value)
    return m.finish(data, [*_HANDLERS, *_QUIET])


def _read_toml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's keys as sd-scripts merges them (every table's into one; a later one wins), and each key's line."""
    text = mp.read_config_text(path, LABEL, "TOML")
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TunecastError(f"{path}: not TOML: {error}", field="config",
                            hint="give sd-scripts' --config_file, a TOML file of key = value lines") from None
    merged: dict[str, Any] = {}
    for name, value in document.items():
        if isinstance(value, dict):
            merged.update(value)
        else:
            merged[name] = value
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        found = re.match(r"\s*([A-Za-z0-9_]+)\s*=", line)
        if found:
            lines[found.group(1)] = number  # the last, as the last value wins
    return merged, lines


def _check(m: Mapper, data: dict[str, Any]) -> None:
    module = data.get("network_module")
    if module is not None and module not in _LORA_MODULES:
        raise m.error("network_module", f"{module!r} is not kohya's LoRA (networks.lora, lora_flux, lora_sd3): "
                      "LyCORIS and other networks are not modelled", "estimate its LoRA: network_module = "
                      "\"networks.lora\" with the same network_dim")
    if data.get("network_train_text_encoder_only"):
        raise m.error("network_train_text_encoder_only", "trains the text encoders only, which tunecast does not "
                      "estimate (the denoiser's training step)", "remove it to estimate the denoiser's LoRA")
    if data.get("full_fp16"):
        raise m.error("full_fp16", "fp16 weights and gradients without fp32 adapters are not modelled",
                      "use mixed_precision = \"fp16\" without full_fp16, or full_bf16")
    swap = data.get("blocks_to_swap")
    if isinstance(swap, int) and swap > 0:
        raise m.error("blocks_to_swap", f"swapping {swap} blocks to the CPU is not modelled",
                      "remove blocks_to_swap to estimate the run with every block on the GPU")
    if data.get("cpu_offload_checkpointing"):
        raise m.error("cpu_offload_checkpointing", "checkpoints kept in CPU memory are not modelled",
                      "remove it to estimate checkpointing on the GPU")
    for item in data.get("network_args") or []:
        name = str(item).partition("=")[0].strip()
        if name in ("conv_dim", "conv_alpha", "conv_block_dims"):
            raise m.error("network_args", f"{item}: LoRA on the 3 × 3 convolutions (LoCon) is not modelled",
                          "remove the conv_* network_args to estimate the linear layers' LoRA")


def _model(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "model", str(value))
    if str(value).endswith((".safetensors", ".ckpt")):
        m.note(f"{key} is a single-file checkpoint, which tunecast does not read: give {_PIPELINE}")


def _resolution(m: Mapper, key: str, value: Any) -> None:
    sides = [int(side) for side in str(value).replace(" ", "").split(",") if side.isdigit()]
    if len(sides) == 1:
        m.put(key, "diffusion.resolution", sides[0])
    elif len(sides) == 2:
        m.put(key, "diffusion.resolution", f"{sides[0]}x{sides[1]}")
    else:
        m.skip(key, value, "not 'size' or 'width,height': the pipeline's own size is estimated")


def _precision(m: Mapper, key: str, value: Any) -> None:
    if str(value) in _PRECISION:
        m.put(key, "precision", _PRECISION[str(value)])
    else:
        m.skip(key, value, "not one of no, fp16, bf16: kohya's default (no) applies")


def _full_bf16(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "precision", "bf16")
    else:
        m.skip(key, value, "false: mixed precision as mixed_precision says")


def _optimizer(m: Mapper, key: str, value: Any) -> None:
    if not str(value):
        m.skip(key, value, "empty: kohya's AdamW (the runner's default)")
    else:
        mp.put_optimizer(m, key, value, _OPTIMIZERS)


def _eight_bit_adam(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "optimizer", "adamw-8bit")
    else:
        m.skip(key, value, "false: optimizer_type decides")


def _either(tunecast_key: str, other: str) -> mp.Handler:
    """A yes/no key that, like `other`, turns `tunecast_key` on (cache_latents and cache_latents_to_disk)."""
    def handle(m: Mapper, key: str, value: Any) -> None:
        if value or not m.get(tunecast_key):
            m.put(key, tunecast_key, bool(value))
        else:
            m.skip(key, value, f"false: {other} is true")
    return handle


def _lora_only(tunecast_key: str) -> mp.Handler:
    def handle(m: Mapper, key: str, value: Any) -> None:
        if m.config.get("method") == "lora":
            m.put(key, tunecast_key, value)
        else:
            m.skip(key, value, "no network_module: no LoRA")
    return handle


def _alpha(m: Mapper, key: str, value: Any) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1 and float(value).is_integer():
        _lora_only("lora.alpha")(m, key, int(value))
    else:
        m.skip(key, value, "a scale of the adapters' output: " + NO_EFFECT)


def _fp8(m: Mapper, key: str, value: Any) -> None:
    if value:
        m.put(key, "diffusion.base_8bit", True)
        if key == "fp8_base_unet":
            m.note("fp8_base_unet keeps the text encoders in the weight dtype: estimated with them in 8 bits as well "
                   "(fp8_base), low by half the resident encoders' bytes")
    else:
        m.skip(key, value, "false: the base weights in the weight dtype")


def _train_unet_only(m: Mapper, key: str, value: Any) -> None:
    m.skip(key, value, "true: the denoiser's LoRA only, as estimated" if value else
           "false: the text encoders' LoRA is trained too, which the estimate does not trace (the runner's notes)")


def _epochs(m: Mapper, key: str, value: Any) -> None:
    m.put(key, "epochs", float(value))


def _network_args(m: Mapper, key: str, value: Any) -> None:
    m.skip(key, value, "the network's own options: estimated with kohya's layers and one rank")


_HANDLERS: dict[str, mp.Handler] = {
    "pretrained_model_name_or_path": _model, "network_module": lambda m, k, v: m.put(k, "method", "lora"),
    "network_dim": _lora_only("lora.rank"), "network_alpha": _alpha,
    "network_args": _network_args, "network_train_unet_only": _train_unet_only,
    "train_batch_size": mp.to("micro_batch"), "resolution": _resolution, "mixed_precision": _precision,
    "full_bf16": _full_bf16, "gradient_checkpointing": mp.flag("grad_checkpointing"),
    "cache_latents": _either("diffusion.cache_latents", "cache_latents_to_disk"),
    "cache_latents_to_disk": _either("diffusion.cache_latents", "cache_latents"),
    "cache_text_encoder_outputs": _either("diffusion.cache_text", "cache_text_encoder_outputs_to_disk"),
    "cache_text_encoder_outputs_to_disk": _either("diffusion.cache_text", "cache_text_encoder_outputs"),
    "no_half_vae": mp.flag("diffusion.vae_fp32"), "fp8_base": _fp8, "fp8_base_unet": _fp8,
    "enable_bucket": mp.flag("diffusion.buckets"),
    "optimizer_type": _optimizer, "use_8bit_adam": _eight_bit_adam,
    "learning_rate": mp.to("learning_rate", float), "unet_lr": mp.to("learning_rate", float),
    "max_train_steps": mp.to("max_steps"), "max_train_epochs": _epochs,
    "gradient_accumulation_steps": mp.to("grad_accum"), "seed": mp.to("seed"), "output_dir": mp.to("output"),
    "max_grad_norm": mp.to("max_grad_norm", float), "lr_warmup_steps": mp.to("warmup_steps"),
}

_DATA = "the images: tunecast's estimate of a pipeline does not count them; give the run's length by max_train_steps"
_ATTENTION = "an attention kernel: estimated with SDPA (neither it nor xformers keeps the scores)"
_QUIET: dict[str, str] = {
    **dict.fromkeys(("save_precision", "save_model_as", "save_every_n_epochs", "save_every_n_steps", "save_state",
                     "save_last_n_steps_state", "save_last_n_epochs_state", "save_n_epoch_ratio",
                     "save_last_n_epochs", "save_last_n_steps", "output_name", "resume", "network_weights",
                     "base_weights", "base_weights_multiplier", "dim_from_weights", "network_dropout",
                     "training_comment", "clip_skip", "max_token_length", "min_snr_gamma", "noise_offset",
                     "adaptive_noise_scale", "multires_noise_discount", "multires_noise_iterations",
                     "scale_weight_norms", "prior_loss_weight", "lr_scheduler", "lr_scheduler_type",
                     "lr_scheduler_num_cycles", "lr_scheduler_power", "lr_scheduler_args", "optimizer_args",
                     "text_encoder_lr", "max_data_loader_n_workers", "persistent_data_loader_workers",
                     "dataset_repeats", "debug_dataset", "save_state_to_huggingface", "resume_from_huggingface",
                     "async_upload", "lowram", "highvram", "vae_batch_size", "skip_cache_check", "loss_type",
                     "huber_c", "huber_schedule", "ip_noise_gamma", "v_pred_like_loss", "debiased_estimation_loss",
                     "timestep_sampling", "model_prediction_type", "discrete_flow_shift", "guidance_scale",
                     "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "min_timestep", "max_timestep",
                     "zero_terminal_snr", "scale_v_pred_loss_like_noise_pred", "dynamo_backend",
                     "use_lion_optimizer", "apply_t5_attn_mask", "max_bucket_reso", "min_bucket_reso",
                     "bucket_reso_steps", "bucket_no_upscale"), NO_EFFECT),
    **dict.fromkeys(("v2", "v_parameterization", "sdxl", "clip_l", "clip_g", "t5xxl", "ae", "vae"),
                    "a part of the model: the pipeline given as model decides"),
    **dict.fromkeys(("train_data_dir", "reg_data_dir", "dataset_config", "in_json", "caption_extension",
                     "shuffle_caption", "keep_tokens", "caption_dropout_rate", "caption_dropout_every_n_epochs",
                     "caption_tag_dropout_rate", "weighted_captions", "token_warmup_min", "token_warmup_step",
                     "color_aug", "flip_aug", "random_crop", "face_crop_aug_range"), _DATA),
    **dict.fromkeys(("xformers", "sdpa", "mem_eff_attn"), _ATTENTION),
    **dict.fromkeys(("logging_dir", "log_with", "log_prefix", "log_tracker_name", "wandb_api_key",
                     "sample_sampler", "sample_every_n_steps", "sample_every_n_epochs", "sample_prompts",
                     "sample_at_first"), LOGGING),
    **dict.fromkeys(("network_train_text_encoder_only", "full_fp16", "blocks_to_swap", "cpu_offload_checkpointing"),
                    "false or 0: " + NO_EFFECT),
}
