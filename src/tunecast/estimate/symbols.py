"""Sizes as polynomials in a model's dimensions, read off one trace at marker dimensions (no torch here).

A traced model whose dimensions are distinct primes — key-value heads, query heads per key-value head,
half the head size, hidden size per head, intermediate size, vocabulary, LoRA rank, micro-batch, length —
allocates tensors whose byte counts factor uniquely into those primes and a small constant (the element
size, a factor of two): `b·s·V·4` is the fp32 logits, `2·hd2·kv·x·g·2` a bf16 key projection weight.
A size that is not one product (the loss's labels padded by one position, `8·b·(s+1)`; Phi-3's fused
query-key-value projection, `kv·(g+2)·2·hd2` outputs) has factors a small offset away from a marker, and is read
as that product of sums. Every reading is checked against a second trace at other primes before it is used
(see templates.py), so a misreading is never silent.

A polynomial is a tuple of terms `(coefficient, exponents)`, the exponents one per VARIABLES entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tunecast.step.shape import WINDOW_UNLESS_USED

VARIABLES = ("kv", "g", "hd2", "x", "i", "V", "r", "b", "s", "e", "k", "m")
Term = tuple[int, tuple[int, ...]]
Poly = tuple[Term, ...]

# Constants a size may carry besides the dimensions: element sizes, small factors (a fused gate and up
# projection's 2, attention's backward's 5 matmuls), the units of widths (`units`).
_CONSTANTS = frozenset(2 ** a * 3 ** c * 5 ** f for a in range(14) for c in range(3) for f in range(2))
# Two marker sets. The first is read from: distinct primes above 5 (so that none is taken for a constant),
# small where a dimension is materialised (peft builds LoRA matrices, rank × width, as real tensors before
# moving them to the meta device), half the head size in the range real heads have (kernels choose by head
# size). Micro-batch and length may also appear off by one (the loss's labels padded by one position,
# `b·(s + 1)`): their neighbours (±1) each have a prime factor above 5 that no marker and no other
# neighbour has, so that `s + 1` is told from a constant and from another dimension. The second set only
# checks a reading, at other values in another order.
# Mixture-of-experts layers add the number of experts (e), the experts each token is routed to (k) and the
# expert width where it differs from the dense MLP's (m); 29, 43, 47 and 71 are the neighbours' factors.
MARKERS = {"kv": 7, "g": 11, "hd2": 37, "x": 13, "i": 17, "V": 19, "r": 23, "b": 173, "s": 283, "e": 41, "k": 31,
           "m": 53}
CHECK_MARKERS = {"kv": 5, "g": 3, "hd2": 41, "x": 53, "i": 47, "V": 61, "r": 9, "b": 4, "s": 71, "e": 13, "k": 7,
                 "m": 11}
# MoE types count the head size in units of 8 (`units`): their head markers are smaller, so that the marker
# heads (104 and 88) stay in the range of real ones (attention kernels choose by head size).
MOE_MARKERS = {**MARKERS, "hd2": 13, "x": 37}
MOE_CHECK_MARKERS = {**CHECK_MARKERS, "hd2": 11, "m": 17}


# Phi-3 fuses the query, key and value projections into one of (heads + 2·kv)·head size outputs: with grouped
# query heads, kv·(g + 2)·head size, so g also appears two more. Its markers give g + 2 a prime of its own (59 + 2 =
# 61; 11 + 2 would be 13, the width marker), and in the check g + 2 is 15, no other check value (3 + 2 would be
# the check's kv, and a misreading of g + 2 as kv would pass the check).
_FUSED_QKV = frozenset({"phi3"})
# Types that rotate `partial_rotary_factor` of each head (transformers' Phi-3 rotary embedding: int(head size ·
# factor) dimensions, split in halves): their head unit follows the factor (`units`).
_PARTIAL_ROTARY = frozenset({"phi3"})
FUSED_MARKERS = {**MARKERS, "g": 59}
FUSED_CHECK_MARKERS = {**CHECK_MARKERS, "g": 13}
# A head unit above 6 (Phi-4-mini rotating 0.75 of each head: units of 8) would make marker heads of 296 and
# 328, past the head sizes real models have (attention kernels choose by head size): such types take the MoE
# types' head markers, heads of 104 and 88.
_SMALL_HEADS = {"hd2": MOE_MARKERS["hd2"], "x": MOE_MARKERS["x"]}
_SMALL_CHECK_HEADS = {"hd2": MOE_CHECK_MARKERS["hd2"]}


def markers(config: Mapping[str, Any], *, check: bool = False) -> dict[str, int]:
    """The marker dimensions a template of this config is read (or, with `check`, checked) at."""
    model_type = config.get("model_type")
    if model_type in MOE_TYPES:
        return MOE_CHECK_MARKERS if check else MOE_MARKERS
    if model_type in _FUSED_QKV:
        chosen = FUSED_CHECK_MARKERS if check else FUSED_MARKERS
    else:
        chosen = CHECK_MARKERS if check else MARKERS
    if units(config)[0] > 6:
        chosen = {**chosen, **(_SMALL_CHECK_HEADS if check else _SMALL_HEADS)}
    return chosen


# The variables that may appear shifted, and by how much: micro-batch and length off by one (the loss's labels);
# for fused query-key-value projections the query heads per kv head plus the key and value heads (g + 2).
_SHIFTS: dict[str, tuple[int, ...]] = {"b": (1, -1), "s": (1, -1)}
_FUSED_SHIFTS = {**_SHIFTS, "g": (2,)}


def shifts(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """How far each variable may appear shifted in a size of this config's step (see `factor`)."""
    return _FUSED_SHIFTS if config.get("model_type") in _FUSED_QKV else _SHIFTS

# Model types whose attention and MLP are sized by these dimensions (q, k, v, o projections, separate or with q,
# k and v fused into one; a gated or plain MLP of one intermediate size, gate and up separate or fused), and the
# config keys that hold them.
DENSE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi", "phi3", "gpt2"})
# GPT-2 names its dimensions its own way, has one query head per key-value head, and an MLP four times the
# hidden size unless `n_inner` says otherwise.
_RENAMED = {"gpt2": {"hidden_size": "n_embd", "num_attention_heads": "n_head", "intermediate_size": "n_inner"}}
# Mixture-of-experts types of the same attention, and the config keys of their experts: (count, routed per
# token, expert width). Mixtral's experts are as wide as its intermediate size (it has no dense MLP).
MOE_TYPES = {"mixtral": ("num_local_experts", "num_experts_per_tok", None),
             "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
             "gpt_oss": ("num_local_experts", "num_experts_per_tok", None)}
# Types whose hidden size is not the heads' total width (gpt-oss: 2880 against 64 heads of 64): for them `x`
# is the hidden size itself, in width units, not the hidden size per head.
_FREE_HIDDEN = frozenset({"gpt_oss"})
# Config entries that do not change which tensors a training step allocates (token ids, numerical
# constants, bookkeeping): left out of the structure a template is keyed on.
_INERT_KEYS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps", "initializer_range",
                         "router_aux_loss_coef",
                         "rope_theta", "torch_dtype", "dtype", "transformers_version", "max_position_embeddings",
                         "_name_or_path", "architectures", "use_cache", "max_window_layers"})
# Entries left out when they hold the value the config class defaults to (transformers 5.x, checked in
# tests/unit/estimate/test_symbols.py): a config that states the default builds the model one without it does.
# `rope_scaling: null` is the default of every type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"pretraining_tp": 1, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False},
    "mistral": {"attention_dropout": 0.0}, "qwen2": {"attention_dropout": 0.0},
    "mixtral": {"attention_dropout": 0.0},
    "qwen3": {"attention_bias": False, "attention_dropout": 0.0},
    "qwen3_moe": {"attention_bias": False, "attention_dropout": 0.0},
    "gpt_oss": {"attention_bias": True, "attention_dropout": 0.0, "output_router_logits": False},
    "phi3": {"attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    "gemma3_text": {"attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None,
                    "final_logit_softcapping": None, "use_bidirectional_attention": False},
}
# Entries that nearly every published config states, though they hold the config class's default: one that leaves
# them out (a local config written by hand) is read with them, so that it is the structure of the catalog models
# that state them (the other way round, dropping them, would change every shipped template's key).
_STATED: dict[str, dict[str, Any]] = {model_type: {"hidden_act": "silu"} for model_type in
                                      ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")}
# Entries some published configs carry that transformers 5.x no longer reads (checked in test_templates.py).
_UNREAD = {"gemma2": frozenset({"sliding_window_size"}), "qwen2": frozenset({"use_mrope"}),
           "gpt_oss": frozenset({"experts_per_token", "initial_context_length"}),
           # Keys of Phi-3's remote code (configuration_phi3.py on the Hub) that transformers' Phi-3 does not read:
           # its projections have no biases, whatever the config says.
           "phi3": frozenset({"attention_bias", "mlp_bias", "lm_head_bias", "full_attn_mod", "interpolate_factor"})}
# Entries of a rope scaling that hold one number per rotary frequency (longrope's long_factor and short_factor):
# as many as half the rotated part of a head, so a marker model gets lists of its own length, and only their
# presence is structure (their numbers scale the frequencies and change no size).
_PER_FREQUENCY = ("long_factor", "short_factor")
DIMENSION_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "vocab_size", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "n_embd", "n_head", "n_inner")


def one(exponents: Mapping[str, int], coefficient: int = 1) -> Poly:
    return ((coefficient, tuple(exponents.get(name, 0) for name in VARIABLES)),)


def multiply(a: Poly, b: Poly) -> Poly:
    product: dict[tuple[int, ...], int] = {}
    for ca, ea in a:
        for cb, eb in b:
            exponents = tuple(x + y for x, y in zip(ea, eb, strict=True))
            product[exponents] = product.get(exponents, 0) + ca * cb
    return normalise(product.items())


def add(polys: Iterable[Poly]) -> Poly:
    total: dict[tuple[int, ...], int] = {}
    for poly in polys:
        for coefficient, exponents in poly:
            total[exponents] = total.get(exponents, 0) + coefficient
    return normalise(total.items())


def normalise(terms: Iterable[tuple[tuple[int, ...], int]]) -> Poly:
    return tuple(sorted(((c, e) for e, c in terms if c), key=lambda term: term[1]))


def evaluate(poly: Poly, values: Mapping[str, int]) -> int:
    point = [values.get(name, 1) for name in VARIABLES]
    total = 0
    for coefficient, exponents in poly:
        term = coefficient
        for value, power in zip(point, exponents, strict=True):
            if power:
                term *= value ** power
        total += term
    return total


def factor(n: int, markers: Mapping[str, int], depth: int = 2,
           shifted: Mapping[str, tuple[int, ...]] = _SHIFTS) -> Poly | None:
    """`n` as a product of the markers' variables, their sums with small offsets (`shifted`: by variable, the
    offsets it may carry), and a small constant; None when it is none of these (the caller then has no reading
    of it)."""
    if n == 0:
        return ()
    exponents: dict[str, int] = {}
    rest = n
    for name, prime in markers.items():
        while rest % prime == 0:
            rest //= prime
            exponents[name] = exponents.get(name, 0) + 1
    if rest in _CONSTANTS:
        return one(exponents, rest)
    if depth == 0:
        return None
    for name, prime in markers.items():
        for offset in shifted.get(name, ()):
            moved = prime + offset
            if moved > 1 and rest % moved == 0:
                inner = factor(rest // moved, markers, depth - 1, shifted)
                if inner is not None:
                    linear = add((one({name: 1}), one({}, offset)))
                    return multiply(multiply(inner, linear), one(exponents))
    return None


def to_json(poly: Poly) -> list[list[Any]]:
    return [[c, list(e)] for c, e in poly]


def from_json(data: list[list[Any]]) -> Poly:
    return tuple((int(c), tuple(e)) for c, e in data)


def units(config: Mapping[str, Any]) -> tuple[int, int]:
    """(head unit, width unit): the head size is `hd2` head units, the hidden size per head `x` width units,
    the intermediate and expert widths `i` and `m` width units. Dense types: (2, 1), so that half the head
    size is a variable (rotary embeddings split heads in halves); Phi: (4, 1), since it rotates half of each
    head, which must split in halves again; Phi-3: the least unit whose rotated part splits in halves (8 for
    Phi-4-mini, which rotates 0.75 of each head). MoE types: (8, 8), because their grouped expert matmuls need
    16-byte strides, so every width of a marker model is a multiple of 8 elements."""
    model_type = config.get("model_type")
    if model_type in MOE_TYPES:
        return 8, 8
    if model_type == "phi":
        return 4, 1
    if model_type in _PARTIAL_ROTARY:
        return _rotary_unit(config), 1
    return 2, 1


def _rotary_factor(config: Mapping[str, Any]) -> float | None:
    """The part of each head rotated (1.0 unless the config says otherwise); None when it is no number."""
    factor = config.get("partial_rotary_factor")
    for key in ("rope_parameters", "rope_scaling"):
        scaling = config.get(key)
        if factor is None and isinstance(scaling, Mapping):
            factor = scaling.get("partial_rotary_factor")
    try:
        return 1.0 if factor is None else float(factor)
    except (TypeError, ValueError):
        return None


def _rotary_unit(config: Mapping[str, Any]) -> int:
    """The least head unit u of 2 to 8 for which u · partial_rotary_factor is an even whole number, so that the
    rotated part of a marker head, u · factor · hd2, splits in halves and is a multiple of hd2; 0 when there is
    none (no template: `dense_dimensions`)."""
    factor = _rotary_factor(config)
    if factor is None:
        return 0
    for unit in range(2, 9):
        rotated = unit * factor
        if rotated == int(rotated) and int(rotated) % 2 == 0 and rotated > 0:
            return unit
    return 0


def standard(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config with its dimensions under the names most types use (see _RENAMED)."""
    names = _RENAMED.get(str(config.get("model_type")))
    if names is None:
        return config
    view = dict(config)
    for standard, own in names.items():
        view[standard] = config.get(own)
    if view["intermediate_size"] is None and isinstance(view["hidden_size"], int):
        view["intermediate_size"] = 4 * view["hidden_size"]
    return view


def dense_dimensions(config: Mapping[str, Any]) -> dict[str, int] | None:
    """The variables of a config whose attention and MLP (or experts) they size — kv heads, query heads per
    kv head, head size, hidden size per head, intermediate size, vocabulary, and for MoE types the experts,
    the experts per token and the expert width (see `units`) — or None when its sizes are not of that form."""
    model_type = config.get("model_type")
    if model_type not in DENSE_TYPES and model_type not in MOE_TYPES:
        return None
    config = standard(config)
    head_unit, width_unit = units(config)
    if head_unit == 0:  # a rotated part no marker head splits in halves
        return None
    try:
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        free = model_type in _FREE_HIDDEN
        widths = {"x": hidden if free else hidden // heads, "i": int(config["intermediate_size"])}
        values = {"kv": kv, "g": heads // kv, "hd2": head_dim // head_unit, "V": int(config["vocab_size"])}
        if model_type in MOE_TYPES:
            experts, routed, width = MOE_TYPES[str(model_type)]
            values.update(e=int(config[experts]), k=int(config[routed]))
            if width is not None:
                widths["m"] = int(config[width])
            if not 0 < values["k"] <= values["e"]:
                return None
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if heads % kv or head_dim % head_unit or (hidden % heads and not free):
        return None
    if not config.get("head_dim"):
        widths.pop("x")  # folded into the head size (x is set to 1 by variable_values)
    if any(width % width_unit for width in widths.values()):
        return None
    values.update({name: width // width_unit for name, width in widths.items()})
    values.setdefault("x", hidden // heads)
    return values


def structure(config: Mapping[str, Any]) -> dict[str, Any]:
    """What of a config decides the operations of a step, beyond its dimensions: the other entries, and
    which dimensions coincide (grouped-query or not, head size given or derived from the hidden size, a single
    key-value head or more)."""
    values = dense_dimensions(config) or {}
    model_type = str(config.get("model_type"))
    inert = set(_INERT_KEYS) | _UNREAD.get(model_type, frozenset())
    if config.get("use_sliding_window") is True:
        inert.discard("max_window_layers")
    elif model_type in WINDOW_UNLESS_USED:
        inert.add("sliding_window")
    defaults = {**_DEFAULTS.get(model_type, {}), "rope_scaling": None}
    config = {**_STATED.get(model_type, {}), **config}
    kept = {k: v for k, v in config.items()
            if k not in inert and k not in DIMENSION_KEYS and not (k in defaults and v == defaults[k])}
    for key in ("rope_scaling", "rope_parameters"):
        scaling = kept.get(key)
        if isinstance(scaling, dict) and any(name in scaling for name in _PER_FREQUENCY):
            kept[key] = {name: "per rotary frequency" if name in _PER_FREQUENCY else value
                         for name, value in scaling.items()}
    kept["_grouped"] = values.get("g", 1) > 1
    kept["_head_dim_given"] = bool(config.get("head_dim"))
    if values.get("kv") == 1:
        # Multi-query attention (Gemma 3 1B): a key of one head, (b, 1, s, head) once transposed, is contiguous
        # where one of several heads is not, so the step copies less; a marker model keeps its single kv head.
        # Stated only when so: the keys of every other structure stay as they were.
        kept["_single_kv"] = True
    return kept


def marker_config(config: Mapping[str, Any], markers: Mapping[str, int]) -> dict[str, Any]:
    """`config` with its dimensions replaced by the markers', keeping its structure (which dimensions
    coincide): one query head per key-value head stays so, a derived head size stays derived, a single key-value
    head stays single."""
    shaped = dict(config)
    shape = structure(config)
    groups = markers["g"] if shape["_grouped"] else 1
    kv = 1 if shape.get("_single_kv") else markers["kv"]
    heads = kv * groups
    head_unit, width_unit = units(config)
    shaped["num_key_value_heads"] = kv
    shaped["num_attention_heads"] = heads
    if config.get("head_dim"):
        shaped["head_dim"] = head_unit * markers["hd2"]
        shaped["hidden_size"] = (1 if config.get("model_type") in _FREE_HIDDEN else heads) * width_unit * markers["x"]
    else:  # the head size is the hidden size per head: one marker serves both
        shaped["hidden_size"] = heads * head_unit * markers["hd2"]
    shaped["intermediate_size"] = width_unit * markers["i"]
    shaped["vocab_size"] = markers["V"]
    if config.get("model_type") in MOE_TYPES:
        experts, routed, width = MOE_TYPES[str(config["model_type"])]
        shaped[experts], shaped[routed] = markers["e"], markers["k"]
        if width is not None:
            shaped[width] = width_unit * markers["m"]
    _resize_per_frequency(shaped)
    for standard, own in _RENAMED.get(str(config.get("model_type")), {}).items():
        shaped[own] = shaped.pop(standard)
    if config.get("model_type") in _RENAMED:
        del shaped["num_key_value_heads"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        shaped[key] = None
    return shaped


def _resize_per_frequency(shaped: dict[str, Any]) -> None:
    """Give a marker config's per-frequency rope lists (`_PER_FREQUENCY`) the length its heads want: half the
    rotated part of a head (transformers refuses a longrope config whose lists are of another length), each
    entry taken from the real list at the same relative position."""
    factor = _rotary_factor(shaped)
    if factor is None:
        return
    head = shaped.get("head_dim") or shaped["hidden_size"] // shaped["num_attention_heads"]
    wanted = int(head * factor) // 2
    for key in ("rope_scaling", "rope_parameters"):
        scaling = shaped.get(key)
        if not isinstance(scaling, dict):
            continue
        resized = dict(scaling)
        for name in _PER_FREQUENCY:
            values = scaling.get(name)
            if isinstance(values, list) and values:
                resized[name] = [values[index * len(values) // wanted] for index in range(wanted)]
        shaped[key] = resized


def variable_values(config: Mapping[str, Any], rank: int, batch: int | None) -> dict[str, int] | None:
    """Values of every variable for a real config: its dimensions, the LoRA rank and, for templates of
    micro-batches of two or more, the micro-batch (the length stays a variable of the profile)."""
    values = dense_dimensions(config)
    if values is None:
        return None
    if not config.get("head_dim"):
        values["x"] = 1  # folded into hd2: the hidden size per head is the head size
    if not structure(config)["_grouped"]:
        values["g"] = 1
    values["r"] = rank
    if batch is not None:
        values["b"] = batch
    return values


def marker_values(config: Mapping[str, Any], markers: Mapping[str, int], *, multi: bool) -> dict[str, int]:
    """The variables' values in a marker config: the markers, less those folded away (as in
    `variable_values`), which are left out so that factoring does not look for them."""
    values = dict(markers)
    moe = MOE_TYPES.get(str(config.get("model_type")))
    for name in ("e", "k", "m") if moe is None else ("m",) if moe[2] is None else ():
        del values[name]
    if not config.get("head_dim"):
        del values["x"]
    shape = structure(config)
    if not shape["_grouped"]:
        del values["g"]
    if shape.get("_single_kv"):
        del values["kv"]
    if not multi:
        del values["b"]
    return values
