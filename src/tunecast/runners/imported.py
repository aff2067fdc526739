"""Another tool's config read into a tunecast config (`--from TOOL FILE`), and what could not be carried over.

Each reader (runners/axolotl.py, llamafactory.py, trl.py, torchtune.py) turns the tool's YAML into the nested
mapping a tunecast config file holds — with `runner:` set to the tool, so that the estimate is of that tool's
step — and accounts for every key of the file: mapped (to which tunecast keys), or unmapped with the reason. No key
is dropped silently. The mapping is then validated like any config file (config/load.py), so a value that
cannot be used gets the usual message naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOOLS = ("axolotl", "llamafactory", "trl", "torchtune")


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


def read_config(tool: str, path: Path) -> Imported:
    """`path` read as `tool`'s config (one of TOOLS)."""
    import importlib

    from tunecast.errors import TunecastError

    if tool not in TOOLS:
        from difflib import get_close_matches

        close = get_close_matches(tool, TOOLS, n=1)
        raise TunecastError(f"--from {tool}: not a tool whose configs tunecast reads" +
                            (f" (did you mean {close[0]}?)" if close else ""), field="--from",
                            hint=f"use one of: {', '.join(TOOLS)}")
    reader = importlib.import_module(f"tunecast.runners.{tool}")
    imported: Imported = reader.read(path)
    return imported
