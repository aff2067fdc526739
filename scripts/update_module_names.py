"""Write the catalog's table of module names by architecture (src/tunecast/catalog/data/modules.json).

`tunecast validate` checks `lora.targets` against a model's modules without torch: this table holds, for each
`model_type` of the bundled model configs, every module name of its causal-LM model as transformers builds it (the
layer index written `{i}`) and whether LoRA can adapt the module (step/targets.py). It is the union over the
catalog's configs of that type, each built on the meta device. A test rebuilds a model of every type and compares.
Run after adding a config of a new architecture, or after upgrading transformers:
    .venv/bin/python scripts/update_module_names.py
"""

from __future__ import annotations

import json
import sys

from tunecast.catalog.models import ModelEntry, read_config_file
from tunecast.catalog.modules import MODULES_FILE, patterns
from tunecast.catalog.rows import parse_rows
from tunecast.catalog.store import MODELS_DIR, MODELS_FILE, bundled_data_dir
from tunecast.step.shape import build_meta_model, num_layers, shallow_config_data, text_config_data
from tunecast.step.targets import module_table


def main() -> int:
    import transformers

    directory = bundled_data_dir()
    rows = parse_rows((directory / MODELS_FILE).read_text(), ModelEntry, MODELS_FILE)
    table: dict[str, dict[str, bool]] = {}
    for row in rows:
        data = read_config_file(directory / MODELS_DIR / row.file)
        model_type = str(text_config_data(data)["model_type"])
        shallow = shallow_config_data(data, min(num_layers(data), 4))
        found = patterns(module_table(build_meta_model(shallow, name=row.name)))
        if found is None:
            print(f"{row.name}: module names with two indices; {model_type} is checked on the built model",
                  file=sys.stderr)
            continue
        known = table.setdefault(model_type, {})
        for name, adaptable in found.items():
            known[name] = known.get(name, False) or adaptable
    document = {"source": "scripts/update_module_names.py: named_modules() of the causal-LM model transformers "
                          "builds from each bundled config, on the meta device",
                "transformers": transformers.__version__,
                "model_types": dict(sorted(table.items()))}  # modules in the order the model holds them
    (directory / MODULES_FILE).write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
