"""Helpers for tests that run `tunecast train` for real: a tiny run config, a warm fork server that starts
runs in fresh processes, and readers for what a run leaves (final adapter bytes, per-step losses)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "examples" / "tiny-model"
ALPACA = REPO / "examples" / "data" / "alpaca.jsonl"
TINY_PIPELINE = REPO / "examples" / "tiny-diffusion"
IMAGES = REPO / "examples" / "images"
NO_EVAL = {"eval.examples": 0, "eval.every_steps": None}


def tiny_run(tmp: Path, name: str = "run.yaml", **changes: Any) -> Path:
    """A LoRA run of the bundled tiny model on the sample data: 16 steps of 2 × 2 sequences, dropout on (so
    exact resume needs the random generators restored), evaluation and checkpoints every few steps. `changes`
    are dotted keys; a value of None removes the key."""
    return _write_run(tmp / name, {
        "model": str(TINY_MODEL), "random_weights": True, "method": "lora",
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": "all-linear"},
        "precision": "fp32", "optimizer": "adamw", "micro_batch": 2, "grad_accum": 2, "seq_len": 128,
        "learning_rate": 2e-3, "schedule": "cosine", "warmup_steps": 2, "max_steps": 16, "seed": 7,
        "dataset": {"path": str(ALPACA)}, "eval": {"examples": 4, "every_steps": 5},
        "checkpoint": {"every_steps": 2, "keep": 2}, "output": str(tmp / "out"),
    }, changes)


def tiny_diffusion_run(tmp: Path, name: str = "run.yaml", **changes: Any) -> Path:
    """A LoRA run of the bundled tiny diffusion pipeline on the sample images: 8 steps of 2 × 2 images of 32 px, the
    VAE encoding and the text encoder running at every step, checkpoints every 2 steps. `changes` as tiny_run's."""
    return _write_run(tmp / name, {
        "model": str(TINY_PIPELINE), "random_weights": True, "method": "lora", "lora": {"rank": 4, "alpha": 8},
        "precision": "fp32", "optimizer": "adamw", "micro_batch": 2, "grad_accum": 2, "learning_rate": 1e-3,
        "schedule": "cosine", "warmup_steps": 2, "max_steps": 8, "seed": 7, "dataset": {"path": str(IMAGES)},
        "diffusion": {"resolution": 32}, "checkpoint": {"every_steps": 2, "keep": 2}, "output": str(tmp / "out"),
    }, changes)


def tiny_sdxl_pipeline(folder: Path) -> Path:
    """The tiny pipeline made SDXL-shaped in `folder`: a second text encoder (CLIPTextModelWithProjection, the same
    tokenizer), the UNet conditioned on the pooled embedding and the size conditioning (`text_time`), attending to
    both encoders' hidden states side by side."""
    import shutil

    shutil.copytree(TINY_PIPELINE, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index.update({"_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True,
                  "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
                  "tokenizer_2": ["transformers", "CLIPTokenizer"]})
    for name in ("feature_extractor", "image_encoder", "requires_safety_checker", "safety_checker"):
        index.pop(name)
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    shutil.copytree(folder / "tokenizer", folder / "tokenizer_2")
    encoder = json.loads((folder / "text_encoder" / "config.json").read_text())
    (folder / "text_encoder_2").mkdir()
    (folder / "text_encoder_2" / "config.json").write_text(json.dumps(
        {**encoder, "architectures": ["CLIPTextModelWithProjection"]}, indent=2))
    unet = json.loads((folder / "unet" / "config.json").read_text())
    width = encoder["hidden_size"]
    unet.update({"addition_embed_type": "text_time", "addition_time_embed_dim": 8, "cross_attention_dim": 2 * width,
                 "projection_class_embeddings_input_dim": 6 * 8 + encoder["projection_dim"]})
    (folder / "unet" / "config.json").write_text(json.dumps(unet, indent=2))
    return folder


CATALOG_PIPELINES = REPO / "src" / "tunecast" / "catalog" / "data" / "diffusion"
_TINY_VAE_16 = {  # the tiny VAE's blocks on 16 latent channels, without the quant convolutions (as SD3's and FLUX's)
    "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "block_out_channels": [32, 64], "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"], "layers_per_block": 1, "norm_num_groups": 32,
    "sample_size": 32, "use_quant_conv": False, "use_post_quant_conv": False}


def tiny_sd3_pipeline(folder: Path) -> Path:
    """A tiny SD3-shaped pipeline in `folder`, configs only: an SD3Transformer2DModel of 2 joint blocks on 16 latent
    channels (patches of 2), the tiny VAE on 16 channels with SD3's shift and scaling factors, two CLIP encoders with
    projection (the tiny one's config and tokenizer), a T5 encoder (width 64: both CLIP widths side by side) with a
    tokenizer learned from the captions (tiny_t5_tokenizer), and SD 3 Medium's scheduler config."""
    _flow_folder(folder, "stabilityai__stable-diffusion-3-medium-diffusers", "StableDiffusion3Pipeline", {
        "text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
        "text_encoder_3": "T5EncoderModel"})
    clip = json.loads((TINY_PIPELINE / "text_encoder" / "config.json").read_text())
    _write_json(folder / "transformer" / "config.json", {
        "_class_name": "SD3Transformer2DModel", "sample_size": 16, "patch_size": 2, "in_channels": 16,
        "out_channels": 16, "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 4,
        "joint_attention_dim": 2 * clip["hidden_size"], "caption_projection_dim": 32,
        "pooled_projection_dim": 2 * clip["projection_dim"], "pos_embed_max_size": 16})
    _write_json(folder / "vae" / "config.json", {**_TINY_VAE_16, "scaling_factor": 1.5305, "shift_factor": 0.0609})
    _t5(folder, "text_encoder_3", "tokenizer_3", width=2 * clip["hidden_size"])
    return folder


def tiny_flux_pipeline(folder: Path) -> Path:
    """A tiny FLUX.1-dev-shaped pipeline in `folder`, configs only: a FluxTransformer2DModel of one double and one
    single block with the guidance embedding, on the 2 × 2-packed latents of the tiny VAE on 16 channels (FLUX's shift
    and scaling factors), the tiny CLIP encoder (its pooled output), a T5 encoder with a tokenizer learned from the
    captions, and FLUX.1-dev's scheduler config (dynamic shifting)."""
    _flow_folder(folder, "black-forest-labs__FLUX.1-dev", "FluxPipeline", {
        "text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel"})
    clip = json.loads((TINY_PIPELINE / "text_encoder" / "config.json").read_text())
    _write_json(folder / "transformer" / "config.json", {
        "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "num_layers": 1,
        "num_single_layers": 1, "attention_head_dim": 8, "num_attention_heads": 4, "joint_attention_dim": 32,
        "pooled_projection_dim": clip["hidden_size"], "guidance_embeds": True, "axes_dims_rope": [2, 2, 4]})
    _write_json(folder / "vae" / "config.json", {**_TINY_VAE_16, "scaling_factor": 0.3611, "shift_factor": 0.1159})
    _t5(folder, "text_encoder_2", "tokenizer_2", width=32)
    return folder


def _flow_folder(folder: Path, catalog: str, pipeline_class: str, encoders: dict[str, str]) -> None:
    """model_index.json naming the catalog pipeline's components; its scheduler config; the CLIP encoders (the tiny
    pipeline's config under each encoder's class) and their tokenizers (the tiny pipeline's)."""
    import shutil

    index: dict[str, Any] = json.loads((CATALOG_PIPELINES / catalog / "model_index.json").read_text())
    index["_class_name"] = pipeline_class
    shutil.copytree(CATALOG_PIPELINES / catalog / "scheduler", folder / "scheduler")
    clip = json.loads((TINY_PIPELINE / "text_encoder" / "config.json").read_text())
    for encoder, kind in encoders.items():
        if kind.startswith("CLIP"):
            _write_json(folder / encoder / "config.json", {**clip, "architectures": [kind]})
            shutil.copytree(TINY_PIPELINE / "tokenizer", folder / encoder.replace("text_encoder", "tokenizer"))
    _write_json(folder / "model_index.json", index)


def _t5(folder: Path, encoder: str, tokenizer: str, *, width: int) -> None:
    """A T5 encoder of 2 layers, `width` wide, and its tokenizer (tiny_t5_tokenizer) under those names."""
    tokens = tiny_t5_tokenizer()
    tokens.save_pretrained(str(folder / tokenizer))
    _write_json(folder / encoder / "config.json", {
        "architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": width, "d_kv": width // 4,
        "d_ff": 2 * width, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32, "feed_forward_proj": "gated-gelu", "vocab_size": len(tokens),
        "pad_token_id": tokens.pad_token_id, "eos_token_id": tokens.eos_token_id,
        "decoder_start_token_id": tokens.pad_token_id})


def tiny_t5_tokenizer() -> Any:
    """T5's tokenizer (a SentencePiece-style unigram model over '▁'-marked words, `</s>` appended) whose pieces were
    learned by `tokenizers`' UnigramTrainer from the sample images' captions: `<pad>`, `</s>` and `<unk>` first, at
    ids 0, 1 and 2 as in T5's vocabulary, no extra ids. Nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    learner = Tokenizer(models.Unigram())
    learner.pre_tokenizer = pre_tokenizers.Metaspace()
    learner.train_from_iterator(
        [path.read_text(encoding="utf-8").strip() for path in sorted(IMAGES.glob("*.txt"))],
        trainer=trainers.UnigramTrainer(vocab_size=100, special_tokens=["<pad>", "</s>", "<unk>"],
                                        unk_token="<unk>", show_progress=False))
    vocab = json.loads(learner.to_str())["model"]["vocab"]
    return T5Tokenizer(vocab=[(piece, score) for piece, score in vocab], extra_ids=0)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _write_run(path: Path, config: dict[str, Any], changes: dict[str, Any]) -> Path:
    for key, value in changes.items():  # a dotted key; None removes it
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path.write_text(yaml.safe_dump(config))
    return path


def train_losses(output: Path) -> dict[int, float]:
    """step → loss of every `train` line of metrics.jsonl; a step logged twice is an error."""
    losses: dict[int, float] = {}
    for line in (output / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            assert record["step"] not in losses, f"step {record['step']} logged twice"
            losses[record["step"]] = record["loss"]
    return losses


def adapter_bytes(output: Path) -> bytes:
    return (output / "final" / "adapter_model.safetensors").read_bytes()


def lora_bytes(output: Path) -> bytes:
    """A diffusion run's adapters, in diffusers' LoRA format."""
    return (output / "final" / "pytorch_lora_weights.safetensors").read_bytes()


@dataclass
class ForkServer:
    """Client of tests/forkserver.py."""

    process: subprocess.Popen[str]
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, warm: tuple[str, ...] = (), threads: int | None = None) -> ForkServer:
        """A server with torch, transformers and peft imported, and the modules `warm` names (`diffusers`); with
        `threads`, torch's CPU threads set to that many (OMP_NUM_THREADS, before torch loads)."""
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads is not None else {})}
        process = subprocess.Popen([sys.executable, str(REPO / "tests" / "forkserver.py"), *warm],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
        ready = process.stdout.readline()  # type: ignore[union-attr]
        assert json.loads(ready) == {"ready": True}, ready
        return cls(process)

    def stop(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        self.process.wait(timeout=30)

    def _send(self, args: list[str], log: Path, kill_in_write: int | None, slow_load_s: float | None = None,
              script: Path | None = None) -> int:
        request = {"args": args, "cwd": str(REPO), "log": str(log), "kill_in_write": kill_in_write,
                   "slow_load_s": slow_load_s, "script": str(script) if script is not None else None,
                   "env": {**{k: v for k, v in os.environ.items() if k.startswith(("TUNECAST_", "HF_", "AWS_"))},
                           **self.env}}
        self.process.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        return int(json.loads(self.process.stdout.readline())["pid"])  # type: ignore[union-attr]

    def _wait(self) -> int:
        return int(json.loads(self.process.stdout.readline())["code"])  # type: ignore[union-attr]

    def start_ranks(self, args: list[str], log: Path, ranks: int) -> list[int]:
        """Start `ranks` workers of `tunecast ARGS` (one run, torchrun's variables); their pids. Logs: LOG.rankR."""
        request = {"args": args, "cwd": str(REPO), "log": str(log), "ranks": ranks,
                   "env": {**{k: v for k, v in os.environ.items() if k.startswith(("TUNECAST_", "HF_", "AWS_"))},
                           **self.env}}
        self.process.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        return [int(pid) for pid in json.loads(self.process.stdout.readline())["pids"]]  # type: ignore[union-attr]

    def wait_ranks(self) -> list[int]:
        """The exit status of each worker started by start_ranks (minus the signal number when killed)."""
        return [int(code) for code in json.loads(self.process.stdout.readline())["codes"]]  # type: ignore[union-attr]

    def run_ranks(self, args: list[str], log: Path, ranks: int) -> list[int]:
        self.start_ranks(args, log, ranks)
        return self.wait_ranks()

    def start_one(self, args: list[str], log: Path, *, slow_load_s: float | None = None) -> int:
        """Start `tunecast ARGS` and return its pid at once (`wait_one` gives its exit status); `slow_load_s` holds it
        that long where it starts loading the model."""
        return self._send(args, log, None, slow_load_s)

    def wait_one(self) -> int:
        return self._wait()

    def run_script(self, script: Path, args: list[str], log: Path) -> int:
        """Run the Python file `script` with `args` in a fresh child of the warm server; its exit status."""
        self._send(args, log, None, script=script)
        return self._wait()

    def run(self, args: list[str], log: Path, *, kill_in_write: int | None = None) -> int:
        """Run `tunecast ARGS` to its end; its exit status (minus the signal number when killed)."""
        self._send(args, log, kill_in_write)
        return self._wait()

    def run_and_signal(self, args: list[str], log: Path, *, after_s: float, signal_number: int = signal.SIGKILL
                       ) -> tuple[int, float]:
        """Start `tunecast ARGS`, send it `signal_number` after `after_s` seconds (unless it ended), and return
        its exit status and the seconds from the signal to its end."""
        pid = self._send(args, log, None)
        time.sleep(after_s)
        sent = time.monotonic()
        with contextlib.suppress(ProcessLookupError):  # it may have finished already
            os.kill(pid, signal_number)
        code = self._wait()
        return code, time.monotonic() - sent

    def signal_when(self, args: list[str], log: Path, ready: Any, *, signal_number: int, timeout_s: float = 120.0
                    ) -> tuple[int, float]:
        """Start `tunecast ARGS`, send `signal_number` once `ready()` is true, and return its exit status and the
        seconds from the signal to its end."""
        pid = self._send(args, log, None)
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline, f"never ready; log:\n{log.read_text()[-3000:]}"
            time.sleep(0.05)
        sent = time.monotonic()
        os.kill(pid, signal_number)
        code = self._wait()
        return code, time.monotonic() - sent
