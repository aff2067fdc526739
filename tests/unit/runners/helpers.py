"""What every reader test checks: every key of the tool's file accounted for, and a config that validates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tunecast.config.imported import Imported
from tunecast.config.spec import RunSpec
from tunecast.runners.mapping import leaves

DATA = Path(__file__).parents[2] / "data" / "runners"


def unaccounted(imported: Imported) -> list[str]:
    """Leaf keys of the tool's file that are neither mapped nor unmapped (nor under a key that is)."""
    document = yaml.safe_load(imported.source.read_text(encoding="utf-8"))
    taken = set(imported.mapped) | {item.key for item in imported.unmapped}
    missing = []
    for key, _ in leaves(document):
        parts = key.split(".")
        if not any(".".join(parts[:n]) in taken for n in range(1, len(parts) + 1)):
            missing.append(key)
    return missing


def checked(imported: Imported) -> RunSpec:
    """The imported config validated as a tunecast config, after checking that every key is accounted for."""
    assert unaccounted(imported) == []
    for item in imported.unmapped:
        assert item.reason.strip(), item.key
    for key in imported.lines:
        assert _has(imported.config, key), key
    return RunSpec.model_validate(imported.config)


def flat(config: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            found |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            found[key] = value
    return found


def reason(imported: Imported, key: str) -> str:
    return next(item.reason for item in imported.unmapped if item.key == key)


def _has(config: dict[str, Any], key: str) -> bool:
    *sections, leaf = key.split(".")
    for section in sections:
        config = config.get(section, {})
    return leaf in config
