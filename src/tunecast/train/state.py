"""What a checkpoint holds, and how a run is put back exactly as it was.

A checkpoint is taken between two optimizer steps, and holds everything the next step depends on:

| file                    | what                                                                          |
|-------------------------|-------------------------------------------------------------------------------|
| `state/`                | the trained weights (the adapters only for LoRA / QLoRA) and the optimizer's  |
|                         | state, through `torch.distributed.checkpoint`: one `__R_0.distcp` per rank    |
|                         | (its shards under FSDP2) and a `.metadata` index written by rank 0            |
| `scheduler.pt`          | the learning-rate schedule (a function of the step) and the fp16 grad scaler  |
| `rng-rankNNN.pt`        | each rank's random generators: Python's, NumPy's, torch's CPU and CUDA ones    |
| `progress.json`         | step, data position (epoch, units consumed), tokens, elapsed time, cost       |
| `config.yaml`           | the resolved config it was trained with, and its hash                         |

The weights and optimizer state are saved by name (the parameters' fully qualified names), not by position,
and `torch.distributed.checkpoint` reshards them on load: a checkpoint written by two ranks of an FSDP2 run
loads in one process, or in four, or under DDP. The random generators are per rank, and are restored only
where the world size is the one they were saved with; exact resume holds on the same world size.

The random generators are those of the moment the step *began*: a preemption inside a step abandons that
step's partial work and saves the state before it, so the resumed run redoes it with the same draws (the
same dropout masks) and reaches the same weights bit for bit. Nothing is replayed: the data position is
set directly (see batches.py). A checkpoint of step 0 (a run stopped before its first step) has no optimizer
state: there is none yet, and making one would count a step that never ran.

Checkpoints of earlier tunecast versions (`trainable.safetensors`, `optimizer.pt`, `rng.pt`) still resume,
in one process.

Bytes, manifests and atomicity are the store's (storage/store.py); this module knows only what the bytes mean.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE = "state"
SCHEDULER = "scheduler.pt"
PROGRESS = "progress.json"
CONFIG = "config.yaml"
LAYOUT = "dcp"  # the manifest's `layout`: weights and optimizer through torch.distributed.checkpoint
# the one-process layout of earlier versions, still read
TRAINABLE = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:03d}.pt"


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


def _options(loading: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen base weights are the base model's, not the run's; on load they are simply not in the checkpoint
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


@contextlib.contextmanager
def _tensor_keys_only(module: Any) -> Iterator[None]:
    """`module.state_dict()` without the keys that name no parameter or buffer, while torch's get_model_state_dict
    reads it: it looks every key up as an attribute of its module, and bitsandbytes' 8-bit layers add two that are
    none (SCB and weight_format, bitsandbytes nn/modules.py Linear8bitLt._save_to_state_dict), which would stop it.
    Both belong to the frozen base, which a checkpoint leaves out anyway."""
    named = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    named |= {name for name, _ in module.named_buffers(remove_duplicate=False)}

    def drop_other_keys(_module: Any, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            name = key[len(prefix):]
            if name not in named and not name.endswith(torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX):
                del state_dict[key]

    handle = module.register_state_dict_post_hook(drop_other_keys)
    try:
        yield
    finally:
        handle.remove()


def _state(model: Any, optimizers: list[Any] | None, *, loading: bool = False) -> dict[str, Any]:
    """The state `torch.distributed.checkpoint` saves or fills: trainable weights and (unless None) the
    optimizers' state, by parameter name; DTensor shards under FSDP2, whole tensors otherwise."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # by name, only what trains: a tied output head (the embedding's own tensor, frozen) keeps its second name in a
    # state dict even when frozen parameters are left out
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    trains = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    with _tensor_keys_only(module):
        whole = get_model_state_dict(model, options=_options(loading))
    state: dict[str, Any] = {"model": {name: value for name, value in whole.items() if name in trains}}
    if optimizers is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizers, options=_options(loading))
    return state


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """Around torch.distributed.checkpoint: it warns that it assumes one process when there is no process group
    (so it is), and reports its failures as a CheckpointException, a BaseException that no `except Exception`
    sees: made a RuntimeError here (a lost rank's, or a file's), for the handlers of the loop and of resume."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as error:
            raise RuntimeError(f"torch.distributed.checkpoint: {str(error)[:2000]}") from None


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _torch_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def checkpoint_files(folder: Path, *, rank: int, model: Any, optimizer: Any, schedule: dict[str, Any], scaler: Any,
                     rng: dict[str, Any], progress: Progress, config_yaml: str) -> dict[str, bytes | Path]:
    """This rank's files of a checkpoint (a collective: every rank calls it). The weights and optimizer state
    go to `folder`, a local scratch folder of this rank, so they are never held in memory whole; the small
    files are bytes. Rank 0 also has the files every rank shares. `schedule` describes the learning-rate
    schedule (a function of the step, kept for the record); `scaler` is the fp16 gradient scaler or None."""
    import torch.distributed.checkpoint as dcp

    target = folder / STATE
    target.mkdir(parents=True)
    optimizers = optimizer.optimizers if progress.step > 0 else None
    with _one_process_quiet():
        dcp.save(_state(model, optimizers), storage_writer=dcp.FileSystemWriter(str(target)))
    files: dict[str, bytes | Path] = {f"{STATE}/{path.name}": path for path in sorted(target.iterdir())}
    files[rng_file(rank)] = _torch_bytes(rng)
    if rank == 0:
        files[SCHEDULER] = _torch_bytes({"schedule": schedule,
                                         "scaler": scaler.state_dict() if scaler is not None else None})
        files[PROGRESS] = json.dumps(progress.as_dict(), indent=1).encode()
        files[CONFIG] = config_yaml.encode()
    return files


@dataclass(frozen=True)
class Restored:
    progress: Progress
    rng_restored: bool  # False: saved by another world size, the generators were seeded afresh


def restore(read: Any, state_folder: Path, manifest: dict[str, Any], *, rank: int, world_size: int, model: Any,
            optimizer: Any, scaler: Any, seed: int) -> Restored:
    """Put the run back as it was at the checkpoint (a collective: every rank calls it). `read(name)` returns a
    checkpoint file's bytes, `state_folder` is where its `state/` files can be read on this machine. The random
    generators are restored last, after everything that might draw from them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    with_optimizer = bool(manifest.get("optimizer_state", True))
    state = _state(model, optimizer.optimizers if with_optimizer else None, loading=True)
    with _one_process_quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(state_folder)))
    set_model_state_dict(model, state["model"], options=_options(loading=True))
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer.optimizers, state["optim"], options=_options(loading=True))
    schedule = _torch_load(read(SCHEDULER))
    if scaler is not None and schedule["scaler"] is not None:
        scaler.load_state_dict(schedule["scaler"])
    progress = Progress.from_dict(json.loads(read(PROGRESS)))
    same_world = manifest.get("world_size", 1) == world_size
    if same_world:
        restore_rng(_torch_load(read(rng_file(rank))))
    else:
        seed_ranks(seed, rank, progress.step)
    return Restored(progress, same_world)


def seed_ranks(seed: int, rank: int, step: int) -> None:
    """Generators of a rank that has no saved state of its own: drawn from (seed, rank, step) alone."""
    value = (seed * 1_000_003 + rank) * 1_000_003 + step
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def restore_legacy(files: dict[str, bytes], *, model: Any, optimizer: Any, scaler: Any) -> Progress:
    """A checkpoint of the one-process layout earlier versions wrote (trainable.safetensors, optimizer.pt)."""
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
