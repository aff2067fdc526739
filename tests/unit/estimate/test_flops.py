"""FLOPs of a traced step against the analytic count, term by term.

* Full fine-tuning: 6N per token (forward 2N, input and weight gradients 2N each), the head included.
* LoRA: 4N (frozen weights get no weight gradient), adapters 6 per parameter — except that nothing before
  the first layer's q/k/v needs a gradient, so their input gradients are skipped (2 × their weights).
* Checkpointing recomputes each layer's forward pass (+2N), but torch's non-reentrant checkpoint stops once
  the tensors the backward pass needs exist (`early_stop`): in full fine-tuning down_proj's output is needed by
  nothing, so it is not recomputed; with LoRA its adapter needs its input, so it is. transformers also makes the
  embeddings' output require a gradient when checkpointing a peft model, so the first layer's input gradients
  are computed after all.
* Attention: 4·b·h·s²·d per layer forward, halved for the causal mask; the backward pass costs 2.5 forwards (it
  recomputes the scores), and checkpointing one more forward.
"""

import pytest
from tests.models import tiny_llama

from tunecast.config.spec import RunSpec
from tunecast.estimate.tracer import trace_step
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import build_meta_model

CONFIG = tiny_llama(num_hidden_layers=2, hidden_size=128, intermediate_size=384, vocab_size=1024)
BATCH, SEQ = 2, 256


def matmul_params() -> tuple[int, int, int]:
    """(weights in the decoder layers' Linears, rank-4 LoRA adapters on all of them, the output head)."""
    import torch

    model = build_meta_model(CONFIG)
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    adapters = sum(4 * (m.in_features + m.out_features) for m in linears)
    return sum(m.weight.numel() for m in linears), adapters, model.lm_head.weight.numel()


def attention_flops(factor: float) -> float:
    """4·b·h·s²·d per layer for a forward pass (QKᵀ and AV), halved for the causal mask; the backward pass
    costs 2.5 forwards (it recomputes the scores)."""
    heads, head_dim = CONFIG["num_attention_heads"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    forward = 4 * BATCH * heads * SEQ * SEQ * head_dim / 2
    return CONFIG["num_hidden_layers"] * forward * factor


@pytest.mark.parametrize(("method", "checkpointing"), [("full", False), ("lora", False), ("full", True),
                                                       ("lora", True)])
def test_matmul_flops_follow_the_analytic_count(method: str, checkpointing: bool) -> None:
    settings = TraceSettings.from_spec(RunSpec(model="x", method=method, lora={"rank": 4}),
                                       grad_checkpointing=checkpointing)
    flops = trace_step(CONFIG, settings, BATCH, SEQ).flops
    layers, adapters, head = matmul_params()
    h, i, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_key_value_heads"] * 32
    first_qkv = h * h + 2 * h * kv  # the first layer's q, k, v weights
    first_qkv_adapters = 3 * 4 * h  # their adapters' A matrices (rank 4) see the same input
    down = CONFIG["num_hidden_layers"] * i * h
    if method == "full":
        per_token = 6 * layers + 6 * head + (2 * (layers - down) if checkpointing else 0)
    elif checkpointing:
        per_token = 4 * layers + 6 * adapters + 4 * head + 2 * layers + 2 * adapters
    else:
        per_token = 4 * layers + 6 * adapters + 4 * head - 2 * first_qkv - 2 * first_qkv_adapters
    # exact but for one rank-4 adapter product in the LoRA + checkpointing case (0.07%)
    assert flops["matmul"] == pytest.approx(BATCH * SEQ * per_token, rel=1e-3)
    assert flops["attention"] == pytest.approx(attention_flops(1 + 2.5 + (1 if checkpointing else 0)), rel=1e-9)
