"""Write local files so that a reader never sees half a file: temporary file, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_user_file(path: Path, text: str, *, field: str) -> None:
    """A file the user asked for (a report, an export) at `path`, with ordinary permissions; a path that cannot
    be written is the user's error, naming the flag that gave it."""
    from tunecast.errors import TunecastError

    try:
        write_text_atomic(path, text, shared=True)
    except OSError as error:
        raise TunecastError(f"{field} {path}: cannot write it ({error.strerror or error})", field=field,
                            hint="give a file path in a folder you can write") from None


def write_text_atomic(path: Path, text: str, *, shared: bool = False) -> None:
    """`text` at `path`, whole or not at all. A temporary file is private (0600); `shared` gives the file the
    permissions of one made the usual way (0666 less the umask): a report or an export a user hands on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if shared:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(descriptor, 0o666 & ~umask)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
