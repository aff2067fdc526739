"""Diffusion pipelines as diffusers saves them: `model_index.json` and each component's config, bundled for the
catalog's pipelines (data/diffusion, with their sources) or read from a local folder. No torch.

A pipeline names its components and their classes; training loads the denoiser (a UNet or a transformer), the VAE
and the text encoders, and trains the denoiser (and optionally the text encoders). What tunecast needs to know of each
comes from the configs alone: the denoiser's class and objective, the latent channels and downsampling of the VAE, the
text encoders' widths and sequence lengths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunecast.errors import TunecastError

DATA = Path(__file__).parent / "data" / "diffusion"

# The denoisers tunecast builds from a config: class → family (how it is called and what it predicts).
DENOISERS = {
    "UNet2DConditionModel": "unet",
    "UNet3DConditionModel": "unet3d",
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass(frozen=True)
class Pipeline:
    """A diffusers pipeline's configs: what training loads, by component name."""

    name: str
    pipeline_class: str
    classes: dict[str, str]  # component → class name
    configs: dict[str, dict[str, Any]] = field(repr=False)  # component → its config

    @property
    def denoiser(self) -> str:
        """The component that is trained: `unet` or `transformer`."""
        return "unet" if "unet" in self.classes else "transformer"

    @property
    def family(self) -> str:
        return DENOISERS[self.classes[self.denoiser]]

    @property
    def text_encoders(self) -> tuple[str, ...]:
        return tuple(name for name in TEXT_ENCODERS if name in self.classes)

    @property
    def video(self) -> bool:
        return self.family == "unet3d"

    @property
    def objective(self) -> str:
        """What the denoiser is trained to predict: `epsilon` or `v_prediction` (the scheduler's `prediction_type`,
        for the UNet models), or `flow` (flow matching: SD3 and FLUX)."""
        if self.family in ("sd3", "flux"):
            return "flow"
        return str(self.configs.get("scheduler", {}).get("prediction_type", "epsilon"))

    @property
    def latent_channels(self) -> int:
        return int(self.configs["vae"].get("latent_channels", 4))

    @property
    def vae_scale(self) -> int:
        """Pixels per latent along each side: 2 to the number of the VAE's downsampling blocks less one."""
        return int(2 ** (len(self.configs["vae"].get("block_out_channels", [0] * 4)) - 1))

    @property
    def grid(self) -> int:
        """The pixels a training side must be a multiple of: the VAE's downsampling times the denoiser's (a UNet's
        halving between blocks; a transformer's patches, and FLUX's packing of 2 × 2 latents)."""
        config = self.configs[self.denoiser]
        if self.denoiser == "unet":
            return int(self.vae_scale * 2 ** (len(config.get("block_out_channels", [0])) - 1))
        return int(self.vae_scale * int(config.get("patch_size") or 1) * (2 if self.family == "flux" else 1))


def is_pipeline(model: str) -> bool:
    """Whether `model` names a bundled pipeline or a local folder that holds a `model_index.json`."""
    return _bundled(model) is not None or (Path(model).expanduser() / "model_index.json").is_file()


def bundled_pipelines() -> list[str]:
    """The catalog's pipelines, by Hugging Face id."""
    return sorted(folder.name.replace("__", "/", 1) for folder in DATA.iterdir() if folder.is_dir())


def _bundled(model: str) -> Path | None:
    folder = DATA / model.replace("/", "__", 1)
    return folder if "/" in model and (folder / "model_index.json").is_file() else None


def load_pipeline(model: str) -> Pipeline:
    """The pipeline `model` names: a catalog id (bundled configs) or a local folder as diffusers saves one."""
    folder = _bundled(model) or Path(model).expanduser()
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise TunecastError(f"{model!r} is neither a diffusion pipeline in the catalog nor a folder with a "
                            "model_index.json", field="model",
                            hint="name one of " + ", ".join(bundled_pipelines()) + ", or a folder diffusers saved")
    index = _read(index_path, model)
    classes = {name: str(value[1]) for name, value in index.items()
               if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[1]}
    denoiser = "unet" if "unet" in classes else "transformer"
    if classes.get(denoiser) not in DENOISERS:
        raise TunecastError(f"{model}: the denoiser {classes.get(denoiser, 'missing')!r} is not one tunecast builds",
                            field="model", hint="tunecast estimates " + ", ".join(DENOISERS))
    configs: dict[str, dict[str, Any]] = {}
    for name in classes:
        for file in ("config.json", "scheduler_config.json"):
            path = folder / name / file
            if path.is_file():
                configs[name] = _read(path, model)
    missing = [name for name in (denoiser, "vae", *[t for t in TEXT_ENCODERS if t in classes]) if name not in configs]
    if missing:
        raise TunecastError(f"{model}: no config for {', '.join(missing)}", field="model",
                            hint="each component's folder needs its config.json, as diffusers saves it")
    return Pipeline(model, str(index.get("_class_name", "")), classes, configs)


def _read(path: Path, model: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TunecastError(f"{model}: {path} cannot be read as JSON ({error})", field="model",
                            hint="the configs diffusers saves are JSON files") from error
    if not isinstance(data, dict):
        raise TunecastError(f"{model}: {path} is not a JSON object", field="model",
                            hint="use the config diffusers saved")
    return data
