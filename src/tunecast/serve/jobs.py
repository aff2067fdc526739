"""A request's work in a worker thread: what the estimate says on the way, and stopping it when its client leaves or
its time runs out.

Estimates run in threads of the server's own pool, never on the event loop, so that a cold trace (seconds to minutes)
keeps no other request waiting for an answer the loop could give (the catalog, the model search, health). Each job
runs in a copy of its request's context, with its own listener (`tunecast.estimate.progress` keeps the listener in a
ContextVar): two requests' progress never mix. A streaming request relays what the estimate says as it says it.

Cancelling is cooperative. When the client of a streaming request goes away (the page's AbortController closes the
connection), or the job has run longer than the server allows one request (`Worker(timeout_s=…)`: the request is
answered 503 at once), the job is marked cancelled, and the estimate stops at its next check: the listener raises
`Cancelled` there. The checks are each trace of a cold estimate (or of a step template being built), each GPU of a
plan and each memory estimate within it (`Planner.check`), and every 10,000 examples of a sample; a trace under way
finishes first, so a cancelled cold estimate stops within one trace (about a second for a small model, up to a minute
for a large one on a laptop CPU), a warm plan within one estimate (milliseconds). A job waiting for another's estimate
(one runs at a time) stops waiting at once. So a job nobody waits for any more gives the CPU back.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tunecast.errors import TunecastError, error_document
from tunecast.estimate.progress import listening

T = TypeVar("T")
LOG = logging.getLogger("tunecast.serve")


class Cancelled(BaseException):
    """The request's client went away, or its time ran out. Raised in the job's thread at the next progress point; a
    BaseException so that no `except Exception` on the way (a failed marker trace is caught as one) takes it for a
    failure."""


class TookTooLong(TunecastError):
    """A request ran longer than the server allows one (answered 503: the server is fine, this answer is not
    coming)."""

    status = 503

    def __init__(self, seconds: float) -> None:
        super().__init__(f"this request took longer than the {seconds:g} s the server allows one, and was stopped",
                         field=None, hint="ask for less (one GPU with gpus.gpu, fewer options), or start the server "
                                          "with a longer `tunecast serve --timeout SECONDS`; `tunecast plan` on the "
                                          "command line has no limit")


@dataclass
class Job:
    """One request's work: whether its client went away, and where what the estimate says goes."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    relay: Callable[[str, str], None] | None = None  # (kind, message) → the client; None: nobody listens

    def check(self) -> None:
        """Stop here (raise Cancelled) when the client went away."""
        if self.cancelled.is_set():
            raise Cancelled

    def hear(self, kind: str, message: str) -> None:
        """The estimate's listener: a progress point."""
        self.check()
        if self.relay is not None:
            self.relay(kind, message)


def internal_error(error: BaseException) -> dict[str, Any]:
    """The document of an unexpected failure (a bug in tunecast, never the user's input): still a JSON error."""
    return {"error": {"message": f"internal error: {type(error).__name__}: {error}", "field": None,
                      "hint": "This is a bug in tunecast: the server's log has the traceback. Please report it."}}


def encoded(document: dict[str, Any]) -> bytes:
    """A document as the response body: JSON as `--json` writes it (keys in order, non-ASCII as is), compact. Text
    that UTF-8 cannot hold (a lone surrogate a request sent) is escaped instead."""
    text = json.dumps(document, default=str, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(document, default=str, separators=(",", ":")).encode("ascii")


class Worker:
    """The server's threads for estimates: started on the first job, stopped when the application shuts down (and
    started again if it serves once more, as a test client's application does). `timeout_s`: the longest one job
    may run (None: no limit)."""

    def __init__(self, threads: int = 4, *, timeout_s: float | None = None) -> None:
        self._threads = threads
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _started(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="tunecast-serve")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, work: Callable[[Job], T], job: Job | None = None) -> T:
        """`work(job)` in a worker thread, in a copy of this context, with the job's listener; its result or its
        exception; TookTooLong once it has run `timeout_s`. When the awaiting request is cancelled or times out, so
        is the job."""
        job = job if job is not None else Job()
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._started(), context.run, _listened, work, job)
        # what a job left behind ends as it ends (Cancelled at its next check): retrieved, so that it is not logged
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            job.cancelled.set()
            assert self.timeout_s is not None
            raise TookTooLong(self.timeout_s) from None
        except asyncio.CancelledError:
            job.cancelled.set()
            raise

    async def stream(self, work: Callable[[Job], bytes]) -> AsyncIterator[bytes]:
        """NDJSON lines: `{"event": "progress", "message", "kind"}` for each thing the estimate says, then
        `{"event": "result", "document"}` (`work` returns the document's encoded body) or `{"event": "error",
        "status", "error"}`. Closing the stream (the client went away) cancels the job."""
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[bytes] = asyncio.Queue()

        def relay(kind: str, message: str) -> None:
            line = encoded({"event": "progress", "message": message, "kind": kind}) + b"\n"
            loop.call_soon_threadsafe(lines.put_nowait, line)

        job = Job(relay=relay)
        task = asyncio.ensure_future(self.run(work, job))
        try:
            while not task.done():
                waiting = asyncio.ensure_future(lines.get())
                await asyncio.wait({waiting, task}, return_when=asyncio.FIRST_COMPLETED)
                if waiting.done():
                    yield waiting.result()
                else:
                    waiting.cancel()
            while not lines.empty():  # said before the job ended
                yield lines.get_nowait()
            yield _outcome(task)
        finally:
            job.cancelled.set()  # the client left before the end (or the job is over: then it changes nothing)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a job stopped by its client's leaving is no error to log
            else:
                task.cancel()


def _listened(work: Callable[[Job], T], job: Job) -> T:
    job.check()  # its client left, or its time ran out, while it waited for a thread
    with listening(job.hear):
        return work(job)


def _outcome(task: asyncio.Future[bytes]) -> bytes:
    error = task.exception()
    if error is None:
        return b'{"event":"result","document":' + task.result() + b"}\n"
    if isinstance(error, TunecastError):
        return encoded({"event": "error", "status": status_of(error), "error": error_document(error)["error"]}) + b"\n"
    LOG.error("internal error in a streamed request", exc_info=error)
    return encoded({"event": "error", "status": 500, "error": internal_error(error)["error"]}) + b"\n"


def status_of(error: TunecastError) -> int:
    """The HTTP status of a user error: 400, or 503 for a request that ran out of time."""
    return TookTooLong.status if isinstance(error, TookTooLong) else 400
