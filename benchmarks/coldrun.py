"""One console command as a new user runs it: a fresh process, an empty cache, the bundled catalog, the Hub offline,
stopped at a time limit. Shared by the cold-estimate benchmarks (runner_speed.py, diffusion_cold.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ColdRun:
    seconds: float | None  # None: stopped at the limit
    traced: bool  # its stderr announced a trace (one of the words asked for)
    answer: dict[str, Any] | None  # the JSON document on stdout
    problem: str | None  # "stopped", "exit N: …" or "no JSON" where there is no answer


def run_cold(command: list[str], limit: float, home: Path, trace_words: tuple[str, ...]) -> ColdRun:
    """Run `command` from the repository with its own empty cache under `home` (exit 3, does not fit, is an answer)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNECAST_")}
    env.update({"TUNECAST_CACHE": tempfile.mkdtemp(prefix="cache-", dir=home),
                "TUNECAST_CATALOG": str(home / "catalog"), "HF_HUB_OFFLINE": "1"})
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired as stopped:
        said = stopped.stderr.decode() if isinstance(stopped.stderr, bytes) else (stopped.stderr or "")
        return ColdRun(None, any(word in said for word in trace_words), None, "stopped")
    elapsed = time.perf_counter() - start
    traced = any(word in done.stderr for word in trace_words)
    if done.returncode not in (0, 3):
        return ColdRun(elapsed, traced, None,
                       "exit " + str(done.returncode) + ": " + done.stderr.strip().splitlines()[-1][:120])
    try:
        return ColdRun(elapsed, traced, json.loads(done.stdout), None)
    except ValueError:
        return ColdRun(elapsed, traced, None, "no JSON")


def cell(seconds: float | None, limit: float) -> str:
    """A table cell of a run's seconds, `> limit` where it was stopped."""
    return f"> {limit:g}" if seconds is None else f"{seconds:.2f}"
