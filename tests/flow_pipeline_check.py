"""Check a finished SD3 or FLUX run against diffusers' own pipeline: `python flow_pipeline_check.py OUTPUT`. Loads the
run's base/ with the pipeline class its model_index.json names and prints one JSON line:

* `states_equal`, `pooled_equal`: tunecast's encode_captions of two captions equals the pipeline's `encode_prompt`
  (at the T5 length tunecast trains at), bit for bit, both without gradients;
* `lora_tensors`, `lora_layers`: the tensors in final/'s LoRA file, and the layers `load_lora_weights` adapted in the
  transformer (two tensors, A and B, to a layer: every tensor was loaded).

Run by tests/integration/test_train_diffusion.py in a warm fork server's child."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import diffusers
import torch
from diffusers.utils import logging
from safetensors.torch import load_file

from tunecast.catalog.diffusion import load_pipeline
from tunecast.step.diffusion import encode_captions, t5_tokens

CAPTIONS = ["a red circle on a white background", "a small blue square"]


def main() -> None:
    logging.set_verbosity_error()
    output = Path(sys.argv[1])
    pipe = getattr(diffusers, json.loads((output / "base" / "model_index.json").read_text())["_class_name"]
                   ).from_pretrained(str(output / "base"))
    pipeline = load_pipeline(str(output / "base"))
    tokenizers = [getattr(pipe, name.replace("text_encoder", "tokenizer")) for name in pipeline.text_encoders]
    encoders = [getattr(pipe, name) for name in pipeline.text_encoders]
    ours = encode_captions(pipeline, tokenizers, encoders, CAPTIONS)
    with torch.no_grad():
        if pipeline.family == "sd3":
            states, _, pooled, _ = pipe.encode_prompt(CAPTIONS, CAPTIONS, CAPTIONS, do_classifier_free_guidance=False,
                                                      max_sequence_length=t5_tokens(pipeline))
        else:
            states, pooled, _ = pipe.encode_prompt(CAPTIONS, CAPTIONS, max_sequence_length=t5_tokens(pipeline))
    tensors = load_file(str(output / "final" / "pytorch_lora_weights.safetensors"))
    pipe.load_lora_weights(str(output / "final"))
    layers = sum(1 for name, _ in pipe.transformer.named_modules() if name.endswith("lora_A.default_0"))
    print(json.dumps({"states_equal": torch.equal(ours.states, states), "pooled_equal": torch.equal(ours.pooled, pooled),
                      "lora_tensors": len(tensors), "lora_layers": layers}))


if __name__ == "__main__":
    main()
