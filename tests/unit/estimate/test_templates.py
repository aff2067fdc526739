"""Templates (templates.py) against direct traces of real configs: byte for byte wherever one is used."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tunecast.catalog.store import load_catalog
from tunecast.estimate import profiles, templates
from tunecast.estimate.settings import AdapterSettings, TraceSettings
from tunecast.estimate.shape import shallow_config_data, text_config_data
from tunecast.estimate.tracer import trace_step

LORA = TraceSettings("lora", AdapterSettings(16, 32, 0.05, "all-linear", False, ()), "bf16", "adamw", False,
                     True, "sdpa", "standard")
FULL = TraceSettings("full", AdapterSettings(8, 8, 0.0, "all-linear", False, ()), "fp16-mixed", "adamw-foreach",
                     False, False, "eager", "standard")


def config(name: str, layers: int | None = None) -> dict[str, Any]:
    model = load_catalog(None).models.find(name)
    assert model is not None
    data = text_config_data(model.data)
    return shallow_config_data(data, layers) if layers is not None else data


def assert_exact(data: dict[str, Any], settings: TraceSettings, batch: int, seq: int) -> None:
    pair = profiles.templated_profiles(data, settings, batch, seq)
    assert pair is not None, "no template served the model"
    for profile in {id(p): p for p in (pair.shallow, pair.deeper)}.values():
        traced = trace_step(shallow_config_data(data, profile.layers), settings, batch, seq)
        assert templates._same(profile, traced, batch, seq)


@pytest.mark.parametrize("name, settings, batch, seq", [
    ("Qwen/Qwen3-0.6B", LORA, 2, 96),             # head size given apart from the hidden size
    ("Qwen/Qwen2.5-0.5B", LORA, 1, 80),           # micro-batch 1, tied embeddings, q/k/v biases
    ("mistralai/Mistral-7B-v0.1", FULL, 3, 40),   # full fine-tuning, autocast, foreach AdamW, eager attention
    ("meta-llama/Llama-2-7b-hf", LORA, 2, 48),    # one query head per key-value head
])
def test_a_template_equals_a_trace_of_the_real_model(name: str, settings: TraceSettings, batch: int,
                                                     seq: int) -> None:
    assert_exact(config(name, layers=4), settings, batch, seq)


def test_a_template_extrapolated_in_depth_equals_the_traces_at_both_depths() -> None:
    """A deep model: templates at 4 and 8 layers, each equal to its trace; the depth-8 one at a length
    where the batch holds more tokens than the vocabulary has entries (the embedding's read is capped)."""
    data = config("meta-llama/Llama-3.2-1B")
    pair = profiles.templated_profiles(data, LORA, 2, 64)
    assert pair is not None and (pair.shallow.layers, pair.deeper.layers, pair.layers) == (4, 8, 16)
    assert_exact(data, LORA, 2, 64)


def test_every_family_of_the_catalog_is_served_by_a_template_or_traced() -> None:
    catalog = load_catalog(None)
    served = {}
    for name in catalog.models.names:
        data = config(name)
        served.setdefault(data["model_type"], templates.applies(data, LORA, 512))
    assert served == {"llama": True, "mistral": True, "qwen2": True, "qwen3": True, "gpt2": False, "phi": False,
                      "gemma2": False, "mixtral": False, "qwen3_moe": False, "gpt_oss": False}
    llama = config("meta-llama/Llama-3.1-8B")
    assert not templates.applies(llama, TraceSettings(**{**LORA.__dict__, "loss": "chunked"}), 512)
    assert not templates.applies(config("mistralai/Mistral-7B-v0.1"), LORA, 8192)  # above the sliding window


def test_one_template_serves_every_rank_and_every_model_of_a_structure() -> None:
    a = templates.template_key(config("meta-llama/Llama-3.1-8B"), LORA, True)
    other_rank = TraceSettings(**{**LORA.__dict__, "adapters": AdapterSettings(64, 16, 0.1, "all-linear", False, ())})
    assert templates.template_key(config("meta-llama/Llama-3.1-70B"), other_rank, True) == a
    assert templates.template_key(config("meta-llama/Llama-3.1-8B"), LORA, False) != a
    assert templates.template_key(config("meta-llama/Llama-3.1-8B"), FULL, True) != a


def test_a_structure_no_template_reads_is_traced_and_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def unreadable(data: dict[str, Any], settings: TraceSettings, multi: bool) -> None:
        built.append(data["model_type"])

    monkeypatch.setattr(templates, "build_template", unreadable)
    data = {**config("Qwen/Qwen2.5-0.5B", layers=2), "rope_theta": 12345.0, "tie_word_embeddings": False}
    assert profiles.templated_profiles(data, LORA, 2, 64) is None
    templates._READ.clear()
    assert profiles.templated_profiles(data, LORA, 2, 64) is None  # read back from the cache: not built again
    assert built == ["qwen2"]
    path = templates.cache_path(templates.template_key(data, LORA, True))
    assert "failed" in json.loads(path.read_text())
