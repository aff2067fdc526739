"""The warm server (tunecast/cli/warm.py): a quick command runs in a child forked from a server that imported
tunecast already, with the caller's arguments, directory, environment, streams, signals and exit status."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from tests.conftest import PYTHON, REPO, run_subprocess

from tunecast.cli import warm

ESTIMATE = ["memory", "--model", "meta-llama/Llama-3.1-8B", "--method", "lora", "--json", "--micro-batch", "2"]


@pytest.fixture
def served():  # type: ignore[no-untyped-def]
    """The environment of commands that use a warm server of their own; the server is stopped afterwards. Its
    directory is a short one (a socket's path holds about 100 bytes; pytest's temporary paths are longer)."""
    directory = Path(tempfile.mkdtemp(prefix="tcw-", dir="/tmp"))
    env = {"TUNECAST_WARM": "1", "TUNECAST_WARM_DIR": str(directory), "TUNECAST_WARM_IDLE": "120"}
    yield env
    for lock in directory.glob("*.lock"):
        text = lock.read_text().strip()
        if text:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(text), signal.SIGTERM)
    shutil.rmtree(directory, ignore_errors=True)


# The console script, as users run it: its import path starts with its own directory, wherever it is run from (under
# `python -m` it would start with the working directory, and each directory would have a server of its own).
TUNECAST = str(Path(PYTHON).parent / "tunecast")


def _tunecast(*args: str, env: dict[str, str], cwd: Path | None = None):  # type: ignore[no-untyped-def]
    return run_subprocess(TUNECAST, *args, env=env, cwd=cwd)


def _wait_until(check, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _started(env: dict[str, str]) -> None:
    """Run a first quick command (which starts the server) and wait until the server listens."""
    assert _tunecast("gpus", env=env).code == 0
    _wait_until(lambda: any(Path(env["TUNECAST_WARM_DIR"]).glob("*.sock")))


def _served_lines(env: dict[str, str]) -> list[str]:
    return [line for log in Path(env["TUNECAST_WARM_DIR"]).glob("*.log") for line in log.read_text().splitlines()]


def test_a_served_command_prints_and_exits_as_one_run_in_its_own_process(served: dict[str, str]) -> None:
    _started(served)
    through_server = _tunecast(*ESTIMATE, "--seq-len", "1500", env=served)
    alone = _tunecast(*ESTIMATE, "--seq-len", "1500", env={"TUNECAST_WARM": "0"})
    assert through_server.code == alone.code == 0
    assert through_server.stdout == alone.stdout and through_server.json()["micro_batch"] == 2
    assert through_server.stderr == alone.stderr
    assert any(" memory exit 0 in " in line for line in _served_lines(served))

    bad = _tunecast("memory", "--model", "nobody/no-such-model", env=served)
    bad_alone = _tunecast("memory", "--model", "nobody/no-such-model", env={"TUNECAST_WARM": "0"})
    assert bad.code == bad_alone.code == 2
    assert bad.stderr == bad_alone.stderr and "unknown model" in bad.stderr
    assert any(" memory exit 2 in " in line for line in _served_lines(served))


def test_the_child_has_the_callers_directory_and_environment(served: dict[str, str], tmp_path: Path) -> None:
    _started(served)
    catalog = tmp_path / "my-catalog"
    catalog.mkdir()
    bundled = (REPO / "src" / "tunecast" / "catalog" / "data" / "gpus.csv").read_text().splitlines()
    header, row = bundled[0], next(line for line in bundled[1:] if line.startswith("rtx-3090,"))
    mine = row.replace("rtx-3090,NVIDIA GeForce RTX 3090,", "lab-card,Lab Card,", 1).replace(
        "3090;RTX3090;RTX 3090;RTX-3090;GeForce RTX 3090;NVIDIA GeForce RTX 3090", "labcard", 1)
    (catalog / "gpus.csv").write_text(f"{header}\n{mine}\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.yaml").write_text("model: meta-llama/Llama-3.1-8B\nmethod: lora\n")

    listed = _tunecast("gpus", env={**served, "TUNECAST_CATALOG": str(catalog)})
    assert listed.code == 0 and "lab-card" in listed.stdout
    assert "lab-card" not in _tunecast("gpus", env=served).stdout  # each command has its own environment
    checked = _tunecast("validate", "run.yaml", env=served, cwd=work)  # a path relative to the caller
    assert checked.code == 0, checked.stderr
    assert sum(" exit 0 in " in line for line in _served_lines(served)) >= 3


def _blocked_on_fifo(env: dict[str, str], fifo: Path, waiting: int) -> subprocess.Popen[str]:
    """A served `validate` of a named pipe nobody writes: its child waits in open() until it is stopped.
    Returns once the server logged the `waiting`-th such command as started."""
    os.mkfifo(fifo)
    caller = subprocess.Popen([TUNECAST, "validate", str(fifo)], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_until(lambda: sum(line.endswith(" validate started") for line in _served_lines(env)) == waiting,
                timeout=30)
    time.sleep(1.0)  # into the command's open() (a signal before it stops the child alike)
    return caller


def _pid_of_started(env: dict[str, str], nth: int) -> str:
    return [line.split()[0] for line in _served_lines(env) if line.endswith(" validate started")][nth - 1]


def test_signals_reach_the_child_and_a_killed_caller_takes_its_child_along(served: dict[str, str],
                                                                          tmp_path: Path) -> None:
    _started(served)
    caller = _blocked_on_fifo(served, tmp_path / "a.yaml", 1)
    caller.send_signal(signal.SIGTERM)
    caller.communicate(timeout=30)
    assert caller.returncode == -signal.SIGTERM  # killed by it, as the command run alone would be
    child = _pid_of_started(served, 1)
    time.sleep(1.0)
    # the child was killed by the forwarded SIGTERM: it logged no exit (a child left behind would have been
    # stopped by its caller's closed connection, and logged exit 130)
    assert not any(line.startswith(f"{child} validate exit") for line in _served_lines(served))

    caller = _blocked_on_fifo(served, tmp_path / "b.yaml", 2)
    caller.send_signal(signal.SIGINT)
    caller.communicate(timeout=30)
    assert caller.returncode == 130  # as Ctrl-C ends the command run alone (typer exits 130)
    assert any(line.startswith(f"{_pid_of_started(served, 2)} validate exit 130 in ") for line in _served_lines(served))

    caller = _blocked_on_fifo(served, tmp_path / "c.yaml", 3)
    caller.kill()  # SIGKILL: nothing is forwarded; the child sees its caller's connection close
    caller.wait(timeout=30)
    child = _pid_of_started(served, 3)
    _wait_until(lambda: any(line.startswith(f"{child} validate exit 130 in ") for line in _served_lines(served)),
                timeout=30)


def test_an_idle_server_exits_and_removes_its_socket(served: dict[str, str]) -> None:
    env = {**served, "TUNECAST_WARM_IDLE": "3"}
    _started(env)
    lock = next(Path(env["TUNECAST_WARM_DIR"]).glob("*.lock"))
    pid = int(lock.read_text())

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

    _wait_until(gone, timeout=60)
    assert not any(Path(env["TUNECAST_WARM_DIR"]).glob("*.sock")) and not lock.read_text()


def test_a_module_that_fails_to_load_is_left_to_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose preload fails still serves: the command imports the module itself and reports the error as
    it would alone (a server that died instead would be started again by every command)."""
    import gc

    monkeypatch.setattr(warm, "PRELOAD", ("tunecast.no_such_module", "json"))
    try:
        warm._preload()
    finally:
        gc.unfreeze()


def test_only_quick_commands_go_to_a_server_and_only_when_it_is_on(monkeypatch: pytest.MonkeyPatch,
                                                                   served: dict[str, str], tmp_path: Path) -> None:
    monkeypatch.setenv("TUNECAST_WARM_DIR", served["TUNECAST_WARM_DIR"])
    monkeypatch.setenv("TUNECAST_WARM", "1")
    started: list[str] = []
    monkeypatch.setattr(warm, "_start_server", lambda directory, key: started.append(key))
    assert warm.run_warm(["train", "run.yaml"]) is None and warm.run_warm(["--catalog", "memory", "init"]) is None
    assert not started
    assert warm.run_warm(["--catalog", "dir", "memory", "--model", "x"]) is None  # none up: this one runs here
    assert started == [warm.server_key()]
    monkeypatch.setenv("TUNECAST_WARM", "0")
    assert warm.run_warm(["memory", "--model", "x"]) is None and len(started) == 1
    monkeypatch.setenv("TUNECAST_WARM", "1")
    monkeypatch.setenv("TUNECAST_WARM_DIR", str(tmp_path / ("deep" * 20)))  # no socket path that long
    assert warm.run_warm(["memory", "--model", "x"]) is None and len(started) == 1


def test_a_server_is_keyed_by_the_source_and_its_directory_is_private(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    copy = tmp_path / "tunecast"  # a copy of the sources: the real files' times are other tests' server keys
    shutil.copytree(Path(warm.__file__).parent.parent, copy, ignore=shutil.ignore_patterns("data", "__pycache__"))
    monkeypatch.setattr(warm, "__file__", str(copy / "cli" / "warm.py"))
    before = warm.server_key()
    source = copy / "estimate" / "memory.py"
    status = source.stat()
    os.utime(source, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
    assert warm.server_key() != before  # an edited tunecast is served by a new server
    os.utime(source, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert warm.server_key() == before
    monkeypatch.setenv("PYTHONWARNINGS", "error")  # a child would inherit the server's interpreter settings
    assert warm.server_key() != before

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    monkeypatch.setenv("TUNECAST_WARM_DIR", str(shared))
    assert warm.server_dir() is None  # others could reach the socket: no server
    monkeypatch.setenv("TUNECAST_WARM_DIR", str(tmp_path / "mine"))
    made = warm.server_dir()
    assert made is not None and made.stat().st_mode & 0o777 == 0o700
