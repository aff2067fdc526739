"""Write the bundled tiny diffusion pipeline (examples/tiny-diffusion/): a Stable Diffusion-style pipeline small
enough to fine-tune on a laptop CPU in about a minute, as diffusers saves one, configs only. No weights are written:
`tunecast train` with `random_weights: true` builds them from the configs and the run's seed, so the demo needs
nothing from the Hugging Face Hub.

What is written, and why:

* model_index.json: `StableDiffusionPipeline` with a UNet2DConditionModel, an AutoencoderKL, a CLIPTextModel, a
  CLIPTokenizer and a DDPMScheduler (no safety checker or feature extractor).
* unet/, vae/: the configs diffusers writes for each model (`save_config` of the model built from the sizes below
  on the meta device): a UNet of two blocks (32 and 64 channels, cross-attention on the first) on 4 latent
  channels, 16 × 16 latents for 32 px images; a VAE of two blocks, which halves each side.
* text_encoder/: a CLIP text model of 2 layers, hidden 32, 77 positions, whose vocabulary is the tokenizer's.
* tokenizer/: CLIP's byte-level BPE (its lower-casing, word split and `</w>` word ends), with merges learned by
  `tokenizers` from the sample images' captions (examples/images/*.txt): the 256 bytes and their word-end forms,
  the merges, then `<|startoftext|>` and `<|endoftext|>`, as CLIP's vocabulary is laid out.
* scheduler/: DDPMScheduler with Stable Diffusion 1.5's schedule (scaled_linear betas 0.00085-0.012, 1,000 steps,
  epsilon prediction).

Deterministic: rerunning rewrites byte-identical files with the same library versions (the BPE trainer learns the
same merges from the same captions, JSON is written in a fixed key order).

Run:  .venv/bin/python scripts/make_sample_images.py && .venv/bin/python scripts/make_tiny_pipeline.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CAPTIONS = ROOT / "examples" / "images"
OUT = ROOT / "examples" / "tiny-diffusion"

START, END = "<|startoftext|>", "<|endoftext|>"
MERGES = 200  # more than the captions' words need: every caption word becomes one token
MAX_LENGTH = 77  # CLIP's text length

UNET = {"sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
        "block_out_channels": [32, 64], "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 32, "attention_head_dim": 8,
        "norm_num_groups": 32}
VAE = {"sample_size": 32, "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 1,
       "block_out_channels": [32, 64], "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
       "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"], "norm_num_groups": 32,
       "scaling_factor": 0.18215}
TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": MAX_LENGTH, "hidden_act": "quick_gelu", "projection_dim": 32}
SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
             "prediction_type": "epsilon", "clip_sample": False, "steps_offset": 1}


def captions() -> list[str]:
    return [path.read_text(encoding="utf-8").strip() for path in sorted(CAPTIONS.glob("*.txt"))]


def train_tokenizer(texts: list[str]) -> Any:
    """CLIP's tokenizer with merges learned from `texts` (transformers' CLIPTokenizer sets CLIP's normalizer,
    pre-tokenizer and post-processor around the vocabulary and merges given)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    learner = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    learner.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                               normalizers.Lowercase()])
    learner.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                             behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) * 2 + MERGES, initial_alphabet=alphabet,
                                  end_of_word_suffix="</w>", show_progress=False)
    learner.train_from_iterator(texts, trainer=trainer)
    model = json.loads(learner.to_str())["model"]
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in model["merges"]]
    symbols = sorted(alphabet, key=lambda char: ord(char))
    vocab: dict[str, int] = {}
    for token in [*symbols, *(f"{char}</w>" for char in symbols),
                  *("".join(merge) for merge in merges), START, END]:
        vocab.setdefault(token, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_LENGTH)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main() -> int:
    import diffusers
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig

    tokenizer = train_tokenizer(captions())
    tokenizer.save_pretrained(str(OUT / "tokenizer"))
    with torch.device("meta"):
        UNet2DConditionModel(**UNET).save_config(str(OUT / "unet"))
        AutoencoderKL(**VAE).save_config(str(OUT / "vae"))
    DDPMScheduler(**SCHEDULER).save_config(str(OUT / "scheduler"))
    text = CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TEXT)
    text.architectures = ["CLIPTextModel"]
    text.save_pretrained(str(OUT / "text_encoder"))
    write_json(OUT / "model_index.json", {
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None], "image_encoder": [None, None], "requires_safety_checker": False,
        "safety_checker": [None, None], "scheduler": ["diffusers", "DDPMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]})
    files = sorted(path.relative_to(OUT).as_posix() for path in OUT.rglob("*") if path.is_file())
    print(f"wrote {OUT.relative_to(ROOT)}/: {', '.join(files)}; vocabulary {len(tokenizer)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
