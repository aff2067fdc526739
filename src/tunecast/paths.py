"""Where tunecast keeps the user's files: the user catalog and the cache (XDG base directories)."""

from __future__ import annotations

import os
from pathlib import Path

CATALOG_ENV = "TUNECAST_CATALOG"
CACHE_ENV = "TUNECAST_CACHE"


def _xdg(variable: str, fallback: str) -> Path:
    value = os.environ.get(variable)
    return Path(value) if value else Path.home() / fallback


def default_user_catalog_dir() -> Path:
    """`$TUNECAST_CATALOG`, else `$XDG_DATA_HOME/tunecast/catalog` (~/.local/share/tunecast/catalog)."""
    value = os.environ.get(CATALOG_ENV)
    if value:
        return Path(value)
    return _xdg("XDG_DATA_HOME", ".local/share") / "tunecast" / "catalog"


def cache_dir() -> Path:
    """`$TUNECAST_CACHE`, else `$XDG_CACHE_HOME/tunecast` (~/.cache/tunecast)."""
    value = os.environ.get(CACHE_ENV)
    if value:
        return Path(value)
    return _xdg("XDG_CACHE_HOME", ".cache") / "tunecast"
