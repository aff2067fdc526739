"""Write the catalog's table of config defaults by architecture (src/tunecast/catalog/data/config_defaults.json).

A config.json may leave out an entry whose value is its config class's default (one written by hand, or saved by a
tool that writes only what differs): transformers builds the same model either way. The table holds, for each
`model_type` whose sizes a step template reads (estimate/symbols.py), the entries its config class fills in when they
are absent, without torch: a config that leaves them out is then recognised as the structure of a catalog model that
states them (estimate/templates.py), and the few entries read from a config directly are read as transformers reads
them. Left out: the sizes and the depth (a template's variables), and every entry the class derives from others
(a head size from the hidden size, the layer types from the depth, rope parameters from rope_theta), found by
building each class twice with those inputs changed. A test builds each class and compares. Run after upgrading
transformers:
    .venv/bin/python scripts/update_config_defaults.py
"""

from __future__ import annotations

import json
from typing import Any

from tunecast.catalog.models import CONFIG_DEFAULTS_FILE, class_defaults_table_path
from tunecast.estimate.symbols import DENSE_TYPES, DIMENSION_KEYS, MOE_TYPES

# Inputs that other entries are derived from, each given another value in a second build: what then changes is
# derived, not a default.
_CHANGED = {"num_hidden_layers": 7, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
            "intermediate_size": 160, "vocab_size": 320, "max_position_embeddings": 1024, "rope_theta": 12345.0,
            "n_embd": 96, "n_head": 6, "n_layer": 7, "n_positions": 1024}
# Entries that are never structure: what the config is, and where it came from.
_NOT_DEFAULTS = {"transformers_version", "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype"}


def defaults_of(model_type: str) -> dict[str, Any]:
    """The entries `model_type`'s config class fills in when a config leaves them out."""
    from transformers import AutoConfig

    plain = AutoConfig.for_model(model_type).to_dict()
    changed = AutoConfig.for_model(model_type, **_CHANGED).to_dict()
    return {key: value for key, value in sorted(plain.items())
            if key not in _NOT_DEFAULTS and key not in _CHANGED and key not in DIMENSION_KEYS
            and changed.get(key) == value}


def table() -> dict[str, Any]:
    import transformers

    return {"source": "scripts/update_config_defaults.py: AutoConfig.for_model(model_type).to_dict(), less what "
                      "the class derives from the sizes, the depth or rope_theta",
            "transformers": transformers.__version__,
            "model_types": {model_type: defaults_of(model_type) for model_type in sorted(DENSE_TYPES | set(MOE_TYPES))}}


def main() -> int:
    class_defaults_table_path().write_text(json.dumps(table(), indent=1, default=str) + "\n")
    print(f"wrote {CONFIG_DEFAULTS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
