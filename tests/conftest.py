"""Shared fixtures. Every test runs with its own empty user catalog and cache, so a developer's own
catalog never changes a result, and calls the real entry point (`tunecast.cli.main`)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tunecast.catalog.store import load_catalog

REPO = Path(__file__).resolve().parent.parent
# A user catalog and cache of the suite's own, set before any fixture runs: module- and session-scoped fixtures
# (and the processes they start) never read the developer's ~/.local/share/tunecast, whose measurements would
# change results, or whose rows from another tunecast version would be refused. `isolated_home` gives each test
# an empty one of its own on top.
_SUITE_HOME = Path(tempfile.mkdtemp(prefix="tunecast-suite-"))
atexit.register(shutil.rmtree, _SUITE_HOME, ignore_errors=True)
os.environ["TUNECAST_CATALOG"] = str(_SUITE_HOME / "catalog")
os.environ["TUNECAST_CACHE"] = str(_SUITE_HOME / "cache")
# The suite never asks the Hugging Face Hub, in this process or in those it starts: a model outside the catalog is
# refused at once, offline, rather than after a fetch that waits on the network. The tests of fetching serve a
# stand-in Hub on loopback and turn offline mode off for themselves (tests/hub.py).
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("TUNECAST_CATALOG", str(home / "catalog"))
    monkeypatch.setenv("TUNECAST_CACHE", str(home / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("TUNECAST_DEBUG", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    load_catalog.cache_clear()
    return home


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One profile cache for the estimator tests of a session, shared by every xdist worker: traces of the
    same model and settings are deterministic and written atomically, so sharing them changes no result and
    saves most of the tracing time."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "profile-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("profile-cache")


@pytest.fixture
def profile_cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The session's shared profile cache as this test's cache (`pytestmark = pytest.mark.usefixtures(
    "profile_cache")` in a module whose tests estimate)."""
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))
    return shared_cache


@pytest.fixture
def catalog() -> Any:
    """The bundled catalog (each test's home is empty: no user rows)."""
    from tunecast.catalog.store import load_catalog

    return load_catalog(None)

@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """Run `tunecast ARGS…` in this process through the real entry point; return code and output."""
    from tunecast.cli import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            main(list(args))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        else:  # pragma: no cover - main always exits
            code = 0
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def run_subprocess(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Result:
    """Run a command in a fresh interpreter (for import checks and the installed console script)."""
    completed = subprocess.run(
        list(args), capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd or REPO,
        timeout=300,
    )
    return Result(completed.returncode, completed.stdout, completed.stderr)


PYTHON = sys.executable
