"""How long one optimizer step takes on a GPU, from the traced step's work and the card's roofline.

Work comes from the same traced step as the memory estimate: the FLOPs torch's FlopCounterMode counts (its
matmuls; attention through the CPU flash kernel, registered and halved for causal masks) and the bytes the
other operations write, both as polynomials in micro-batch and length, extrapolated in depth. Time is:

* matmuls: every Linear of every layer (and the head) on the roofline of the card — the larger of its
  FLOPs at the card's achievable matmul rate (dense bf16 or fp8 TFLOPS × the measured matmul efficiency)
  and its bytes (inputs, weight, output) at the memory bandwidth. Small micro-batches and short sequences
  thus fall to memory speed by themselves; LoRA's frozen weights skip the weight-gradient matmul;
* attention: its FLOPs at the attention kernels' efficiency;
* everything else (norms, activations, rotary, softmax, casts, the loss): memory-bound, each byte written
  once and read once, at the bandwidth;
* QLoRA: each pass over a quantized weight dequantizes it (read half a byte, write two) — forward, backward,
  and again when checkpointing recomputes;
* the optimizer step: a fused pass over parameters, gradients and states at the bandwidth; CPU offload moves
  gradients and parameters over PCIe instead;
* activation offload: saved activations to CPU RAM and back over PCIe, overlapped with compute;
* several GPUs: DDP's ring all-reduce of gradients, FSDP's all-gathers of parameters (forward and backward)
  and reduce-scatter of gradients, over the card's interconnect, overlapped with computation where the
  engines overlap them (DDP with the backward pass, FSDP with the whole step).

Every constant is a catalog row (`catalog/data/throughput.csv`, `gpus.csv`) with its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunecast.catalog.gpus import Gpu
from tunecast.catalog.throughput import ThroughputConstants
from tunecast.config.spec import RunSpec
from tunecast.estimate.profiles import ProfilePair


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one GPU, by part."""

    compute_s: float  # matmuls + attention + memory-bound operations, all micro-batches
    dequantize_s: float
    optimizer_s: float
    communication_s: float  # exposed (not hidden behind computation)
    offload_s: float  # exposed
    tokens_per_step: int  # tokens one GPU processes per optimizer step (padding included)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.dequantize_s + self.optimizer_s + self.communication_s + self.offload_s

    def as_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "dequantize_s": self.dequantize_s, "optimizer_s": self.optimizer_s,
                "communication_s": self.communication_s, "offload_s": self.offload_s, "total_s": self.total_s}


def _depth(pair: ProfilePair, pick: Any) -> float:
    a, b = pick(pair.shallow), pick(pair.deeper)
    da, db = pair.shallow.layers, pair.deeper.layers
    if da == db:
        return float(b)
    return float(a + (b - a) * (pair.layers - da) / (db - da))


def matmul_seconds(linears: tuple[tuple[int, int, bool], ...], tokens: int, *, passes: int, flops_per_s: float,
                   bytes_per_s: float, element: int) -> tuple[float, float]:
    """Roofline time and FLOPs of the Linear layers for `tokens` rows: forward, input gradient, and weight
    gradient when the weight trains; `passes` forward passes (2 with checkpointing)."""
    seconds = flops_total = 0.0
    for inputs, outputs, trains in linears:
        flops = 2 * tokens * inputs * outputs
        moved = element * (tokens * inputs + inputs * outputs + tokens * outputs)
        count = passes + 1 + (1 if trains else 0)
        seconds += max(flops / flops_per_s, moved / bytes_per_s) * count
        flops_total += flops * count
    return seconds, flops_total


def step_time(spec: RunSpec, pair: ProfilePair, gpu: Gpu, constants: ThroughputConstants, *, micro_batch: int,
              seq: int, grad_accum: int, gpu_count: int, grad_checkpointing: bool,
              offloaded_activation_bytes: float = 0.0) -> StepTime:
    """One optimizer step of `spec` on one of `gpu_count` GPUs, micro-batches of `micro_batch` × `seq`.
    `offloaded_activation_bytes`: what activation offload moves to CPU RAM per micro-batch (the memory
    estimate's host RAM)."""
    facts = pair.deeper.facts
    fp8 = spec.precision == "fp8" and gpu.fp8_tflops is not None
    peak = (gpu.fp8_tflops if fp8 and gpu.fp8_tflops else gpu.bf16_tflops) * 1e12
    efficiency = constants.matmul_efficiency(gpu)
    bandwidth = gpu.memory_bandwidth_gb_per_s * 1e9 * constants.get("memory_efficiency")
    element = 1 if fp8 else (2 if spec.precision != "fp32" else 4)
    tokens = micro_batch * seq
    passes = 2 if grad_checkpointing else 1

    # Matmuls on the roofline, from the model's Linear shapes; the traced matmul FLOPs cover the rest (LoRA's
    # small adapters and the loss's logits), at the achievable rate.
    layer_s, layer_flops = matmul_seconds(facts.layer_linears, tokens, passes=passes, flops_per_s=peak * efficiency,
                                          bytes_per_s=bandwidth, element=element)
    head = (facts.head_linear,) if facts.head_linear[0] else ()
    head_s, head_flops = matmul_seconds(head, tokens, passes=1, flops_per_s=peak * efficiency,
                                        bytes_per_s=bandwidth, element=element)
    flops = {kind: _depth(pair, lambda p, k=kind: p.flops_at(micro_batch, seq).get(k, 0.0))
             for kind in ("matmul", "attention", "elementwise_bytes")}
    # Matmuls the Linear shapes do not cover (eager attention's score products, the chunked loss's logits) at
    # the achievable rate, from the traced count.
    other_flops = max(0.0, flops["matmul"] - pair.layers * layer_flops - head_flops)
    bf16_peak = gpu.bf16_tflops * 1e12 * efficiency
    compute_s = (pair.layers * layer_s + head_s + other_flops / bf16_peak
                 + flops["attention"] / (bf16_peak * constants.get("attention_efficiency"))
                 + 2 * flops["elementwise_bytes"] / bandwidth)

    dequantize_s = 0.0
    if spec.method == "qlora":
        quantized = _depth(pair, lambda p: p.facts.quantizable_numel)
        # per pass over the weights: read NF4 (0.5 byte), write and read the bf16 copy (2 + 2 bytes)
        dequantize_s = (passes + 1) * quantized * 4.5 / bandwidth
    compute_s *= grad_accum
    dequantize_s *= grad_accum

    trainable = _depth(pair, lambda p: p.facts.trainable_numel)
    state_bytes = 4 if spec.method != "full" or spec.precision in ("bf16-mixed", "fp16-mixed", "fp32") else element
    per_value = {"adamw": 2, "adamw-8bit": 0.5, "paged-adamw": 2, "paged-adamw-8bit": 0.5, "sgd": 0,
                 "adafactor": 0.1}[spec.optimizer]
    param_bytes = 4 if spec.method != "full" else pair.deeper.facts.param_dtype_bytes
    # fused step: read parameter, gradient and states, write parameter and states
    optimizer_bytes = trainable * (2 * param_bytes + param_bytes + 2 * per_value * state_bytes)
    optimizer_s = optimizer_bytes / bandwidth
    offload_s = 0.0
    pcie = constants.pcie_bytes_per_s(gpu.pcie_gen)
    if spec.gpus.offload in ("optimizer", "params"):
        optimizer_s = trainable * 2 * param_bytes / pcie  # gradients down, parameters up
    if spec.activation_offload:
        # to CPU RAM in the forward pass and back in the backward pass, overlapped with computation
        offload_s = max(0.0, grad_accum * 2 * offloaded_activation_bytes / pcie - compute_s)

    communication_s = 0.0
    if gpu_count > 1:
        link = gpu.interconnect_gb_per_s / 2 * 1e9 * constants.get("communication_efficiency")
        ring = (gpu_count - 1) / gpu_count
        grads = trainable * param_bytes
        if spec.gpus.strategy == "ddp":
            exposed = 2 * ring * grads / link - compute_s * 2 / 3  # hidden behind the backward pass
        else:
            params = _depth(pair, lambda p: p.facts.layer_bytes) * pair.layers
            exposed = (2 * ring * params * grad_accum + ring * grads) / link - compute_s
        communication_s = max(0.0, exposed)
    return StepTime(compute_s, dequantize_s, optimizer_s, communication_s, offload_s, tokens * grad_accum)
