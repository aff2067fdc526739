"""metrics.jsonl: one JSON object per line — `train` lines every `log_every_steps`, `eval` lines, and events.

The file only grows. Each checkpoint records its length at that moment; a resumed run cuts the file back to
that length before it appends, so the lines of the steps it redoes appear once, and a finished run's file
reads as if the run had never stopped (plus its `preempted` and `resume` events).

On a local output the file is written in place and flushed at every line. On object storage, where files
cannot be appended to, a working copy is kept on local disk and uploaded at every checkpoint and at the end.
A line that cannot be written (a full disk) stops the run with the store's WriteFailed: the checkpoints written
so far stay as they are, and the file is cut back to a checkpoint's length when the run resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunecast.storage.store import WRITE_HINT, Storage, WriteFailed

METRICS = "metrics.jsonl"


class MetricsLog:
    def __init__(self, storage: Storage, *, keep_bytes: int | None) -> None:
        """Open the run's log; `keep_bytes` is the length recorded by the checkpoint resumed from (the rest is
        cut), None for a fresh run (an old log is cleared)."""
        self.storage = storage
        if storage.local:
            self.path = Path(storage.path(METRICS))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existing = self.path.read_bytes() if self.path.exists() else b""
        else:
            self.path = Path(tempfile.mkdtemp(prefix="tunecast-metrics-")) / METRICS
            existing = storage.read(METRICS) if storage.exists(METRICS) else b""
        kept = existing[:keep_bytes] if keep_bytes is not None else b""
        storage.check()
        with self._appending():
            with open(self.path, "wb") as handle:
                handle.write(kept)
            # unbuffered: a line that does not fit on the disk is not left in a buffer to fail again at close
            self._handle = open(self.path, "ab", buffering=0)  # noqa: SIM115 - open for the run's lifetime

    @property
    def size(self) -> int:
        return self._handle.tell()

    @contextlib.contextmanager
    def _appending(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            raise WriteFailed(f"cannot write {self.path}: {error.strerror or error}", field="output",
                              hint=WRITE_HINT) from None

    def write(self, record: dict[str, Any]) -> None:
        if self.storage.local:  # written in place: only while the run holds its output (a lock file on FUSE mounts)
            self.storage.check()
        line = memoryview((json.dumps(record, allow_nan=True) + "\n").encode())
        with self._appending():
            while line:  # a raw write may take part of the line
                line = line[self._handle.write(line):]

    def sync(self) -> int:
        """Make the log durable (upload it, on object storage); returns its length."""
        with self._appending():
            os.fsync(self._handle.fileno())
        if not self.storage.local:
            self.storage.write(METRICS, self.path.read_bytes())
        return self.size

    def close(self) -> None:
        self._handle.close()
