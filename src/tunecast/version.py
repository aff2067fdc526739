"""Version of the package and of the JSON documents it prints."""

from __future__ import annotations

from typing import Any, overload

__version__ = "0.1.0"

# Bumped whenever a JSON document's keys change incompatibly; every document carries it.
SCHEMA_VERSION = 1


@overload
def stamped(document: dict[str, Any]) -> dict[str, Any]: ...
@overload
def stamped(document: list[dict[str, Any]]) -> list[dict[str, Any]]: ...
def stamped(document: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
    """A document as `--json` prints it (and the web planner answers it): `schema_version` first in the object, or
    in every object of a list."""
    if isinstance(document, list):
        return [{"schema_version": SCHEMA_VERSION, **item} for item in document]
    return {"schema_version": SCHEMA_VERSION, **document}
