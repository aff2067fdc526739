"""Estimator tests share the session's profile cache (see tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _profile_cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))
