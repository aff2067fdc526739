"""Per-GPU memory of DeepSpeed's ZeRO stages, as DeepSpeed 0.19 allocates them (docs/research/deepspeed-cpu.md has
the lines of DeepSpeed's code each term follows; docs/benchmarks/deepspeed-rank-memory.md checks them on real ranks).

DeepSpeed's bf16 and fp16 modes cast the model to 16 bits (ZeRO-3: what zero.Init built, not peft's adapters added
after it) and keep an fp32 master copy of the trained weights inside the optimizer, so the traced step (run in bf16:
settings.py) gives the activations and temporaries, and the model states are laid out here. For Ψ trained elements
over N ranks, P bytes a 16-bit element:

* every stage: the fp32 master and the optimizer's states on it, 4Ψ/N + states/N; during the optimizer step an
  fp32 copy of the gradient partition, 4Ψ/N (ZeRO-1/2 flatten the 16-bit partition into one more copy first);
* ZeRO-1 and ZeRO-2 keep the 16-bit weights whole (PΨ) and reduce gradients into a partition (PΨ/N) through a
  bucket of `reduce_bucket_size` elements, two with `overlap_comm`, held through the backward pass only. ZeRO-1
  reduces once a step: between micro-batches it accumulates whole gradients (PΨ), and a weight larger than a bucket
  keeps its whole gradient until the step. With offload, a 16-bit buffer of the largest weight stays on each side;
* ZeRO-3 keeps a partition of every weight (P/N of them), gathers a module and the prefetched parameters, keeps the
  weights used again within `stage3_max_reuse_distance` elements gathered (all under `stage3_max_live_parameters`),
  keeps parameters below `stage3_param_persistence_threshold` elements whole beside their partition, and holds its
  reduce bucket and its gradient partition for the whole run;
* offload moves the master, the states and the fp32 gradients (and with ZeRO-3 the weights) to CPU memory.

For full fine-tuning DeepSpeed's own `estimate_zero2_model_states_mem_needs` says 2Ψ + 18Ψ/N per GPU: the step's
flattened copy (2Ψ/N) is beside it here. Its `estimate_zero3_model_states_mem_needs` says 18Ψ/N and 4 × the largest
layer: here the 16-bit gradient partition (2Ψ/N) it leaves out is added, and the gathered parameters take the place
of its largest layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tunecast.config.spec import RunSpec
from tunecast.step.settings import TRACED_OPTIMIZERS

if TYPE_CHECKING:
    from tunecast.estimate.memory import Facts, StepMemory



@dataclass(frozen=True)
class Buffers:
    """DeepSpeed's buffer settings in elements, with `auto` and the stage's defaults resolved."""

    reduce_bucket: int
    overlap_comm: bool
    prefetch_bucket: int
    persistence_threshold: int
    max_live: int
    reuse_distance: int


class ModelSizes(NamedTuple):
    """What the modelled terms read from the model's config: DeepSpeed's buffers are sized by the hidden size
    (`auto` buckets) and the vocabulary (an embedding is the largest weight of most models); `linear_experts` and
    `largest_linear_expert` are the elements of the expert and router weights, and of the largest one, that the
    transformers the runner ran built as nn.Linear modules (0 for today's fused 3-D experts: moe.py
    `linear_expert_numel`)."""

    hidden: int
    vocab: int
    linear_experts: int = 0
    largest_linear_expert: int = 0


def model_sizes(config_data: dict[str, Any], spec: RunSpec | None = None) -> ModelSizes:
    """`config_data`'s sizes; `spec` names the transformers its runner ran (none: today's)."""
    from tunecast.catalog.models import ModelConfig
    from tunecast.estimate.moe import ExpertShape, linear_expert_numel

    model = ModelConfig(name="", path=Path(), origin="file", data=config_data)
    experts = linear_expert_numel(config_data, spec)
    shape = ExpertShape.from_config(config_data) if experts else None
    largest = shape.hidden * shape.width if shape is not None else 0
    return ModelSizes(model.hidden_size or 0, model.vocab_size or 0, experts, largest)


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
                   resolved(settings.stage3_param_persistence_threshold, 10 * h),
                   settings.stage3_max_live_parameters, settings.stage3_max_reuse_distance)


def sixteen_bit_bytes(spec: RunSpec) -> int:
    """Bytes of a weight as DeepSpeed casts the model: 16 bits in its bf16 and fp16 modes, fp32 without them."""
    return 4 if spec.precision == "fp32" else 2


def fp32_widening(step: StepMemory, trainable_numel: float) -> float:
    """How many times larger fp32 copies of the trained weights are than the traced ones (2 for weights traced in
    16 bits; 1 where the trace holds them in fp32 already, as peft's adapters, or nothing trains)."""
    traced = max(memory.breakdown["trainable_weights"] for memory in step.phases.values())
    return 4 / (traced / trainable_numel) if traced and trainable_numel else 1.0


def apply_deepspeed(step: StepMemory, spec: RunSpec, facts: Facts, layers: int, sizes: ModelSizes,
                    layer_bytes: float) -> None:
    """Replace the traced step's model states (weights, trained weights, gradients, optimizer states) by DeepSpeed's
    layout on one rank, for `spec.gpus.strategy` zero1, zero2 or zero3 (see the module's docstring). `layer_bytes`:
    one decoder layer's weights as stored (QLoRA's quantized), what ZeRO-3 gathers. The line numbers are DeepSpeed
    0.19.8's (runtime/zero/), as docs/benchmarks/deepspeed-rank-memory.md measured them on real ranks."""
    stage = int(spec.gpus.strategy[-1])
    ranks = spec.gpus.count
    settings = buffers(spec, sizes.hidden)
    half = sixteen_bit_bytes(spec)
    trained = facts.trainable_numel
    offload = spec.gpus.offload
    on_gpu = offload == "none"
    phases = step.phases
    states = max(memory.breakdown["optimizer"] for memory in phases.values())
    if spec.optimizer in TRACED_OPTIMIZERS:  # their states traced in the weights' dtype; DeepSpeed's on the fp32 master
        states *= fp32_widening(step, trained)
    sharded_states = (4 * trained + states) / ranks  # master and states
    # ZeRO-3 casts only what zero.Init did not build: peft's adapters, added after it, keep their fp32
    # (engine.py, _configure_distributed_model); ZeRO-1/2 cast the whole model
    trained_element = 4 if stage == 3 and spec.method != "full" and spec.lora.fp32_adapters else half
    fp32_grads = 4 * trained / ranks  # the step's fp32 copy of the gradient partition
    partition = half * trained / ranks  # the 16-bit gradient partition (16 bits for fp32 adapters too)
    bucket = settings.reduce_bucket * half
    frozen_whole = max(memory.breakdown["weights"] for memory in phases.values())
    quantization = max(memory.breakdown["quantization"] for memory in phases.values())
    whole = frozen_whole + half * trained + quantization
    root = max(0.0, whole - layers * layer_bytes)  # embeddings, final norm, head
    embedding = sizes.hidden * sizes.vocab  # elements of one embedding matrix (two where untied)
    linears = [inputs * outputs for inputs, outputs, _ in facts.layer_linears]
    largest = max([*linears, embedding])
    # ZeRO-3: small parameters stay whole (LoRA's matrices where rank × hidden is under the threshold), beside their
    # partition (parameter_offload.py)
    persistent = trained if stage == 3 and spec.method != "full" and \
        spec.lora.rank * sizes.hidden < settings.persistence_threshold else 0.0
    trained_bytes = half * trained if stage < 3 else trained_element * (persistent + trained / ranks)
    # ZeRO-1 keeps the whole 16-bit gradients of weights larger than a bucket until the step (they skip the bucket
    # and stage 1 does not free them: stage_1_and_2.py); full fine-tuning's weights only, adapters are small
    unbucketed = 0.0
    if stage == 1 and spec.method == "full":
        matrices = 2 if root / half >= 1.5 * embedding else 1
        unbucketed = layers * sum(n for n in linears if n > settings.reduce_bucket) + \
            (matrices * embedding if embedding > settings.reduce_bucket else 0)
    # ZeRO-1/2 offload: a 16-bit buffer of the largest weight on each side, held all run (stage_1_and_2.py)
    offload_buffer = half * largest if stage < 3 and not on_gpu else 0.0
    # ZeRO-3: a module and the prefetched parameters gathered, and the weights used again within
    # stage3_max_reuse_distance elements (the last layers, at the turn from the forward to the backward pass) kept
    # so, all under stage3_max_live_parameters (partitioned_param_coordinator.py)
    module = max(layer_bytes, half * embedding if root else 0.0)
    gathered = min(whole, half * settings.max_live,
                   module + half * settings.prefetch_bucket + half * settings.reuse_distance)
    for phase, memory in phases.items():
        b = memory.breakdown
        # the persistent weights' whole copies are gathered for the passes, not held through the step
        whole_copies = trained_element * persistent if phase != "optimizer" else 0.0
        b["trainable_weights"] = trained_bytes - trained_element * persistent + whole_copies \
            if offload != "params" else whole_copies
        if stage == 3:
            b["weights"] = frozen_whole / ranks if offload != "params" else 0.0
            b["quantization"] = quantization / ranks if offload != "params" else 0.0
            if phase != "optimizer":
                b["temporaries"] += gathered
        b["optimizer"] = sharded_states if on_gpu else 0.0
        kept = partition if on_gpu else 0.0
        if stage == 3:
            gradients = kept + bucket
        elif phase == "backward":
            accumulated = half * trained if stage == 1 and spec.grad_accum > 1 else \
                kept + half * unbucketed * (1 - 1 / ranks)
            gradients = accumulated + bucket * (2 if settings.overlap_comm else 1)
        elif phase == "forward" and spec.grad_accum > 1:  # what the earlier micro-batches left
            gradients = half * trained if stage == 1 else kept
        else:
            # the step flattens the 16-bit partition into a copy, cast to fp32 (stage_1_and_2.py)
            gradients = 2 * kept if phase == "optimizer" else 0.0
        if phase == "optimizer" and on_gpu:
            gradients += fp32_grads
        b["gradients"] = gradients + offload_buffer
    if not on_gpu:
        step.host_bytes += sharded_states + fp32_grads + half * trained / ranks + offload_buffer
    if offload == "params":
        step.host_bytes += (frozen_whole + quantization + half * (trained - persistent)) / ranks
    kept_text = "the 16-bit weights whole" if stage < 3 else "a partition of every weight, a layer and the " \
        "prefetched parameters gathered"
    moved = {"none": "", "optimizer": "; master weights, optimizer states and fp32 gradients in CPU memory",
             "params": "; weights, master weights, optimizer states and fp32 gradients in CPU memory"}[offload]
    step.notes.append(
        f"DeepSpeed ZeRO-{stage} over {ranks} GPU(s): {kept_text}, the fp32 master weights and optimizer states "
        f"sharded, a reduce bucket of {settings.reduce_bucket:,} elements ({bucket / 2**30:.2f} GiB"
        f"{', two with overlap_comm' if stage < 3 and settings.overlap_comm else ''}){moved}")
