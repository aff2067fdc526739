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
