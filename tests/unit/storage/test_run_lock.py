"""The run's lock (`tunecast.storage.lock`): on object storage a background thread keeps it fresh whatever the run
is doing, a takeover needs it stale for several periods, and a run that lost it writes nothing more; locally a full
disk while taking it is a user error; `probe_lock` refuses a busy output without taking anything.

Object storage is fsspec's process-wide `memory://` filesystem (and S3 on moto where the behaviour depends on the
backend); two RunLocks in this one process stand for two runs. Periods are shortened with TUNECAST_LOCK_REFRESH_S.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tunecast.errors import TunecastError
from tunecast.storage import lock as run_lock
from tunecast.storage.lock import LockLost, RunLock, lock_periods, probe_lock
from tunecast.storage.store import LOCK, Storage

REFRESH_S = 0.2  # stale after 6 periods: 1.2 s


@pytest.fixture
def fast_lock(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("TUNECAST_LOCK_REFRESH_S", str(REFRESH_S))
    return lock_periods()[1]


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    url = f"memory://tunecast-lock-{uuid.uuid4().hex[:12]}/run"
    yield url
    fs = fsspec.filesystem("memory")
    root = "/" + url.removeprefix("memory://").split("/")[0]
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["memory", "s3"])
def remote_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


def held_by(storage: Storage) -> dict[str, Any]:
    return dict(json.loads(storage.read(LOCK)))


def test_periods_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNECAST_LOCK_REFRESH_S", raising=False)
    assert lock_periods() == (30.0, 180.0)
    monkeypatch.setenv("TUNECAST_LOCK_REFRESH_S", "2.5")
    assert lock_periods() == (2.5, 15.0)
    monkeypatch.setenv("TUNECAST_LOCK_REFRESH_S", "soon")
    with pytest.raises(TunecastError, match=r"^TUNECAST_LOCK_REFRESH_S is 'soon', not a number of seconds$"):
        lock_periods()


def test_the_lock_stays_fresh_while_the_run_does_nothing_else(fast_lock: float, remote_url: str) -> None:
    """No step ends, no checkpoint: the run is loading a model, say. The refresher alone keeps the lock, so a
    second launch long after the stale age is refused."""
    first = RunLock(Storage(remote_url))
    first.acquire()
    try:
        refreshed = held_by(first.storage)["refreshed"]
        time.sleep(fast_lock * 2)
        assert held_by(first.storage)["refreshed"] > refreshed
        with pytest.raises(TunecastError, match=r"is in use by pid \d+ on .* \(lock refreshed \d+ s ago\)$"):
            RunLock(Storage(remote_url)).acquire()
        assert held_by(first.storage)["token"] == first.token
    finally:
        first.release()
    assert not first.storage.exists(LOCK)


def pause(lock: RunLock) -> None:
    """What SIGSTOP does to the run's refresher (in this one process: its thread stops, the lock ages)."""
    lock._stop.set()
    assert lock._thread is not None
    lock._thread.join()


def test_a_run_that_lost_its_lock_stops_before_writing(fast_lock: float, memory_url: str) -> None:
    first = RunLock(Storage(memory_url))
    first.acquire()
    first.storage.write("checkpoints/step-00000002/manifest.json", b"{}")
    pause(first)
    time.sleep(fast_lock + 0.3)
    second = RunLock(Storage(memory_url))
    second.acquire()
    assert second.took_over == f"pid {os.getpid()} on {held_by(second.storage)['host']}"

    with pytest.raises(LockLost, match=rf"^this run lost the lock of {memory_url} to pid {os.getpid()} on .*: it was not "
                                       r"refreshed for over 1 s .* this run stops without writing anything more$"):
        first.storage.write("checkpoints/step-00000004/manifest.json", b"{}")
    assert not first.storage.exists("checkpoints/step-00000004")
    with pytest.raises(LockLost):
        first.storage.remove("checkpoints/step-00000002")
    assert first.storage.exists("checkpoints/step-00000002/manifest.json")
    first.release()  # the lock it lost is the other run's: left in place
    assert held_by(second.storage)["token"] == second.token
    second.release()


def test_a_lock_object_gone_is_a_lock_lost(fast_lock: float, memory_url: str) -> None:
    """Another run took the output over and finished (its release removed the lock object) while this one was
    paused."""
    first = RunLock(Storage(memory_url))
    first.acquire()
    pause(first)
    first.storage.fs.rm(first.storage.path(LOCK))
    time.sleep(1.5 * REFRESH_S + 0.1)
    with pytest.raises(LockLost, match="to a run that has since finished"):
        first.storage.write("metrics.jsonl", b"")
    first.release()


def test_a_refresher_finds_the_takeover_by_itself(fast_lock: float, memory_url: str) -> None:
    first = RunLock(Storage(memory_url))
    first.acquire()
    other = {"host": "spot-vm-7", "pid": 4242, "token": "theirs", "refreshed": time.time()}
    first.storage.fs.pipe_file(first.storage.path(LOCK), json.dumps(other).encode())
    deadline = time.monotonic() + 5
    while first.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.lost == "pid 4242 on spot-vm-7"
    assert held_by(first.storage)["token"] == "theirs"  # never overwritten
    first.release()
    assert held_by(first.storage)["token"] == "theirs"


def test_a_run_paused_in_the_middle_of_a_refresh_stops(fast_lock: float, memory_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused after reading its lock object and before rewriting it, for longer than the stale age: another run
    may have taken the lock over in between and had its lock overwritten by this rewrite. The run cannot tell, so
    it stops, and removes the lock object (a run that took over then finds it gone, and stops too)."""
    first = RunLock(Storage(memory_url))
    first.acquire()
    pause(first)
    read = run_lock._read_holder

    def read_then_pause(storage: Storage) -> dict[str, Any] | None:
        holder = read(storage)
        time.sleep(fast_lock + 0.3)
        return holder

    monkeypatch.setattr(run_lock, "_read_holder", read_then_pause)
    with pytest.raises(LockLost, match="to a run that may have taken it over while this process was paused"):
        first._refresh()  # the refresher thread's step
    monkeypatch.undo()
    with pytest.raises(LockLost):
        first.storage.write("metrics.jsonl", b"")
    assert not first.storage.exists("metrics.jsonl")
    first.release()
    assert not first.storage.exists(LOCK)


def test_a_full_disk_while_taking_a_local_lock_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    class Full:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def write(self, data: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

    monkeypatch.setattr(run_lock, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    with pytest.raises(TunecastError, match=rf"^cannot take the lock of {tmp_path}/run: No space left on device$") as raised:
        RunLock(Storage(str(tmp_path / "run"))).acquire()
    assert raised.value.hint == "free space on the output storage or check its permissions; nothing was written"


HOLDER = textwrap.dedent("""
    import sys
    from tunecast.storage.lock import RunLock
    from tunecast.storage.store import Storage
    lock = RunLock(Storage(sys.argv[1]))
    lock.acquire()
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_probe_lock_refuses_a_busy_local_output_without_taking_it(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    probe_lock(Storage(url))  # nothing there: free, and nothing made
    assert not (tmp_path / "run").exists()
    with subprocess.Popen([sys.executable, "-c", HOLDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as holder:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(TunecastError, match=rf"^{url} is in use by pid {holder.pid} on "):
            probe_lock(Storage(url))
        holder.communicate("")
    probe_lock(Storage(url))
    taken = RunLock(Storage(url))
    taken.acquire()  # the probe left no lock behind
    taken.release()


def test_probe_lock_reads_a_remote_lock(fast_lock: float, remote_url: str) -> None:
    storage = Storage(remote_url)
    storage.fs.pipe_file(storage.path(LOCK), json.dumps({"host": "spot-vm-7", "pid": 4242,
                                                         "refreshed": time.time()}).encode())
    with pytest.raises(TunecastError, match=r"is in use by pid 4242 on spot-vm-7 \(lock refreshed 0 s ago\)$"):
        probe_lock(storage)
    storage.fs.pipe_file(storage.path(LOCK), json.dumps({"host": "spot-vm-7", "pid": 4242,
                                                         "refreshed": time.time() - fast_lock - 1}).encode())
    probe_lock(storage)
    assert held_by(storage)["pid"] == 4242  # read, never written
