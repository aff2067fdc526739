"""What one request may cost the server: a body over its size and an absurd list of overrides are refused before
anything reads them, a request past its time is answered 503 and its work stops, and a slow request holds up no
other (the catalog answers while a plan computes)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tunecast.serve.app import BODY_BYTES, SAMPLE_BYTES, create_app
from tunecast.serve.bodies import MAX_OVERRIDES
from tunecast.serve.jobs import Job
from tunecast.serve.service import Answer

RUN = "model: openai-community/gpt2\nmethod: lora\nseq_len: 512\n"


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert body["schema_version"] == 1 and {"message", "field", "hint"} <= set(body["error"])
    return dict(body["error"])


def busy_plan(steps: list[int], seconds: float) -> Any:
    """A stand-in for Service.plan that keeps a core busy in pure Python for `seconds` (as counting a huge global
    batch's divisors did), checking its job as the planner does before each estimate."""
    def plan(_run: Any, _options: Any, job: Job) -> Answer:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            job.check()
            steps.append(sum(range(20_000)))  # about a millisecond of the interpreter, holding the GIL
        return Answer.of({"planned": len(steps)})
    return plan


def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    client = TestClient(create_app(), raise_server_exceptions=False)
    huge = {"config": RUN, "overrides": {f"key{i}": "x" * 40 for i in range(BODY_BYTES // 40)}}
    refused = _error(client.post("/api/plan", json=huge), 413)
    assert refused["field"] == "body" and f"{BODY_BYTES:,} bytes" in refused["message"]
    # a Content-Length over the limit is refused from the header: not one chunk of the body is read
    read: list[int] = []

    def body() -> Any:
        for _ in range(BODY_BYTES // 100_000 + 2):
            read.append(1)
            yield b"x" * 100_000

    declared = str((BODY_BYTES // 100_000 + 2) * 100_000)
    _error(client.post("/api/plan", content=body(), headers={"content-type": "application/json",
                                                             "content-length": declared}), 413)
    assert len(read) <= 1
    # the same size without a Content-Length (a chunked upload) is counted as it arrives
    chunks = (b'{"config": "' + b"x" * 100_000 for _ in range(BODY_BYTES // 100_000 + 1))
    _error(client.post("/api/memory", content=chunks, headers={"content-type": "application/json"}), 413)
    # a dataset sample may be larger, up to its own limit
    sample = {"config": RUN, "sample": {"name": "train.jsonl", "text": "x" * (SAMPLE_BYTES + 1)}}
    assert "/api/data" in _error(client.post("/api/data", json=sample), 413)["message"]
    over_page = {"config": RUN, "sample": {"name": "train.jsonl", "text": '{"text": "a b c"}\n' * 100_000}}
    assert BODY_BYTES < len(json.dumps(over_page)) < SAMPLE_BYTES
    assert client.post("/api/data", json=over_page).status_code == 200


def test_an_absurd_number_of_overrides_is_refused_at_once() -> None:
    client = TestClient(create_app(), raise_server_exceptions=False)
    many = {"config": RUN, "overrides": {f"k{i}": 1 for i in range(MAX_OVERRIDES + 1)}}
    started = time.monotonic()
    refused = _error(client.post("/api/plan", json=many), 422)
    assert time.monotonic() - started < 1.0
    assert refused["field"] == "overrides" and str(MAX_OVERRIDES) in refused["problems"][0]["message"]


def test_a_request_past_its_time_is_503_and_its_work_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(timeout_s=0.5)
    steps: list[int] = []
    monkeypatch.setattr(app.state.service, "plan", busy_plan(steps, seconds=30))
    with TestClient(app, raise_server_exceptions=False) as client:
        started = time.monotonic()
        refused = _error(client.post("/api/plan", json={"config": RUN}), 503)
        assert time.monotonic() - started < 3.0 and "longer than the 0.5 s" in refused["message"]
        time.sleep(0.2)
        stopped_at = len(steps)
        time.sleep(0.5)
        assert len(steps) == stopped_at, "the job gave the CPU back once its time ran out"
        with client.stream("POST", "/api/plan/stream", json={"config": RUN}) as stream:
            events = [json.loads(line) for line in stream.iter_lines() if line]
        assert events[-1]["event"] == "error" and events[-1]["status"] == 503


def test_a_slow_request_holds_up_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """More slow plans than the server has threads for estimates (as a page sends when each corrected value starts
    another): the catalog, health and the model search are still answered at once."""
    app = create_app(threads=2)
    steps: list[int] = []
    monkeypatch.setattr(app.state.service, "plan", busy_plan(steps, seconds=8))
    with TestClient(app, raise_server_exceptions=False) as client:
        answers: list[Any] = []
        slow = [threading.Thread(target=lambda: answers.append(client.post("/api/plan", json={"config": RUN})))
                for _ in range(3)]
        for thread in slow:
            thread.start()
        while not steps:
            time.sleep(0.01)
        for path in ("/api/catalog", "/api/health", "/api/models?search=llama+3.1+8b", "/api/catalog"):
            got: list[Any] = []
            asking = threading.Thread(target=lambda into=got, at=path: into.append(client.get(at)), daemon=True)
            asking.start()
            asking.join(1.0)  # answered within a second, or not at all as far as a person waiting is concerned
            assert got and got[0].status_code == 200, (path, got)
        assert all(thread.is_alive() for thread in slow), "the slow plans ran while the others were answered"
        for thread in slow:
            thread.join(60)
    assert [answer.status_code for answer in answers] == [200, 200, 200]


def test_a_huge_global_batch_is_refused_in_under_a_second() -> None:
    """The issue's typo: 32,000,000,000 for 32 (the config bounds it; the planner's own speed under that bound is
    tests/unit/plan/test_planner_choices.py)."""
    with TestClient(create_app(), raise_server_exceptions=False) as client:
        body = {"config": RUN + "dataset:\n  examples: 20000\n  mean_tokens: 600\n",
                "overrides": {"global_batch": 32_000_000_000}}
        started = time.monotonic()
        refused = _error(client.post("/api/plan", json=body), 400)
        assert time.monotonic() - started < 1.0
        assert refused["problems"][0]["field"] == "global_batch"
        assert client.get("/api/catalog").status_code == 200
