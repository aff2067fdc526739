"""Changes to the user's catalog directory: added models and imported offers. Files are replaced
atomically, and rows with the same key are replaced, never duplicated."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any

from tunecast.atomic import write_text_atomic
from tunecast.catalog.models import MODEL_COLUMNS, ModelEntry, file_name_for, read_config_file
from tunecast.catalog.offers import OFFER_COLUMNS, Offer
from tunecast.catalog.rows import parse_rows, write_rows
from tunecast.catalog.store import MODELS_DIR, MODELS_FILE, OFFERS_FILE, load_catalog
from tunecast.errors import TunecastError
from tunecast.paths import default_user_catalog_dir


def user_catalog_dir(user_dir: Path | None) -> Path:
    return (user_dir if user_dir is not None else default_user_catalog_dir()).expanduser().resolve()


def merge_offers(new: list[Offer], user_dir: Path | None) -> Path:
    """Add `new` to the user's offers.csv, replacing rows with the same key. Returns the file written."""
    directory = user_catalog_dir(user_dir)
    path = directory / OFFERS_FILE
    existing = parse_rows(path.read_text(encoding="utf-8"), Offer, str(path)) if path.exists() else []
    merged = {offer.key: offer for offer in existing}
    merged.update({offer.key: offer for offer in new})
    write_text_atomic(path, write_rows(list(merged.values()), OFFER_COLUMNS))
    load_catalog.cache_clear()
    return path


def read_model_config(config: Path) -> dict[str, Any]:
    """The config `models add` was given: a config.json file, or a model directory holding one."""
    config_path = config / "config.json" if config.is_dir() else config
    if not config_path.is_file():
        raise TunecastError(f"{config_path} does not exist", field="config",
                            hint="give a config.json file or a model directory holding one")
    return read_config_file(config_path, field_name="config")


def add_model(data: dict[str, Any], *, name: str, params: int, source: str,
              user_dir: Path | None) -> tuple[ModelEntry, Path]:
    """Copy a model config into the user's catalog with its exact parameter count, which the caller counts
    (on the meta device, in estimate/) so that the catalog never imports torch."""
    try:
        entry = ModelEntry(name=name, file=file_name_for(name), params=params, as_of=date.today(),
                           source=source)
    except ValueError:
        raise TunecastError(f"{name!r} is not a model id of the form org/name", field="--name",
                            hint="for example --name my-org/llama-3.1-8b-custom") from None
    directory = user_catalog_dir(user_dir)
    target = directory / MODELS_DIR / entry.file
    write_text_atomic(target, json.dumps(data, indent=2) + "\n")
    index = directory / MODELS_FILE
    rows = parse_rows(index.read_text(encoding="utf-8"), ModelEntry, str(index)) if index.exists() else []
    rows = [row for row in rows if row.name != entry.name] + [entry]
    write_text_atomic(index, write_rows(rows, MODEL_COLUMNS))
    load_catalog.cache_clear()
    return entry, target
