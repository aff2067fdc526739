"""Per-GPU memory of DeepSpeed's ZeRO stages, as DeepSpeed 0.19 allocates them (docs/research/deepspeed-cpu.md has
the measurements on real ranks and the lines of DeepSpeed's code each term follows).

DeepSpeed's bf16 and fp16 modes cast the whole model to 16 bits (the LoRA adapters too) and keep an fp32 master copy
of the trained weights inside the optimizer, so the traced step (run in bf16: settings.py) gives the activations and
temporaries, and the model states are laid out here. For Ψ trainable elements over N ranks, P bytes a 16-bit element:

* every stage: the fp32 master and the optimizer's states on it, 4Ψ/N + states/N; during the optimizer step an
  fp32 copy of the gradient partition, 4Ψ/N;
* ZeRO-1 and ZeRO-2 keep the 16-bit weights whole (PΨ) and reduce gradients into a partition (PΨ/N) through a
  bucket of `reduce_bucket_size` elements, two with `overlap_comm`, held through the backward pass only. ZeRO-1
  reduces once a step: between micro-batches it accumulates whole gradients (PΨ);
* ZeRO-3 keeps a partition of every weight (P/N of them), gathers a layer and the prefetched parameters for
  computing, keeps parameters below `stage3_param_persistence_threshold` elements whole, and holds its reduce bucket
  and its gradient partition for the whole run;
* offload moves the master, the states and the fp32 gradients (and with ZeRO-3 the weights) to CPU memory.

For full fine-tuning this is DeepSpeed's own `estimate_zero2_model_states_mem_needs` (2Ψ + 18Ψ/N per GPU, its
formula exactly) and, for ZeRO-3, its 18Ψ/N plus the 16-bit gradient partition its estimator leaves out (2Ψ/N) and
the gathered parameters in place of its 4 × the largest layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunecast.config.spec import RunSpec

if TYPE_CHECKING:
    from tunecast.estimate.memory import Facts, StepMemory

# Optimizers whose states the trace holds in the traced weights' dtype; DeepSpeed keeps them on its fp32 master.
TRACED_DTYPE_STATES = ("adamw", "adamw-foreach", "sgd", "adafactor")


@dataclass(frozen=True)
class Buffers:
    """DeepSpeed's buffer settings in elements, with `auto` and the stage's defaults resolved."""

    reduce_bucket: int
    overlap_comm: bool
    prefetch_bucket: int
    persistence_threshold: int


def model_hidden_size(config_data: dict[str, Any]) -> int | None:
    from tunecast.catalog.models import ModelConfig

    return ModelConfig(name="", path=Path(), origin="file", data=config_data).hidden_size


def buffers(spec: RunSpec, hidden: int | None) -> Buffers:
    """`gpus.deepspeed` in elements: `auto` as the transformers integration fills it from the hidden size h (h², 0.9·h²,
    10·h; trainer_utils' HfTrainerDeepSpeedConfig), overlap_comm on for ZeRO-3 only unless set (DeepSpeed's
    validator)."""
    settings = spec.gpus.deepspeed
    h = hidden or 0

    def resolved(value: int | str, auto: int) -> int:
        return auto if value == "auto" else int(value)

    overlap = spec.gpus.strategy == "zero3" if settings.overlap_comm is None else settings.overlap_comm
    return Buffers(resolved(settings.reduce_bucket_size, h * h), overlap,
                   resolved(settings.stage3_prefetch_bucket_size, int(0.9 * h * h)),
                   resolved(settings.stage3_param_persistence_threshold, 10 * h))


def apply_deepspeed(step: StepMemory, spec: RunSpec, facts: Facts, layers: int, hidden: int | None,
                    layer_bytes: float) -> None:
    """Replace the traced step's model states (weights, trained weights, gradients, optimizer states) by DeepSpeed's
    layout on one rank, for `spec.gpus.strategy` zero1, zero2 or zero3 (see the module's docstring). `layer_bytes`:
    one decoder layer's weights as stored (QLoRA's quantized), what ZeRO-3 gathers."""
    stage = int(spec.gpus.strategy[-1])
    ranks = spec.gpus.count
    settings = buffers(spec, hidden)
    half = 4 if spec.precision == "fp32" else 2  # bytes of a weight as DeepSpeed casts the model
    trained = facts.trainable_numel
    offload = spec.gpus.offload
    phases = step.phases
    traced_trained = max(memory.breakdown["trainable_weights"] for memory in phases.values())
    states = max(memory.breakdown["optimizer"] for memory in phases.values())
    if spec.optimizer in TRACED_DTYPE_STATES and traced_trained and trained:
        states *= 4 / (traced_trained / trained)  # on the fp32 master, not the traced weights' dtype
    sharded_states = (4 * trained + states) / ranks  # master and states
    fp32_grads = 4 * trained / ranks  # the step's fp32 copy of the gradient partition
    partition = half * trained / ranks  # the 16-bit gradient partition
    bucket = settings.reduce_bucket * half
    # ZeRO-3: small parameters stay whole (LoRA's matrices where rank × hidden is under the threshold)
    persistent = trained if stage == 3 and spec.method != "full" and \
        spec.lora.rank * (hidden or 0) < settings.persistence_threshold else 0.0
    trained_bytes = half * (trained if stage < 3 else persistent + (trained - persistent) / ranks)
    frozen_whole = max(memory.breakdown["weights"] for memory in phases.values())
    quantization = max(memory.breakdown["quantization"] for memory in phases.values())
    whole = frozen_whole + half * trained + quantization
    root = max(0.0, whole - layers * layer_bytes)  # embeddings, final norm, head
    gathered = max(layer_bytes, root / 2) + min(settings.prefetch_bucket * half, layer_bytes)
    on_gpu = offload == "none"
    for phase, memory in phases.items():
        b = memory.breakdown
        b["trainable_weights"] = trained_bytes if offload != "params" else half * persistent
        if stage == 3:
            b["weights"] = frozen_whole / ranks if offload != "params" else 0.0
            b["quantization"] = quantization / ranks if offload != "params" else 0.0
            if phase != "optimizer":
                b["temporaries"] += gathered
        b["optimizer"] = sharded_states if on_gpu else 0.0
        if stage == 3:
            gradients = (partition if on_gpu else 0.0) + bucket
        elif phase == "backward":
            accumulated = half * trained if stage == 1 and spec.grad_accum > 1 else partition if on_gpu else 0.0
            gradients = accumulated + bucket * (2 if settings.overlap_comm else 1)
        elif phase == "forward" and spec.grad_accum > 1:  # what the earlier micro-batches left
            gradients = half * trained if stage == 1 else partition if on_gpu else 0.0
        else:
            gradients = partition if on_gpu and phase == "optimizer" else 0.0
        if phase == "optimizer" and on_gpu:
            gradients += fp32_grads
        b["gradients"] = gradients
    if not on_gpu:
        step.host_bytes += sharded_states + fp32_grads + partition
    if offload == "params":
        step.host_bytes += (frozen_whole + quantization + half * (trained - persistent)) / ranks
    kept = "the 16-bit weights whole" if stage < 3 else "a partition of every weight, a layer and the prefetched " \
        "parameters gathered"
    moved = {"none": "", "optimizer": "; master weights, optimizer states and fp32 gradients in CPU memory",
             "params": "; weights, master weights, optimizer states and fp32 gradients in CPU memory"}[offload]
    step.notes.append(
        f"DeepSpeed ZeRO-{stage} over {ranks} GPU(s): {kept}, the fp32 master weights and optimizer states sharded, "
        f"a reduce bucket of {settings.reduce_bucket:,} elements ({bucket / 2**30:.2f} GiB"
        f"{', two with overlap_comm' if stage < 3 and settings.overlap_comm else ''}){moved}")
