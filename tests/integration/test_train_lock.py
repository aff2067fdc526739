"""One writer per run output, on object storage and locally, with real processes.

On S3 (moto on loopback) the lock object is kept fresh by a background thread from before loading to after
`final/`: a run held in model loading for longer than the stale age keeps its output, and a second launch is
refused. A run paused (SIGSTOP) for longer than that loses the output to a second launch, and when continued it
stops with a user error, writing nothing more. Locally, a second launch into a busy output is refused before the
training libraries are imported.

Lock periods are shortened with TUNECAST_LOCK_REFRESH_S (0.5 s: stale after 3 s). Two warm fork servers
(tests/forkserver.py) run the two launches at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.s3server import FAKE_AWS_ENV
from tests.trainruns import NO_EVAL, REPO, ForkServer, tiny_run

from tunecast.storage.store import LOCK

REFRESH_S = 0.5
STALE_S = 6 * REFRESH_S


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ForkServer, ForkServer]]:
    first, second = ForkServer.start(), ForkServer.start()
    yield first, second
    first.stop()
    second.stop()


@pytest.fixture
def on_s3(servers: tuple[ForkServer, ForkServer], s3_endpoint: str) -> Iterator[tuple[ForkServer, ForkServer]]:
    env = {**FAKE_AWS_ENV, "TUNECAST_TEST_S3_ENDPOINT": s3_endpoint, "TUNECAST_LOCK_REFRESH_S": str(REFRESH_S)}
    for server in servers:
        server.env = env
    yield servers
    for server in servers:
        server.env = {}


def wait_for(ready: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.02)


def text(log: Path) -> str:
    return " ".join(log.read_text().split()) if log.exists() else ""


def test_a_run_held_in_loading_keeps_its_output(on_s3: tuple[ForkServer, ForkServer], s3_url: str,
                                                tmp_path: Path) -> None:
    first, second = on_s3
    config = tiny_run(tmp_path, output=s3_url, max_steps=2, **NO_EVAL)
    pid = first.start_one(["train", str(config)], tmp_path / "first.txt", slow_load_s=3 * STALE_S)
    wait_for(lambda: "loading held" in text(tmp_path / "first.txt"), "held in loading")
    time.sleep(STALE_S + 2 * REFRESH_S)  # no step, no checkpoint: only the refresher keeps the lock

    code = second.run(["train", str(config)], tmp_path / "second.txt")

    assert code == 2, text(tmp_path / "second.txt")[-3000:]
    assert f"is in use by pid {pid} on " in text(tmp_path / "second.txt")
    assert first.wait_one() == 0, text(tmp_path / "first.txt")[-3000:]
    assert "took over" not in text(tmp_path / "first.txt")


def snapshot(fs: object, root: str) -> dict[str, bytes]:
    """Every object of the run but the lock, with its bytes."""
    fs.invalidate_cache()  # type: ignore[attr-defined]
    return {path: fs.cat(path) for path in fs.find(root) if not path.endswith(LOCK)}  # type: ignore[attr-defined]


def test_a_paused_run_loses_its_output_and_stops_without_writing(on_s3: tuple[ForkServer, ForkServer], s3_url: str,
                                                                  tmp_path: Path) -> None:
    import fsspec

    first, second = on_s3
    fs = fsspec.filesystem("s3")
    root = s3_url.removeprefix("s3://")
    config = tiny_run(tmp_path, output=s3_url, **{"checkpoint.every_steps": 100})
    pid = first.start_one(["train", str(config)], tmp_path / "first.txt")
    wait_for(lambda: "step 1/16" in text(tmp_path / "first.txt"), "training")

    def refreshed() -> float:
        fs.invalidate_cache()
        return float(json.loads(fs.cat(f"{root}/{LOCK}"))["refreshed"])

    # stop it just after a refresh landed, as a machine suspended between two refreshes
    before = refreshed()
    wait_for(lambda: refreshed() != before, "refreshed")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALE_S + 1)
        code = second.run(["train", str(config)], tmp_path / "second.txt")
        assert code == 0, text(tmp_path / "second.txt")[-3000:]
        assert f"took over the lock left by pid {pid} on " in text(tmp_path / "second.txt")
        written = snapshot(fs, root)
        assert f"{root}/final/adapter_model.safetensors" in written
    finally:
        os.kill(pid, signal.SIGCONT)

    assert first.wait_one() == 2, text(tmp_path / "first.txt")[-3000:]
    assert f"this run lost the lock of {s3_url} to " in text(tmp_path / "first.txt")
    assert "this run stops without writing anything more" in text(tmp_path / "first.txt")
    assert snapshot(fs, root) == written


def test_a_busy_local_output_is_refused_before_the_libraries_load(servers: tuple[ForkServer, ForkServer],
                                                                   tmp_path: Path) -> None:
    """The second launch is a fresh interpreter, as a user's: refused before torch is imported."""
    first, _ = servers
    config = tiny_run(tmp_path, max_steps=2, **NO_EVAL)
    pid = first.start_one(["train", str(config)], tmp_path / "first.txt", slow_load_s=60)
    wait_for(lambda: "loading held" in text(tmp_path / "first.txt"), "held in loading")
    probe = ("import sys, time\nstarted = time.monotonic()\nfrom tunecast.cli import main\n"
             "try:\n    main(['train', sys.argv[1]])\nexcept SystemExit as done:\n    code = done.code\n"
             "print(code, 'torch' in sys.modules, round(time.monotonic() - started, 2), file=sys.stderr)")
    try:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", probe, str(config)], capture_output=True, text=True, cwd=REPO,
                              timeout=120)
        seconds = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGKILL)
        first.wait_one()
    code, torch_loaded, in_process_s = done.stderr.split()[-3:]
    print(f"refused in {seconds:.2f} s ({in_process_s} s after the interpreter started)")
    assert code == "2", done.stderr[-3000:]
    assert f"is in use by pid {pid} on " in " ".join(done.stderr.split())
    assert torch_loaded == "False"
    assert float(in_process_s) < 2.0
