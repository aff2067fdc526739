"""The web planner's worker threads: progress relayed in order, each request hearing only its own estimate, and a
job stopped at its next progress point once its client leaves."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from tunecast.errors import TunecastError
from tunecast.estimate import progress
from tunecast.serve.jobs import Cancelled, Job, Worker, encoded


def _lines(chunks: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line) for chunk in chunks for line in chunk.splitlines() if line]


async def _collect(worker: Worker, work: Any) -> list[dict[str, Any]]:
    return _lines([chunk async for chunk in worker.stream(work)])


def test_a_stream_relays_what_the_estimate_says_then_the_result() -> None:
    def work(job: Job) -> bytes:
        progress.progress("tracing 1 of 2")  # as the estimator says it: through the context's listener
        progress.warning("a cached profile was damaged")
        job.hear("progress", "planning h100-sxm")
        return encoded({"schema_version": 1, "answer": 42})

    worker = Worker()
    try:
        events = asyncio.run(_collect(worker, work))
    finally:
        worker.close()
    assert events == [{"event": "progress", "message": "tracing 1 of 2", "kind": "progress"},
                      {"event": "progress", "message": "a cached profile was damaged", "kind": "warning"},
                      {"event": "progress", "message": "planning h100-sxm", "kind": "progress"},
                      {"event": "result", "document": {"schema_version": 1, "answer": 42}}]


def test_a_user_error_ends_the_stream_as_an_error_event_and_a_bug_as_a_500() -> None:
    def user_error(_: Job) -> bytes:
        raise TunecastError("no purchase price", field="--purchase-usd", hint="give --purchase-usd")

    def bug(_: Job) -> bytes:
        raise ZeroDivisionError("division by zero")

    worker = Worker()
    try:
        refused = asyncio.run(_collect(worker, user_error))
        broken = asyncio.run(_collect(worker, bug))
    finally:
        worker.close()
    assert refused == [{"event": "error", "status": 400, "error": {
        "message": "no purchase price", "field": "--purchase-usd", "hint": "give --purchase-usd"}}]
    assert broken[-1]["event"] == "error" and broken[-1]["status"] == 500
    assert "ZeroDivisionError" in broken[-1]["error"]["message"]


def test_concurrent_requests_hear_only_their_own_estimate() -> None:
    """The listener is a ContextVar: each job runs in its own copy of the context, in its own thread."""
    both_running = threading.Barrier(2, timeout=10)

    def work_of(name: str) -> Any:
        def work(_: Job) -> bytes:
            both_running.wait()  # the two jobs interleave
            for step in range(20):
                progress.progress(f"{name} {step}")
                time.sleep(0.001)
            return encoded({"name": name})
        return work

    async def both(worker: Worker) -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(_collect(worker, work_of("a")), _collect(worker, work_of("b"))))

    worker = Worker()
    try:
        heard_a, heard_b = asyncio.run(both(worker))
    finally:
        worker.close()
    assert [e["message"] for e in heard_a[:-1]] == [f"a {step}" for step in range(20)]
    assert [e["message"] for e in heard_b[:-1]] == [f"b {step}" for step in range(20)]
    assert heard_a[-1]["document"] == {"name": "a"} and heard_b[-1]["document"] == {"name": "b"}


def test_closing_the_stream_stops_the_job_at_its_next_progress_point() -> None:
    said = threading.Event()
    stopped: list[str] = []
    steps: list[int] = []

    def work(_: Job) -> bytes:
        try:
            for step in range(1000):
                steps.append(step)
                progress.progress(f"trace {step}")
                said.set()
                time.sleep(0.01)  # a trace
        except Cancelled:
            stopped.append("cancelled")
            raise
        return encoded({})

    async def leave_after_the_first_line(worker: Worker) -> dict[str, Any]:
        stream = worker.stream(work)
        first = json.loads(await stream.__anext__())
        await stream.aclose()  # the client went away
        return first

    worker = Worker()
    try:
        first = asyncio.run(leave_after_the_first_line(worker))
        deadline = time.monotonic() + 5
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.close()
    assert first == {"event": "progress", "message": "trace 0", "kind": "progress"}
    assert stopped == ["cancelled"] and len(steps) < 10  # stopped at a progress point, not after 1000 traces


def test_a_cancelled_job_raises_at_its_next_progress_point() -> None:
    job = Job()
    job.hear("progress", "fine")
    job.cancelled.set()
    with pytest.raises(Cancelled):
        job.hear("progress", "too late")
    assert not issubclass(Cancelled, Exception)  # no `except Exception` on the way takes it for a failure


def test_bodies_are_json_even_with_text_utf8_cannot_hold() -> None:
    assert json.loads(encoded({"message": "ok ✓"})) == {"message": "ok ✓"}
    assert json.loads(encoded({"key": "\ud800"})) == {"key": "\ud800"}  # escaped, not a failure
