"""Templates (templates.py) against direct traces of real configs: byte for byte wherever one is used."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from tunecast.catalog.store import load_catalog
from tunecast.estimate import profiles, symbols, templates
from tunecast.estimate.memo import Memo
from tunecast.estimate.tracer import trace_step
from tunecast.step.settings import AdapterSettings, TraceSettings
from tunecast.step.shape import WINDOW_UNLESS_USED, shallow_config_data, text_config_data

LORA = TraceSettings("lora", AdapterSettings(16, 32, 0.05, "all-linear", False, ()), "bf16", "adamw", False,
                     True, "sdpa", "standard")
FULL = TraceSettings("full", AdapterSettings(8, 8, 0.0, "all-linear", False, ()), "fp16-mixed", "adamw-foreach",
                     False, False, "eager", "standard")
# Full fine-tuning in bf16 weights with sdpa attention.
FULL_BF16 = TraceSettings(**{**FULL.__dict__, "precision": "bf16", "attention": "sdpa"})


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
    ("google/gemma-2-2b", LORA, 2, 40),           # sliding and global layers alternating, soft-capped logits
    ("google/gemma-2-2b", LORA, 1, 48),
    ("microsoft/phi-1_5", LORA, 2, 40),           # half of each head rotated, biased projections, fc1/fc2 MLP
    ("openai-community/gpt2", LORA, 2, 40),       # fused qkv Conv1D, learned positions, dropout everywhere
    ("openai-community/gpt2-large", FULL_BF16, 1, 32),
])
def test_a_template_equals_a_trace_of_the_real_model(name: str, settings: TraceSettings, batch: int,
                                                     seq: int) -> None:
    assert_exact(config(name, layers=4), settings, batch, seq)


ATTENTION = TraceSettings(**{**LORA.__dict__, "adapters": AdapterSettings(16, 32, 0.05, ("q_proj", "k_proj", "v_proj",
                                                                                       "o_proj"), False, ())})


@pytest.mark.parametrize("name, settings, batch, seq", [
    ("mistralai/Mixtral-8x7B-v0.1", ATTENTION, 2, 40),   # 8 experts top-2, no dense MLP, head size derived
    ("Qwen/Qwen3-30B-A3B", ATTENTION, 1, 48),           # 128 experts top-8 of their own width, head size given
    ("mistralai/Mixtral-8x7B-v0.1", FULL_BF16, 2, 24),  # full fine-tuning: the experts' weights train
    ("Qwen/Qwen3-30B-A3B", FULL, 1, 32),                # fp32 master weights: the grouped matmuls run in fp32
    ("openai/gpt-oss-20b", ATTENTION, 2, 200),          # above its 128-token window; hidden size not heads × head
    ("openai/gpt-oss-20b", ATTENTION, 1, 160),
])
def test_a_template_of_a_mixture_of_experts_equals_a_trace(name: str, settings: TraceSettings, batch: int,
                                                           seq: int) -> None:
    """Grouped expert matmuls size every buffer by the routed (token, expert) pairs, b·s·k, whatever the
    router chose, so the marker model's experts (41 of them, 31 per token) read back exactly."""
    assert_exact(config(name, layers=2), settings, batch, seq)


def test_above_a_sliding_window_a_template_equals_a_trace() -> None:
    """From the window's length on the masks differ (sliding layers mask what the full ones keep); a template of
    that side is read with a marker window below both marker lengths and checked at another window."""
    pair = profiles.templated_profiles(config("google/gemma-2-2b", layers=2), LORA, 2, 4160)
    assert pair is not None and pair.shortest == 4096 and pair.longest is None and not pair.covers(2, 4095)
    assert_exact(config("google/gemma-2-2b", layers=2), LORA, 2, 4160)


@pytest.mark.parametrize("built_from, serves", [
    ("meta-llama/Llama-2-70b-hf", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),  # attention_bias: false stated or not
    ("Qwen/Qwen2-7B", "Qwen/Qwen1.5-110B"),                              # an unused sliding window of another size
    ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x22B-v0.1"),     # another auxiliary loss coefficient
])
def test_a_template_built_from_one_model_serves_another_of_its_structure(built_from: str, serves: str) -> None:
    settings = ATTENTION if "Mixtral" in built_from else LORA
    first, second = config(built_from, layers=4), config(serves, layers=4)
    assert templates.template_key(first, settings, True) == templates.template_key(second, settings, True)
    templates.get_template(first, settings, True)
    assert_exact(second, settings, 2, 40)


# Configs as a person writes them by hand (or a tool saves them, with only what differs from the class's defaults):
# the model type and the sizes, at widths and depths of no catalog model.
HAND_WRITTEN = {
    "llama": {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000},
    "mistral": {"model_type": "mistral", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 10,
                "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32768},
    "qwen2": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 2432, "num_hidden_layers": 9,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 64000},
    "qwen3": {"model_type": "qwen3", "hidden_size": 640, "intermediate_size": 1792, "num_hidden_layers": 14,
              "num_attention_heads": 10, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 50000},
    "mixtral": {"model_type": "mixtral", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 16,
                "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000, "num_local_experts": 4,
                "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("family", sorted(HAND_WRITTEN))
def test_a_config_that_leaves_its_class_defaults_out_is_served_by_the_template_of_its_catalog_structure(
        family: str) -> None:
    """Such a config builds the model of the catalog configs that state those defaults (tie_word_embeddings: false,
    hidden_act: silu, ...): their shipped template serves it, no trace (the class defaults' table,
    catalog/data/config_defaults.json); for Llama, checked against traces of the config itself."""
    from tunecast.config.spec import RunSpec

    data = HAND_WRITTEN[family]
    settings = TraceSettings.from_spec(RunSpec(model="x", method="lora"), config_data=data)
    stated = templates._structure(shallow_config_data(data, 8))
    assert templates._stated_alike(shallow_config_data(data, 8)) and not templates._kept(
        templates.template_key({**data, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, settings, True))
    pair = profiles.templated_profiles(data, settings, 2, 256, trace=False)  # NeedsTrace where it would trace
    assert pair is not None and (pair.origin or "").startswith("template"), stated
    if family == "llama":
        assert_exact(data, settings, 2, 40)


def test_the_defaults_a_structure_leaves_out_are_the_config_classes() -> None:
    from transformers import AutoConfig

    for model_type, defaults in {**symbols._DEFAULTS, **symbols._STATED}.items():
        made = AutoConfig.for_model(model_type)
        for key, value in defaults.items():
            assert getattr(made, key, value) == value, (model_type, key)
    # a config that leaves out what published ones state is their structure
    llama = config("meta-llama/Meta-Llama-3-8B")
    assert symbols.structure({k: v for k, v in llama.items() if k != "hidden_act"}) == symbols.structure(llama)
    for model_type in WINDOW_UNLESS_USED:
        assert AutoConfig.for_model(model_type, sliding_window=77, use_sliding_window=False).sliding_window is None
    for model_type, keys in symbols._UNREAD.items():  # no file of the model type's package mentions them
        package = Path(importlib.import_module(f"transformers.models.{model_type}").__file__).parent
        for source in package.glob("*.py"):
            assert not any(key in source.read_text() for key in keys), (model_type, source.name)


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
        served.setdefault(data["model_type"], templates.applies(data, LORA))
    assert served == {"llama": True, "mistral": True, "qwen2": True, "qwen3": True, "gpt2": True, "phi": True,
                      "gemma2": True, "mixtral": True, "qwen3_moe": True, "gpt_oss": True,
                      "phi3": True, "gemma3_text": True, "deepseek_v2": False}
    llama = config("meta-llama/Llama-3.1-8B")
    chunked = TraceSettings(**{**LORA.__dict__, "loss": "chunked"})  # composed onto the rest of the step's template
    assert templates.applies(llama, chunked) and templates.template_key(llama, chunked, True) != \
        templates.template_key(llama, LORA, True)
    mistral = config("mistralai/Mistral-7B-v0.1")  # each side of the sliding window has its templates
    assert templates.above_window(mistral, 8192) and templates.above_window(mistral, 4096)
    assert not templates.above_window(mistral, 4095)
    assert not templates.above_window(llama, 1 << 20)
    assert templates.template_key(mistral, LORA, True, above=True) != templates.template_key(mistral, LORA, True)


def test_one_template_serves_every_rank_and_every_model_of_a_structure() -> None:
    a = templates.template_key(config("meta-llama/Llama-3.1-8B"), LORA, True)
    other_rank = TraceSettings(**{**LORA.__dict__, "adapters": AdapterSettings(64, 16, 0.1, "all-linear", False, ())})
    assert templates.template_key(config("meta-llama/Llama-3.1-70B"), other_rank, True) == a
    assert templates.template_key(config("meta-llama/Llama-3.1-8B"), LORA, False) != a
    assert templates.template_key(config("meta-llama/Llama-3.1-8B"), FULL, True) != a


def test_a_marker_model_that_does_not_run_is_recorded_as_no_template() -> None:
    """Phi rotating 0.4 of each head: at the marker head size the rotated part is odd and the step fails;
    the structure is traced the old way (where the real model runs)."""
    data = {**config("microsoft/phi-1_5", layers=2), "partial_rotary_factor": 0.4}
    assert templates.build_template(data, LORA, True) is None


def test_a_structure_no_template_reads_is_traced_and_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def unreadable(data: dict[str, Any], settings: TraceSettings, multi: bool, above: bool = False) -> None:
        built.append(data["model_type"])

    monkeypatch.setattr(templates, "build_template", unreadable)
    data = {**config("Qwen/Qwen2.5-0.5B", layers=2), "rope_theta": 12345.0, "tie_word_embeddings": False}
    assert profiles.templated_profiles(data, LORA, 2, 64) is None
    templates._READ.clear()
    assert profiles.templated_profiles(data, LORA, 2, 64) is None  # read back from the cache: not built again
    assert built == ["qwen2"]
    path = templates.cache_path(templates.template_key(data, LORA, True))
    assert "failed" in json.loads(path.read_text())


def test_the_order_of_the_target_modules_changes_no_template() -> None:
    """peft keeps a list of target modules as a set: one template serves every order of the same list."""
    def targeting(*modules: str) -> TraceSettings:
        return TraceSettings(**{**LORA.__dict__, "adapters": AdapterSettings(16, 32, 0.0, modules, False, ())})

    llama = config("meta-llama/Llama-3.1-8B")
    key = templates.template_key(llama, targeting("q_proj", "v_proj"), True)
    assert templates.template_key(llama, targeting("v_proj", "q_proj", "q_proj"), True) == key
    assert templates.template_key(llama, targeting("q_proj", "k_proj"), True) != key


def test_events_are_stored_by_column_and_read_back_as_they_were() -> None:
    events = [("a", 0, [[4, [1, 0]]], "weights", "setup", 0), ("a", 1, [[2, [0, 1]]], "activations", "forward", 1),
              ("f", 0, [], "", "backward", 1), ("a", 2, [[4, [1, 0]]], "temporaries", "backward", 1)]
    table = templates.columns(events)
    assert len(table["polys"]) == 3 and len(table["names"]) == 9  # a size and a name kept once each
    rows = list(zip(*(table[column] for column in ("kind", "key", "size", "category", "phase", "step")),
                    strict=True))
    assert [(table["names"][k], key, table["polys"][p], table["names"][c], table["names"][ph], step)
            for k, key, p, c, ph, step in rows] == [tuple(e) for e in events]


def test_without_tracing_a_setting_no_template_serves_is_refused_not_traced(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    def no_trace(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("traced")

    monkeypatch.setattr(templates, "build_template", no_trace)
    monkeypatch.setattr(profiles, "trace_profiles", no_trace)
    data = {**config("Qwen/Qwen2.5-0.5B", layers=2), "rope_theta": 54321.0}  # a structure nothing has cached
    with pytest.raises(profiles.NeedsTrace):
        profiles.get_profiles(data, LORA, 2, 64, trace=False)
    chunked = TraceSettings(**{**LORA.__dict__, "loss": "chunked"})  # never templated
    with pytest.raises(profiles.NeedsTrace):
        profiles.get_profiles(config("Qwen/Qwen2.5-0.5B", layers=2), chunked, 2, 64, trace=False)


def test_library_versions_are_the_installed_releases_without_a_build_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed versions, each a release: torch 2.13.0+cpu (PyTorch's CPU index), 2.13.0 (PyPI) and
    2.13.0+cu130 key the same templates, so those shipped serve every build of the release."""
    from importlib.metadata import version

    installed = {package: version(package).split("+")[0] for package in ("torch", "transformers", "peft")}
    assert profiles.library_versions() == installed
    keys = set()
    for build in ("", "+cpu", "+cu130"):
        profiles.library_versions.cache_clear()
        profiles.release.cache_clear()
        templates._versions.cache_clear()
        monkeypatch.setattr(profiles, "_version", lambda package, build=build: installed[package] + (
            build if package == "torch" else ""))
        monkeypatch.setattr(templates, "_KEYS", Memo())
        keys.add(templates.template_key(config("Qwen/Qwen2.5-0.5B", layers=2), LORA, True))
    profiles.library_versions.cache_clear()
    profiles.release.cache_clear()
    templates._versions.cache_clear()
    assert len(keys) == 1


MIXED = TraceSettings(**{**LORA.__dict__, "precision": "bf16-mixed"})


def test_a_mixed_precision_template_equals_a_trace() -> None:
    """fp32 weights under bf16 autocast: the casts autocast keeps are freed, as the forward pass leaves autocast,
    in the order of a hash table, which differs between traces; frees with no allocation between them are
    compared as a set (templates._free_runs_sorted)."""
    assert_exact(config("Qwen/Qwen3-0.6B", layers=4), MIXED, 2, 96)


def test_fp16_and_bf16_autocast_allocate_alike_and_fp8_is_traced_as_bf16() -> None:
    data = config("Qwen/Qwen3-0.6B", layers=2)
    fp16 = trace_step(data, TraceSettings(**{**MIXED.__dict__, "precision": "fp16-mixed"}), 2, 64)
    bf16 = trace_step(data, MIXED, 2, 64)
    assert [(e.kind, e.key, e.nbytes, e.category, e.phase, e.step) for e in templates._free_runs_sorted(fp16.events)] \
        == [(e.kind, e.key, e.nbytes, e.category, e.phase, e.step) for e in templates._free_runs_sorted(bf16.events)]
    from tunecast.config.spec import RunSpec

    def traced(precision: str) -> str:
        spec = RunSpec.model_validate({"model": "Qwen/Qwen3-0.6B", "precision": precision})
        return TraceSettings.from_spec(spec).precision

    assert [traced(p) for p in ("fp16-mixed", "bf16-mixed", "fp8", "bf16", "fp32")] == \
        ["bf16-mixed", "bf16-mixed", "bf16", "bf16", "fp32"]


def test_frees_with_no_allocation_between_them_are_compared_in_key_order() -> None:
    from tunecast.estimate.tracer import Event

    events = [Event("a", 1, 8), Event("a", 2, 8), Event("f", 2), Event("f", 1), Event("a", 3, 8), Event("f", 3),
              Event("c", 1, category="activations"), Event("f", 5), Event("f", 4)]
    assert [(e.kind, e.key) for e in templates._free_runs_sorted(events)] == [
        ("a", 1), ("a", 2), ("f", 1), ("f", 2), ("a", 3), ("f", 3), ("c", 1), ("f", 4), ("f", 5)]


@pytest.mark.parametrize("name, layers", [("meta-llama/Llama-3.2-1B", ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"]),
                                          ("microsoft/phi-1_5", ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"]),
                                          ("microsoft/Phi-3-mini-4k-instruct", ["qkv_proj", "o_proj", "gate_up_proj",
                                                                                "down_proj"]),
                                          ("openai-community/gpt2", ["c_attn", "c_proj", "c_fc"])])
def test_a_target_list_of_every_linear_layer_is_all_linear(name: str, layers: list[str]) -> None:
    """The same adapter as `all-linear` (peft adapts every linear layer but the head): the same trace, so the
    same template; a list missing one layer is another."""
    data = config(name, layers=2)
    listed = TraceSettings(**{**LORA.__dict__, "adapters": AdapterSettings(16, 32, 0.05, tuple(reversed(layers)),
                                                                           False, ())})
    one_less = TraceSettings(**{**LORA.__dict__, "adapters": AdapterSettings(16, 32, 0.05, tuple(layers[1:]),
                                                                             False, ())})
    full = config(name)
    assert templates.template_key(full, listed, True) == templates.template_key(full, LORA, True)
    assert templates.template_key(full, one_less, True) != templates.template_key(full, LORA, True)

    def events(settings: TraceSettings) -> list[tuple[Any, ...]]:
        trace = trace_step(data, settings, 2, 32)
        return [(e.kind, e.key, e.nbytes, e.category, e.phase, e.step) for e in trace.events] + [trace.facts]

    assert events(listed) == events(LORA)


def _runner_settings(runner: str, method: str) -> TraceSettings:
    """The settings a config naming `runner` traces, the runner's defaults applied as loading a config does."""
    from tunecast.config.runner import apply_runner
    from tunecast.config.spec import RunSpec

    spec = apply_runner(RunSpec.model_validate({"model": "x", "runner": runner, "method": method,
                                                "lora": {"dropout": 0.05}}))
    return TraceSettings.from_spec(spec)


@pytest.mark.parametrize("runner, method, name, batch, seq", [
    # the Trainer's step (autocast, the fp32 copy of the logits) and, for QLoRA, peft's fp32 casts (kbit-fp32)
    ("hf-trainer", "qlora", "Qwen/Qwen2.5-0.5B", 2, 64),     # tied embeddings: the fp32 cast of a shared weight
    ("hf-trainer", "lora", "meta-llama/Llama-2-7b-hf", 1, 48),
    ("axolotl", "lora", "google/gemma-2-2b", 2, 40),        # soft-capped logits copied to fp32
    ("axolotl", "full", "Qwen/Qwen3-0.6B", 1, 64),
    ("llamafactory", "full", "mistralai/Mistral-7B-v0.1", 2, 40),  # full: fp32 weights under autocast (its default)
    ("llamafactory", "qlora", "Qwen/Qwen3-0.6B", 2, 48),
])
def test_a_runner_s_template_equals_a_trace_of_that_runner_s_step(runner: str, method: str, name: str, batch: int,
                                                                  seq: int) -> None:
    """Runners whose step differs from tunecast's by casts and copies (step/variants.py, no chunked loss) are
    served from templates of their own step, which reproduce a direct trace of it byte for byte."""
    settings = _runner_settings(runner, method)
    assert settings.runner_step, "the runner's step is tunecast's own: this would test nothing new"
    assert_exact(config(name, layers=4), settings, batch, seq)


# Tiny configs of the fused Phi-3 layout and of Gemma 3's text model, built here (no catalog entry): a few seconds a
# template. Phi-3 fuses q, k and v into one projection of (heads + 2·kv)·head outputs and gate and up into one of
# 2·intermediate; Gemma 3 alternates sliding and full layers, each type with its own rotary embedding, and normalises
# queries and keys.
PHI3 = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 320, "num_hidden_layers": 2, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096, "sliding_window": 2047, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "pad_token_id": 0}
# Phi-4-mini's kind: a quarter of each head left unrotated, longrope frequencies (one factor per rotated pair), tied
# embeddings, three query heads per kv head.
PHI4_MINI = {**PHI3, "num_attention_heads": 6, "hidden_size": 96, "partial_rotary_factor": 0.75,
             "max_position_embeddings": 131072, "tie_word_embeddings": True, "sliding_window": 262144,
             "rope_scaling": {"type": "longrope", "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0],
                              "short_factor": [1.0] * 6}}
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 32, "intermediate_size": 96, "vocab_size": 320, "num_hidden_layers": 2,
          "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512, "query_pre_attn_scalar": 32,
          "rope_theta": 1000000, "rope_local_base_freq": 10000, "hidden_activation": "gelu_pytorch_tanh",
          "pad_token_id": 0}


@pytest.mark.parametrize("data, settings, batch, seq", [
    (PHI3, LORA, 2, 40),                                             # grouped: qkv_proj is kv·(g + 2)·head wide
    ({**PHI3, "num_key_value_heads": 4}, LORA, 1, 48),               # one query head per kv head: 3·kv·head
    (PHI3, FULL_BF16, 2, 24),                                        # full fine-tuning: the fused weights train
    (PHI4_MINI, LORA, 2, 40),                                        # 0.75 of each head rotated (head units of 8)
    ({**PHI3, "sliding_window": 32}, LORA, 2, 48),                   # above the window: the sliding mask
    (GEMMA3, LORA, 2, 40),                                           # a single kv head (gemma-3-1b's)
    ({**GEMMA3, "num_key_value_heads": 2}, LORA, 1, 48),
    ({**GEMMA3, "num_key_value_heads": 2}, FULL, 2, 24),             # autocast, foreach AdamW, eager attention
    ({**GEMMA3, "sliding_window": 32}, LORA, 2, 48),                 # above the window
])
def test_a_template_of_phi3_or_gemma3_equals_a_trace(data: dict[str, Any], settings: TraceSettings, batch: int,
                                                     seq: int) -> None:
    assert_exact(data, settings, batch, seq)


def test_a_single_kv_head_is_structure() -> None:
    """Multi-query attention (one kv head) copies less than several heads do (a key of one head stays contiguous
    once transposed), so a marker model keeps one kv head: a template read at 7 kv heads differed from the trace
    of a Llama of one. Other structures' keys are unchanged (the entry is there only when true)."""
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
             "intermediate_size": 96, "vocab_size": 320, "num_hidden_layers": 2, "pad_token_id": 0}
    assert symbols.structure(llama)["_single_kv"] is True
    assert "_single_kv" not in symbols.structure({**llama, "num_key_value_heads": 2})
    assert symbols.marker_config(llama, symbols.MARKERS)["num_key_value_heads"] == 1
    assert_exact(llama, LORA, 2, 40)


def test_a_fused_qkv_width_is_read_back_with_two_more_heads_per_kv_head() -> None:
    """Phi-3's markers give g + 2 a prime factor of its own (61), read as the sum; other types are not read so."""
    markers = symbols.FUSED_MARKERS
    n = 2 * markers["kv"] * (markers["g"] + 2) * markers["hd2"] * markers["r"] * 2
    poly = symbols.factor(n, markers, shifted=symbols.shifts(PHI3))
    assert poly is not None
    assert symbols.evaluate(poly, {"kv": 8, "g": 3, "hd2": 48, "r": 16}) == 2 * 8 * 5 * 48 * 16 * 2
    assert symbols.factor(n, markers, shifted=symbols.shifts(config("meta-llama/Llama-3.2-1B"))) is None
    values = set(symbols.FUSED_CHECK_MARKERS.values())
    assert symbols.FUSED_CHECK_MARKERS["g"] + 2 not in values and symbols.FUSED_MARKERS["g"] + 2 not in \
        set(symbols.FUSED_MARKERS.values())


def test_phi3_head_units_split_the_rotated_part_in_halves() -> None:
    assert symbols.units(PHI3) == (2, 1)
    assert symbols.units(PHI4_MINI) == (8, 1) and symbols.markers(PHI4_MINI)["hd2"] * 8 <= 256
    assert symbols.units({**PHI3, "partial_rotary_factor": 0.5}) == (4, 1)
    shaped = symbols.marker_config(PHI4_MINI, symbols.markers(PHI4_MINI))
    rotated = int(shaped["hidden_size"] // shaped["num_attention_heads"] * 0.75)
    assert len(shaped["rope_scaling"]["long_factor"]) == rotated // 2
    # the factors' numbers are no structure: Phi-3.5-mini and a copy with other factors share templates
    phi35 = config("microsoft/Phi-3.5-mini-instruct")
    other = {**phi35, "rope_scaling": {**phi35["rope_scaling"], "long_factor": [2.0] * 48}}
    assert templates.template_key(phi35, LORA, True) == templates.template_key(other, LORA, True)


def test_within_building_beside_a_second_process_builds_half_of_the_other_templates(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The command line's estimates (`building_beside`): where a template must be built, a second process (a new
    interpreter) builds half of the other templates of the same settings (micro-batch 1 and 2+, each side of a
    sliding window) at the same time, and this process its own share before it waits; each is built once, and the
    second process's are those this process builds alone."""
    monkeypatch.setattr(templates, "_READ", {})
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path / "beside"))
    monkeypatch.delenv("TUNECAST_NO_PREWARM", raising=False)
    monkeypatch.delenv("TUNECAST_NO_CACHE", raising=False)
    here: list[tuple[bool, bool]] = []
    built = templates._built

    def building(data: dict[str, Any], settings: TraceSettings, multi: bool, above: bool) -> dict[str, Any]:
        here.append((multi, above))
        return built(data, settings, multi, above)

    monkeypatch.setattr(templates, "_built", building)
    data = config("mistralai/Mistral-7B-v0.1", layers=1)  # with a sliding window
    settings = TraceSettings(**{**LORA.__dict__, "adapters": AdapterSettings(8, 16, 0.0, ("o_proj",), False, ())})
    assert all(templates.cached_template(templates.template_key(data, settings, multi, above)) is None
               for multi in (False, True) for above in (False, True))  # none shipped
    shapes = [(True, True), (False, False), (False, True), (True, False)]
    with templates.building_beside():
        found = [json.loads(json.dumps(templates.get_template(data, settings, multi, above=above)))
                 for multi, above in shapes]
    assert here == [(True, True), (True, False)] and not templates._BESIDE  # its own, then its share
    assert all("profiles" in template for template in found)
    monkeypatch.setattr(templates, "_READ", {})
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path / "alone"))
    for (multi, above), template in zip(shapes[1:3], found[1:3], strict=True):  # the second process's
        assert json.loads(json.dumps(templates.get_template(data, settings, multi, above=above))) == template
    assert here[2:] == shapes[1:3]
