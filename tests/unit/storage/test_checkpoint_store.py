"""The checkpoint store (`tunecast.storage.store`): sets are whole or skipped with a reason, pruning keeps the
newest complete ones, a failed save leaves the previous checkpoint loadable, and one run holds its output.

Backends: a local folder, fsspec's `memory://` and S3 (moto on loopback, `s3_url` in tests/s3server.py).
Damage is done through the raw fsspec filesystem, never through the store, so the store cannot hide it.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tunecast.errors import TunecastError
from tunecast.storage import lock as run_lock
from tunecast.storage import store
from tunecast.storage.lock import REMOTE_LOCK_STALE_S, RunLock
from tunecast.storage.store import (
    MANIFEST,
    CheckpointStore,
    InvalidSet,
    Skipped,
    Storage,
    read_set,
    sha256,
    step_name,
    write_set,
)

FILES = {"model.safetensors": bytes(range(256)) * 4, "optimizer.pt": b"adam moments " * 50, "state.json": b"{}"}
BACKENDS = ["local", "memory", "s3"]


class Killed(BaseException):
    """Stands for SIGKILL arriving at a given instant: nothing after it runs, no `except Exception` sees it."""


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh folder on fsspec's process-wide memory filesystem, removed afterwards."""
    import fsspec

    url = f"memory://tunecast-test-{uuid.uuid4().hex[:12]}/run"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://").split("/")[0]
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture(params=["memory", "s3"])
def remote_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


def folder(step: int) -> str:
    return f"checkpoints/{step_name(step)}"


def files_for(step: int) -> dict[str, bytes]:
    """Contents that differ per step, so loading the wrong step cannot pass."""
    return {name: data + f"@{step}".encode() for name, data in FILES.items()}


def raw_put(storage: Storage, relative: str, data: bytes) -> None:
    path = storage.path(relative)
    storage.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # a local folder must exist; elsewhere a no-op
    storage.fs.pipe_file(path, data)


def raw_rm(storage: Storage, relative: str) -> None:
    storage.fs.rm(storage.path(relative))


# --- sets: written whole, read back verified ------------------------------------------------------------


def test_write_then_read_a_set(url: str) -> None:
    storage = Storage(url)
    write_set(storage, "sets/a", FILES, {"note": "hello"})

    manifest, files = read_set(storage, "sets/a")

    assert files == FILES
    assert manifest["note"] == "hello"
    assert manifest["format"] == 1
    assert manifest["files"] == {name: {"bytes": len(data), "sha256": sha256(data)} for name, data in FILES.items()}
    # nothing else in the folder: no temporary names left behind
    assert sorted(storage.listdir("sets", "a")) == sorted([*FILES, MANIFEST])


def test_unknown_protocol_is_a_user_error() -> None:
    with pytest.raises(TunecastError, match="cannot use the storage nosuchfs://bucket/run"):
        Storage("nosuchfs://bucket/run")


# --- newest_valid: the newest complete checkpoint, and why newer folders were skipped ---------------------

# Each damage turns a complete checkpoint into one that must be skipped, with the reason naming the problem.
DAMAGE: dict[str, tuple[Callable[[Storage, str], None], str]] = {
    "missing manifest": (lambda s, f: raw_rm(s, f"{f}/{MANIFEST}"), r"^no manifest\.json"),
    "unparsable manifest": (lambda s, f: raw_put(s, f"{f}/{MANIFEST}", b'{"format": 1, "files": {'),
                            r"^manifest\.json does not parse$"),
    # optimizer.pt of step 2 is 13 * 50 + len("@2") = 652 bytes
    "truncated file": (lambda s, f: raw_put(s, f"{f}/optimizer.pt", files_for(2)["optimizer.pt"][:-7]),
                       r"^optimizer\.pt has 645 bytes, the manifest says 652 \(truncated\)$"),
    "flipped byte": (lambda s, f: raw_put(s, f"{f}/model.safetensors", flip(files_for(2)["model.safetensors"], 100)),
                     r"^model\.safetensors does not match its SHA-256 \(corrupted\)$"),
    "missing file": (lambda s, f: raw_rm(s, f"{f}/state.json"), r"^state\.json is missing$"),
}


def flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1:]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_newest_valid_skips_a_damaged_newer_checkpoint(damage: str, tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    checkpoints.save(1, files_for(1), {})
    checkpoints.save(2, files_for(2), {})
    assert checkpoints.is_valid(2)  # whole before the damage, so the damage is what the test measures
    spoil, reason = DAMAGE[damage]
    spoil(storage, folder(2))

    loaded, skipped = checkpoints.newest_valid()

    assert loaded is not None
    assert (loaded.step, loaded.files) == (1, files_for(1))
    assert [s.name for s in skipped] == ["step-00000002"]
    assert re.search(reason, skipped[0].reason), skipped[0].reason
    assert not checkpoints.is_valid(2)


def test_newest_valid_never_loads_a_damaged_checkpoint(url: str) -> None:
    """Every kind of damage at once, each on its own step newer than the one good checkpoint."""
    storage = Storage(url)
    checkpoints = CheckpointStore(storage)
    checkpoints.save(1, files_for(1), {"loss": 1.5})
    damaged = {}
    for step, (damage, (spoil, reason)) in enumerate(DAMAGE.items(), start=2):
        checkpoints.save(step, files_for(2), {})  # step 2's bytes, which the damage table is written for
        spoil(storage, folder(step))
        damaged[step_name(step)] = (damage, reason)
    raw_put(storage, "checkpoints/step-7/manifest.json", b"{}")  # not a step folder: ignored, not skipped

    loaded, skipped = checkpoints.newest_valid()

    assert loaded is not None
    assert (loaded.step, loaded.files, loaded.manifest["loss"]) == (1, files_for(1), 1.5)
    assert [s.name for s in skipped] == sorted(damaged, reverse=True)
    for entry in skipped:
        damage, reason = damaged[entry.name]
        assert re.search(reason, entry.reason), (damage, entry.reason)


def test_newest_valid_is_none_when_nothing_verifies(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    checkpoints.save(5, FILES, {})
    raw_rm(storage, f"{folder(5)}/{MANIFEST}")

    assert checkpoints.newest_valid() == (None, [Skipped("step-00000005", "no manifest.json (the write did not finish)")])
    assert CheckpointStore(Storage(str(tmp_path / "empty"))).newest_valid() == (None, [])


def test_a_manifest_with_a_corrupted_key_is_skipped(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    checkpoints.save(1, FILES, {})
    checkpoints.save(2, FILES, {})
    manifest = storage.read(folder(2), MANIFEST)
    # one flipped bit turns the key "bytes" into "cytes": still JSON, no longer a manifest
    raw_put(storage, f"{folder(2)}/{MANIFEST}", manifest.replace(b'"bytes"', b'"cytes"', 1))

    loaded, skipped = checkpoints.newest_valid()

    assert loaded is not None and loaded.step == 1
    assert [s.name for s in skipped] == ["step-00000002"]


def test_load_raises_invalid_set_naming_the_problem(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    checkpoints.save(4, FILES, {})
    raw_rm(storage, f"{folder(4)}/optimizer.pt")

    with pytest.raises(InvalidSet, match=r"^optimizer\.pt is missing$"):
        checkpoints.load(4)


# --- prune --------------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_complete_and_removes_older_incomplete(url: str) -> None:
    storage = Storage(url)
    checkpoints = CheckpointStore(storage)
    for step in (10, 20, 30, 40, 50, 60):
        checkpoints.save(step, files_for(step), {})
    for incomplete in (20, 60):  # 20: an older run killed mid-save; 60: newer than the one just written
        raw_rm(storage, f"{folder(incomplete)}/{MANIFEST}")

    removed = checkpoints.prune(2, newest=50)

    assert removed == ["step-00000030", "step-00000020", "step-00000010"]
    assert checkpoints.steps() == [60, 50, 40]
    assert checkpoints.load(50)[1] == files_for(50)
    assert checkpoints.load(40)[1] == files_for(40)
    assert not storage.exists(folder(10))


def test_an_interrupted_prune_leaves_a_folder_that_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    for step in (1, 2):
        checkpoints.save(step, files_for(step), {})
    real_remove = storage.remove

    def killed_between_manifest_and_files(*parts: str) -> None:
        if parts[-1] != MANIFEST:
            raise Killed
        real_remove(*parts)

    monkeypatch.setattr(storage, "remove", killed_between_manifest_and_files)
    with pytest.raises(Killed):
        checkpoints.prune(1, newest=2)
    monkeypatch.undo()

    loaded, skipped = checkpoints.newest_valid()
    assert loaded is not None and loaded.step == 2
    assert checkpoints.steps() == [2, 1]  # step 1's files are still there, without a manifest
    assert skipped == []  # step 1 is older than the one loaded, so it is not reported
    assert not checkpoints.is_valid(1)


# --- rewriting and failing saves -----------------------------------------------------------------------


def test_rewriting_a_step_removes_its_old_manifest_before_any_file(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(url)
    checkpoints = CheckpointStore(storage)
    checkpoints.save(4, files_for(4), {})
    checkpoints.save(5, files_for(5), {})
    manifest_at_first_write: list[bool] = []

    def killed_at_first_write(relative: str, data: bytes) -> None:
        manifest_at_first_write.append(storage.exists(folder(5), MANIFEST))
        raise Killed

    monkeypatch.setattr(storage, "write", killed_at_first_write)
    with pytest.raises(Killed):
        checkpoints.save(5, files_for(55), {})
    monkeypatch.undo()

    assert manifest_at_first_write == [False]
    loaded, skipped = checkpoints.newest_valid()
    assert loaded is not None and loaded.step == 4
    assert skipped == [Skipped("step-00000005", "no manifest.json (the write did not finish)")]


def test_a_rewrite_that_finishes_replaces_the_step(tmp_path: Path) -> None:
    checkpoints = CheckpointStore(Storage(str(tmp_path / "run")))
    checkpoints.save(5, files_for(5), {"try": 1})
    checkpoints.save(5, files_for(55), {"try": 2})

    manifest, files = checkpoints.load(5)
    assert (manifest["try"], files) == (2, files_for(55))


class _DiskFills:
    """A file whose `write` stores half the data and then fails as a full disk does."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __enter__(self) -> _DiskFills:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()

    def write(self, data: bytes) -> int:
        self._handle.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


@pytest.mark.parametrize("fails_at", ["model.safetensors", MANIFEST])
def test_a_full_disk_during_save_is_a_user_error_and_the_previous_checkpoint_loads(
        fails_at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    checkpoints.save(1, files_for(1), {})

    def open_on_a_full_disk(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = builtins.open(path, mode, *args, **kwargs)  # noqa: SIM115 - closed by the caller's `with`
        return _DiskFills(handle) if os.path.basename(str(path)).startswith(f"{fails_at}.tmp-") else handle

    # store.py's `_write_local` calls the builtin `open`; a module global of that name shadows it there only
    monkeypatch.setattr(store, "open", open_on_a_full_disk, raising=False)
    with pytest.raises(TunecastError, match=rf"^cannot write {tmp_path}/run/checkpoints/step-00000002/{fails_at}: No space left on device$") as raised:
        checkpoints.save(2, files_for(2), {})
    monkeypatch.undo()

    assert raised.value.field == "output"
    assert raised.value.hint == ("free space on the output storage or check its permissions; the checkpoint of step 1 "
                                 "is intact: run the same command again to resume from it")
    loaded, skipped = checkpoints.newest_valid()
    assert loaded is not None
    assert (loaded.step, loaded.files) == (1, files_for(1))
    assert [s.name for s in skipped] == ["step-00000002"]
    # the half-written temporary file is gone, and nothing under the failed name
    left = sorted(p.name for p in (tmp_path / "run" / folder(2)).iterdir())
    assert left == (sorted(FILES) if fails_at == MANIFEST else [])


def test_unwritable_storage_while_rewriting_a_step_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    checkpoints.save(1, files_for(1), {})
    checkpoints.save(2, files_for(2), {})

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS))

    # the run resumed from step 1 (step 2 was, say, corrupted) and saves step 2 again; the disk went read-only
    monkeypatch.setattr(storage.fs, "rm", read_only)
    monkeypatch.setattr(store, "_write_local", read_only)
    with pytest.raises(TunecastError, match=r"^cannot remove .*step-00000002/manifest.json"):
        checkpoints.save(2, files_for(2), {})


def test_unwritable_storage_during_a_new_save_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(str(tmp_path / "run"))
    checkpoints = CheckpointStore(storage)
    checkpoints.save(1, files_for(1), {})

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(store.os, "makedirs", read_only)  # tests run as root: chmod would not stop a write
    with pytest.raises(TunecastError, match=r"^cannot write .*/run/checkpoints/step-00000002/model\.safetensors: Read-only file system$"):
        checkpoints.save(2, files_for(2), {})
    monkeypatch.undo()

    loaded, _ = checkpoints.newest_valid()
    assert loaded is not None and loaded.step == 1


# --- RunLock: local ---------------------------------------------------------------------------------------


def test_a_second_local_lock_is_refused_until_the_first_is_released(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    first = RunLock(Storage(url))
    first.acquire()

    with pytest.raises(TunecastError, match=rf"^{url} is in use by pid {os.getpid()} on "):
        RunLock(Storage(url)).acquire()

    first.release()
    again = RunLock(Storage(url))
    again.acquire()
    again.release()
    assert again.took_over is None  # released cleanly, so nobody was taken over


HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from tunecast.storage.lock import RunLock
    from tunecast.storage.store import Storage
    lock = RunLock(Storage(sys.argv[1]))  # held by a name: a collected RunLock closes its file, and the lock
    lock.acquire()
    print("locked", flush=True)
    time.sleep(60)
""")


def test_a_local_lock_left_by_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(TunecastError, match=rf"in use by pid {holder.pid} on "):
            RunLock(Storage(url)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    assert holder.returncode == -signal.SIGKILL

    lock = RunLock(Storage(url))
    lock.acquire()

    assert lock.took_over == f"pid {holder.pid} on {socket.gethostname()}"
    lock.release()


# --- RunLock: object storage ------------------------------------------------------------------------------


def put_lock(storage: Storage, *, host: str, pid: int, age_s: float) -> None:
    raw_put(storage, store.LOCK, json.dumps({"host": host, "pid": pid, "refreshed": time.time() - age_s}).encode())


def test_a_fresh_remote_lock_of_another_host_is_refused(remote_url: str) -> None:
    storage = Storage(remote_url)
    put_lock(storage, host="spot-vm-7", pid=4242, age_s=10)

    with pytest.raises(TunecastError, match=r"is in use by pid 4242 on spot-vm-7 \(lock refreshed 1\d s ago\)$"):
        RunLock(storage).acquire()

    assert json.loads(storage.read(store.LOCK))["host"] == "spot-vm-7"  # the holder's lock is untouched


def test_a_stale_remote_lock_is_taken_over(remote_url: str) -> None:
    storage = Storage(remote_url)
    put_lock(storage, host="spot-vm-7", pid=4242, age_s=REMOTE_LOCK_STALE_S + 5)
    lock = RunLock(storage)

    lock.acquire()

    assert lock.took_over == "pid 4242 on spot-vm-7"
    now = json.loads(storage.read(store.LOCK))
    assert (now["host"], now["pid"]) == (socket.gethostname(), os.getpid())
    assert time.time() - now["refreshed"] < 30
    lock.release()
    assert not storage.exists(store.LOCK)


def test_a_remote_lock_of_a_dead_process_on_this_host_is_taken_over(memory_url: str) -> None:
    storage = Storage(memory_url)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    put_lock(storage, host=socket.gethostname(), pid=dead_pid, age_s=1)
    lock = RunLock(storage)

    lock.acquire()

    assert lock.took_over == f"pid {dead_pid} on {socket.gethostname()}"
    lock.release()


def test_half_written_files_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "run"))
    CheckpointStore(storage).save(1, FILES, {})
    left = tmp_path / "run" / "checkpoints" / "step-00000002" / "optimizer.pt.tmp-4242"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"half")
    assert storage.remove_temporaries() == ["checkpoints/step-00000002/optimizer.pt.tmp-4242"]
    assert not left.exists()
    loaded, _ = CheckpointStore(storage).newest_valid()
    assert loaded is not None and loaded.step == 1


# --- a bucket mounted with FUSE (goofys, gcsfuse): no flock, no fsync of folders -----------------------------

def _unsupported(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSYS, "Function not implemented")


def test_a_folder_that_cannot_flock_is_locked_by_a_lock_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    monkeypatch.setattr(fcntl, "flock", _unsupported)
    url = str(tmp_path / "run")
    first = RunLock(Storage(url))
    first.acquire()
    holder = json.loads((tmp_path / "run" / store.LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    monkeypatch.setattr(run_lock, "_alive", lambda pid: True)
    monkeypatch.setattr(socket, "gethostname", lambda: "another-host")  # a live run of another node
    with pytest.raises(TunecastError, match="is in use by pid"):
        RunLock(Storage(url)).acquire()
    monkeypatch.undo()
    first.release()
    assert not (tmp_path / "run" / store.LOCK).exists()


def test_a_folder_that_cannot_fsync_still_takes_whole_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fsync

    def fsync(descriptor: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{descriptor}"):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    checkpoints = CheckpointStore(Storage(str(tmp_path / "run")))
    checkpoints.save(3, {"a.bin": b"abc"}, {})
    loaded, skipped = checkpoints.newest_valid()
    assert loaded is not None and loaded.files == {"a.bin": b"abc"} and skipped == []


def test_the_s3_endpoint_comes_from_aws_endpoint_url(s3_url: str, s3_endpoint: str) -> None:
    """docs/train.md: a process given AWS_ENDPOINT_URL (and no other setting) writes its s3:// output there."""
    import fsspec
    from tests.s3server import FAKE_AWS_ENV

    writer = "import sys\nfrom tunecast.storage.store import Storage\nStorage(sys.argv[1]).write('hello.txt', b'hello')\n"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}, **FAKE_AWS_ENV,
           "AWS_ENDPOINT_URL": s3_endpoint}
    subprocess.run([sys.executable, "-c", writer, s3_url], env=env, check=True, timeout=60)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.cat(f"{s3_url.removeprefix('s3://')}/hello.txt") == b"hello"
