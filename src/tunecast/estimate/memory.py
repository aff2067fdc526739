"""Peak memory of one training step: traced where a trace can see, modelled where it cannot.

Traced (exact for the traced code path): weights, trainable weights, gradients, optimizer states of
AdamW / SGD / Adafactor, activations, temporaries (logits and loss, attention, LoRA casts), gradient
checkpointing, chunked loss, optimizer-in-backward, DoRA and `modules_to_save`, the caching allocator's
rounding and reserve (simulated from the traced allocation order, on a ladder of shapes so that reserved
never falls as micro-batch or length grow — see `_ladder_reserved`).

Modelled, each a named formula below with its source: NF4 weights and their quantization constants
(QLoRA), an 8-bit base's int8 weights, row scales and temporaries (int8.py), 8-bit and paged optimizer states,
activation offload, DDP gradient buckets, FSDP / ZeRO sharding and gather buffers, CPU offload, the CUDA context and
cuBLAS workspaces.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from fractions import Fraction
from math import floor
from typing import Any

from tunecast.catalog.gpus import Gpu
from tunecast.catalog.overheads import Overhead, overhead_bytes
from tunecast.config.spec import DEEPSPEED_STRATEGIES, RunSpec
from tunecast.estimate import replays
from tunecast.estimate.deepspeed import ModelSizes, apply_deepspeed, fp32_widening, model_sizes
from tunecast.estimate.memo import config_digest
from tunecast.estimate.profile import Replay
from tunecast.estimate.profiles import ProfilePair, TracingUnavailable, get_profiles
from tunecast.estimate.tracer import CATEGORIES
from tunecast.step.settings import TRACED_OPTIMIZERS, TraceSettings, sixteen_bit_weights
from tunecast.step.shape import has_experts, sliding_window, sliding_window_offset
from tunecast.units import BYTES_PER_GIB, format_params

PHASES = ("forward", "backward", "optimizer")
BREAKDOWN = (*CATEGORIES, "quantization", "overhead")

# QLoRA (Dettmers et al. 2023, arXiv:2305.14314, section 3; bitsandbytes Linear4bit): NF4 packs two
# weights per byte; one absmax constant per block of 64 weights, fp32 (4 bytes), or with double
# quantization 8-bit (1 byte) plus one fp32 constant per 256 first-level blocks.
NF4_BYTES_PER_WEIGHT = 0.5
NF4_BLOCK = 64
DOUBLE_QUANT_BLOCK = 256

# bitsandbytes 8-bit optimizers (bitsandbytes/optim/optimizer.py, Optimizer2State.init_state): two uint8
# states with one fp32 absmax per block of 256; tensors under 4096 elements keep fp32 states. Paged
# states (tensors of at least 1e5 elements) live in CUDA managed memory, outside the caching allocator.
OPTIMIZER_8BIT_BLOCK = 256

# Activation offload keeps the layer being computed and the one being copied on the device (torchtune's
# OffloadActivations overlaps copies on a second stream).
OFFLOAD_RESIDENT_LAYERS = 2

# The caching allocator's reserve is simulated at ladder shapes (`_ladder_reserved`): micro-batches that are
# powers of two; lengths of one token, then RESERVE_MIN_SEQ, 1.5 times it, and their doublings (512, 768,
# 1024, 1536, …), and the sliding window (where the masks change).
RESERVE_MIN_SEQ = 512

# A backward-phase peak whose activations are at most this share of it is taken to come at the end of the backward
# pass (what is left are a few small tensors: token ids, masks), which decides what FSDP2 holds gathered there.
ENDED_ACTIVATIONS = 0.01


@dataclass
class PhaseMemory:
    """Bytes live at the peak of one phase, by category."""

    breakdown: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BREAKDOWN, 0.0))

    @property
    def total(self) -> float:
        return sum(self.breakdown.values())


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU peak memory of a training step. All figures in GiB."""

    device: str
    peak_allocated_gib: float
    peak_reserved_gib: float
    device_total_gib: float
    least_reserved_gib: float
    """What the process must hold at least: the allocator, out of memory, releases the cached segments no live block
    holds and retries, so a device with `least_device_total_gib` runs the step at the edge (allocator.py)."""
    least_device_total_gib: float
    peak_phase: str
    host_ram_gib: float
    managed_gib: float
    breakdown_gib: dict[str, float]
    phases_gib: dict[str, float]
    micro_batch: int
    seq_len: int
    notes: tuple[str, ...]
    composed: bool = False  # the step's loss traced alone and composed onto its template (estimate/compose.py)

    def on_device(self, capacity_gib: float) -> tuple[float, float]:
        """(reserved, device total) on a device of `capacity_gib`: the figures above where they fit in it; at the
        edge, the cache grows until cudaMalloc fails at the device's memory and is released there, so neither
        counter passes the device (`torch.cuda.max_memory_reserved` stops at it, less the context). A step that does
        not fit even at the edge asks for the figures above and fails."""
        if self.device_total_gib <= capacity_gib or self.least_device_total_gib > capacity_gib:
            return self.peak_reserved_gib, self.device_total_gib
        context = self.device_total_gib - self.peak_reserved_gib
        return capacity_gib - context, capacity_gib

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "peak_allocated_gib": round(self.peak_allocated_gib, 3),
            "peak_reserved_gib": round(self.peak_reserved_gib, 3),
            "device_total_gib": round(self.device_total_gib, 3),
            "least_reserved_gib": round(self.least_reserved_gib, 3),
            "least_device_total_gib": round(self.least_device_total_gib, 3),
            "peak_phase": self.peak_phase,
            "host_ram_gib": round(self.host_ram_gib, 3),
            "managed_gib": round(self.managed_gib, 3),
            "breakdown_gib": {k: round(v, 3) for k, v in self.breakdown_gib.items()},
            "phases_gib": {k: round(v, 3) for k, v in self.phases_gib.items()},
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Facts:
    """ModelFacts extrapolated to the full depth."""

    quantizable_numel: float
    largest_quantizable_numel: int
    trainable_numel: float
    trainable_small_numel: float
    layer_bytes: int
    layer_numel: int
    layer_linears: tuple[tuple[int, int, bool], ...] = ()  # (in, out, weight trains) of one decoder layer


def _extrapolate(a: float, b: float, depth_a: int, depth_b: int, depth: int) -> float:
    """Linear in depth: every decoder layer holds the same memory (for the same layer pattern)."""
    if depth_a == depth_b:
        return b
    return a + (b - a) * (depth - depth_a) / (depth_b - depth_a)


def _facts(pair: ProfilePair) -> Facts:
    a, b = pair.shallow.facts, pair.deeper.facts
    da, db, depth = pair.shallow.layers, pair.deeper.layers, pair.layers

    def grow(name: str) -> float:
        return _extrapolate(getattr(a, name), getattr(b, name), da, db, depth)

    return Facts(grow("quantizable_numel"), b.largest_quantizable_numel, grow("trainable_numel"),
                 grow("trainable_small_numel"), b.layer_bytes, b.layer_numel, b.layer_linears)


@dataclass
class StepMemory:
    phases: dict[str, PhaseMemory]
    reserve_bytes: float  # caching-allocator reserve above the allocated peak
    pinned_bytes: float | None = None  # of it, what segments holding a live block keep (None: not simulated)
    host_bytes: float = 0.0
    managed_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)


def _reserve_of(replayed: Replay) -> int:
    """Bytes the allocator holds above the step's peak allocated; never negative (reserved holds allocated)."""
    top = max(p.allocated for p in replayed.phases.values()) + replayed.extra_allocated
    return max(0, replayed.peak_reserved - top)


def _depth_reserve(pair: ProfilePair, shallow: Replay, deeper: Replay) -> Fraction:
    """The reserve at the full depth. Linear in depth while it grows from the shallow copy to the deeper one
    (full fine-tuning: optimizer states of the first step land in blocks activations used); where it falls,
    the deeper copy's. A falling reserve is the shallow copy's fragmentation, not memory that layers give
    back: extrapolated, it would go below zero (reserved under allocated) on deep models."""
    a, b = _reserve_of(shallow), _reserve_of(deeper)
    depth_a, depth_b = pair.shallow.layers, pair.deeper.layers
    if depth_a == depth_b or b <= a:
        return Fraction(b)
    return b + Fraction(b - a) * (pair.layers - depth_b) / (depth_b - depth_a)


def _copies(pair: ProfilePair, batch: int, seq: int, *, cuda: bool, blocks: tuple[int, ...]) -> tuple[Replay, Replay]:
    """The replays of the pair's shallow and deeper copies at (batch, seq) (one, where the pair has one copy)."""
    shallow = replays.replayed(pair, "shallow", batch, seq, cuda=cuda, blocks=blocks)
    deeper = shallow if pair.deeper is pair.shallow else replays.replayed(pair, "deeper", batch, seq, cuda=cuda,
                                                                          blocks=blocks)
    return shallow, deeper


def _replayed(pair: ProfilePair, batch: int, seq: int, *, cuda: bool, workspace: int) -> StepMemory:
    """Replay both depths and extrapolate every figure to the full depth. The reserve is the one simulated at this
    shape (`estimate_memory` takes the ladder's instead where the profiles sweep shapes), and what the segments
    holding a live block keep beyond the peak."""
    blocks = (workspace,) if cuda and workspace else ()
    shallow, deeper = _copies(pair, batch, seq, cuda=cuda, blocks=blocks)

    def at_depth(pick: Any) -> float:
        return _extrapolate(pick(shallow), pick(deeper), pair.shallow.layers, pair.deeper.layers, pair.layers)

    phases: dict[str, PhaseMemory] = {}
    for phase in PHASES:
        memory = PhaseMemory()
        for category in CATEGORIES:
            memory.breakdown[category] = max(0.0, at_depth(lambda r, c=category, p=phase: r.phases[p].breakdown[c]))
        memory.breakdown["overhead"] = float(shallow.extra_allocated)
        phases[phase] = memory
    if not cuda:
        return StepMemory(phases, 0.0)
    pinned = float(_pinned_beyond_peak(shallow, deeper))
    if pair.stand_in is None:
        return StepMemory(phases, float(_depth_reserve(pair, shallow, deeper)), pinned)
    rest = _copies(pair.stand_in, batch, seq, cuda=cuda, blocks=blocks)
    return StepMemory(phases, float(_composed_reserve(pair, shallow, deeper, *rest)), pinned)


def _pinned_beyond_peak(shallow: Replay, deeper: Replay) -> int:
    """What the segments holding a live block keep beyond the step's allocated peak, at the full depth: the larger
    of the two copies' (allocator.py `peak_pinned`). The free space inside segments still in use is what the
    allocator cannot give back when it runs out and releases its cache; it is taken as it is in the copies, not grown
    with depth as the whole reserve may be, so that what a run needs at least is not overstated."""

    def beyond(replayed: Replay) -> int:
        top = max(p.allocated for p in replayed.phases.values()) + replayed.extra_allocated
        return max(0, replayed.peak_pinned - top)

    return max(beyond(shallow), beyond(deeper))


def _composed_reserve(pair: ProfilePair, shallow: Replay, deeper: Replay, rest_shallow: Replay,
                      rest_deeper: Replay) -> Fraction:
    """The reserve at the full depth of a step whose loss is composed onto its template: the larger of the two
    copies' reserves, grown with depth as the rest of the step's (the template with the loss's stand-in) grows.

    A composed loss allocates its chunks once, above the layers: where their blocks land in the segments the layers
    left differs from one copy to the other, so one copy or the other holds several GiB more, by shape (unsloth's
    QLoRA of Gemma 2 9B at micro-batch 109 and 111: 10.5 and 4.5 GiB, then 3.7 and 10.7). Extrapolated in depth
    as a per-layer growth, that swing became tens of GiB (131 GiB at 111 against 65 at 109). The larger of the two
    copies holds the loss's own fragmentation whichever copy shows it; what grows with depth is the rest of the
    step's (full fine-tuning's optimizer states landing in blocks activations used), measured without the loss."""
    grown = _depth_reserve(pair, rest_shallow, rest_deeper) - _reserve_of(rest_deeper)
    return max(_reserve_of(shallow), _reserve_of(deeper)) + max(Fraction(0), grown)


def _rungs(n: int, ladder: Iterator[int], extra: int | None = None) -> list[int]:
    """The values of an increasing `ladder` (and `extra` among them) up to the first at or above n."""
    rungs = [next(ladder)]
    while rungs[-1] < n:
        rungs.append(next(ladder))
    if extra is not None and extra not in rungs:
        rungs = sorted([*rungs, extra])
        rungs = rungs[:next(i for i, rung in enumerate(rungs) if rung >= n) + 1]
    return rungs


def _batch_ladder() -> Iterator[int]:
    return (1 << k for k in itertools.count())


def seq_ladder() -> Iterator[int]:
    yield 1
    for k in itertools.count():
        yield RESERVE_MIN_SEQ << k
        yield RESERVE_MIN_SEQ * 3 // 2 << k


def _seq_rungs(seq: int, window: int | None) -> list[int]:
    """The length ladder, with the longest length below a sliding window among its rungs."""
    return _rungs(seq, seq_ladder(), None if window is None else window - 1)


# Reserved (plus allocated) simulated at a ladder shape, by profiles, spec, shape and workspace: every estimate of a
# plan (each micro-batch, each GPU count) climbs the same ladder, and a server's next plan of the model again.
SIMULATED_KEPT = 65_536
_SIMULATED: dict[tuple[Any, ...], tuple[ProfilePair, Fraction]] = {}
_RAISED: dict[tuple[Any, ...], tuple[ProfilePair, list[list[Fraction]]]] = {}  # ladders, by what they were made of


def _ladder_reserved(config_data: dict[str, Any], settings: TraceSettings, spec: RunSpec, pair: ProfilePair,
                     batch: int, seq: int, workspace: int, trace: bool = True) -> int:
    """Bytes reserved at (batch, seq), made monotone in micro-batch and length.

    The simulated reserve is not: a larger tensor can land in a free block a smaller one could not use, so a
    larger shape may reserve less (on a GPU too), and a deep model's extrapolated reserve carries the shallow
    copies' fragmentation. A run, though, meets shorter batches than its longest, and the allocator keeps every
    segment it obtained. So reserved is simulated at ladder shapes (see RESERVE_MIN_SEQ), each raised to the
    largest reserved of the ladder shapes below it, and interpolated linearly in micro-batch and length between
    the ladder shapes around (batch, seq); the caller takes the larger of this and allocated. At a ladder shape
    whose reserved already grew, it is the simulated one. Ladder shapes of other profiles (micro-batch 1, the
    far side of a sliding window) are replayed from theirs. Exact arithmetic, rounded down once."""
    window = sliding_window(config_data)
    sizes = model_sizes(config_data, spec)
    batches = _rungs(batch, _batch_ladder())
    seqs = _seq_rungs(seq, window)
    own = (batch == 1, sliding_window_offset(config_data, seq))
    pairs: dict[tuple[bool, int], ProfilePair | None] = {own: pair}

    def serving(b: int, s: int) -> ProfilePair | None:
        regime = (b == 1, sliding_window_offset(config_data, s))
        if regime not in pairs:
            # The other profile, fetched at its regime's smallest ladder shape (so that a regime whose shapes
            # trace differently is traced at one shape, once). Left out if it holds that one shape only.
            first_seq = next(x for x in _seq_rungs(s, window) if sliding_window_offset(config_data, x) == regime[1])
            try:
                other: ProfilePair | None = get_profiles(config_data, settings, 1 if regime[0] else 2, first_seq,
                                                         trace=trace)
            except TracingUnavailable:
                other = None
            pairs[regime] = other if other is not None and other.exact_shape is None else None
        return pairs[regime]

    # the modelled terms read the spec (not its shape, given here, nor the GPU's name: its workspace is given)
    settings_key = spec.model_dump_json(exclude={"seq_len": True, "micro_batch": True, "gpus": {"gpu"}})

    def simulated(b: int, s: int) -> Fraction:
        serves = serving(b, s)
        if serves is None:
            return Fraction(0)
        key = (id(serves), settings_key, b, s, workspace)
        kept = _SIMULATED.get(key)
        if kept is not None and kept[0] is serves:  # the entry holds its profiles, so the id is not reused
            return kept[1]
        step = _traced_step(serves, spec, b, s, cuda=True, workspace=workspace,
                            checkpointing=settings.grad_checkpointing, sizes=sizes)
        value = Fraction(_peak(step)[1]) + Fraction(step.reserve_bytes)
        if len(_SIMULATED) >= SIMULATED_KEPT:
            _SIMULATED.clear()
        _SIMULATED[key] = (serves, value)
        return value

    # raised[i][j]: the largest simulated reserved over the ladder shapes at or below (batches[i], seqs[j]); the same
    # for every shape between the same rungs (kept: a plan asks for many, a server for more)
    ladder = (id(pair), config_digest(config_data), settings, settings_key, workspace, tuple(batches), tuple(seqs),
              trace)
    kept_ladder = _RAISED.get(ladder)
    if kept_ladder is not None and kept_ladder[0] is pair:
        raised = kept_ladder[1]
    else:
        raised = []
        for i, b in enumerate(batches):
            row: list[Fraction] = []
            for j, s in enumerate(seqs):
                below = [raised[i - 1][j]] if i else []
                below += [row[j - 1]] if j else []
                row.append(max([simulated(b, s), *below]))
            raised.append(row)
        if len(_RAISED) >= SIMULATED_KEPT:
            _RAISED.clear()
        _RAISED[ladder] = (pair, raised)

    def between(rungs: list[int], n: int) -> tuple[int, int, Fraction]:
        """Indices of the rungs around n, and n's position between them (0 at the lower, 1 at the upper).
        The rungs end at the first at or above n, so the one before it is below n."""
        high = len(rungs) - 1
        if high == 0 or rungs[high] == n:
            return high, high, Fraction(0)
        return high - 1, high, Fraction(n - rungs[high - 1], rungs[high] - rungs[high - 1])

    i0, i1, u = between(batches, batch)
    j0, j1, v = between(seqs, seq)
    interpolated = ((1 - u) * (1 - v) * raised[i0][j0] + u * (1 - v) * raised[i1][j0]
                    + (1 - u) * v * raised[i0][j1] + u * v * raised[i1][j1])
    return floor(interpolated)


def _apply_qlora(step: StepMemory, facts: Facts, param_bytes: int, double_quant: bool) -> None:
    """Frozen decoder Linear weights become NF4 (bitsandbytes keeps the output head and embeddings in
    the compute dtype, and every weight that is not an nn.Linear: a mixture of experts' fused experts, see
    `unquantized_experts_note`); each quantized matmul dequantizes its weight into a temporary."""
    quantized = facts.quantizable_numel
    constants = quantized / NF4_BLOCK * (1 if double_quant else 4)
    if double_quant:
        constants += quantized / NF4_BLOCK / DOUBLE_QUANT_BLOCK * 4
    for phase, memory in step.phases.items():
        memory.breakdown["weights"] -= quantized * (param_bytes - NF4_BYTES_PER_WEIGHT)
        memory.breakdown["quantization"] += constants
        if phase in ("forward", "backward"):
            memory.breakdown["temporaries"] += facts.largest_quantizable_numel * param_bytes
    step.notes.append("QLoRA: NF4 Linear weights with " + ("double quantization" if double_quant else "fp32 constants")
                      + " modelled on the traced LoRA step (bitsandbytes Linear4bit)")


def _apply_int8(step: StepMemory, facts: Facts, param_bytes: int, *, tokens: int, cuda: bool,
                checkpointing: bool) -> None:
    """An 8-bit base in place of NF4: int8 weights, their row scales, one layer's temporaries (int8.py)."""
    from tunecast.estimate.int8 import int8_note, int8_terms

    terms = int8_terms(facts.quantizable_numel, facts.layer_linears, tokens=tokens, param_bytes=param_bytes,
                       cuda=cuda, checkpointing=checkpointing)
    for phase, memory in step.phases.items():
        memory.breakdown["weights"] -= terms.weights_saved_bytes
        memory.breakdown["quantization"] += terms.scale_bytes
        memory.breakdown["temporaries"] += {"forward": terms.forward_bytes,
                                            "backward": terms.backward_bytes}.get(phase, 0.0)
    step.notes.append(int8_note(cuda))


def unquantized_experts_note(spec: RunSpec, config_data: dict[str, Any]) -> str | None:
    """What QLoRA leaves unquantized in a mixture-of-experts model, in words; None for a dense model or another
    method. transformers 5 keeps the experts as fused 3-D parameters and the router as a plain one, and bitsandbytes'
    4-bit conversion replaces nn.Linear modules only, so they stay in the compute dtype (estimate/moe.py
    `unquantized_numel`; docs/memory.md). The trace counts them so already (it models NF4 on nn.Linear weights only,
    `quantizable_numel`): this says it, for the weights that make most of such a model."""
    from tunecast.estimate.moe import unquantized_numel
    from tunecast.step.variants import experts_were_linear, runner_step

    kept = unquantized_numel(config_data) if spec.method == "qlora" else 0
    if not kept:
        return None
    if experts_were_linear(config_data, spec):
        return (f"transformers {spec.transformers_version} (transformers_version) built the experts and the router "
                f"as nn.Linear modules, one MLP per expert, so QLoRA quantizes their {format_params(kept)} weights "
                "like the other Linears (transformers 5 fuses them into 3-D parameters, which it leaves unquantized)")
    cast = "kbit-fp32" in runner_step(spec, "cuda")
    size = 4 if cast else _param_bytes(spec)
    quantized = "int8" if spec.quantization.bits == 8 else "NF4"
    why = "; peft's prepare_model_for_kbit_training then casts them to fp32" if cast else ""
    return (f"QLoRA leaves the experts in {'bf16' if size == 2 else 'fp32'}, not {quantized}: {format_params(kept)} "
            f"expert and router weights, {kept * size / BYTES_PER_GIB:.2f} GiB of the frozen weights (bitsandbytes "
            f"quantizes nn.Linear layers only; transformers keeps the experts as fused 3-D parameters{why})")


def expert_dropout_note(spec: RunSpec, config_data: dict[str, Any]) -> str | None:
    """Where LoRA dropout is not applied on a mixture of experts (step/setup.py `apply_adapters`), in words."""
    if spec.method == "full" or not spec.lora.dropout or not has_experts(config_data):
        return None
    return (f"lora.dropout {spec.lora.dropout:g} applies to the adapters of Linear layers only: peft adapts the "
            "experts' fused 3-D weights as parameters, which take no dropout (peft's ParamWrapper)")


def _optimizer_state_bytes(spec: RunSpec, facts: Facts, traced_state_bytes: float) -> tuple[float, float]:
    """(device bytes, managed bytes) of optimizer states for bitsandbytes optimizers; torch ones as traced."""
    return optimizer_state_bytes(spec.optimizer, facts.trainable_numel, facts.trainable_small_numel,
                                 traced_state_bytes)


def optimizer_state_bytes(optimizer: str, trainable_numel: float, small_numel: float,
                          traced_state_bytes: float) -> tuple[float, float]:
    """(device bytes, managed bytes) of the states of `optimizer` over `trainable_numel` elements, of which
    `small_numel` in tensors under 4,096 elements (bitsandbytes keeps those in fp32): bitsandbytes' modelled, torch's
    as traced."""
    large = trainable_numel - small_numel
    small = small_numel
    if optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        large_bytes = 2 * large + 2 * 4 * large / OPTIMIZER_8BIT_BLOCK
    elif optimizer == "paged-adamw":
        large_bytes = 2 * 4 * large  # bitsandbytes 32-bit optimizer states are fp32
    else:
        return traced_state_bytes, 0.0
    small_bytes = 2 * 4 * small
    if optimizer.startswith("paged"):
        return small_bytes, large_bytes
    return large_bytes + small_bytes, 0.0


def _apply_optimizer(step: StepMemory, spec: RunSpec, facts: Facts) -> None:
    traced = max(memory.breakdown["optimizer"] for memory in step.phases.values())
    device, managed = _optimizer_state_bytes(spec, facts, traced)
    if device == traced and not managed:
        return
    for memory in step.phases.values():
        if memory.breakdown["optimizer"]:
            memory.breakdown["optimizer"] = device
    step.managed_bytes += managed
    step.notes.append(f"{spec.optimizer}: bitsandbytes states modelled (8-bit: 1 byte per state and an fp32 "
                      "constant per 256 values; paged: in CUDA managed memory, not counted by the allocator)")


def _apply_activation_offload(step: StepMemory, layers: int) -> None:
    moved = max(memory.breakdown["activations"] for memory in step.phases.values())
    keep = moved / max(layers, 1) * OFFLOAD_RESIDENT_LAYERS
    for memory in step.phases.values():
        if memory.breakdown["activations"] > keep:
            memory.breakdown["activations"] = keep
    step.host_bytes += moved
    step.notes.append("activation offload: saved activations kept in CPU RAM, two layers' worth on the GPU")


def stored_layer_bytes(spec: RunSpec, layer_bytes: float, quantizable_numel: float, layers: int,
                       param_bytes: int) -> float:
    """Bytes of one decoder layer's weights as stored, which is what FSDP and ZeRO-3 gather: QLoRA's quantized Linear
    weights (`quantizable_numel` of the model's) in 4 or 8 bits (their constants are few), the rest as traced."""
    if spec.method != "qlora":
        return float(layer_bytes)
    stored = NF4_BYTES_PER_WEIGHT if spec.quantization.bits == 4 else 1
    return layer_bytes - quantizable_numel / max(layers, 1) * (param_bytes - stored)


def _apply_strategy(step: StepMemory, spec: RunSpec, facts: Facts, param_bytes: int, layers: int,
                    layer_bytes: float) -> None:
    """Per-GPU memory for the multi-GPU strategy and CPU offload.

    FSDP2 as tunecast wraps it (train/distributed.py): every decoder layer a unit, the rest of the model
    (embeddings, final norm, output head) the root unit. Each rank keeps its shard of every parameter; a unit's
    parameters gathered for computing are a full copy beside the shards. The root is gathered for the whole
    forward and backward pass (FSDP2 does not reshard the root after the forward pass); a layer for its own
    passes, with the next one prefetched. fsdp-grad-op keeps every gathered layer until the backward pass is done.
    DeepSpeed's stages: deepspeed.py."""
    gpus = spec.gpus
    count = gpus.count
    grad_bytes = 4 if spec.method != "full" else param_bytes
    if gpus.strategy == "ddp":
        if count > 1:
            # torch DDP allocates communication buckets holding a copy of every gradient
            # (gradient_as_bucket_view=False, the default).
            buckets = facts.trainable_numel * grad_bytes
            for memory in step.phases.values():
                memory.breakdown["gradients"] += buckets
            step.notes.append("DDP: gradient buckets (a second copy of the gradients) on every GPU")
        return
    shard_weights = gpus.strategy == "fsdp"
    # accelerate's FSDP under mixed precision (settings.py sixteen_bit_weights): the step was traced on 16-bit weights,
    # which are what it gathers; the shards keep fp32 weights, gradients and optimizer states
    frozen_widen = trained_widen = 1.0
    if count > 1 and sixteen_bit_weights(spec):
        frozen_widen = 4 / param_bytes
        trained_widen = fp32_widening(step, facts.trainable_numel)
    states_widen = trained_widen if spec.optimizer in TRACED_OPTIMIZERS else 1.0
    for phase, memory in step.phases.items():
        b = memory.breakdown
        whole = b["trainable_weights"] if spec.method == "full" else b["weights"]
        root = max(0.0, whole - layers * layer_bytes)
        # A backward peak with (next to) no activation left comes at the end of the backward pass (checkpointed or
        # full fine-tuning runs, whose gradients pile up): every layer is resharded by then, only the root gathered.
        ended = phase == "backward" and b["activations"] <= ENDED_ACTIVATIONS * sum(b.values())
        traced_gradients = b["gradients"]
        if count > 1:
            gathered = root if ended else (whole if not shard_weights else root + 2 * layer_bytes)
            b["weights"] *= frozen_widen / count
            b["trainable_weights"] *= trained_widen / count
            b["quantization"] /= count
            if phase != "optimizer":
                b["temporaries"] += gathered
        b["gradients"] *= trained_widen / count
        b["optimizer"] *= states_widen / count
        if phase != "backward" or count == 1:
            continue
        if not ended:
            # A layer's gradients before their reduce-scatter: all its weights' in full fine-tuning, its adapters'
            # otherwise (the adapters of one layer: the trainable elements spread over the layers).
            layer_trainable = facts.layer_numel if spec.method == "full" else facts.trainable_numel / max(layers, 1)
            b["temporaries"] += layer_trainable * grad_bytes
        if spec.method == "full":
            # The root unit's gradients stay whole until the backward pass ends: its inputs (token ids) need no
            # gradient, so FSDP2 reduce-scatters them in its final callback (torch/distributed/fsdp/_fully_shard/
            # _fsdp_state.py, _root_post_backward_final_callback). The output head's gradient is the first one the
            # backward pass makes, so of the gradients live at the traced peak, up to the root's size are the root's;
            # none are when the peak comes before any gradient exists (without checkpointing, usually at the start
            # of the backward pass).
            b["temporaries"] += min(traced_gradients, root) * (1 - 1 / count)
    offloaded = 0.0
    if gpus.offload in ("optimizer", "params"):
        offloaded += max(memory.breakdown["optimizer"] for memory in step.phases.values())
        for memory in step.phases.values():
            memory.breakdown["optimizer"] = 0.0
    if gpus.offload == "params":
        offloaded += max(m.breakdown["weights"] + m.breakdown["trainable_weights"] + m.breakdown["gradients"]
                         for m in step.phases.values())
        for memory in step.phases.values():
            for category in ("weights", "trainable_weights", "gradients"):
                memory.breakdown[category] = 0.0
    step.host_bytes += offloaded
    label = {"fsdp": "FSDP2 full shard",
             "fsdp-grad-op": "FSDP2 without resharding after the forward pass (SHARD_GRAD_OP)"}[gpus.strategy]
    kept = "every layer" if gpus.strategy == "fsdp-grad-op" else "the embeddings and head, and two layers,"
    mixed = " (mixed precision as accelerate runs it: fp32 shards, gathered in 16 bits)" if frozen_widen != 1 else ""
    step.notes.append(f"{label} over {count} GPU(s){mixed}: shards modelled, plus {kept} gathered for the passes")


def _experts_as_linears(facts: Facts, sizes: ModelSizes) -> Facts:
    """The experts and router as the transformers the runner ran built them, nn.Linear modules (ModelSizes'
    `linear_experts`), counted with the Linear weights QLoRA quantizes. The trace holds them as today's fused 3-D
    parameters, in the compute dtype (peft's fp32 cast leaves them: the `linear-experts` variant)."""
    return replace(facts, quantizable_numel=facts.quantizable_numel + sizes.linear_experts,
                   largest_quantizable_numel=max(facts.largest_quantizable_numel, sizes.largest_linear_expert))


def _modelled_terms(step: StepMemory, spec: RunSpec, facts: Facts, param_bytes: int, layers: int, *, tokens: int,
                    cuda: bool, checkpointing: bool, sizes: ModelSizes) -> None:
    """What the trace cannot see, applied to the traced (or closed-form) step of `tokens` tokens a micro-batch
    (`sizes`: the model's hidden size and vocabulary, which size DeepSpeed's buffers)."""
    if spec.method == "qlora" and sizes.linear_experts:
        facts = _experts_as_linears(facts, sizes)
    if spec.method == "qlora" and spec.quantization.bits == 8:
        _apply_int8(step, facts, param_bytes, tokens=tokens, cuda=cuda, checkpointing=checkpointing)
    elif spec.method == "qlora":
        _apply_qlora(step, facts, param_bytes, double_quant=spec.lora.double_quant)
    _apply_optimizer(step, spec, facts)
    if spec.activation_offload:
        _apply_activation_offload(step, layers)
    layer_bytes = stored_layer_bytes(spec, facts.layer_bytes, facts.quantizable_numel, layers, param_bytes)
    if spec.gpus.strategy in DEEPSPEED_STRATEGIES:
        apply_deepspeed(step, spec, facts, layers, sizes, layer_bytes)
    else:
        _apply_strategy(step, spec, facts, param_bytes=param_bytes, layers=layers, layer_bytes=layer_bytes)


def _traced_step(pair: ProfilePair, spec: RunSpec, batch: int, seq: int, *, cuda: bool,
                 workspace: int, checkpointing: bool, sizes: ModelSizes) -> StepMemory:
    step = _replayed(pair, batch, seq, cuda=cuda, workspace=workspace)
    _modelled_terms(step, spec, _facts(pair), pair.deeper.facts.param_dtype_bytes, pair.layers, tokens=batch * seq,
                    cuda=cuda, checkpointing=checkpointing, sizes=sizes)
    return step


def _peak(step: StepMemory) -> tuple[str, float]:
    """The phase with the most allocated, and its bytes."""
    phase = max(PHASES, key=lambda p: step.phases[p].total)
    return phase, step.phases[phase].total


def _analytic_step(spec: RunSpec, settings: TraceSettings, config_data: dict[str, Any], batch: int, seq: int,
                   reason: str, workspace: int) -> tuple[StepMemory, Facts, int, int]:
    """The closed-form estimate, when the trace cannot run (see analytic.py for what it covers)."""
    from tunecast.errors import TunecastError
    from tunecast.estimate.analytic import Shape, analytic_peak_bytes, supports

    unsupported = supports(config_data, spec)
    if unsupported is not None:
        raise TunecastError(f"cannot trace here ({reason}) and the closed-form estimate does not cover "
                            f"{unsupported}", field="model", hint="install torch >= 2.6, which has the tracer's API")
    shape = Shape.from_config(config_data)
    peak = analytic_peak_bytes(config_data, spec, batch, seq)
    phases = {}
    for phase in PHASES:
        memory = PhaseMemory()
        memory.breakdown.update(peak)
        memory.breakdown["overhead"] = float(workspace)
        if phase == "optimizer":
            memory.breakdown["activations"] = memory.breakdown["temporaries"] = 0.0
            memory.breakdown["gradients"] = memory.breakdown["trainable_weights"]
        phases[phase] = memory
    trainable = peak["trainable_weights"] / (4 if spec.method != "full" else _param_bytes(spec))
    linears = sum(a * b for a, b in shape.linear_shapes().values())
    facts = Facts(quantizable_numel=float(shape.layers * linears),
                  largest_quantizable_numel=max(a * b for a, b in shape.linear_shapes().values()),
                  trainable_numel=trainable, trainable_small_numel=0.0,
                  layer_bytes=shape.layer_params(config_data) * _param_bytes(spec),
                  layer_numel=shape.layer_params(config_data),
                  layer_linears=tuple((a, b, False) for a, b in shape.linear_shapes().values()))
    step = StepMemory(phases, 0.0, notes=[f"closed-form estimate: {reason}; allocator reserve not simulated"])
    return step, facts, _param_bytes(spec), shape.layers


def _param_bytes(spec: RunSpec) -> int:
    return 2 if spec.precision in ("bf16", "fp8") else 4


def estimate_memory(spec: RunSpec, config_data: dict[str, Any], *, device: str, gpu: Gpu | None,
                    overheads: tuple[Overhead, ...], grad_checkpointing: bool | None = None,
                    micro_batch: int | None = None, seq_len: int | None = None,
                    pair: ProfilePair | None = None, exact_shape: bool = False, trace: bool = True,
                    stand_in: bool = False) -> MemoryEstimate:
    """Per-GPU memory of a training step of `spec` on `device` ("cuda" or "cpu"). `exact_shape` traces
    only this micro-batch and length when nothing is cached (cheaper; no sweeps from it). Without `trace`,
    settings that neither a template nor the cache serves raise NeedsTrace (profiles.py). With `stand_in`, a step
    whose loss is composed (compose.py) is taken with the loss's stand-in instead: the rest of the step, from its
    template's polynomials, without the loss's own tensors (fit.py solves limits with it)."""
    settings = TraceSettings.from_spec(spec, grad_checkpointing=grad_checkpointing, device=device,
                                       config_data=config_data)
    if stand_in:
        from tunecast.estimate.compose import composable, stub_settings

        if composable(settings):
            settings = stub_settings(settings)
    batch = micro_batch if micro_batch is not None else spec.micro_batch_size
    seq = seq_len if seq_len is not None else spec.seq_len
    cuda = device == "cuda"
    architecture = gpu.architecture if gpu is not None else "hopper"
    workspace = overhead_bytes(overheads, "cublas_workspace", architecture) if cuda else 0
    ladder: float | None = None  # reserved by the ladder rule (profiles that sweep shapes, on CUDA)
    closed_form = False
    try:
        if pair is None or not pair.covers(batch, seq):
            pair = get_profiles(config_data, settings, batch, seq, exact=exact_shape, trace=trace)
        step = _traced_step(pair, spec, batch, seq, cuda=cuda, workspace=workspace,
                            checkpointing=settings.grad_checkpointing, sizes=model_sizes(config_data, spec))
        if cuda and pair.exact_shape is None:  # profiles that sweep shapes: reserved by the ladder rule
            ladder = float(_ladder_reserved(config_data, settings, spec, pair, batch, seq, workspace, trace))
        traced_at = pair.exact_shape
        composed = (pair.origin or "").startswith("composed")
    except TracingUnavailable as reason:
        step, facts, param_bytes, layers = _analytic_step(spec, settings, config_data, batch, seq, str(reason),
                                                          workspace)
        _modelled_terms(step, spec, facts, param_bytes, layers, tokens=batch * seq, cuda=cuda,
                        checkpointing=settings.grad_checkpointing, sizes=model_sizes(config_data, spec))
        traced_at = None
        composed = False
        closed_form = True
    finally:  # the replays made so far are kept, also when the estimate stops (NeedsTrace, Ctrl-C)
        replays.flush()
    experts = unquantized_experts_note(spec, config_data)
    if experts is not None:  # first: it is most of such a model's weights
        step.notes.insert(0, experts)
    dropout = expert_dropout_note(spec, config_data)
    if dropout is not None:
        step.notes.append(dropout)
    if spec.precision == "fp8":
        step.notes.append("fp8: memory modelled as bf16 (torchao float8 keeps bf16 weights and activations)")
    if spec.attention == "flash":
        step.notes.append("flash attention traced as SDPA (neither stores the seq × seq scores)")
    if composed:
        step.notes.append("the loss taken alone at this shape (from its forms, or traced), in place of its stand-in "
                          "in the step's template (its chunks follow the length)")
    elif traced_at is not None:
        step.notes.append("traced at this exact shape (operations differed between shapes)")
    from tunecast.step.variants import runner_notes

    tool_notes = runner_notes(spec, device)  # another runner's step, or an older bitsandbytes' 4-bit layers
    if tool_notes:
        step.notes.extend(tool_notes)
        if closed_form:
            step.notes.append("the closed-form estimate does not run the runner's step: its differences are not in "
                              "these figures")

    peak_phase, allocated = _peak(step)
    peak = step.phases[peak_phase]
    # Reserved holds allocated; the ladder's figure where it applies (it never falls as the shape grows).
    reserved = allocated + step.reserve_bytes if ladder is None else max(allocated, ladder)
    context = overhead_bytes(overheads, "cuda_context", architecture) if cuda else \
        overhead_bytes(overheads, "cpu_framework", "*")
    device_total = reserved + context
    # At the edge the allocator releases the cached segments no live block holds and retries (allocator.py): what
    # the process needs at least is the allocated peak and the free space inside segments still in use.
    least = reserved if step.pinned_bytes is None else min(reserved, allocated + step.pinned_bytes)
    breakdown = dict(peak.breakdown)
    breakdown["overhead"] = device_total - sum(v for k, v in breakdown.items() if k != "overhead")
    return MemoryEstimate(
        device=device,
        peak_allocated_gib=allocated / BYTES_PER_GIB,
        peak_reserved_gib=reserved / BYTES_PER_GIB,
        device_total_gib=device_total / BYTES_PER_GIB,
        least_reserved_gib=least / BYTES_PER_GIB,
        least_device_total_gib=(least + context) / BYTES_PER_GIB,
        peak_phase=peak_phase,
        host_ram_gib=step.host_bytes / BYTES_PER_GIB,
        managed_gib=step.managed_bytes / BYTES_PER_GIB,
        breakdown_gib={k: breakdown[k] / BYTES_PER_GIB for k in BREAKDOWN},
        phases_gib={p: step.phases[p].total / BYTES_PER_GIB for p in PHASES},
        micro_batch=batch,
        seq_len=seq,
        notes=tuple(step.notes),
        composed=composed,
    )

