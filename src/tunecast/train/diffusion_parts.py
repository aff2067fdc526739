"""The parts of a diffusers pipeline a run loads, the base it keeps, and `final/`.

* Weights: each component's `from_pretrained` (`subfolder`) from a local pipeline folder, or for a catalog id from
  the local Hugging Face cache or the Hub (the cache only under `--offline` or HF_HUB_OFFLINE), in the step's
  dtypes (step/diffusion.py). A folder that holds configs but no weights trains weights drawn from the seed only
  with `random_weights: true` (the denoiser, then the VAE, then the text encoders, built from their configs), and
  those are kept under the run's `base/` as a pipeline folder diffusers loads (configs copied, weights saved), so
  the result has a base to load into.
* `final/`: LoRA adapters in diffusers' LoRA format (`pytorch_lora_weights.safetensors`, peft's state dict in
  diffusers' names with the adapters' config as metadata), what `load_lora_weights` reads into the pipeline; or the
  fully fine-tuned denoiser saved by `save_pretrained`. Written like a checkpoint, manifest last (train/final.py).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunecast.catalog.diffusion import Pipeline
from tunecast.catalog.hub import offline_reason
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.step.diffusion import DiffusionSettings, denoiser_dtype, vae_dtype, weight_dtype
from tunecast.storage.store import Storage, write_set
from tunecast.train.model import BASE_SAVED, folder_files
from tunecast.train.preflight import local_pipeline, pipeline_has_weights
from tunecast.train.run import FINAL

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE


@dataclass
class PipelineParts:
    """What a run trains with: the denoiser as built or loaded (before LoRA), the frozen VAE and text encoders, their
    tokenizers, the noise scheduler, and where the weights came from."""

    denoiser: Any
    vae: Any
    text_encoders: list[Any]  # in the pipeline's order (text_encoder, text_encoder_2, text_encoder_3)
    tokenizers: list[Any]  # each encoder's (tokenizer, tokenizer_2, tokenizer_3)
    scheduler: Any
    origin: str
    random: bool


def load_parts(spec: RunSpec, pipeline: Pipeline, settings: DiffusionSettings, *, offline: bool) -> PipelineParts:
    """The pipeline's parts on the CPU, each in its dtype."""
    import diffusers
    import torch
    import transformers

    from tunecast.step.diffusion import build_text_encoders, build_vae, make_denoiser, quiet

    quiet()
    folder = local_pipeline(spec)
    if folder is not None and not pipeline_has_weights(folder, pipeline):
        tokenizers = [_tokenizer(pipeline, name, str(folder), local=True) for name in pipeline.text_encoders]
        torch.manual_seed(spec.seed)
        denoiser = make_denoiser(pipeline, settings, "cpu")
        vae = build_vae(pipeline, settings, "cpu")
        encoders = build_text_encoders(pipeline, settings, "cpu")
        return PipelineParts(denoiser, vae, encoders, tokenizers, _scheduler(pipeline),
                             f"random weights drawn from seed {spec.seed} (random_weights: true; {folder} has no "
                             "weights)", True)
    source = str(folder) if folder is not None else pipeline.name
    local = folder is not None or offline_reason(offline) is not None
    try:
        with warnings.catch_warnings():  # the Hub client's notices to its callers' maintainers
            warnings.simplefilter("ignore")
            denoiser = getattr(diffusers, pipeline.classes[pipeline.denoiser]).from_pretrained(
                source, subfolder=pipeline.denoiser, torch_dtype=denoiser_dtype(settings), local_files_only=local)
            vae = getattr(diffusers, pipeline.classes["vae"]).from_pretrained(
                source, subfolder="vae", torch_dtype=vae_dtype(pipeline, settings), local_files_only=local)
            encoders = [getattr(transformers, pipeline.classes[name]).from_pretrained(
                source, subfolder=name, dtype=weight_dtype(settings), local_files_only=local)
                for name in pipeline.text_encoders]
            tokenizers = [_tokenizer(pipeline, name, source, local=local) for name in pipeline.text_encoders]
    except OSError as error:
        hint = ("check that each component's folder holds its weights" if folder is not None else
                f"download it where the Hub can be reached (`hf download {pipeline.name}`), or run without "
                "--offline" if local else "check the pipeline id, the network and HF_TOKEN (a gated model: accept "
                "its licence on the Hub)")
        raise TunecastError(f"cannot load the weights of {source}: {str(error).splitlines()[0]}", field="model",
                            hint=hint) from None
    for frozen in (vae, *encoders):
        frozen.requires_grad_(False)
    return PipelineParts(denoiser, vae, encoders, tokenizers, _scheduler(pipeline), f"loaded from {source}", False)


def _tokenizer(pipeline: Pipeline, encoder: str, source: str, *, local: bool) -> Any:
    """The tokenizer of text encoder `encoder`: `tokenizer` for `text_encoder`, `tokenizer_2` for `text_encoder_2`."""
    import transformers

    name = encoder.replace("text_encoder", "tokenizer")
    if name not in pipeline.classes:
        raise TunecastError(f"{pipeline.name} names no {name} in its model_index.json", field="model",
                            hint="a pipeline folder needs the tokenizer its text encoder reads")
    try:
        return getattr(transformers, pipeline.classes[name]).from_pretrained(source, subfolder=name,
                                                                              local_files_only=local)
    except (OSError, ValueError, TypeError) as error:
        raise TunecastError(f"cannot load the tokenizer of {source}: {str(error).splitlines()[0]}", field="model",
                            hint="the pipeline's tokenizer/ folder needs the files its class reads") from None


def _scheduler(pipeline: Pipeline) -> Any:
    """The noise schedule, as diffusers' examples make it from the pipeline's scheduler config: for the UNet models a
    DDPMScheduler (the config's own class is for sampling); for SD3 and FLUX the FlowMatchEulerDiscreteScheduler
    whose timesteps and sigmas they draw from (train_dreambooth_lora_sd3.py L1200-1203, _flux.py L1202-1205; SD3's
    shift 3.0 applied to its sigmas, FLUX's dynamic shifting not, as the scheduler makes them)."""
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    if pipeline.objective == "flow":
        return FlowMatchEulerDiscreteScheduler.from_config(pipeline.configs["scheduler"])
    return DDPMScheduler.from_config(pipeline.configs["scheduler"])


def save_base(parts: PipelineParts, pipeline: Pipeline, folder: Path, storage: Storage) -> None:
    """Keep random base weights with the run (`base/`): the pipeline folder with each component's config copied and
    the drawn weights saved, which `from_pretrained` of the pipeline class loads."""
    with tempfile.TemporaryDirectory(prefix="tunecast-base-") as temporary:
        target = Path(temporary)
        shutil.copy(folder / "model_index.json", target / "model_index.json")
        models = {pipeline.denoiser: parts.denoiser, "vae": parts.vae,
                  **dict(zip(pipeline.text_encoders, parts.text_encoders, strict=True))}
        for name in pipeline.classes:
            if name in models:
                models[name].save_pretrained(str(target / name))
            elif (folder / name).is_dir():
                shutil.copytree(folder / name, target / name)
        write_set(storage, BASE_SAVED, folder_files(target), {"kind": "base pipeline (random weights)"})


def write_final(model: Any, pipeline: Pipeline, spec: RunSpec, storage: Storage, card: str, meta: dict[str, Any]
                ) -> None:
    """`final/`: the adapters in diffusers' LoRA format, or the whole denoiser; and the model card."""
    import diffusers

    with tempfile.TemporaryDirectory(prefix="tunecast-final-") as temporary:
        folder = Path(temporary)
        if spec.method == "lora":
            from diffusers.utils.state_dict_utils import convert_state_dict_to_diffusers
            from peft.utils import get_peft_model_state_dict

            layers = get_peft_model_state_dict(model)
            if pipeline.denoiser == "unet":  # the UNet examples convert; SD3's and FLUX's save peft's names as they
                layers = convert_state_dict_to_diffusers(layers)  # are (_sd3.py L1943-1954, _flux.py L1941-1951)
            config = model.peft_config["default"].to_dict()
            getattr(diffusers, pipeline.pipeline_class).save_lora_weights(  # unet_... or transformer_lora_layers
                str(folder), safe_serialization=True, **{f"{pipeline.denoiser}_lora_layers": layers,
                                                         f"{pipeline.denoiser}_lora_adapter_metadata": config})
            sorted_metadata(folder / LORA_WEIGHTS)
        else:
            model.save_pretrained(str(folder))
        (folder / "README.md").write_text(card)
        write_set(storage, FINAL, folder_files(folder), meta)


def sorted_metadata(path: Path) -> None:
    """Rewrite a safetensors file with its metadata's keys in sorted order. safetensors writes the metadata from a
    hash map, in an order that changes from process to process, so the same adapters (the format, and diffusers'
    LoRA config) would make other bytes in a resumed run than in an uninterrupted one. The header is JSON padded with
    spaces to 8 bytes (safetensors' format); the tensors' bytes and offsets stay as they are."""
    import json
    import struct

    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(metadata.items()))} if metadata is not None else {}) | header
    text = json.dumps(ordered, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
