"""Tiny real architectures, built from a config in-process, for estimator and training tests."""

from __future__ import annotations

from typing import Any


def tiny_llama(**changes: Any) -> dict[str, Any]:
    """A 10-layer Llama with hidden size 64: deep enough to exercise extrapolation (4 and 8 layers)."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 10,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}
    config.update(changes)
    return config


def shallow_llama(**changes: Any) -> dict[str, Any]:
    """The tiny Llama at two layers: traced once per shape (no depth fit), for tests of what uses a profile."""
    return tiny_llama(**{"num_hidden_layers": 2, **changes})


def tiny_qwen3(**changes: Any) -> dict[str, Any]:
    """Qwen3 shape: per-head q/k norms, head_dim × heads larger than the hidden size, tied embeddings."""
    config = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 10,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 640,
              "max_position_embeddings": 4096, "tie_word_embeddings": True}
    config.update(changes)
    return config


def shallow_gemma(**changes: Any) -> dict[str, Any]:
    """A two-layer Gemma (1): a type no step template reads, so that an estimate of it traces the step itself."""
    config = {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 640,
              "max_position_embeddings": 4096}
    config.update(changes)
    return config
