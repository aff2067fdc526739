"""A model's real architecture, built from its config on the meta device (no memory, no weights)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from tunecast.errors import TunecastError

if TYPE_CHECKING:
    import torch


def hf_config(data: dict[str, Any], *, name: str = "model") -> Any:
    """A transformers config object from a config.json's contents."""
    from transformers import AutoConfig

    fields = dict(data)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as error:
        raise TunecastError(
            f"transformers cannot build {name}: model_type {model_type!r} is unknown to it ({error})",
            field="model", hint="upgrade transformers, or use a model whose architecture it knows",
        ) from None


def build_meta_model(data: dict[str, Any], *, name: str = "model") -> torch.nn.Module:
    """The causal-LM model of a config on the meta device: its real modules, shapes and tied weights."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(data, name=name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(config)
            except ValueError as error:
                raise TunecastError(f"{name} is not a causal language model transformers can build: {error}",
                                    field="model", hint="tunecast fine-tunes decoder-only (causal LM) models")\
                    from None


def count_parameters(module: torch.nn.Module) -> int:
    """Parameters of `module`, each shared (tied) tensor counted once."""
    return sum(parameter.numel() for parameter in module.parameters())
