"""Load a finished diffusion run's result with diffusers, as its model card says, and make an image from a prompt
(2 inference steps, 32 px): `python load_diffusion_result.py OUTPUT lora|full`. The pipeline class is the one the
run's base/model_index.json names (StableDiffusionPipeline, StableDiffusionXLPipeline, StableDiffusion3Pipeline or
FluxPipeline); for `full`, its denoiser's class loads final/. Prints one JSON line: the image's shape, whether every
value is finite, and whether the result changed the image the base pipeline makes (the trained weights were
applied). Run by tests/integration/test_train_diffusion.py in a warm fork server's child."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers.utils import logging

PROMPT = "a red circle on a white background"


def image(pipe: Any) -> np.ndarray:
    return pipe(PROMPT, num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images[0]


def main() -> None:
    logging.set_verbosity_error()
    output, method = Path(sys.argv[1]), sys.argv[2]
    index = json.loads((output / "base" / "model_index.json").read_text())
    kind = getattr(diffusers, index["_class_name"])
    denoiser = "unet" if "unet" in index else "transformer"
    pipe = kind.from_pretrained(str(output / "base"))
    pipe.set_progress_bar_config(disable=True)
    before = image(pipe)
    if method == "lora":
        pipe.load_lora_weights(str(output / "final"))
    else:
        model = getattr(diffusers, index[denoiser][1]).from_pretrained(str(output / "final"))
        pipe = kind.from_pretrained(str(output / "base"), **{denoiser: model})
        pipe.set_progress_bar_config(disable=True)
    after = image(pipe)
    print(json.dumps({"shape": list(after.shape), "finite": bool(np.isfinite(after).all()),
                      "changed": bool(np.abs(after - before).max() > 0)}))


if __name__ == "__main__":
    main()
