"""Another tool's config as read into a tunecast config (`--from TOOL FILE`): the mapping a config file would hold,
and every key of the tool's file accounted for, mapped or not with the reason (runners/ reads each tool's files;
load.py validates the mapping like any config file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Unmapped:
    """A key of the other tool's config that tunecast did not use, and why."""

    key: str  # as written in the tool's file; nested keys dotted (`model.lora_rank`, `datasets.0.type`)
    value: Any
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": _plain(self.value), "reason": self.reason}


@dataclass(frozen=True)
class Imported:
    tool: str
    source: Path
    config: dict[str, Any]  # a tunecast config, nested as in a YAML file, `runner` included
    mapped: dict[str, tuple[str, ...]]  # tool key -> the tunecast keys it set
    unmapped: tuple[Unmapped, ...]
    lines: dict[str, int] = field(default_factory=dict)  # tunecast key -> line of the tool key it came from
    notes: tuple[str, ...] = ()  # approximations made while mapping, one line each

    def as_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "file": str(self.source),
                "mapped_keys": {key: list(targets) for key, targets in self.mapped.items()},
                "unmapped_keys": [item.as_dict() for item in self.unmapped], "notes": list(self.notes)}


def _plain(value: Any) -> Any:
    """A value JSON can hold (YAML may give dates and other objects)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
