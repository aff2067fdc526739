"""Recompute the `params` column of the bundled model index from each config on the meta device.

Run after adding a config file to src/tunecast/catalog/data/models/ and a row for it (params 1) to
models.csv:  .venv/bin/python scripts/update_model_index.py
"""

from __future__ import annotations

import sys

from tunecast.catalog.models import MODEL_COLUMNS, ModelEntry, read_config_file
from tunecast.catalog.rows import parse_rows, write_rows
from tunecast.catalog.store import MODELS_DIR, MODELS_FILE, bundled_data_dir
from tunecast.step.shape import build_meta_model, count_parameters


def main() -> int:
    directory = bundled_data_dir()
    index = directory / MODELS_FILE
    rows = parse_rows(index.read_text(), ModelEntry, MODELS_FILE)
    updated = []
    for row in rows:
        data = read_config_file(directory / MODELS_DIR / row.file)
        params = count_parameters(build_meta_model(data, name=row.name))
        if params != row.params:
            print(f"{row.name}: {row.params:,} → {params:,}", file=sys.stderr)
        updated.append(row.model_copy(update={"params": params}))
    index.write_text(write_rows(updated, MODEL_COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
