"""A model's real architecture, built from its config on the meta device (no memory, no weights)."""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

from tunecast.errors import TunecastError

if TYPE_CHECKING:
    import torch

# Keys that list one entry per decoder layer; a shallow copy of the model keeps the first k entries.
_PER_LAYER_KEYS = ("layer_types",)


def _text_section(data: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (itself, or its `text_config` for multimodal configs), not copied:
    for the readers below, which an estimate calls at every shape it replays."""
    inner = data.get("text_config")
    return inner if isinstance(inner, dict) and "model_type" in inner else data


def text_config_data(data: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config, as a deep copy: transformers edits nested entries such as
    `rope_scaling` in place."""
    return copy.deepcopy(_text_section(data))


# Types whose config class drops `sliding_window` unless `use_sliding_window` is set (transformers 5; checked in
# tests/unit/estimate/test_templates.py): their published configs often carry a window the model never uses.
WINDOW_UNLESS_USED = frozenset({"qwen2", "qwen3", "qwen3_moe"})


def sliding_window(data: dict[str, Any]) -> int | None:
    """The sliding attention window the model uses, in tokens, or None when it has none."""
    config = _text_section(data)
    if config.get("model_type") in WINDOW_UNLESS_USED and config.get("use_sliding_window") is not True:
        return None
    window = config.get("sliding_window")
    return window if isinstance(window, int) and window > 0 else None


# Config keys that count a mixture of experts' experts (Mixtral and gpt-oss; Qwen's MoE models; DeepSeek's).
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def has_experts(data: dict[str, Any]) -> bool:
    """Whether the model's MLP is a mixture of more than one expert."""
    config = _text_section(data)
    return any(isinstance(count := config.get(key), int) and count > 1 for key in _EXPERT_COUNT_KEYS)


def sliding_window_offset(data: dict[str, Any], seq: int) -> int:
    """0 below a sliding window; the window at and above it (attention masks differ on either side, so the
    fitting shapes must lie on the same side as the length asked for). At the window's own length transformers
    already builds the sliding mask (masking_utils `_ignore_causal_mask_sdpa` skips it only while the keys are
    fewer than the window)."""
    window = sliding_window(data)
    return window if window is not None and seq >= window else 0


def num_layers(data: dict[str, Any]) -> int:
    config = _text_section(data)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise TunecastError(f"the model config's {key} is {value}: a model has at least one layer",
                                    field="model", hint=f"check {key} in the config.json")
            return value
    raise TunecastError("the model config has no layer count (num_hidden_layers)", field="model",
                        hint="give a decoder-only model's config.json")


def layer_period(data: dict[str, Any]) -> int:
    """The smallest repeat of the per-layer pattern (2 for alternating sliding/full attention, else 1). A config
    without the list may state its repeat instead: Gemma 3's `sliding_window_pattern: 6` (five sliding layers, then
    a full one), from which transformers builds `layer_types` for the depth it is given, so that a copy of fewer
    layers than the repeat would have no full layer."""
    config = _text_section(data)
    for key in _PER_LAYER_KEYS:
        pattern = config.get(key)
        if isinstance(pattern, list) and pattern:
            for period in range(1, len(pattern) + 1):
                if all(pattern[i] == pattern[i % period] for i in range(len(pattern))):
                    return period
    stated = config.get("sliding_window_pattern")
    return stated if isinstance(stated, int) and not isinstance(stated, bool) and stated > 1 else 1


def shallow_config_data(data: dict[str, Any], layers: int) -> dict[str, Any]:
    """The same architecture with only its first `layers` decoder layers."""
    config = text_config_data(data)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int):
            config[key] = layers
    for key in _PER_LAYER_KEYS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    if isinstance(config.get("mlp_only_layers"), list):
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    return config


def hf_config(data: dict[str, Any], *, name: str = "model") -> Any:
    """A transformers config object from a config.json's contents."""
    from transformers import AutoConfig

    fields = text_config_data(data)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as error:
        raise TunecastError(
            f"transformers cannot build {name}: model_type {model_type!r} is unknown to it ({error})",
            field="model", hint="upgrade transformers, or use a model whose architecture it knows",
        ) from None
    except Exception as error:
        if not _refused_value(error):
            raise
        raise TunecastError(f"transformers refuses a value of {name}'s config: {_first_line(error)}", field="model",
                            hint="check that value in the config.json (a whole number where one is expected)") from None


def _refused_value(error: Exception) -> bool:
    """Whether `error` is a config class refusing a value of the wrong type (transformers' configs are strict
    dataclasses of huggingface_hub in transformers 5; a TypeError in older ones)."""
    if isinstance(error, TypeError):
        return True
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # a huggingface_hub before strict dataclasses
        return False
    return isinstance(error, StrictDataclassError)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return " ".join(line.strip() for line in lines[:2]) if lines else type(error).__name__


def build_meta_model(data: dict[str, Any], *, name: str = "model", dtype: Any = None,
                     attention: str | None = None) -> torch.nn.Module:
    """The causal-LM model of a config on the meta device: its real modules, shapes and tied weights.

    `attention` asks for an attention implementation (`sdpa`, `eager`); a model that does not support
    it gets transformers' own choice, readable afterwards from `model.config._attn_implementation`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
    # A model that does not support the asked attention gets transformers' own choice; the config is
    # built afresh for it, since a failed attempt leaves its choice written in the config.
    attempts = [{"attn_implementation": attention}, {}] if attention is not None else [{}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for number, attempt in enumerate(attempts, start=1):
            try:
                with torch.device("meta"):
                    return AutoModelForCausalLM.from_config(hf_config(data, name=name), **attempt, **kwargs)
            except (ValueError, ImportError) as error:
                if number == len(attempts):
                    raise TunecastError(f"{name} is not a causal language model transformers can build: {error}",
                                        field="model",
                                        hint="tunecast fine-tunes decoder-only (causal LM) models") from None
    raise AssertionError("unreachable")


def count_parameters(module: torch.nn.Module) -> int:
    """Parameters of `module`, each shared (tied) tensor counted once."""
    return sum(parameter.numel() for parameter in module.parameters())
