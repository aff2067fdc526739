"""The checkpoint store: named sets of files on any fsspec filesystem, each complete or absent.

What it knows is bytes, not training: a checkpoint is a folder `checkpoints/step-NNNNNNNN/` of files and a
`manifest.json` naming every file with its size and SHA-256. What the files hold is `state.py`'s business.

Why a checkpoint is never half there, in the order things happen:

1. Every file is written first. On a local disk each goes to a temporary name in the same folder, is
   fsynced, renamed over its final name and the folder fsynced, so a file under its final name is whole. On
   object storage (s3://, gs://) an object appears only when its upload completes.
2. `manifest.json` is written last, the same way. A folder without a manifest that parses, or whose files
   do not match their sizes and checksums, is not a checkpoint: `newest_valid` skips it and says why.
3. Old checkpoints are deleted only after the new one is complete, and their manifest goes first, so a
   deletion interrupted half-way leaves a folder that is skipped, never one that loads.

A kill at any instant (SIGKILL, power loss) therefore leaves the previous checkpoint intact and the one
being written invisible. The run also holds a lock on its output (lock.py), so two processes never write
the same run; every write here first calls the lock's check (`Storage.guard`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tunecast.errors import TunecastError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CHECKPOINTS = "checkpoints"
STEP_PATTERN = re.compile(r"^step-(\d{8,})$")
TEMPORARY = re.compile(r"\.tmp-\d+$")  # a file being written: `{name}.tmp-{pid}`
HASH_CHUNK = 1 << 22
LOCK = ".tunecast.lock"  # the run's lock (lock.py)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class Skipped:
    """A checkpoint folder that is not a complete checkpoint, and why."""

    name: str
    reason: str
    written: bool = False  # its manifest was written: a checkpoint once complete, since damaged (not a write cut short)


class Storage:
    """A folder on an fsspec filesystem (`/runs/x`, `s3://bucket/runs/x`, `memory://x`), with the writes the
    store needs: whole files only, made durable before they are named."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as error:
            raise TunecastError(f"cannot use the storage {url}: {error}", field="output",
                                hint="install the fsspec backend (pip install 'tunecast[s3]' for s3://)") from None
        self.local = "file" in _protocols(self.fs)
        # the run's lock sets this: called before every write, it raises LockLost once another run holds the output
        self.guard: Callable[[], None] | None = None

    def check(self) -> None:
        """Raise LockLost when the run writing here lost its lock (nothing to check without one)."""
        if self.guard is not None:
            self.guard()

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        """The URL of a path inside this folder, as a user (or another process) would give it."""
        return "/".join([self.url, *parts])

    def exists(self, *parts: str) -> bool:
        return bool(self.fs.exists(self.path(*parts)))

    def read(self, *parts: str) -> bytes:
        if not self.local:
            # one request for the whole object: an opened remote file asks for it by the version it saw first,
            # and fails ("pre-conditions … did not hold") when another process rewrote it in between, as a
            # run's refresher rewrites its lock while a second launch reads it
            return bytes(self.fs.cat_file(self.path(*parts)))
        with self.fs.open(self.path(*parts), "rb") as handle:
            return bytes(handle.read())

    def write(self, relative: str, data: bytes, *, guarded: bool = True) -> None:
        """`data` under `relative`, whole or not at all (`guarded`: only while the run holds its lock)."""
        target = self.path(relative)
        if guarded:
            self.check()
        with self._writing(relative):
            if self.local:
                _write_local(target, data)
            else:
                self.fs.pipe_file(target, data)

    def write_file(self, relative: str, source: Path) -> None:
        """The local file `source` under `relative`, copied in chunks (never whole in memory), whole or not at all."""
        target = self.path(relative)
        self.check()
        with self._writing(relative):
            if self.local:
                _copy_local(source, target)
            else:
                self.fs.put_file(str(source), target)

    @contextlib.contextmanager
    def _writing(self, relative: str) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            raise WriteFailed(f"cannot write {self.url}/{relative}: {error.strerror or error}", field="output",
                              hint=WRITE_HINT) from None

    def listdir(self, *parts: str) -> list[str]:
        folder = self.path(*parts)
        if not self.fs.exists(folder):
            return []
        names = []
        for entry in self.fs.ls(folder, detail=False):
            names.append(str(entry).rstrip("/").rsplit("/", 1)[-1])
        return names

    def remove(self, *parts: str, guarded: bool = True) -> None:
        target = self.path(*parts)
        if guarded:
            self.check()
        try:
            if self.fs.exists(target):
                self.fs.rm(target, recursive=True)
        except OSError as error:
            raise WriteFailed(f"cannot remove {self.url}/{'/'.join(parts)}: {error.strerror or error}",
                              field="output", hint="check the output storage's permissions") from None

    def remove_temporaries(self) -> list[str]:
        """Delete the half-written temporary files a killed writer left (local storage only: an object store
        never shows a partial upload). Call it holding the run's lock."""
        if not self.local or not os.path.isdir(self.root):
            return []
        removed = []
        for folder, _, names in os.walk(self.root):
            for name in names:
                if TEMPORARY.search(name):
                    os.unlink(os.path.join(folder, name))
                    removed.append(os.path.relpath(os.path.join(folder, name), self.root))
        return removed


WRITE_HINT = "free space on the output storage or check its permissions"


class WriteFailed(TunecastError):
    """The run's storage refused a write (full, read-only, unreachable). What was complete before stays so; the run
    (run.py) says which checkpoint a new start resumes from."""

    def with_hint(self, hint: str) -> WriteFailed:
        return WriteFailed(self.message, field=self.field, hint=hint)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return tuple(protocol) if isinstance(protocol, (tuple, list)) else (protocol,)


def _write_local(target: str, data: bytes) -> None:
    _write_durably(target, lambda out: out.write(data))


def _copy_local(source: Path, target: str) -> None:
    def copy(out: BinaryIO) -> None:
        with open(source, "rb") as reader:
            while chunk := reader.read(HASH_CHUNK):
                out.write(chunk)

    _write_durably(target, copy)


def _write_durably(target: str, fill: Callable[[BinaryIO], object]) -> None:
    """`fill` writes the content to a temporary name beside `target`; then fsync, rename, fsync the folder:
    under its final name a file is always whole."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    temporary = f"{target}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_folder(folder)


# errno values of a filesystem that has no such operation (FUSE mounts of buckets: goofys, gcsfuse, rclone)
UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)


def _fsync_folder(folder: str) -> None:
    """Make a rename in `folder` durable; a filesystem that cannot sync folders (a bucket mounted with FUSE)
    makes each file durable when it is closed, so there is nothing more to do there."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            os.fsync(descriptor)
        except OSError as error:
            if error.errno not in UNSUPPORTED:
                raise
    finally:
        os.close(descriptor)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def write_set(storage: Storage, folder: str, files: Mapping[str, bytes | Path], meta: Mapping[str, Any]) -> None:
    """The files of one set under `folder` (bytes, or local files copied in chunks), then its manifest: the
    set exists once the manifest does. An older manifest in the folder (a set being rewritten) is removed
    before any file changes."""
    storage.remove(folder, MANIFEST)
    write_manifest(storage, folder, write_files(storage, folder, files), meta)


def write_files(storage: Storage, folder: str, files: Mapping[str, bytes | Path]) -> dict[str, dict[str, Any]]:
    """Files of a set without its manifest (one rank's share of a checkpoint); returns their manifest entries."""
    listed: dict[str, dict[str, Any]] = {}
    for name, data in files.items():
        if isinstance(data, Path):
            size, digest = _file_digest(data)
            storage.write_file(f"{folder}/{name}", data)
        else:
            size, digest = len(data), sha256(data)
            storage.write(f"{folder}/{name}", data)
        listed[name] = {"bytes": size, "sha256": digest}
    return listed


def write_manifest(storage: Storage, folder: str, listed: Mapping[str, Mapping[str, Any]],
                   meta: Mapping[str, Any]) -> None:
    """The manifest that makes the files of `listed`, already written, a set."""
    manifest = {"format": MANIFEST_FORMAT, **meta, "files": dict(sorted(listed.items()))}
    storage.write(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())


@contextlib.contextmanager
def local_folder(storage: Storage, folder: str, manifest: Mapping[str, Any], prefix: str) -> Iterator[Path]:
    """The files of a verified set whose names start with `prefix`/, in a folder of this machine: the set's own
    folder on local storage, else a temporary copy, each file checked against the manifest as it is copied."""
    if storage.local:
        yield Path(storage.path(folder, prefix))
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tunecast-restore-") as scratch:
        for name, expected in manifest["files"].items():
            if not name.startswith(f"{prefix}/"):
                continue
            size, digest = _listed(name, expected)
            target = Path(scratch) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            hasher, length = hashlib.sha256(), 0
            with storage.fs.open(storage.path(folder, name), "rb") as source, open(target, "wb") as out:
                while chunk := source.read(HASH_CHUNK):
                    hasher.update(chunk)
                    length += len(chunk)
                    out.write(chunk)
            if length != size or hasher.hexdigest() != digest:
                raise InvalidSet(f"{name} changed since it was verified")
        yield Path(scratch) / prefix


def read_set(storage: Storage, folder: str, *, keep: bool = True) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and files of a set, each file checked against its size and checksum (read in chunks).
    With `keep` false the files are only verified, never held in memory whole (the files returned are
    empty). Raises `InvalidSet` saying what is wrong."""
    try:
        raw = storage.read(folder, MANIFEST)
    except FileNotFoundError:
        raise InvalidSet("no manifest.json (the write did not finish)") from None
    try:
        manifest = json.loads(raw)
        listed = manifest["files"]
        assert isinstance(listed, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise InvalidSet("manifest.json does not parse") from None
    files: dict[str, bytes] = {}
    for name, expected in listed.items():
        size, digest = _listed(name, expected)
        hasher, chunks, length = hashlib.sha256(), [], 0
        try:
            with storage.fs.open(storage.path(folder, name), "rb") as handle:
                while chunk := handle.read(HASH_CHUNK):
                    hasher.update(chunk)
                    length += len(chunk)
                    if keep:
                        chunks.append(chunk)
        except FileNotFoundError:
            raise InvalidSet(f"{name} is missing") from None
        if length != size:
            raise InvalidSet(f"{name} has {length:,} bytes, the manifest says {size:,} (truncated)")
        if hasher.hexdigest() != digest:
            raise InvalidSet(f"{name} does not match its SHA-256 (corrupted)")
        if keep:
            files[name] = b"".join(chunks)
    return manifest, files


class InvalidSet(Exception):
    """A folder that is not a complete, verified set of files."""


def _listed(name: str, entry: object) -> tuple[int, str]:
    """A manifest entry's size and checksum; a damaged entry makes the set invalid."""
    if isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str):
        return entry["bytes"], entry["sha256"]
    raise InvalidSet(f"manifest.json's entry for {name} is damaged")


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint: its step, manifest and files."""

    step: int
    manifest: dict[str, Any]
    files: dict[str, bytes]


@dataclass
class CheckpointStore:
    """Checkpoints of one run under `storage`/checkpoints."""

    storage: Storage

    def steps(self) -> list[int]:
        """Steps of the checkpoint folders present, complete or not, newest first."""
        found = []
        for name in self.storage.listdir(CHECKPOINTS):
            match = STEP_PATTERN.match(name)
            if match:
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def save(self, step: int, files: Mapping[str, bytes | Path], meta: Mapping[str, Any]) -> None:
        try:
            write_set(self.storage, f"{CHECKPOINTS}/{step_name(step)}", files, {"step": step, **meta})
        except WriteFailed as failed:
            raise failed.with_hint(f"{WRITE_HINT}; {self.recovery()}") from None

    def recovery(self) -> str:
        """What running the same command again does after a failed write: resume from the newest checkpoint whose
        manifest was written (a manifest is written last, so its checkpoint was whole), or start over."""
        try:
            complete = [step for step in self.steps() if self.storage.exists(self.folder(step), MANIFEST)]
        except Exception:  # the storage cannot even be read: nothing is known about what is there
            return "then run the same command again"
        if complete:
            return f"the checkpoint of step {complete[0]} is intact: run the same command again to resume from it"
        return "no checkpoint was written yet: the same command starts the run over"

    def folder(self, step: int) -> str:
        return f"{CHECKPOINTS}/{step_name(step)}"

    def load(self, step: int, *, keep: bool = True) -> tuple[dict[str, Any], dict[str, bytes]]:
        return read_set(self.storage, self.folder(step), keep=keep)

    def newest_valid(self, *, keep: bool = True) -> tuple[Loaded | None, list[Skipped]]:
        """The newest checkpoint that verifies (None when none does), and the newer folders skipped on the
        way, each with why. With `keep` false its files are verified but not held (Loaded.files is empty)."""
        skipped: list[Skipped] = []
        for step in self.steps():
            try:
                manifest, files = self.load(step, keep=keep)
            except InvalidSet as problem:
                skipped.append(Skipped(step_name(step), str(problem), self.storage.exists(self.folder(step), MANIFEST)))
                continue
            return Loaded(step, manifest, files), skipped
        return None, skipped

    def is_valid(self, step: int) -> bool:
        try:
            self.load(step, keep=False)
        except InvalidSet:
            return False
        return True

    def prune(self, keep: int, *, newest: int) -> list[str]:
        """Delete all but the `keep` newest complete checkpoints (and every incomplete folder older than
        `newest`, the one just written). Manifests go first, so a half-done deletion is skipped later."""
        removed = []
        complete = 0
        for step in self.steps():
            name = step_name(step)
            folder = f"{CHECKPOINTS}/{name}"
            if step > newest:
                continue  # written by nobody now: a newer, incomplete folder is left for inspection
            if complete < keep and self.storage.exists(folder, MANIFEST):
                complete += 1
                continue
            self.storage.remove(folder, MANIFEST)
            self.storage.remove(folder)
            removed.append(name)
        return removed


@contextlib.contextmanager
def locked(storage: Storage) -> Iterator[Any]:
    """The run's lock on `storage` (lock.py's RunLock), held inside the block."""
    from tunecast.storage.lock import RunLock  # lock.py builds on this module

    lock = RunLock(storage)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
