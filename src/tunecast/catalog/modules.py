"""Each architecture's module names, as data: what `lora.targets` may name, known without building the model.

modules.json holds, by `model_type`, every module name of the causal-LM model transformers builds (the decoder
layer's index written `{i}`) and whether LoRA can adapt the module. scripts/update_module_names.py writes it from the
bundled configs; a test rebuilds a model of each type and compares. No torch here.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunecast.catalog.models import ModelConfig

MODULES_FILE = "modules.json"
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


@functools.cache
def _table() -> dict[str, dict[str, bool]]:
    document: dict[str, Any] = json.loads((Path(__file__).parent / "data" / MODULES_FILE).read_text(encoding="utf-8"))
    table: dict[str, dict[str, bool]] = document["model_types"]
    return table


def module_names(model: ModelConfig) -> dict[str, bool] | None:
    """Every module name of `model` (`model.layers.3.mlp.down_proj`) → whether LoRA can adapt it; None when the
    table lacks its architecture or its depth is unknown."""
    known = _table().get(str(model.text_config.get("model_type")))
    layers = model.num_layers
    if known is None or layers is None:
        return None
    names: dict[str, bool] = {}
    for pattern, adaptable in known.items():
        for index in range(layers) if "{i}" in pattern else (None,):
            names[pattern if index is None else pattern.replace("{i}", str(index))] = adaptable
    return names


def patterns(modules: Mapping[str, bool]) -> dict[str, bool] | None:
    """`modules` with the layer index written `{i}` (the table's form); None when a name holds two indices (experts
    in a list inside each layer), which the table's expansion by layer cannot describe."""
    found: dict[str, bool] = {}
    for name, adaptable in modules.items():
        if len(_INDEX.findall(name)) > 1:
            return None
        pattern = _INDEX.sub("{i}", name)
        found[pattern] = found.get(pattern, False) or adaptable
    return found
