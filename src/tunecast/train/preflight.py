"""What a run needs of this machine and of its model folder, checked before anything is read, traced or loaded.

Each of these would otherwise surface minutes later, after the data is tokenized and the memory estimate traced,
as a library's exception deep inside loading:

* a dataset file (a declared size plans a run but holds no examples);
* `attention: flash` needs the flash-attn package and a CUDA GPU (transformers imports it when the model is built);
* `precision: fp8` needs a CUDA GPU with FP8 tensor cores (compute capability 8.9: Ada, Hopper, Blackwell) and
  torchao's float8 training;
* the base weights: a model folder without weights (a download cut short, a folder holding only config.json) or a
  config file trains weights drawn from the seed only when the config says so (`random_weights: true`), or when
  the run only measures speed (`tunecast calibrate`). Otherwise it is an error naming the files looked for.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tunecast.catalog.diffusion import Pipeline
from tunecast.catalog.models import ModelConfig
from tunecast.config.spec import RunSpec
from tunecast.data.images import Captioned, read_image_folder
from tunecast.errors import TunecastError
from tunecast.step.diffusion import untrained_reason

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
PIPELINE_WEIGHT_SUFFIXES = (".safetensors", ".bin")  # a diffusers component's weights
FP8_CAPABILITY = (8, 9)  # the first compute capability with FP8 tensor cores (Ada Lovelace)


def check_run(spec: RunSpec, resolved: ModelConfig, *, cuda: bool, capability: tuple[int, int] | None,
              device_name: str, random_allowed: bool) -> None:
    """Raise the first thing that stops `spec` from training here. `cuda`: a CUDA device is there (`capability`
    and `device_name` are its). `random_allowed`: random weights are accepted without random_weights (a measuring
    run)."""
    check_dataset(spec)
    check_attention(spec, cuda=cuda)
    check_fp8(spec, cuda=cuda, capability=capability, device_name=device_name)
    check_weights(spec, resolved, random_allowed=random_allowed)


def check_dataset(spec: RunSpec) -> None:
    """A run trains on a file: a declared size (`dataset.examples`) plans a run but gives nothing to train on."""
    if spec.dataset.path is None:
        declared = " (a declared size plans a run, it has no examples to train on)" if spec.dataset.examples else ""
        raise TunecastError(f"training needs a dataset file{declared}", field="dataset.path",
                            hint="set dataset.path (or --dataset) to a JSONL, JSON, CSV or Parquet file")


def check_attention(spec: RunSpec, *, cuda: bool) -> None:
    if spec.attention != "flash":
        return
    if not cuda:
        raise TunecastError("attention: flash runs flash-attn's CUDA kernels, and this machine has no CUDA GPU",
                            field="attention", hint="use attention: sdpa (torch's own kernels, on every device)")
    if importlib.util.find_spec("flash_attn") is None:
        raise TunecastError("attention: flash needs the flash-attn package, which is not installed",
                            field="attention", hint="pip install flash-attn --no-build-isolation, or use attention: "
                                                    "sdpa (torch's flash kernel is one of its backends)")


def check_fp8(spec: RunSpec, *, cuda: bool, capability: tuple[int, int] | None, device_name: str) -> None:
    if spec.precision != "fp8":
        return
    if not cuda:
        raise TunecastError(f"precision fp8 needs a GPU with FP8 tensor cores; this run is on {device_name}",
                            field="precision", hint="use precision bf16 here")
    if capability is not None and capability < FP8_CAPABILITY:
        raise TunecastError(f"precision fp8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                            f"Blackwell); {device_name} has {capability[0]}.{capability[1]}", field="precision",
                            hint="use precision bf16 (or bf16-mixed) on this GPU")
    if importlib.util.find_spec("torchao") is None:
        raise TunecastError("precision fp8 trains through torchao's float8 training, which is not installed",
                            field="precision", hint="pip install torchao, or use precision bf16")


def has_weights(resolved: ModelConfig) -> bool:
    """Whether the model has weights to load: a catalog or Hub name (from the local cache or the Hub), or a folder
    holding a weights file."""
    if resolved.origin in ("catalog", "downloaded"):
        return True
    folder = resolved.path.parent
    return resolved.origin == "directory" and any((folder / name).exists() for name in WEIGHT_FILES)


def check_weights(spec: RunSpec, resolved: ModelConfig, *, random_allowed: bool) -> None:
    if has_weights(resolved) or spec.random_weights or random_allowed:
        return
    hint = ("put the weights in the folder (download them again if a download stopped), or set random_weights: "
            "true (--random-weights) to train weights drawn from the seed (for tests, demos and timing)")
    if resolved.origin == "directory":
        raise TunecastError(f"the model folder {resolved.path.parent} has no weights: none of "
                            f"{', '.join(WEIGHT_FILES)} is there", field="model", hint=hint)
    raise TunecastError(f"the model {resolved.path} is a config file, which holds no weights", field="model",
                        hint="give the folder holding the weights, or a catalog or Hub name; or set random_weights: "
                             "true (--random-weights) to train weights drawn from the seed (tests, demos, timing)")


def check_pipeline_run(spec: RunSpec, pipeline: Pipeline) -> list[Captioned]:
    """What stops a diffusion pipeline's run, before anything loads: a pipeline or setting not trained yet, a
    pipeline folder without weights, the images and captions (read and checked: returned)."""
    reason = untrained_reason(pipeline)
    if reason is not None:
        raise TunecastError(f"{pipeline.name}: {reason}", field="model",
                            hint="tunecast trains Stable Diffusion 1.x/2.x-, SDXL-, SD3- and FLUX-style pipelines so "
                                 "far; `tunecast memory` estimates this one")
    refused = [("eval.examples", spec.eval.examples > 0, "a held-out loss of a diffusion run is not built yet",
                "set eval.examples: 0"),
               ("dataset.path", spec.dataset.path is None, "training needs a folder of images with captions",
                "set dataset.path (or --dataset) to the folder")]
    for key, applies, message, hint in refused:
        if applies:
            raise TunecastError(message, field=key, hint=hint)
    folder = local_pipeline(spec)
    if folder is not None and not spec.random_weights and not pipeline_has_weights(folder, pipeline):
        raise TunecastError(f"{folder} holds the pipeline's configs but no weights ({pipeline.denoiser}/ has no "
                            f"{' or '.join(PIPELINE_WEIGHT_SUFFIXES)} file)", field="model",
                            hint="point model at a pipeline folder diffusers saved with its weights, or set "
                                 "random_weights: true to train weights drawn from the seed (tests, demos)")
    assert spec.dataset.path is not None
    return read_image_folder(spec.dataset.path)


def local_pipeline(spec: RunSpec) -> Path | None:
    """The pipeline's folder on this machine (None: a catalog id, loaded through the Hugging Face cache)."""
    folder = Path(spec.model).expanduser()
    return folder if (folder / "model_index.json").is_file() else None


def pipeline_has_weights(folder: Path, pipeline: Pipeline) -> bool:
    component = folder / pipeline.denoiser
    return component.is_dir() and any(path.suffix in PIPELINE_WEIGHT_SUFFIXES for path in component.iterdir())
