"""Estimator tests share one profile cache for the session: traces of the same tiny model and settings are
deterministic, so reusing them changes no result and saves most of the tracing time."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profile-cache")


@pytest.fixture(autouse=True)
def _profile_cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))
