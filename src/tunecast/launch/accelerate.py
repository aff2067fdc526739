"""`tunecast export accelerate`: an accelerate config (`accelerate launch --config_file FILE -m tunecast train
CONFIG`) for the strategy and GPU count of a run.

tunecast wraps the model itself (train/distributed.py) and reads the strategy from its own config, so what
accelerate needs from this file is how many processes to start, on how many machines; the `distributed_type`
and `fsdp_config` say the same strategy in accelerate's words, so that the file reads true to anyone who
opens it and accelerate sets up the same kind of run. `tunecast train` warns when the launcher's distributed
type contradicts gpus.strategy (which is what it trains with).
"""

from __future__ import annotations

from typing import Any

from tunecast.config.spec import DEEPSPEED_STRATEGIES, FSDP_EQUIVALENT, RunSpec
from tunecast.errors import TunecastError


def accelerate_config(spec: RunSpec, *, gpus_per_node: int, nodes: int, on_cpu: bool = False) -> dict[str, Any]:
    strategy = spec.gpus.strategy
    if strategy in DEEPSPEED_STRATEGIES:
        raise TunecastError(f"{strategy} is DeepSpeed's, which tunecast train (what this file launches) does not run",
                            field="gpus.strategy",
                            hint="export the run for axolotl or LLaMA-Factory (their config carries the DeepSpeed "
                                 f"settings), or set gpus.strategy to {FSDP_EQUIVALENT[strategy]}")
    document: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": ("MULTI_CPU" if on_cpu else "MULTI_GPU") if strategy == "ddp" else "FSDP",
        "num_processes": gpus_per_node * nodes,
        "num_machines": nodes,
        "machine_rank": 0,
        "main_process_ip": None if nodes == 1 else "MAIN_NODE_IP",
        "main_process_port": None if nodes == 1 else 29500,
        "mixed_precision": "no",  # tunecast applies `precision` itself (autocast or bf16 weights)
        "use_cpu": on_cpu,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "downcast_bf16": "no",
    }
    if strategy != "ddp":
        document["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": strategy != "fsdp-grad-op",
            "fsdp_offload_params": spec.gpus.offload != "none",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,  # tunecast's grad_checkpointing does it
        }
    return {key: value for key, value in document.items() if value is not None}


def contradiction(strategy: str, environ: dict[str, str]) -> str | None:
    """What an accelerate launch says that gpus.strategy does not, or None."""
    fsdp = environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")
    if deepspeed:
        return "accelerate launch was configured for DeepSpeed, which tunecast does not drive"
    if fsdp and strategy == "ddp":
        return "accelerate launch was configured for FSDP, but gpus.strategy is ddp"
    return None
