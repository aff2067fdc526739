"""metrics.jsonl: one JSON object per line — `train` lines every `log_every_steps`, `eval` lines, and events.

The file only grows. Each checkpoint records its length at that moment; a resumed run cuts the file back to
that length before it appends, so the lines of the steps it redoes appear once, and a finished run's file
reads as if the run had never stopped (plus its `preempted` and `resume` events).

On a local output the file is written in place and flushed at every line. On object storage, where files
cannot be appended to, a working copy is kept on local disk and uploaded at every checkpoint and at the end.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tunecast.train.store import Storage

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
        with open(self.path, "wb") as handle:
            handle.write(kept)
        self._handle = open(self.path, "ab")  # noqa: SIM115 - open for the run's lifetime

    @property
    def size(self) -> int:
        return self._handle.tell()

    def write(self, record: dict[str, Any]) -> None:
        self._handle.write((json.dumps(record, allow_nan=True) + "\n").encode())
        self._handle.flush()

    def sync(self) -> int:
        """Make the log durable (upload it, on object storage); returns its length."""
        self._handle.flush()
        os.fsync(self._handle.fileno())
        if not self.storage.local:
            self.storage.write(METRICS, self.path.read_bytes())
        return self.size

    def close(self) -> None:
        self._handle.close()
