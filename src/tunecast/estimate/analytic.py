"""Closed-form memory of a training step for Llama-style decoders, from the config alone.

The traced estimate is the reference; this path exists (1) as a check that the trace counts what the
code really keeps, and (2) as the estimate when the torch build lacks the fake-tensor API the tracer
needs. It covers the architectures whose layer is RMSNorm → attention (RoPE, GQA, SDPA) → RMSNorm →
SwiGLU MLP, as transformers implements them for llama, mistral, qwen2 and qwen3, without checkpointing.

Saved for the backward pass, per token and decoder layer (h hidden size, q = heads × head dim, kv = key/
value heads × head dim, i intermediate size, n heads, a = bytes of the compute dtype, f = 4 bytes of fp32),
as transformers and peft implement the layer on real tensors (no mask with SDPA, grouped-query attention):

* each RMSNorm: its fp32 upcast of the input (f·h) and the fp32 reciprocal RMS (f); when its weight trains
  (full fine-tuning) also the normalised input in the compute dtype (a·h);
* attention: q after RoPE, k and v, and the output (which o_proj's input shares): a·(2q + 2kv), plus the
  fp32 log-sum-exp per head (f·n). Qwen3 also normalises q and k per head: f·(q + kv) + f·(n + kv heads),
  and a·(q + kv) when those norms train;
* SwiGLU: SiLU's input, its output and the up projection (3·a·i);
* Linear inputs, kept only by Linears whose weight trains. Full fine-tuning: q/k/v's shared input and
  gate/up's shared input (the norms' outputs) and down_proj's (a·(2h + i)). LoRA: for every adapted
  Linear its own fp32 copy of the input (peft casts it to the adapters' fp32 dtype) and the adapter's
  rank-r intermediate (f·r).

At the start of the backward pass the loss holds, per token, three fp32 vocabulary-sized tensors: the
log-softmax cross-entropy saved, its gradient, and the gradient of the upcast logits (3·f·V).

Agreement with the trace (tests/unit/estimate/test_analytic.py): the activations exactly, the whole
peak within 1%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunecast.catalog.models import with_class_defaults
from tunecast.config.spec import TORCH_ADAMW, RunSpec

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
FP32 = 4
_DTYPE_BYTES = {"bf16": 2, "fp8": 2, "bf16-mixed": 4, "fp16-mixed": 4, "fp32": 4}


@dataclass(frozen=True)
class Shape:
    hidden: int
    kv: int
    intermediate: int
    heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Shape:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        return cls(config["hidden_size"], kv_heads * head_dim, config["intermediate_size"], heads, head_dim,
                   config["num_hidden_layers"], config["vocab_size"],
                   bool(with_class_defaults(config).get("tie_word_embeddings")))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each Linear of a layer."""
        h, kv, i, q = self.hidden, self.kv, self.intermediate, self.heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self, config: dict[str, Any]) -> int:
        bias = self.kv * 2 + self.heads * self.head_dim if config.get("attention_bias") else 0
        norms = 2 * self.hidden + (2 * self.head_dim if config.get("model_type") == "qwen3" else 0)
        return sum(a * b for a, b in self.linear_shapes().values()) + bias + norms

    def params(self, config: dict[str, Any]) -> int:
        embedding = self.vocab * self.hidden
        return self.layers * self.layer_params(config) + embedding * (1 if self.tied else 2) + self.hidden


def supports(config: dict[str, Any], spec: RunSpec) -> str | None:
    """None when this path covers the run, else why not."""
    if config.get("model_type") not in SUPPORTED:
        return f"model_type {config.get('model_type')!r} (covered: {', '.join(SUPPORTED)})"
    if spec.grad_checkpointing is True or spec.attention == "eager" or spec.loss == "chunked":
        return "checkpointing, eager attention and chunked loss are traced only"
    if spec.optimizer_in_backward or spec.lora.dora or spec.lora.modules_to_save or spec.lora.dropout:
        return "optimizer-in-backward, DoRA, modules_to_save and LoRA dropout are traced only"
    if spec.method == "qlora" and spec.quantization.bits == 8:
        return "an 8-bit base (whose layers keep their inputs, estimate/int8.py) is traced only"
    if spec.method != "full" and not spec.lora.fp32_adapters:
        return "adapters in the model's dtype (lora.fp32_adapters: false) are traced only"
    return None


def _targets(spec: RunSpec, shape: Shape) -> list[str]:
    names = list(shape.linear_shapes())
    if spec.lora.targets == "all-linear":
        return names
    return [n for n in names if n in spec.lora.targets]


def activation_bytes_per_token_layer(config: dict[str, Any], spec: RunSpec) -> int:
    """Bytes a decoder layer keeps for the backward pass, per token (see the module docstring)."""
    s = Shape.from_config(config)
    a = 2 if spec.precision in ("bf16", "fp8", "bf16-mixed", "fp16-mixed") else 4
    full = spec.method == "full"
    q = s.heads * s.head_dim
    norms = 2 * (FP32 * s.hidden + FP32) + (2 * a * s.hidden if full else 0)
    attention = a * (2 * q + 2 * s.kv) + FP32 * s.heads
    if config.get("model_type") == "qwen3":
        attention += FP32 * (q + s.kv) + FP32 * (s.heads + s.kv // s.head_dim) + (a * (q + s.kv) if full else 0)
    mlp = 3 * a * s.intermediate
    if full:
        inputs = a * (2 * s.hidden + s.intermediate)
    else:
        shapes = s.linear_shapes()
        inputs = sum(FP32 * shapes[name][0] + FP32 * spec.lora.rank for name in _targets(spec, s))
    return norms + attention + mlp + inputs


def analytic_peak_bytes(config: dict[str, Any], spec: RunSpec, batch: int, seq: int) -> dict[str, float]:
    """Live bytes by category at the start of the backward pass of the second step."""
    s = Shape.from_config(config)
    p = _DTYPE_BYTES[spec.precision]
    tokens = batch * seq
    total_params = s.params(config)
    if spec.method == "full":
        trainable = total_params
        trainable_bytes = trainable * p
        frozen_bytes = 0.0
        state_bytes = 2 * trainable * p if spec.optimizer in TORCH_ADAMW else 0.0
    else:
        shapes = s.linear_shapes()
        trainable = s.layers * sum(spec.lora.rank * (shapes[n][0] + shapes[n][1]) for n in _targets(spec, s))
        trainable_bytes = trainable * FP32  # peft keeps adapters in fp32
        frozen_bytes = total_params * p
        state_bytes = 2 * trainable * FP32 if spec.optimizer in TORCH_ADAMW else 0.0
    activations = s.layers * tokens * activation_bytes_per_token_layer(config, spec)
    temporaries = tokens * s.vocab * 3 * FP32
    return {"weights": frozen_bytes, "trainable_weights": trainable_bytes, "gradients": 0.0,
            "optimizer": state_bytes, "activations": activations, "temporaries": temporaries}
