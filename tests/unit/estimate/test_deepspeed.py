"""DeepSpeed's ZeRO stages per rank (estimate/deepspeed.py), against DeepSpeed's own estimators of model states
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs` in DeepSpeed 0.19.8's
runtime/zero/stage_1_and_2.py and stage3.py; their formulas are quoted in each test) and the buffers
docs/research/deepspeed-cpu.md measured on real ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tunecast.config.spec import RunSpec
from tunecast.estimate.deepspeed import ModelSizes, apply_deepspeed, buffers
from tunecast.estimate.memory import PHASES, Facts, PhaseMemory, StepMemory

PSI = 8_030_261_248  # Llama-3.1-8B's parameters
LAYER = 218_112_000  # one of its decoder layers
LAYERS = 32
HIDDEN = 4096
VOCAB = 128_256
SIZES = ModelSizes(HIDDEN, VOCAB)
STATES = ("weights", "trainable_weights", "gradients", "optimizer", "quantization")


def _full_bf16_step() -> tuple[StepMemory, Facts]:
    """A full fine-tuning step traced in bf16: weights, gradients and torch AdamW's two states in 2 bytes each."""
    phases = {}
    for phase in PHASES:
        memory = PhaseMemory()
        memory.breakdown["trainable_weights"] = 2.0 * PSI
        memory.breakdown["gradients"] = 2.0 * PSI if phase != "forward" else 0.0
        memory.breakdown["optimizer"] = 4.0 * PSI
        phases[phase] = memory
    linears = ((4096, 4096, True), (4096, 1024, True), (4096, 1024, True), (4096, 4096, True),
               (4096, 14_336, True), (4096, 14_336, True), (14_336, 4096, True))
    facts = Facts(quantizable_numel=0.0, largest_quantizable_numel=0, trainable_numel=float(PSI),
                  trainable_small_numel=0.0, layer_bytes=2 * LAYER, layer_numel=LAYER, layer_linears=linears)
    return step_of(phases), facts


def step_of(phases: dict[str, PhaseMemory]) -> StepMemory:
    return StepMemory(phases, 0.0)


def _states(strategy: str, count: int, phase: str = "optimizer", **gpus: object) -> tuple[float, StepMemory]:
    step, facts = _full_bf16_step()
    spec = RunSpec(model="m", method="full", precision="bf16-mixed",
                   gpus={"strategy": strategy, "count": count, **gpus})
    apply_deepspeed(step, spec, facts, LAYERS, SIZES, 2 * LAYER)
    return sum(step.phases[phase].breakdown[c] for c in STATES), step


@pytest.mark.parametrize("count", [2, 8, 64])
def test_zero2_model_states_are_deepspeeds_formula_and_the_steps_flat_copy(count: int) -> None:
    # DeepSpeed: gpu_mem = 2 * total_params + int(18 * total_params / total_gpus) (no offload); the step also flattens
    # the 16-bit gradient partition into a copy before casting it (2Ψ/N), measured on real ranks
    states, _ = _states("zero2", count)
    assert states == 2 * PSI + 18 * PSI / count + 2 * PSI / count
    # ZeRO-1 holds the same once the gradients are reduced (one micro-batch a step)
    assert _states("zero1", count)[0] == states


def test_zero2_offload_leaves_the_16_bit_weights_and_a_staging_buffer_on_the_gpu() -> None:
    # DeepSpeed: gpu_mem = 2 * total_params with cpu_offload; the master, states and fp32 gradients in CPU memory,
    # and on each side a 16-bit buffer of the largest weight (here the 128k × 4096 embedding)
    states, step = _states("zero2", 8, offload="optimizer")
    buffer = 2 * VOCAB * HIDDEN
    assert states == 2 * PSI + buffer
    assert step.host_bytes == (4 + 8 + 4 + 2) * PSI / 8 + buffer


def test_zero3_adds_the_gradient_partition_deepspeeds_estimator_leaves_out() -> None:
    # DeepSpeed: gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus); its 18 leaves out the 16-bit
    # gradient partition that stage3.py allocates (grad_partitions_flat_buffer), measured on real ranks: 20Ψ/N
    states, step = _states("zero3", 8, deepspeed={"reduce_bucket_size": 1})
    assert states == pytest.approx(20 * PSI / 8 + 2)  # and a 1-element reduce bucket
    # gathered: DeepSpeed's default max_live_parameters (1e9 elements) bounds a module, the prefetched parameters and
    # those kept for reuse at the turn of the passes
    assert step.phases["forward"].breakdown["temporaries"] == 2 * 1e9
    _, lean = _states("zero3", 8, deepspeed={"stage3_max_reuse_distance": 0})
    # the larger of a layer and an embedding, and DeepSpeed's default prefetch (5e7 elements) beside it
    assert lean.phases["forward"].breakdown["temporaries"] == 2 * VOCAB * HIDDEN + 2 * 50_000_000


def test_zero3_parameter_offload_keeps_only_gathered_parameters() -> None:
    # DeepSpeed: gpu_mem = largest_layer_memory with cpu_offload_params; here the reduce bucket is kept too
    states, step = _states("zero3", 8, offload="params", deepspeed={"reduce_bucket_size": 1000})
    assert states == 2 * 1000  # the reduce bucket
    assert step.host_bytes == (4 + 8 + 4 + 2) * PSI / 8 + 2 * PSI / 8


def test_zero1_accumulates_whole_gradients_between_micro_batches() -> None:
    step_zero1 = _accumulating("zero1")
    step_zero2 = _accumulating("zero2")
    # one micro-batch a step: ZeRO-1 keeps the whole gradients of weights over a bucket (here the embeddings, and
    # with a bucket of h² elements every MLP matrix too) until the step
    _, single = _states("zero1", 8, deepspeed={"reduce_bucket_size": HIDDEN * HIDDEN})
    mlp = 3 * 4096 * 14_336
    assert single.phases["backward"].breakdown["gradients"] == pytest.approx(
        2 * PSI / 8 + 2 * HIDDEN * HIDDEN + 2 * (LAYERS * mlp + 2 * VOCAB * HIDDEN) * (1 - 1 / 8))
    bucket = 500_000_000 * 2
    assert step_zero1.phases["backward"].breakdown["gradients"] == 2 * PSI + bucket
    assert step_zero2.phases["backward"].breakdown["gradients"] == 2 * PSI / 8 + bucket
    assert step_zero1.phases["forward"].breakdown["gradients"] == 2 * PSI


def _accumulating(strategy: str) -> StepMemory:
    step, facts = _full_bf16_step()
    spec = RunSpec(model="m", method="full", precision="bf16-mixed", grad_accum=4,
                   gpus={"strategy": strategy, "count": 8})
    apply_deepspeed(step, spec, facts, LAYERS, SIZES, 2 * LAYER)
    return step


def test_overlap_comm_doubles_the_reduce_bucket_of_zero2() -> None:
    _, plain = _states("zero2", 8)
    _, overlapped = _states("zero2", 8, deepspeed={"overlap_comm": True})
    assert overlapped.phases["backward"].breakdown["gradients"] - plain.phases["backward"].breakdown["gradients"] \
        == 500_000_000 * 2


def test_auto_buffers_follow_the_transformers_integration() -> None:
    spec = RunSpec(model="m", gpus={"strategy": "zero3", "count": 2, "deepspeed": {
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}})
    settings = buffers(spec, HIDDEN)
    assert (settings.reduce_bucket, settings.prefetch_bucket, settings.persistence_threshold) == \
        (HIDDEN * HIDDEN, int(0.9 * HIDDEN * HIDDEN), 10 * HIDDEN)
    assert settings.overlap_comm  # DeepSpeed turns it on for ZeRO-3 only
    assert not buffers(spec.with_changes({"gpus.strategy": "zero2"}), HIDDEN).overlap_comm


@pytest.mark.parametrize(("threshold", "whole"), [(100_000, True), ("auto", False)])
def test_zero3_keeps_small_lora_matrices_whole(threshold: int | str, whole: bool) -> None:
    # rank 16 × hidden 4096 = 65,536 elements: under DeepSpeed's default threshold (1e5) each matrix stays whole on
    # every rank; over the transformers integration's `auto` (10 × 4096) it is partitioned
    trained = 41_943_040.0
    phases = {phase: PhaseMemory() for phase in PHASES}
    for memory in phases.values():
        memory.breakdown["weights"] = 2.0 * PSI
        memory.breakdown["trainable_weights"] = 4 * trained
        memory.breakdown["optimizer"] = 8 * trained
    facts = Facts(quantizable_numel=0.0, largest_quantizable_numel=0, trainable_numel=trained,
                  trainable_small_numel=0.0, layer_bytes=2 * LAYER, layer_numel=LAYER)
    spec = RunSpec(model="m", method="lora", lora={"rank": 16}, precision="bf16-mixed",
                   gpus={"strategy": "zero3", "count": 8,
                         "deepspeed": {"stage3_param_persistence_threshold": threshold}})
    step = step_of(phases)
    apply_deepspeed(step, spec, facts, LAYERS, SIZES, 2 * LAYER)
    adapters = step.phases["forward"].breakdown["trainable_weights"]
    # peft's adapters, added after zero.Init, keep fp32: a partition, and a whole copy where they persist
    assert adapters == 4 * trained / 8 + (4 * trained if whole else 0)
    assert step.phases["forward"].breakdown["weights"] == 2 * PSI / 8
    # adapters traced in fp32 with fp32 AdamW states: the states stay 8 bytes an element, beside a 4-byte master
    assert step.phases["forward"].breakdown["optimizer"] == (4 + 8) * trained / 8


def test_accelerate_fsdp_mixed_precision_keeps_fp32_shards_and_computes_in_16_bits(catalog) -> None:
    """The Trainer's FSDP under bf16 mixed precision gathers the fp32 shards in bf16 (MixedPrecisionPolicy), so no
    autocast copy of a weight is saved for the backward pass; tunecast's own loop autocasts fp32 weights instead."""
    from tests.models import tiny_llama

    from tunecast.estimate.memory import estimate_memory

    def estimate(runner: str) -> Any:
        spec = RunSpec(model="m", method="full", precision="bf16-mixed", runner=runner, micro_batch=2, seq_len=64,
                       gpus={"strategy": "fsdp", "count": 4})
        return estimate_memory(spec, tiny_llama(), device="cuda", gpu=catalog.gpus.get("h100"),
                               overheads=catalog.overheads)

    trainer, own = estimate("hf-trainer"), estimate("tunecast")
    # ten layers (q and o 64 × 64; k and v 64 × 32, two of four heads; the MLP 3 × 64 × 160; two norms), two
    # untied embeddings and the final norm
    params = 10 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64) + 2 * 512 * 64 + 64
    assert trainer.breakdown_gib["trainable_weights"] * 2**30 == pytest.approx(4 * params / 4)  # fp32 shards
    assert any("gathered in 16 bits" in note for note in trainer.notes)
    assert trainer.breakdown_gib["activations"] < own.breakdown_gib["activations"]  # no fp32 → bf16 weight copies
