"""LoRA targets against a model's modules, by peft's own rule, without torch.

peft (`check_target_module_exists`, peft/tuners/tuners_utils.py) adapts a module when a name of `target_modules` is
the module's full name (`model.layers.0.self_attn.q_proj`) or a dotted suffix of it (`q_proj`,
`self_attn.q_proj`). A name that matches nothing is an error in peft only when no name of the list matches
anything; one misspelt name among good ones trains the others silently. And a name that matches only a block
(`mlp`), a norm or an activation is refused by peft when it builds the adapter. Here every name must match a
module LoRA can adapt (a linear layer, an embedding, GPT-2's Conv1D), or the run is refused before it starts.

The module names come from the catalog's table of each architecture's modules (catalog/modules.py), so that
`validate` can check without building the model; where the table lacks the architecture, the same check runs on
the built model before any work (step/targets.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tunecast.catalog.models import ModelConfig
from tunecast.errors import Problem, suggestion_text

FIELD = "lora.targets"


def matches(target: str, name: str) -> bool:
    """peft's rule for a list of target names: the full module name, or a dotted suffix of it."""
    return name == target or name.endswith(f".{target}")


def targets_problem(targets: Sequence[str] | str, model: ModelConfig) -> Problem | None:
    """The problem with `targets` on `model`, or None: `all-linear`, every name adapts a module, or an architecture
    the catalog's table lacks (checked on the built model instead)."""
    from tunecast.catalog.modules import module_names

    if isinstance(targets, str):
        return None
    modules = module_names(model)
    if modules is None:
        return None
    return modules_problem(targets, modules, f"{model.name} ({model.text_config.get('model_type')})")


def modules_problem(targets: Sequence[str], modules: Mapping[str, bool], label: str) -> Problem | None:
    """The problem with `targets` among `modules` (every module name of the model → whether LoRA can adapt it), or
    None. `label` names the model in the message."""
    missing: list[str] = []
    blocks: dict[str, list[str]] = {}
    for target in dict.fromkeys(targets):
        found = [name for name in modules if matches(target, name)]
        if not found:
            missing.append(target)
        elif not any(modules[name] for name in found):
            blocks[target] = _layers_inside(found, modules)
    if not missing and not blocks:
        return None
    layers = _leaves(name for name, adaptable in modules.items() if adaptable)
    parts: list[str] = []
    hints: list[str] = []
    if missing:
        parts.append(f"{_quoted(missing)} {'matches' if len(missing) == 1 else 'match'} no module of {label}")
        for target in missing:
            close = suggestion_text(target, [*layers, *_suffixes(modules)], n=1)
            if close:
                hints.append(close if len(missing) == 1 else f"For {target!r}: {close[0].lower()}{close[1:]}")
    if blocks:
        parts.append(f"{_quoted(list(blocks))} {'names' if len(blocks) == 1 else 'name'} only modules LoRA cannot "
                     "adapt (blocks, norms, activations)")
        for target, inside in blocks.items():
            if inside:
                hints.append(f"{target!r} holds {', '.join(inside)}: name those.")
    hints.append(f"The layers LoRA can adapt in {label}: {', '.join(layers)}; or all-linear.")
    unmatched = len(missing) + len(blocks)
    scope = (" (peft would train the other names alone)" if unmatched < len(set(targets)) and missing and not blocks
             else "")
    return Problem(FIELD, "; ".join(parts) + scope, " ".join(hints))


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in names)


def _leaves(names: Iterable[str]) -> list[str]:
    """The last part of each module name, each once, in order."""
    return list(dict.fromkeys(name.rpartition(".")[2] for name in names))


def _suffixes(modules: Mapping[str, bool]) -> list[str]:
    """Two-part suffixes of adaptable modules (`self_attn.q_proj`), for a target written with its parent."""
    return list(dict.fromkeys(".".join(name.split(".")[-2:]) for name, adaptable in modules.items()
                              if adaptable and "." in name))


def _layers_inside(found: list[str], modules: Mapping[str, bool]) -> list[str]:
    """The adaptable layers within the modules a target names (`mlp` → gate_proj, up_proj, down_proj)."""
    inside = [name for name, adaptable in modules.items() if adaptable
              and any(name.startswith(f"{block}.") for block in found)]
    return _leaves(inside)
