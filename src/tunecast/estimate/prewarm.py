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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tunecast.estimate import progress, replays
from tunecast.estimate.fit import MAX_MICRO_BATCH
from tunecast.estimate.memory import seq_ladder

COLLECT_TIMEOUT_S = 60  # longer than any walk takes; past it, this process replays what is missing itself

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
    if not hasattr(os, "fork") or os.environ.get("TUNECAST_NO_PREWARM") == "1" or threading.active_count() > 1:
        return None  # a process with threads (a server's) is not forked: a lock another thread held stays held
    reader, writer = os.pipe()
    pid = os.fork()
    if pid:
        os.close(writer)
        return Prewarm(pid, reader)
    os.close(reader)  # the second process: it returns nothing but its replays, and exits without cleanup
    status = 1
    try:
        with _quiet():
            walk(proxy, capacity, batch, seq, longest)
        with os.fdopen(writer, "wb") as out:
            pickle.dump(replays.exported(), out)
        status = 0
    finally:
        os._exit(status)


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
    prewarm.done = True
    try:
        with os.fdopen(prewarm.reader, "rb") as source:
            if not select.select([source], [], [], COLLECT_TIMEOUT_S)[0]:
                raise OSError("the second process did not answer")
            data = source.read()
        os.waitpid(prewarm.pid, 0)
        if data:
            replays.merge(pickle.loads(data))
    except (OSError, pickle.UnpicklingError, EOFError, ChildProcessError):
        with contextlib.suppress(OSError, ChildProcessError):
            os.kill(prewarm.pid, signal.SIGKILL)
            os.waitpid(prewarm.pid, 0)


def abandon(prewarm: Prewarm | None) -> None:
    """Stop the second process (this one will not collect it: an error, or no limits asked after all)."""
    if prewarm is None or prewarm.done:
        return
    prewarm.done = True
    with contextlib.suppress(OSError, ChildProcessError):
        os.close(prewarm.reader)
        os.kill(prewarm.pid, signal.SIGKILL)
        os.waitpid(prewarm.pid, 0)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The second process says nothing: the first one speaks for the estimate."""
    with progress.listening(lambda kind, message: None):
        yield
