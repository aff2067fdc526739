"""Mixture-of-experts layers: the memory of transformers' expert kernels in closed form, and what a trace of
one kernel misses when the training step runs another.

transformers 5.x runs the experts of qwen3_moe, mixtral and gpt_oss (and most MoE families) through one
interface, `transformers.integrations.moe`: `grouped_mm` by default (chosen at model build whenever the
Experts class carries `@use_experts_implementation`), `eager` (the class's own per-expert loop) on request
or for classes without the decorator (DBRX). Both were read and measured on real CPU tensors, transformers
5.24 and torch 2.13; tests/unit/estimate/test_moe.py checks every formula here byte for byte.

**grouped_mm has no data-dependent size.** Every buffer is sized by the S = T·k routed (token, expert) pairs
(T = b·s tokens, k experts per token), whatever the router chose: the per-expert counts exist only as the
values of an int32 offsets tensor. A trace on fake tensors therefore sees every byte, and routing balance
does not change memory. `untraced_bytes` is zero when the step runs grouped_mm, as tunecast's trainer does
on a CPU (torch >= 2.9) and on CUDA GPUs of compute capability 8.0 and above. (Below 8.0 — V100, T4 —, under
torch.compile in a dtype other than bf16, on a CPU with torch <= 2.8, or <= 2.10 with unaligned weights, transformers
takes its `transformers::grouped_mm_fallback` custom op instead: its forward saves both operands and its
backward allocates a zero gradient the size of the frozen expert weights, E·2I·H·c then E·H·I·c. Not
modelled: none of tunecast's GPUs is below 8.0.)

**eager cannot be traced on fake tensors**: its loop asks `nonzero` / `torch.where` which experts were hit and
which tokens each received (DynamicOutputShapeException under FakeTensorMode). Its memory needs the count of
each expert's tokens, which is where the routing assumption enters (`ROUTINGS`):

* `balanced`: every expert receives ceil(S / E) pairs and all E are hit. A load-balancing loss aims at this,
  and random weights route close to it. Used for the estimate.
* `worst`: every token picks the same k experts: k experts hit, each with all T tokens (a token picks an
  expert at most once, so T is the most one expert can receive). An upper bound for the transients.

What eager keeps for the backward pass does not depend on routing either (the pairs sum to S over the
experts); only its transients do, through the tokens of the expert processed last.

Notation: H hidden size, I expert width (moe_intermediate_size), E experts, c bytes of the experts' dtype (the
parameters'; grouped_mm casts its input to it); int64 indices 8 bytes, fp32 and int32 4. g = tensors of
width I the activation keeps (1: SwiGLU's SiLU output, the up half being a view of the projection; 4:
gpt-oss's clamped SwiGLU keeps the clamped gate, its sigmoid, their product and up + 1).

grouped_mm, kept per MoE layer (`grouped_mm_experts_forward`):
  3·8·S   the sort permutation, perm // k and the inverse permutation (saved by the three gathers)
  c·S     routing weights in expert order (saved by the weighting multiply)
  4·E     int32 offsets (saved by both grouped matmuls)
  c·S·2I  the gate/up projection (the activation reads its halves)
  c·S·g·I the activation's tensors
  c·S·H   the down projection (the weighting multiply's input)
Not kept: the gathered hidden states (the grouped matmul saves no input when expert weights are frozen).
Forward transients (locals alive until the function returns): the sorted ids 8·S, gathered hidden c·S·H,
float ids and histogram 4·S + 4·E; then the weighted and the reordered outputs c·S·H each, and with biases
(gpt-oss) the per-pair bias gathers c·S·2I and c·S·H. Backward: the reorder gather's gradient (zeros and
index_put) with the expanded output gradient, 3·c·S·H; or the activation's gradients, 3·c·S·I, less the
down projection and inverse permutation already freed.

eager, kept per routed pair (the Experts class's `forward`): 16 (the nonzero (slot, token) pair) + c·(2I +
g·I + 2H + 1) — the projection, the activation's tensors, the down output, its weighted copy (index_add_'s
source) and the gathered routing weight: S·(c·H - 8) - 4·E more than grouped_mm. Forward transients: the
output zeros c·T·H, the one-hot mask 8·T·k·(E + 1) (gpt-oss: E classes), 8 per expert hit, and the last
expert's gathered tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tunecast.errors import TunecastError

if TYPE_CHECKING:
    from tunecast.config.spec import RunSpec

IMPLEMENTATIONS = ("grouped_mm", "eager")
ROUTINGS = ("balanced", "worst")
INDEX_BYTES = 8  # int64 indices (sort, nonzero, one_hot)
FP32_BYTES = 4  # the float copy of expert ids for histc, the histogram, the int32 offsets


@dataclass(frozen=True)
class _Family:
    width_key: str  # the expert intermediate size in the config
    experts_key: str
    clamped_glu: bool  # gpt-oss's clamped SwiGLU with the gate and up halves interleaved
    biased: bool  # per-expert biases on both projections
    sentinel_class: bool  # the eager loop's one_hot has a class for expert-parallel sentinels (E + 1)


# The Experts classes of transformers 5.x these formulas were measured on.
FAMILIES = {
    "qwen3_moe": _Family("moe_intermediate_size", "num_experts", clamped_glu=False, biased=False,
                         sentinel_class=True),
    "mixtral": _Family("intermediate_size", "num_local_experts", clamped_glu=False, biased=False,
                       sentinel_class=True),
    "gpt_oss": _Family("intermediate_size", "num_local_experts", clamped_glu=True, biased=True,
                       sentinel_class=False),
}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ExpertShape:
    """The dimensions of one MoE layer's experts."""

    hidden: int
    width: int
    experts: int
    top_k: int
    clamped_glu: bool = False
    biased: bool = False
    sentinel_class: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ExpertShape | None:
        """The experts of a model config (its text part for multimodal ones); None for a dense model."""
        inner = config.get("text_config")
        config = inner if isinstance(inner, dict) and "model_type" in inner else config
        if not any(isinstance(config.get(key), int) and config[key] > 0 for key in _EXPERT_KEYS):
            return None
        family = FAMILIES.get(str(config.get("model_type")))
        if family is None:
            raise TunecastError(f"no memory model for the experts of model_type {config.get('model_type')!r}",
                                field="model", hint=f"MoE families modelled: {', '.join(FAMILIES)}")
        return cls(hidden=config["hidden_size"], width=config[family.width_key], experts=config[family.experts_key],
                   top_k=config["num_experts_per_tok"], clamped_glu=family.clamped_glu, biased=family.biased,
                   sentinel_class=family.sentinel_class)


def moe_layers(config: dict[str, Any], layers: int) -> int:
    """How many of the first `layers` decoder layers have experts: Qwen-MoE's `decoder_sparse_step` and
    `mlp_only_layers` (transformers' Qwen3MoeDecoderLayer), every layer otherwise."""
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    return sum(1 for index in range(layers) if (index + 1) % step == 0 and index not in dense)


def unquantized_numel(config: dict[str, Any]) -> int:
    """Elements of the MoE layers' weights that QLoRA leaves in the compute dtype: in transformers 5 the experts are
    fused 3-D parameters (gate/up E·2I·H, down E·H·I, and gpt-oss's per-expert biases E·(2I + H)) and the router a
    plain E·H parameter, none of them an nn.Linear, which is all bitsandbytes' 4-bit conversion replaces (see
    docs/memory.md, "QLoRA and mixtures of experts"). 0 for a dense model; what tunecast's runner counts with
    train/quantize.py `unquantized_weights` (tests/unit/train/test_quantize.py)."""
    shape = ExpertShape.from_config(config)
    if shape is None:
        return 0
    inner = config.get("text_config")
    text = inner if isinstance(inner, dict) and "model_type" in inner else config
    h, i, e = shape.hidden, shape.width, shape.experts
    per_layer = e * 3 * h * i + e * h + (e * (2 * i + h) if shape.biased else 0)
    return moe_layers(text, text["num_hidden_layers"]) * per_layer


def linear_expert_numel(config: dict[str, Any], spec: RunSpec | None) -> int:
    """Elements of the expert and router weights that the transformers `spec`'s runner ran built as nn.Linear
    modules, which QLoRA quantizes like every other Linear: all of `unquantized_numel` where
    step/variants.py `experts_were_linear`, else 0 (today's fused 3-D experts, and tunecast's own step, which runs the
    transformers installed)."""
    from tunecast.step.variants import experts_were_linear

    return unquantized_numel(config) if experts_were_linear(config, spec) else 0


def expert_tokens(tokens: int, shape: ExpertShape, routing: str) -> tuple[int, int]:
    """(tokens each hit expert receives, experts hit) under `routing` (see ROUTINGS in the module docstring)."""
    if routing == "balanced":
        pairs = tokens * shape.top_k
        return math.ceil(pairs / shape.experts), min(shape.experts, pairs)
    if routing == "worst":
        return tokens, shape.top_k
    raise ValueError(f"routing must be one of {ROUTINGS}, not {routing!r}")


@dataclass(frozen=True)
class ExpertBytes:
    """Memory of one MoE layer's experts (router excluded: it runs the same way in every implementation).

    `kept`: allocated by the forward and still alive after it, its output aside (saved for the backward).
    `forward_peak`: the most bytes allocated by the forward alive at once, its output included.
    `backward_peak`: the most bytes the backward allocates above what was alive when it began, net of the
    saved tensors it frees on the way (the incoming output gradient aside)."""

    kept: int
    forward_peak: int
    backward_peak: int

    def minus(self, other: ExpertBytes) -> ExpertBytes:
        return ExpertBytes(self.kept - other.kept, self.forward_peak - other.forward_peak,
                           self.backward_peak - other.backward_peak)


def _activation_tensors(shape: ExpertShape) -> tuple[int, int]:
    """(kept, alive when the activation's last product is made), in tensors of width I: SwiGLU keeps SiLU's
    output and makes the product; the clamped SwiGLU keeps four and also holds the clamped up half and the
    product."""
    return (4, 6) if shape.clamped_glu else (1, 2)


def _grouped(shape: ExpertShape, tokens: int, c: int) -> ExpertBytes:
    h, i, e, pairs = shape.hidden, shape.width, shape.experts, tokens * shape.top_k
    kept_acts, product_acts = _activation_tensors(shape)
    bias = 1 if shape.biased else 0
    kept = pairs * (3 * INDEX_BYTES + c * (1 + 2 * i + kept_acts * i + h)) + FP32_BYTES * e
    # Alive from the start to the return: sorted ids, perm, perm // k, gathered hidden, routing weights, float ids;
    # the histogram and the offsets.
    start = pairs * (3 * INDEX_BYTES + FP32_BYTES + c * (h + 1)) + 2 * FP32_BYTES * e
    moments = [
        start + pairs * c * (2 * i * bias + 2 * i + product_acts * i),  # the activation's product
        start + pairs * c * (2 * i + kept_acts * i + i + bias * h + h),  # the down projection
        start + pairs * c * (2 * i + kept_acts * i + bias * h + 3 * h) + pairs * INDEX_BYTES,  # the reorder
    ]
    if shape.biased:  # the down bias gathered while the gate/up one is still held
        moments.append(start + pairs * c * (2 * i + 2 * i + kept_acts * i + i + h))
    backward = max(3 * pairs * c * h,  # the reorder's gradient: expanded output gradient, zeros, index_put
                   3 * pairs * c * h + pairs * c - pairs * INDEX_BYTES,  # the weighting multiply's two gradients
                   pairs * (3 * i * c - h * c - INDEX_BYTES))  # the activation's gradients
    return ExpertBytes(kept, max(moments), backward)


def _eager(shape: ExpertShape, tokens: int, c: int, routing: str) -> ExpertBytes:
    h, i, e, k = shape.hidden, shape.width, shape.experts, shape.top_k
    kept_acts, product_acts = _activation_tensors(shape)
    bias = 1 if shape.biased else 0
    per_pair = 2 * INDEX_BYTES + c * (2 * i + kept_acts * i + 2 * h + 1)
    kept = tokens * k * per_pair
    last, hit = expert_tokens(tokens, shape, routing)  # the last expert processed (every hit one has as many)
    classes = e + 1 if shape.sentinel_class else e
    start = c * tokens * h + INDEX_BYTES * tokens * k * classes + INDEX_BYTES * hit  # output, one-hot mask, hits
    before_last = start + kept - last * per_pair
    # gpt-oss keeps `gated_output` bound until the next expert's replaces it (after its product is made).
    gated_alive = 1 if shape.clamped_glu else 0
    previous_gated = gated_alive * last * c * i if hit > 1 else 0
    moments = [
        start + kept + last * c * (h + gated_alive * i),  # the return: the last expert's gathered tokens
        before_last + previous_gated  # the activation's product
        + last * (2 * INDEX_BYTES + c * (h + 2 * i + product_acts * i)),
        before_last + last * (2 * INDEX_BYTES + c * (2 * h + 2 * i + kept_acts * i + i + bias * h)),  # down
    ]
    # The backward visits the last expert first (with equal counts, its moments are the largest).
    backward = max(last * c * (2 * h + 1),  # the weighting multiply's two gradients
                   3 * last * i * c + tokens * k * c - last * c * (2 * h + 1),  # the activation's gradients
                   2 * tokens * h * c + tokens * k * c + last * h * c - last * (per_pair - 2 * INDEX_BYTES))
    return ExpertBytes(kept, max(moments), backward)


def expert_bytes(shape: ExpertShape, tokens: int, *, implementation: str, dtype_bytes: int,
                 routing: str = "balanced") -> ExpertBytes:
    """One MoE layer's experts over `tokens` (b·s) tokens, with frozen expert weights (LoRA or QLoRA on other
    modules) and inputs that need gradients. grouped_mm ignores `routing`."""
    if implementation == "grouped_mm":
        return _grouped(shape, tokens, dtype_bytes)
    if implementation == "eager":
        return _eager(shape, tokens, dtype_bytes, routing)
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, not {implementation!r}")


def untraced_bytes(shape: ExpertShape, batch: int, seq: int, *, runs: str, dtype_bytes: int,
                   routing: str = "balanced", traced: str = "grouped_mm") -> ExpertBytes:
    """What a trace of `traced` misses, per MoE layer, when the training step runs `runs` (negative: what it
    counts that the step does not hold). Zero when both are grouped_mm, whatever the routing."""
    tokens = batch * seq
    return expert_bytes(shape, tokens, implementation=runs, dtype_bytes=dtype_bytes, routing=routing).minus(
        expert_bytes(shape, tokens, implementation=traced, dtype_bytes=dtype_bytes, routing=routing))
