"""What a checkpoint holds, and how a run is put back exactly as it was.

A checkpoint is taken between two optimizer steps, and holds everything the next step depends on:

| file                    | what                                                                          |
|-------------------------|-------------------------------------------------------------------------------|
| `trainable.safetensors` | the trained weights (the adapters only for LoRA / QLoRA)                      |
| `optimizer.pt`          | the optimizer's state (moments, step counts)                                  |
| `scheduler.pt`          | the learning-rate schedule (a function of the step) and the fp16 grad scaler  |
| `rng.pt`                | every random generator: Python's, NumPy's, torch's CPU and each CUDA device's |
| `progress.json`         | step, data position (epoch, units consumed), tokens, elapsed time, cost       |
| `config.yaml`           | the resolved config it was trained with, and its hash                         |

The random generators are those of the moment the step *began*: a preemption inside a step abandons that
step's partial work and saves the state before it, so the resumed run redoes it with the same draws (the
same dropout masks) and reaches the same weights bit for bit. Nothing is replayed: the data position is
set directly (see batches.py).

Bytes, manifests and atomicity are the store's (store.py); this module knows only what the bytes mean.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRAINABLE = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG = "rng.pt"
PROGRESS = "progress.json"
CONFIG = "config.yaml"


@dataclass
class Progress:
    """Where the run is. Updated after every optimizer step; saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch the next step draws from
    offset: int = 0  # units of that epoch already consumed
    tokens: int = 0  # real (non-padding) tokens trained on
    trained_tokens: int = 0  # tokens that counted in the loss
    elapsed_s: float = 0.0  # training time over every session of the run
    cost_usd: float = 0.0  # what that time cost at the run's price
    last_eval_step: int = 0  # the step of the last evaluation done
    metrics_bytes: int = 0  # length of metrics.jsonl when the checkpoint was taken

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


def capture_rng() -> dict[str, Any]:
    """Every generator's state, as tensors and plain values (loadable with torch.load(weights_only=True))."""
    version, keys, gauss = random.getstate()
    kind, np_keys, position, has_gauss, np_gauss = np.random.get_state(legacy=True)
    assert not isinstance(np_keys, str)
    state: dict[str, Any] = {
        "python": {"version": version, "keys": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(int(k) for k in python["keys"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The parameters that train, by name, on the CPU and contiguous (as safetensors stores them)."""
    return {name: parameter.detach().to("cpu").contiguous()
            for name, parameter in model.named_parameters() if parameter.requires_grad}


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _torch_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def checkpoint_files(folder: Path, *, model: Any, optimizer: Any, schedule: dict[str, Any], scaler: Any,
                     rng: dict[str, Any], progress: Progress, config_yaml: str) -> dict[str, bytes | Path]:
    """The files of a checkpoint: the large ones (weights, optimizer) written to `folder`, a local scratch
    folder, so they are never held in memory whole; the small ones as bytes. `schedule` describes the
    learning-rate schedule (a function of the step, kept for the record); `scaler` is the fp16 gradient
    scaler or None."""
    from safetensors.torch import save_file

    save_file(trainable_state(model), str(folder / TRAINABLE))
    torch.save(optimizer.state_dict(), folder / OPTIMIZER)
    return {
        TRAINABLE: folder / TRAINABLE,
        OPTIMIZER: folder / OPTIMIZER,
        SCHEDULER: _torch_bytes({"schedule": schedule,
                                 "scaler": scaler.state_dict() if scaler is not None else None}),
        RNG: _torch_bytes(rng),
        PROGRESS: json.dumps(progress.as_dict(), indent=1).encode(),
        CONFIG: config_yaml.encode(),
    }


def restore(files: dict[str, bytes], *, model: Any, optimizer: Any, scaler: Any) -> Progress:
    """Put the run back as it was when `files` were saved; returns its progress. The random generators are
    restored last, after everything that might draw from them."""
    from safetensors.torch import load

    weights = load(files[TRAINABLE])
    parameters = dict(model.named_parameters())
    missing = [name for name, p in parameters.items() if p.requires_grad and name not in weights]
    if missing or any(name not in parameters for name in weights):
        raise ValueError(f"the checkpoint's weights do not match the model (missing {missing[:3]})")
    with torch.no_grad():
        for name, tensor in weights.items():
            parameters[name].copy_(tensor)
    optimizer.load_state_dict(_torch_load(files[OPTIMIZER]))
    schedule = _torch_load(files[SCHEDULER])
    if scaler is not None and schedule["scaler"] is not None:
        scaler.load_state_dict(schedule["scaler"])
    progress = Progress.from_dict(json.loads(files[PROGRESS]))
    restore_rng(_torch_load(files[RNG]))
    return progress
