"""LoRA targets checked on a built model: the modules peft can adapt, and the check `apply_adapters` runs first.

The layer types are those peft's default LoRA dispatcher adapts (`dispatch_default`, peft/tuners/lora/layer.py, peft
0.21): torch's Linear (bitsandbytes' 4- and 8-bit layers are Linear subclasses), Embedding, Conv1d/2d/3d and
MultiheadAttention, and transformers' Conv1D (GPT-2). The same classification writes the catalog's table of each
architecture's modules (scripts/update_module_names.py), which `validate` reads without torch.
"""

from __future__ import annotations

from typing import Any

from tunecast.config.targets import modules_problem
from tunecast.errors import TunecastError


def adaptable(module: Any) -> bool:
    """Whether peft's LoRA can put an adapter on `module`."""
    import torch
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
             torch.nn.MultiheadAttention, Conv1D)
    return isinstance(module, kinds)


def module_table(model: Any) -> dict[str, bool]:
    """Every named module of `model` (the causal LM, as peft sees it) → whether LoRA can adapt it."""
    return {name: adaptable(module) for name, module in model.named_modules() if name}


def check_targets(model: Any, targets: tuple[str, ...] | list[str] | str) -> None:
    """Raise a user error naming lora.targets when a target name adapts no module of `model` (peft would train the
    others silently, or fail inside its own code)."""
    if isinstance(targets, str):
        return
    label = f"this model ({getattr(getattr(model, 'config', None), 'model_type', 'unknown type')})"
    problem = modules_problem(list(targets), module_table(model), label)
    if problem is not None:
        raise TunecastError(problem.message, field=problem.field, hint=problem.hint)
