"""How long one optimizer step takes on a GPU, from the traced step's work and the card's roofline.

Work comes from the same traced step as the memory estimate: the FLOPs torch's FlopCounterMode counts (its
matmuls; attention through the CPU flash kernel, registered and halved for causal masks) and the bytes the
other operations write, both as polynomials in micro-batch and length, extrapolated in depth. Time is:

* matmuls: every Linear of every layer (and the head) on the roofline of the card — the larger of its
  FLOPs at the card's achievable matmul rate (dense bf16 or fp8 TFLOPS × the measured matmul efficiency)
  and its bytes (inputs, weight, output) at the memory bandwidth. Small micro-batches and short sequences
  thus fall to memory speed by themselves; LoRA's frozen weights skip the weight-gradient matmul;
* attention: its FLOPs at the attention kernels' efficiency;
* everything else (norms, activations, rotary, softmax, casts, the loss): memory-bound, at the bandwidth, for
  the bytes the traced eager kernels read and write (every operand read, every new or in-place-updated
  tensor written: a binary op moves three tensors, an in-place gradient accumulation as much);
* QLoRA: each pass over a quantized weight dequantizes it (bitsandbytes' measured cost per weight) — forward, backward,
  and again when checkpointing recomputes;
* dispatch: every eager operation costs the CPU a few microseconds to dispatch and launch (the traced step
  counts the operations); the GPU works through its queue asynchronously, so this shows only where it
  exceeds the GPU's work — micro-batches of a few hundred tokens;
* the optimizer step: the bytes the traced optimizer step reads and writes (torch's fused AdamW reads
  parameter, gradient and both states and writes three of them; the multi-tensor `foreach` AdamW makes about
  twenty passes), at the bandwidth; bitsandbytes' 8-bit and paged ones from their state sizes; CPU offload moves
  gradients and parameters over PCIe instead; stepped in the backward pass (`optimizer_in_backward`), the same
  bytes, its per-parameter kernels counted among the traced step's dispatches;
* activation offload: saved activations to CPU RAM and back over PCIe, overlapped with compute;
* several GPUs: each collective of the engine over the link between the GPUs (`collective_link`: one direction
  of the card's interconnect at the bus bandwidth NCCL reaches, or the bus bandwidth and latency `tunecast probe
  --collectives` measured between as many of the devices or more, or each GPU's share of the network between nodes),
  a fixed latency per collective plus its bytes, and only what cannot hide behind computation counted
  (`exposed_communication`): DDP's bucketed all-reduce of gradients behind the backward pass of the last
  micro-batch (the others accumulate without syncing), its last bucket after it; FSDP2 grad-op's and ZeRO-2's
  reduce-scatter of each micro-batch's gradients and the all-gather of the updated parameters after the step
  (ZeRO-1's reduction once a step; DeepSpeed's buckets hidden only with overlap_comm); FSDP's (and ZeRO-3's)
  per-layer all-gathers (forward, and again in backward) and reduce-scatters, each layer's prefetched behind the
  previous layer's computation, the first all-gather and the last reduce-scatter of each micro-batch exposed. Sharded
  strategies step the optimizer on each GPU's shard.

Every constant is a catalog row (`catalog/data/throughput.csv`, `gpus.csv`) with its source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunecast.catalog.devices import DeviceFigures
from tunecast.catalog.gpus import Gpu
from tunecast.catalog.throughput import ThroughputConstants
from tunecast.config.spec import DEEPSPEED_STRATEGIES, RunSpec
from tunecast.estimate.deepspeed import buffers as deepspeed_buffers
from tunecast.estimate.deepspeed import sixteen_bit_bytes
from tunecast.estimate.memory import stored_layer_bytes
from tunecast.estimate.profiles import ProfilePair
from tunecast.plan.cost import GPUS_PER_NODE
from tunecast.step.settings import TRACED_OPTIMIZERS


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one GPU, by part."""

    compute_s: float  # matmuls + attention + memory-bound operations, all micro-batches
    dequantize_s: float
    dispatch_s: float  # CPU time dispatching kernels, where it exceeds the GPU's work (small micro-batches)
    optimizer_s: float
    communication_s: float  # exposed (not hidden behind computation)
    offload_s: float  # exposed
    tokens_per_step: int  # tokens one GPU processes per optimizer step (padding included)
    link: Link | None = None  # what the collectives of several GPUs went over; None on one GPU

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.dequantize_s + self.dispatch_s + self.optimizer_s + self.communication_s
                + self.offload_s)

    def as_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "dequantize_s": self.dequantize_s, "dispatch_s": self.dispatch_s,
                "optimizer_s": self.optimizer_s,
                "communication_s": self.communication_s, "offload_s": self.offload_s, "total_s": self.total_s}


@dataclass(frozen=True)
class Link:
    """What the collectives between a run's GPUs go over: its name, the bus bandwidth NCCL reaches on it, and the
    fixed time of one collective."""

    name: str
    bus_bytes_per_s: float
    latency_s: float

    def seconds(self, bus_bytes: float, collectives: int = 1) -> float:
        """Time of `collectives` collectives moving `bus_bytes` over each GPU's link in all."""
        return collectives * self.latency_s + bus_bytes / self.bus_bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bus_gb_per_s": round(self.bus_bytes_per_s / 1e9, 2),
                "latency_us": round(self.latency_s * 1e6, 1)}


# PyTorch DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel bucket_cap_mb, default 25).
DDP_BUCKET_BYTES = 25 * 2**20


def peer_to_peer(gpu: Gpu) -> bool:
    """Whether NCCL can move data between two of these cards directly: over NVLink, or PCIe peer-to-peer. NVIDIA's
    driver does not enable PCIe peer-to-peer on GeForce cards (docs/research/collective-bandwidth.md: RTX 4090 with
    P2P disabled, RTX 2080 Ti "not supported"), so their collectives go through host memory."""
    return not (gpu.interconnect == "pcie" and "geforce" in gpu.name.lower())


def collective_link(gpu: Gpu, gpu_count: int, constants: ThroughputConstants,
                    internode_gb_per_s: float | None = None) -> Link:
    """One direction of the card's interconnect (`gpus.csv` gives both directions) at the fraction of it that NCCL's
    bus bandwidth reaches (a smaller one through host memory, for cards without peer-to-peer), or what `tunecast
    probe --collectives` measured between as many of these devices or more (`DeviceFigures.measured_link`); past
    one node, each GPU's share of the node's network where that is slower."""
    latency = constants.get("collective_latency_us") * 1e-6
    nccl = constants.get("communication_efficiency")
    direct = peer_to_peer(gpu)
    bus = gpu.interconnect_gb_per_s / 2 * (nccl if direct else constants.get("host_route_efficiency"))
    name = (f"{gpu.interconnect} ({gpu.interconnect_gb_per_s:g} GB/s both directions)" if direct else
            f"pcie through host memory, no peer-to-peer ({gpu.interconnect_gb_per_s:g} GB/s both directions)")
    measured = gpu.measured.measured_link(min(gpu_count, GPUS_PER_NODE)) if gpu.measured is not None else None
    if measured is not None:
        bus, latency = measured.bus_gb_per_s, measured.latency_us * 1e-6
        cuda = measured.kind == "cuda"
        devices, backend = (f"{measured.processes} GPUs", "nccl") if cuda else \
            (f"{measured.processes} CPU processes", "gloo")
        name = f"measured by tunecast probe on {devices} ({backend}, {measured.as_of})" + (
            f", planned on {gpu_count}" if gpu_count < measured.processes else "")
    if gpu_count > GPUS_PER_NODE and internode_gb_per_s is not None and \
            internode_gb_per_s / GPUS_PER_NODE * nccl < bus:
        share = internode_gb_per_s / GPUS_PER_NODE
        bus = share * nccl
        name = f"network between nodes ({internode_gb_per_s:g} GB/s a node, {share:g} a GPU)"
    return Link(name, bus * 1e9, latency)


def exposed_communication(strategy: str, link: Link, *, gpu_count: int, layers: int, layer_param_bytes: float,
                          trainable_bytes: float, compute_s: float, grad_accum: int, checkpointing: bool,
                          bucket_bytes: float = DDP_BUCKET_BYTES, overlap: bool = True) -> float:
    """Seconds of one optimizer step the collectives add, beyond what hides behind computation, for ring collectives
    over `gpu_count` GPUs (a ring moves (n-1)/n of a reduce-scatter's or all-gather's bytes over each GPU's link, and
    twice that for an all-reduce: nccl-tests' bus bandwidth). `compute_s` is the step's computation (all
    micro-batches); a micro-batch's backward pass takes two thirds of it, three quarters with checkpointing (the
    recomputed forward pass). Gradients are reduced in buckets of `bucket_bytes`, behind the backward pass with
    `overlap` (DeepSpeed's ZeRO-1/2 by default reduce each bucket in the backward pass's own stream: nothing hides).

    * DDP: an all-reduce of every gradient each step, behind the last micro-batch's backward pass;
    * FSDP2's grad-op mode and DeepSpeed's ZeRO-2: a reduce-scatter each micro-batch, and the trained weights
      all-gathered after the optimizer step; ZeRO-1 reduces once a step, at the last micro-batch;
    * FSDP2 full shard and ZeRO-3: each layer's weights gathered in the forward and backward passes (the next one
      prefetched while this one computes) and its gradients reduce-scattered, every micro-batch."""
    ring = (gpu_count - 1) / gpu_count
    per_micro_batch = compute_s / grad_accum
    backward = per_micro_batch * (3 / 4 if checkpointing else 2 / 3)
    forward = per_micro_batch - backward

    def bucketed(share: float) -> float:
        """Gradients reduced in buckets as the backward pass fills them, `share` of their bytes over each link: what
        the backward pass does not hide, and the last bucket, which only starts once it ends."""
        buckets = max(1, -(-int(trainable_bytes) // int(bucket_bytes)))
        whole = link.seconds(share * trainable_bytes, buckets)
        if not overlap:
            return whole
        last = link.seconds(share * min(trainable_bytes, bucket_bytes))
        return last + max(0.0, whole - last - backward)

    if strategy == "ddp":
        return bucketed(2 * ring)  # an all-reduce
    if strategy in ("fsdp-grad-op", "zero1", "zero2"):
        reductions = 1 if strategy == "zero1" else grad_accum
        return reductions * bucketed(ring) + link.seconds(ring * trainable_bytes)  # reduce-scatters, one all-gather
    gather = link.seconds(ring * layer_param_bytes)
    scatter = link.seconds(ring * trainable_bytes / layers)
    per_layer_forward, per_layer_backward = forward / layers, backward / layers
    exposed = (gather + (layers - 1) * max(0.0, gather - per_layer_forward)
               + scatter + (layers - 1) * max(0.0, gather + scatter - per_layer_backward))
    return grad_accum * exposed


def _depth(pair: ProfilePair, pick: Any) -> float:
    a, b = pick(pair.shallow), pick(pair.deeper)
    da, db = pair.shallow.layers, pair.deeper.layers
    if da == db:
        return float(b)
    return float(a + (b - a) * (pair.layers - da) / (db - da))


def matmul_seconds(linears: tuple[tuple[int, int, bool], ...], tokens: int, *,
                   passes: int, flops_per_s: float | Callable[[float, int, int, str], float],
                   bytes_per_s: float, element: int, backward: bool = True) -> tuple[float, float]:
    """Roofline time and FLOPs of the Linear layers for `tokens` rows: `passes` forward passes (2 with
    checkpointing), then (with `backward`) the input gradient, and the weight gradient when the weight trains.
    `flops_per_s` is a rate, or the rate of one of the three products of a (tokens × inputs) @ (inputs × outputs)
    layer (measured)."""
    seconds = flops_total = 0.0
    for inputs, outputs, trains in linears:
        flops = 2 * tokens * inputs * outputs
        moved = element * (tokens * inputs + inputs * outputs + tokens * outputs)
        counts = {"forward": passes, "input_grad": 1 if backward else 0,
                  "weight_grad": 1 if backward and trains else 0}
        for product, count in counts.items():
            rate = flops_per_s(tokens, inputs, outputs, product) if callable(flops_per_s) else flops_per_s
            seconds += max(flops / rate, moved / bytes_per_s) * count
            flops_total += flops * count
    return seconds, flops_total


# Share of a training step's non-matmul work (attention kernels, memory-bound operations) done in the forward
# pass: backward kernels do about twice the forward's work (FlashAttention-2's backward ~2.5× its forward).
FORWARD_SHARE = 1 / 3
@dataclass(frozen=True)
class _Rates:
    """What one device achieves for this run's precision: the catalog's datasheet figures × efficiencies, or
    what `tunecast probe` measured on it."""

    matmul: float  # FLOP/s of large matmuls (fp8 where the run and the card use it)
    bf16: float  # FLOP/s of matmuls outside the Linear layers (LoRA's adapters, eager attention, the loss)
    attention: float  # FLOP/s of attention kernels
    bandwidth: float  # bytes/s memory-bound kernels reach
    element: int  # bytes of a matmul operand
    host_op_s: float  # host seconds per eager operation (Python, autograd, dispatch, launch)
    synchronous: bool  # the host computes too (a CPU): host time adds to compute instead of hiding behind it
    dequantize_bytes: float  # bytes at the bandwidth that dequantizing one NF4 weight costs (catalog)
    figures: DeviceFigures | None = None
    dtype: str = "bf16"
    random_s: float = 0.0  # seconds per random number drawn beyond writing it (measured; ~0 on a GPU)
    transcendental: float = 0.0  # bytes/s (written) of exp/log/erf-like operations, where measured

    @classmethod
    def of(cls, spec: RunSpec, gpu: Gpu, constants: ThroughputConstants) -> _Rates:
        fp8 = spec.precision == "fp8" and gpu.fp8_tflops is not None
        element = 1 if fp8 else (2 if spec.precision != "fp32" else 4)
        figures: DeviceFigures | None = gpu.measured
        if figures is not None and figures.has("matmul"):  # not a device measured by the collective probe alone
            return cls._measured(spec, figures, constants, element)
        efficiency = constants.matmul_efficiency(gpu)
        peak = (gpu.fp8_tflops if fp8 and gpu.fp8_tflops else gpu.bf16_tflops) * 1e12
        bf16 = gpu.bf16_tflops * 1e12 * efficiency
        return cls(peak * efficiency, bf16, bf16 * constants.get("attention_efficiency"),
                   gpu.memory_bandwidth_gb_per_s * 1e9 * constants.get("memory_efficiency"), element,
                   constants.get("op_dispatch_us") * 1e-6, False, constants.get("bnb_dequantize_bytes_per_weight"))

    @classmethod
    def _measured(cls, spec: RunSpec, figures: DeviceFigures, constants: ThroughputConstants,
                  element: int) -> _Rates:
        dtype = compute_dtype(spec.precision, figures.dtypes())
        large = max(row.value for row in figures.rows if row.quantity == "matmul" and row.dtype == dtype) * 1e12
        attention = figures.attention_tflops(dtype)
        shapes = [row.shape for row in figures.rows if row.quantity == "bandwidth"]
        bandwidth = figures.value("bandwidth", max(shapes, key=lambda s: float(s.removesuffix("MiB"))))
        host = figures.value("op_overhead", "full" if spec.method == "full" else "lora")
        assert bandwidth is not None and host is not None, "a probe always measures bandwidth and overhead"
        random = figures.value("random")
        transcendental = figures.value("transcendental", dtype=dtype)
        return cls(large, large, attention * 1e12 if attention else large * constants.get("attention_efficiency"),
                   bandwidth * 1e9, element, host * 1e-6, figures.device.kind == "cpu",
                   constants.get("bnb_dequantize_bytes_per_weight"), figures, dtype,
                   random * 1e-9 if random is not None else 0.0,
                   transcendental * 1e9 if transcendental is not None else 0.0)

    def linear_rate(self, tokens: float, inputs: int, outputs: int, product: str | None = None) -> float:
        """FLOP/s of one of a Linear layer's products for `tokens` rows: measured at this shape where probed."""
        if self.figures is not None:
            rate = self.figures.matmul_tflops(self.dtype, tokens, inputs, outputs, product)
            if rate is not None:
                return rate * 1e12
        return self.matmul

    def linears(self, pair: ProfilePair, tokens: int, passes: int, backward: bool = True) -> tuple[float, float]:
        """Seconds and FLOPs of every Linear (all layers and the head) on the roofline."""
        facts = pair.deeper.facts
        layer_s, layer_flops = matmul_seconds(facts.layer_linears, tokens, passes=passes, flops_per_s=self.linear_rate,
                                              bytes_per_s=self.bandwidth, element=self.element, backward=backward)
        head = (facts.head_linear,) if facts.head_linear[0] else ()
        head_s, head_flops = matmul_seconds(head, tokens, passes=1, flops_per_s=self.linear_rate,
                                            bytes_per_s=self.bandwidth, element=self.element, backward=backward)
        return pair.layers * layer_s + head_s, pair.layers * layer_flops + head_flops

    def attention_seconds(self, flops: float, layers: int) -> float:
        """Attention kernels of `flops` FLOPs over `layers` layers: at the rate the probe measured for one layer's
        call of that work, where it did (a small call reaches a fraction of a large one's rate), else at the
        attention efficiency."""
        if self.figures is not None and flops > 0:
            rate = self.figures.attention_tflops(self.dtype, flops / max(1, layers))
            if rate is not None:
                return flops / (rate * 1e12)
        return flops / self.attention

    def elementwise_seconds(self, work: dict[str, float]) -> float:
        """Memory-bound operations: the bytes their kernels read and write, at the bandwidth — or, where the probe
        timed eager operations by size (a CPU), each of the step's operations at what one of its mean size costs
        beyond the smallest, if more (a small model's operations: started and joined over the cores, or run on
        one); where the probe measured them, exp/log/erf-like operations at their own (arithmetic-bound) rate,
        if slower."""
        plain = work["moved_bytes"] / self.bandwidth
        kernels = work.get("kernels", 0.0)
        if self.figures is not None and kernels > 0:
            per_operation = self.figures.elementwise_seconds(self.dtype, work["moved_bytes"] / kernels)
            if per_operation is not None:
                plain = max(plain, kernels * per_operation)
        if not self.transcendental:
            return plain
        special = work.get("transcendental_bytes", 0.0)
        return plain + max(0.0, special / self.transcendental - 2 * special / self.bandwidth)

    def host_seconds(self, kernels: float, device_s: float) -> float:
        """Time the step waits for the host: all of it on a CPU; on a GPU, what exceeds the device's own work
        (kernels are queued asynchronously)."""
        host = kernels * self.host_op_s
        return host if self.synchronous else max(0.0, host - device_s)


def compute_dtype(precision: str, measured: set[str]) -> str:
    """The dtype the run's matmuls compute in, among those the probe measured."""
    wanted = {"fp32": "fp32", "fp16": "fp16", "fp16-mixed": "fp16"}.get(precision, "bf16")
    if wanted in measured:
        return wanted
    return "bf16" if "bf16" in measured else sorted(measured)[0]


def _work(pair: ProfilePair, micro_batch: int, seq: int) -> dict[str, float]:
    """The traced step's matmul and attention FLOPs and memory-bound bytes, at the model's depth."""
    figures = {id(p): p.flops_at(micro_batch, seq) for p in (pair.shallow, pair.deeper)}  # each depth's, once
    return {kind: _depth(pair, lambda p, k=kind: figures[id(p)].get(k, 0.0))
            for kind in ("matmul", "attention", "moved_bytes", "optimizer_bytes", "kernels", "random_elements",
                         "transcendental_bytes")}


def forward_seconds(spec: RunSpec, pair: ProfilePair, gpu: Gpu, constants: ThroughputConstants, *,
                    micro_batch: int, seq: int) -> float:
    """One forward pass of a micro-batch without gradients (evaluation) on one GPU."""
    rates = _Rates.of(spec, gpu, constants)
    linear_s, _ = rates.linears(pair, micro_batch * seq, passes=1, backward=False)
    work = _work(pair, micro_batch, seq)
    seconds = linear_s + FORWARD_SHARE * (rates.attention_seconds(work["attention"], pair.layers)
                                          + rates.elementwise_seconds(work))
    if spec.method == "qlora":
        seconds += dequantize_seconds(pair, rates, passes=1)
    return seconds + rates.host_seconds(FORWARD_SHARE * work["kernels"], seconds)


def dequantize_seconds(pair: ProfilePair, rates: _Rates, *, passes: int) -> float:
    """QLoRA: every pass over a quantized weight dequantizes it — at the cost per weight that bitsandbytes'
    kernel has been measured at (catalog row bnb_dequantize_bytes_per_weight, in bytes at the memory
    bandwidth), or at its cost per call and per weight where the probe measured it."""
    quantized = _depth(pair, lambda p: p.facts.quantizable_numel)
    figures = rates.figures
    per_call = figures.value("bnb_4bit_call", "nf4", rates.dtype) if figures is not None else None
    per_weight = figures.value("bnb_4bit_dequantize", "nf4", rates.dtype) if figures is not None else None
    if per_call is None or per_weight is None:
        return passes * quantized * rates.dequantize_bytes / rates.bandwidth
    calls = pair.layers * sum(1 for _, _, trains in pair.deeper.facts.layer_linears if not trains)
    return passes * (calls * per_call * 1e-6 + quantized * per_weight * 1e-9)


def step_time(spec: RunSpec, pair: ProfilePair, gpu: Gpu, constants: ThroughputConstants, *, micro_batch: int,
              seq: int, grad_accum: int, gpu_count: int, grad_checkpointing: bool,
              offloaded_activation_bytes: float = 0.0, internode_gb_per_s: float | None = None,
              hidden_size: int | None = None) -> StepTime:
    """One optimizer step of `spec` on one of `gpu_count` GPUs, micro-batches of `micro_batch` × `seq`.
    `offloaded_activation_bytes`: what activation offload moves to CPU RAM per micro-batch (the memory
    estimate's host RAM). `internode_gb_per_s`: the network between nodes, per node, for a run of more GPUs
    than a node holds: the ring's slowest hop is then each GPU's share of its node's network. `hidden_size`: the
    model's, which sizes DeepSpeed's `auto` buckets."""
    rates = _Rates.of(spec, gpu, constants)
    bandwidth = rates.bandwidth
    tokens = micro_batch * seq
    passes = 2 if grad_checkpointing else 1

    # Matmuls on the roofline, from the model's Linear shapes; the traced matmul FLOPs cover the rest (LoRA's
    # small adapters, eager attention's score products, the chunked loss's logits), at the achievable bf16 rate.
    linear_s, linear_flops = rates.linears(pair, tokens, passes)
    work = _work(pair, micro_batch, seq)
    other_flops = max(0.0, work["matmul"] - linear_flops)
    compute_s = (linear_s + other_flops / rates.bf16 + rates.attention_seconds(work["attention"], pair.layers)
                 + rates.elementwise_seconds(work) + work["random_elements"] * rates.random_s)

    dequantize_s = dequantize_seconds(pair, rates, passes=passes + 1) if spec.method == "qlora" else 0.0
    # Every eager operation costs the host its Python, autograd and dispatch time. On a GPU kernels are queued
    # asynchronously: the GPU waits for the host only when a micro-batch's kernels take less time than
    # dispatching them (small micro-batches, short sequences); on a CPU the host does both, one after the other.
    dispatch_s = rates.host_seconds(work["kernels"], compute_s + dequantize_s)
    compute_s *= grad_accum
    dequantize_s *= grad_accum
    dispatch_s *= grad_accum

    trainable = _depth(pair, lambda p: p.facts.trainable_numel)
    # trainable weights (and their states) are fp32 under mixed precision and for peft's default fp32 adapters
    fp32_trainable = spec.method != "full" and spec.lora.fp32_adapters
    param_bytes = 4 if fp32_trainable else pair.deeper.facts.param_dtype_bytes
    optimizer_s = _optimizer_seconds(spec, pair, rates, work, trainable, param_bytes)
    # gradient clipping reads every gradient for the norm, then scales it in place (read and write); each
    # accumulated micro-batch after the first adds its gradients to the stored ones (read, read, write)
    optimizer_s += 3 * trainable * param_bytes * (1 + (grad_accum - 1)) / bandwidth
    offload_s = 0.0
    pcie = constants.pcie_bytes_per_s(gpu.pcie_gen)
    if spec.gpus.offload in ("optimizer", "params"):
        optimizer_s = trainable * 2 * param_bytes / pcie  # gradients down, parameters up
    if spec.activation_offload:
        # to CPU RAM in the forward pass and back in the backward pass, overlapped with computation
        offload_s = max(0.0, grad_accum * 2 * offloaded_activation_bytes / pcie - compute_s)

    communication_s = 0.0
    link = None
    strategy = spec.gpus.strategy
    if gpu_count > 1 and strategy != "ddp" and spec.gpus.offload == "none":
        optimizer_s /= gpu_count  # each GPU steps its shard (offloaded, the shards share the host: not divided)
    if gpu_count > 1:
        link = collective_link(gpu, gpu_count, constants, internode_gb_per_s)
        layer_bytes = stored_layer_bytes(spec, _depth(pair, lambda p: p.facts.layer_bytes),
                                         _depth(pair, lambda p: p.facts.quantizable_numel), pair.layers,
                                         pair.deeper.facts.param_dtype_bytes)
        reduced = trainable * param_bytes
        bucket, overlap = float(DDP_BUCKET_BYTES), True
        if strategy in DEEPSPEED_STRATEGIES:  # DeepSpeed's 16-bit model: its gradients and weights move in 16 bits
            settings = deepspeed_buffers(spec, hidden_size)
            half = sixteen_bit_bytes(spec)
            reduced = trainable * half
            layer_bytes = layer_bytes * half / pair.deeper.facts.param_dtype_bytes
            bucket, overlap = float(settings.reduce_bucket * half), settings.overlap_comm
        communication_s = exposed_communication(
            strategy, link, gpu_count=gpu_count, layers=pair.layers, layer_param_bytes=layer_bytes,
            trainable_bytes=reduced, compute_s=compute_s, grad_accum=grad_accum, checkpointing=grad_checkpointing,
            bucket_bytes=bucket, overlap=overlap)
    return StepTime(compute_s, dequantize_s, dispatch_s, optimizer_s, communication_s, offload_s,
                    tokens * grad_accum, link)


def _optimizer_seconds(spec: RunSpec, pair: ProfilePair, rates: _Rates, work: dict[str, float], trainable: float,
                       param_bytes: int) -> float:
    """The optimizer step: torch's AdamW as the probe timed it where it did; a traced optimizer's bytes read and
    written at the bandwidth; bitsandbytes' from the sizes of their states (parameter, gradient and states read,
    parameter and states written). Stepped in the backward pass, a traced optimizer's work is already part of
    the backward pass's bytes."""
    tensors = _depth(pair, lambda p: p.facts.trainable_tensors)
    measured = _measured_adamw_seconds(rates, spec.optimizer, trainable, tensors)
    if measured is not None:
        return measured
    if spec.optimizer in TRACED_OPTIMIZERS:
        return 0.0 if spec.optimizer_in_backward else work["optimizer_bytes"] / rates.bandwidth
    fp32_states = (spec.method != "full" and spec.lora.fp32_adapters) or spec.precision in (
        "bf16-mixed", "fp16-mixed", "fp32")
    state_bytes = 4 if fp32_states else param_bytes
    per_value = {"adamw-8bit": 0.5, "paged-adamw": 2, "paged-adamw-8bit": 0.5}[spec.optimizer]
    return trainable * (3 * param_bytes + 2 * per_value * state_bytes) / rates.bandwidth


def _measured_adamw_seconds(rates: _Rates, optimizer: str, trainable: float, tensors: float) -> float | None:
    """torch's AdamW where the probe timed it (`fused` for `adamw`, `foreach` for `adamw-foreach`): per parameter
    over large tensors, plus a fixed cost per tensor (what dominates LoRA's many small adapters)."""
    figures = rates.figures
    variant = {"adamw": "fused", "adamw-foreach": "foreach"}.get(optimizer)
    if figures is None or variant is None:
        return None
    per_param = figures.value("optimizer", variant)
    per_tensor = figures.value("optimizer_tensor", variant)
    if per_param is None or per_tensor is None:
        return None
    return trainable * per_param * 1e-9 + tensors * per_tensor * 1e-6
