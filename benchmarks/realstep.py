"""A real training step's setup for the CPU measurement scripts: the model built from a config with random
weights in the run's precision, prepared as tunecast's trainer prepares it (adapters, checkpointing), and its
optimizer. Importing this module imports torch and transformers, so a caller reads its baseline memory after."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tunecast.config.spec import RunSpec
from tunecast.step.settings import TraceSettings
from tunecast.step.setup import make_optimizer, param_dtype, prepare_for_training, training_config
from tunecast.step.shape import hf_config


def build(config: dict[str, Any], settings: dict[str, Any]) -> tuple[RunSpec, Any, Any]:
    """(the run's spec, the prepared model, its optimizer) for `config` trained with `settings`."""
    spec = RunSpec.model_validate({"model": "x", **settings})
    trace = TraceSettings.from_spec(spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(training_config(config)), dtype=param_dtype(spec.precision),
                                             attn_implementation=trace.attention)
    model = prepare_for_training(model, trace)
    return spec, model, make_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
