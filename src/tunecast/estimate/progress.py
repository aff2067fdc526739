"""What a long estimate says while it works: each trace it starts, and each damaged cache entry it rebuilds.

The core never prints. A caller that wants to hear (the CLI draws it on stderr) listens for the duration of
a call; with nobody listening, progress is dropped and a warning goes to Python's `warnings`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# (kind, message): kind is "progress" (replaced by the next), "notice" (a line to keep: what a cold estimate is about
# to trace and how long it expects that to take) or "warning".
Listener = Callable[[str, str], None]
_LISTENER: ContextVar[Listener | None] = ContextVar("tunecast_estimate_listener", default=None)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Hand every progress line and warning of estimates made inside this block to `listener`."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def progress(message: str) -> None:
    listener = _LISTENER.get()
    if listener is not None:
        listener("progress", message)


def notice(message: str) -> None:
    listener = _LISTENER.get()
    if listener is not None:
        listener("notice", message)


def warning(message: str) -> None:
    listener = _LISTENER.get()
    if listener is not None:
        listener("warning", message)
    else:
        warnings.warn(message, stacklevel=2)
