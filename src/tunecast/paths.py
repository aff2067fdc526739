"""Where tunecast keeps the user's files: the user catalog and the cache (XDG base directories)."""

from __future__ import annotations

import functools
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
    environ = os.environ
    return _cache_dir(environ.get(CACHE_ENV), environ.get("XDG_CACHE_HOME"), environ.get("HOME"))


@functools.lru_cache(maxsize=16)  # an estimate asks for it at every profile it looks up: made once per environment
def _cache_dir(chosen: str | None, _xdg_cache: str | None, _home: str | None) -> Path:
    if chosen:
        return Path(chosen)
    return _xdg("XDG_CACHE_HOME", ".cache") / "tunecast"


def cache_file(*parts: str) -> Path:
    """`cache_dir() / parts…`, the same path object for the same parts in the same environment (an estimate names
    the same cache files hundreds of times)."""
    return _cache_file(cache_dir(), parts)


@functools.lru_cache(maxsize=8192)
def _cache_file(root: Path, parts: tuple[str, ...]) -> Path:
    return root.joinpath(*parts)
