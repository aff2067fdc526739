"""Building a model's real architecture on the meta device and counting its parameters."""

import pytest

from tunecast.errors import TunecastError
from tunecast.step.shape import build_meta_model, count_parameters

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000}


def test_tied_embeddings_are_counted_once() -> None:
    untied = count_parameters(build_meta_model({**TINY, "tie_word_embeddings": False}))
    tied = count_parameters(build_meta_model({**TINY, "tie_word_embeddings": True}))
    assert untied - tied == 1000 * 64


def test_weights_live_on_the_meta_device() -> None:
    model = build_meta_model(TINY)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_unknown_architecture_is_a_user_error() -> None:
    with pytest.raises(TunecastError, match="unknown to it"):
        build_meta_model({**TINY, "model_type": "no-such-arch"})
