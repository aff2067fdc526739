"""Every decoder-only family the estimator promises: a tiny config of each traces and estimates."""

from typing import Any

import pytest

from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.estimate.memory import estimate_memory

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 2048}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral", "sliding_window": 4096},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "gemma2": {"model_type": "gemma2", "head_dim": 16},  # eager attention, logit soft-capping, alternating layers
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 16},
    "phi": {"model_type": "phi", "partial_rotary_factor": 0.5, "hidden_act": "gelu_new"},
    "phi3": {"model_type": "phi3", "pad_token_id": 0},  # its default pad id (32000) is outside this vocabulary
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "head_dim": 16},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 2048,
             "vocab_size": 256},
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["lora", "full"])
def test_family_is_estimated(family: str, method: str) -> None:
    config = FAMILIES[family] if family == "gpt2" else {**BASE, **FAMILIES[family]}
    catalog = load_catalog(None)
    spec = RunSpec(model="x", method=method, micro_batch=2, seq_len=256)
    estimate = estimate_memory(spec, config, device="cuda", gpu=catalog.gpus.get("l4"), overheads=catalog.overheads)
    breakdown = estimate.breakdown_gib
    assert estimate.peak_allocated_gib > 0 and breakdown["activations"] > 0
    frozen, trained = breakdown["weights"], breakdown["trainable_weights"]
    assert (frozen > trained) == (method == "lora")
