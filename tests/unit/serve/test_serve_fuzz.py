"""The API fuzzed against its own OpenAPI spec (schemathesis, in process): whatever a client sends, no 500, and
every error a JSON document with an `error` key. Derandomized and bounded (a few dozen cases per route), so that it
runs the same way each time in well under a minute on two cores."""

from __future__ import annotations

import json

import schemathesis
from hypothesis import HealthCheck, settings

from tunecast.catalog.store import load_catalog
from tunecast.serve.app import create_app

schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(catalog=load_catalog(None)))
CASES_PER_ROUTE = 50


@schema.parametrize()
@settings(max_examples=CASES_PER_ROUTE, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_request_makes_a_500_and_every_error_is_a_json_document(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, response.text[:2000]
    if response.status_code >= 400:
        body = json.loads(response.text)
        assert isinstance(body, dict) and "error" in body, response.text[:2000]
        assert {"message", "field", "hint"} <= set(body["error"]), response.text[:2000]
    elif "application/x-ndjson" in str(response.headers.get("content-type")):
        for line in response.text.splitlines():  # a stream's failure is an event, never a 500 either
            event = json.loads(line)
            assert event.get("status", 200) < 500, line[:2000]
