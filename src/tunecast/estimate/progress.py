"""What a long estimate says while it works: each trace it starts, and each damaged cache entry it rebuilds.

The core never prints. A caller that wants to hear (the CLI draws it on stderr) listens for the duration of
a call; with nobody listening, progress is dropped and a warning goes to Python's `warnings`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

# (kind, message): kind is "progress" (replaced by the next), "notice" (a line to keep: what a cold estimate is about
# to trace and how long it expects that to take) or "warning".
Listener = Callable[[str, str], None]
_LISTENER: ContextVar[Listener | None] = ContextVar("tunecast_estimate_listener", default=None)
# What stops the listener's own threads for a while (a spinner's refresh thread): `paused`.
_PAUSE: ContextVar[Callable[[], AbstractContextManager[object]] | None] = ContextVar("tunecast_estimate_pause",
                                                                                      default=None)


@contextmanager
def listening(listener: Listener, pause: Callable[[], AbstractContextManager[object]] | None = None) -> Iterator[None]:
    """Hand every progress line and warning of estimates made inside this block to `listener`; `pause()` is a
    context within which the listener runs no thread of its own (`paused`)."""
    token, paused_token = _LISTENER.set(listener), _PAUSE.set(pause)
    try:
        yield
    finally:
        _PAUSE.reset(paused_token)
        _LISTENER.reset(token)


def paused() -> AbstractContextManager[object]:
    """Within: the listener's display runs no thread (a process about to fork: a fork copies the locks other threads
    hold, and its copy may wait on one for ever)."""
    pause = _PAUSE.get()
    return pause() if pause is not None else nullcontext()


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
