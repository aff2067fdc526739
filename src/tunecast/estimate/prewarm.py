"""The replays a composed step's limits will ask for, made by a second process while this one traces the loss.

A composed step (compose.py) traces its loss alone at each shape, and the first trace of a process imports torch's
fake-tensor machinery: about 2 s on a small CPU. The limits that `--gpu` reports (fit.py `_solved`) start from the
stand-in's polynomials: estimates of the rest of the step at micro-batches and lengths doubling from the asked ones,
each of which replays the template at a ladder of shapes (memory.py `_ladder_reserved`), one or two more seconds of
pure Python. Neither needs the other. `start` forks a process that makes those estimates from templates alone (it
never traces) while this one imports torch and traces, and `collect` adds its replays to this process's
(replays.py), where the limit search then finds them.

The figures are the same with or without it: a replay depends only on its profile and shape. Without `os.fork`,
with TUNECAST_NO_PREWARM=1, or where the second process fails, this process replays as before.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tunecast.estimate import progress, replays
from tunecast.estimate.fit import MAX_MICRO_BATCH
from tunecast.estimate.memory import seq_ladder

COLLECT_TIMEOUT_S = 30  # longer than any walk takes; past it, this process replays what is missing itself
SECOND_TIMEOUT_S = 60  # longer than a limit's checks take once the first is found

Proxy = Callable[..., float]
"""proxy(micro_batch=…) or proxy(seq_len=…) → per-GPU GiB of the step with its loss's stand-in; NeedsTrace where a
template does not serve it."""


@dataclass
class Prewarm:
    pid: int
    reader: int  # the pipe the second process writes its replays to
    done: bool = False  # collected or abandoned: the pipe is closed and the process waited for


def start(proxy: Proxy, capacity: float, batch: int, seq: int, longest: int) -> Prewarm | None:
    """Fork a process that estimates the stand-in's step up both limits' doubling paths (`walk`); None where it
    cannot run."""
    if not _can_fork() or threading.active_count() > 1:
        return None  # a process with threads (a server's) is not forked: a lock another thread held stays held

    def replayed() -> dict[str, dict[str, Any]]:
        walk(proxy, capacity, batch, seq, longest)
        return replays.exported()

    return _forked(replayed)


def walk(proxy: Proxy, capacity: float, batch: int, seq: int, longest: int) -> None:
    """The stand-in's step at micro-batches 1, 2, 4, ... and at the lengths of the reserve ladder above the asked one,
    up to the second past both the asked value and the capacity (the search doubles past the first): the shapes whose
    replays make the ladders of the limit search's estimates."""
    with contextlib.suppress(Exception):  # a shape no template serves ends the walk: the search replays it later
        over = 0
        micro_batch = 1
        while micro_batch <= MAX_MICRO_BATCH and over < 2:
            over += proxy(micro_batch=micro_batch) > capacity and micro_batch > batch
            micro_batch *= 2
    with contextlib.suppress(Exception):
        over = 0
        for length in seq_ladder():
            if length > longest or over == 2:
                break
            if length > seq:
                over += proxy(seq_len=length) > capacity


def collect(prewarm: Prewarm | None) -> None:
    """Wait for the second process and add its replays to this process's; nothing where it failed."""
    if prewarm is None or prewarm.done:
        return
    found = _received(prewarm, COLLECT_TIMEOUT_S)
    if isinstance(found, dict):
        replays.merge(found)


def _received(process: Prewarm, timeout: float) -> Any:
    """What the forked process wrote before it exited; None where it failed or did not answer within `timeout` s
    (it is then stopped)."""
    process.done = True
    try:
        with os.fdopen(process.reader, "rb") as source:
            if not select.select([source], [], [], timeout)[0]:
                raise OSError("the second process did not answer")
            data = source.read()
        os.waitpid(process.pid, 0)
        return pickle.loads(data) if data else None  # written by this process's own fork, through a pipe
    except (OSError, pickle.UnpicklingError, EOFError, ChildProcessError):
        with contextlib.suppress(OSError, ChildProcessError):
            os.kill(process.pid, signal.SIGKILL)
            os.waitpid(process.pid, 0)
        return None


def abandon(prewarm: Prewarm | None) -> None:
    """Stop the second process (this one will not collect it: an error, or no limits asked after all)."""
    if prewarm is None or prewarm.done:
        return
    prewarm.done = True
    with contextlib.suppress(OSError, ChildProcessError):
        os.close(prewarm.reader)
        os.kill(prewarm.pid, signal.SIGKILL)
        os.waitpid(prewarm.pid, 0)


def both(first: Callable[[], int], second: Callable[[], int]) -> tuple[int, int]:
    """first() here and second() in a forked process at once (a composed step's two limits: each check a trace of its
    own); second() here after first() where the process cannot be forked or does not answer in time. For the command
    line's estimates; a process with threads (a server's, a test runner's) is not forked, as in `start`: its copy
    could wait for ever on a lock another thread held, and this one for SECOND_TIMEOUT_S on it."""
    if not _can_fork():
        return first(), second()
    with progress.paused():  # the command line's spinner stops its thread while the process forks
        child = _forked(second) if threading.active_count() == 1 else None
    if child is None:
        return first(), second()
    try:
        answer = first()
    except BaseException:
        abandon(child)
        raise
    found = _received(child, SECOND_TIMEOUT_S)
    return answer, found if isinstance(found, int) else second()


def _can_fork() -> bool:
    return hasattr(os, "fork") and sys.platform == "linux" and os.environ.get("TUNECAST_NO_PREWARM") != "1"


def _forked(work: Callable[[], Any]) -> Prewarm:
    """A forked process that runs `work` silently and writes its result to a pipe (`_received` reads it), then exits
    without cleanup."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid:
        os.close(writer)
        return Prewarm(pid, reader)
    os.close(reader)
    status = 1
    try:
        _silenced()
        with _quiet():
            found = work()
        with os.fdopen(writer, "wb") as out:
            pickle.dump(found, out)
        status = 0
    finally:
        os._exit(status)


def _silenced() -> None:
    """In a forked process: its output goes nowhere, through streams of its own (a thread of the first process may
    have held the locks of the ones it copied)."""
    silent = os.open(os.devnull, os.O_WRONLY)
    os.dup2(silent, 1)
    os.dup2(silent, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process's short life


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The second process says nothing: the first one speaks for the estimate."""
    with progress.listening(lambda kind, message: None):
        yield
