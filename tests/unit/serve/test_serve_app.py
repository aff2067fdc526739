"""The web planner's HTTP side: every error a JSON document with an `error` key, the page's files from tunecast
itself, the host check, uploads, and cancelling a cold estimate by closing its stream."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tests.hub import standing_hub
from tests.models import shallow_gemma, shallow_llama

from tunecast.catalog.store import load_catalog
from tunecast.config.load import load_spec_text, overrides_from
from tunecast.errors import ConfigError, Problem, TunecastError
from tunecast.estimate import tracer
from tunecast.paths import default_user_catalog_dir
from tunecast.serve.app import STATIC, create_app, host_name, plotly_js
from tunecast.serve.service import Lru
from tunecast.serve.uploads import dropped_model_name, renamed, sample_file_name

RUN = "model: openai-community/gpt2\nmethod: lora\nseq_len: 512\nmicro_batch: 2\n"


@pytest.fixture
def client() -> TestClient:
    return TestClient(create_app(), raise_server_exceptions=False)


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["schema_version"] == 1 and {"message", "field", "hint"} <= set(body["error"])
    return dict(body["error"])


def test_health_names_the_version_and_catalog(client: TestClient) -> None:
    body = client.get("/api/health").json()
    assert body["schema_version"] == 1 and body["version"] and body["catalog"] == load_catalog(None).version


def test_a_user_error_is_400_with_the_cli_error_document(client: TestClient) -> None:
    error = _error(client.post("/api/memory", json={"config": RUN, "overrides": {"lora.rnak": 8, "seq_len": 0}}), 400)
    fields = {p["field"]: p for p in error["problems"]}
    assert fields["lora.rnak"]["hint"] == "Did you mean 'lora.rank'?"
    assert fields["lora.rnak"]["location"] == "overrides.lora.rnak"  # where the value came from, as `--set` is named
    assert fields["seq_len"]["message"] == "must be ≥ 1 (got 0)"
    assert error["field"] in fields


def test_a_bad_line_of_the_config_is_located_by_its_line(client: TestClient) -> None:
    error = _error(client.post("/api/memory", json={"config": RUN + "optimizer: adamm\n"}), 400)
    (problem,) = error["problems"]
    assert problem["field"] == "optimizer" and problem["location"] == "line 5" and "adamw" in problem["hint"]


def test_a_body_of_the_wrong_shape_is_422_in_the_same_shape(client: TestClient) -> None:
    error = _error(client.post("/api/plan", json={"config": 5, "overrides": [], "extra": 1}), 422)
    assert {p["field"] for p in error["problems"]} == {"config", "overrides", "extra"}
    not_json = _error(client.post("/api/plan", content=b"{", headers={"content-type": "application/json"}), 422)
    assert not_json["problems"]
    infinite = client.post("/api/plan", content=b'{"options": {"budget_usd": Infinity}}',
                           headers={"content-type": "application/json"})
    assert _error(infinite, 422)["field"] == "options.budget_usd"


def test_unknown_routes_and_methods_are_json_errors(client: TestClient) -> None:
    assert "GET /api/nothing" in _error(client.get("/api/nothing"), 404)["message"]
    _error(client.get("/api/plan"), 405)


def test_an_unexpected_failure_is_a_500_json_document(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    service = client.app.state.service  # type: ignore[attr-defined]

    def broken(*_: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(service, "memory", broken)
    error = _error(client.post("/api/memory", json={"config": RUN}), 500)
    assert "RuntimeError: boom" in error["message"] and "bug" in error["hint"]


def test_the_page_and_its_files_come_from_tunecast(client: TestClient) -> None:
    index = client.get("/")
    if (STATIC / "index.html").is_file():
        assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    else:
        _error(index, 404)
    bundled = plotly_js()
    assert bundled is not None  # plotly is a dependency: its plotly.js is served, not fetched from a CDN
    script = client.get("/static/plotly.min.js")
    assert script.status_code == 200 and script.content == bundled.read_bytes()
    assert "javascript" in script.headers["content-type"]
    _error(client.get("/static/../app.py"), 404)
    _error(client.get("/static/nothing.js"), 404)


def test_a_loopback_server_answers_its_own_host_only() -> None:
    app = create_app(allowed_hosts=["127.0.0.1", "localhost"])
    assert TestClient(app, base_url="http://127.0.0.1:8000").get("/api/health").status_code == 200
    assert TestClient(app, base_url="http://localhost:8000").get("/api/health").status_code == 200
    refused = _error(TestClient(app, base_url="http://rebound.example:8000").get("/api/health"), 400)
    assert refused["field"] == "Host" and "rebound.example" in refused["message"]
    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:8000", "LocalHost", "::1")] == \
        ["127.0.0.1", "::1", "localhost", "::1"]


def test_a_dropped_config_joins_the_catalog_under_its_own_name(client: TestClient) -> None:
    config = {**shallow_llama(), "_name_or_path": "me/tiny", "architectures": ["LlamaForCausalLM"]}
    first = client.post("/api/models", json={"config_json": config, "file_name": "config.json"})
    assert first.status_code == 200, first.text
    added = first.json()
    assert added["model"] == "me/tiny" and added["added"] is True
    params = added["params"]
    # embeddings and head 2 × 512 × 64, final norm 64, and 2 layers of q, o 64 × 64, k, v 64 × 32 (2 of 4 heads of
    # 16), gate, up, down 64 × 160, two norms of 64
    assert params == 2 * 512 * 64 + 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64)
    again = client.post("/api/models", json={"config_json": config, "file_name": "config.json"}).json()
    assert again["model"] == "me/tiny" and again["added"] is False and again["params"] == params
    # the name plans show, with its parameter count, is the one a person gave it; `model:` takes it here and in
    # the user's catalog on disk (an exported config names it too)
    service = client.app.state.service  # type: ignore[attr-defined]
    loaded = load_spec_text("model: me/tiny\n", [], service.catalog)
    assert loaded.model.name == "me/tiny" and loaded.model.params == params and loaded.model.data == config
    assert load_catalog(default_user_catalog_dir()).models.find("me/tiny") is not None
    listed = client.get("/api/catalog").json()["models"]
    assert [m["params"] for m in listed if m["name"] == "me/tiny"] == [params]
    # another config under the same name is another model: the name with its digest
    wider = {**shallow_llama(hidden_size=128), "_name_or_path": "me/tiny"}
    other = client.post("/api/models", json={"config_json": wider}).json()
    assert other["model"].startswith("me/tiny-") and other["params"] > params
    # a catalog model's own config is that model
    qwen = load_catalog(None).models.find("Qwen/Qwen3-0.6B")
    assert qwen is not None
    same = client.post("/api/models", json={"config_json": qwen.data, "file_name": "Qwen__Qwen3-0.6B.json"}).json()
    assert same["model"] == "Qwen/Qwen3-0.6B" and same["added"] is False and same["params"] == qwen.params
    error = _error(client.post("/api/models", json={"config_json": {"hidden_size": 64}}), 400)
    assert error["field"] == "config_json.model_type"
    huge = _error(client.post("/api/models", json={"config_json": shallow_llama(num_hidden_layers=10**9)}), 400)
    assert huge["field"] == "config_json" and "layers" in huge["message"]


@pytest.mark.parametrize(("config", "file_name", "name"), [
    ({"_name_or_path": "meta-llama/Llama-3.1-8B", "architectures": ["LlamaForCausalLM"]}, "config.json",
     "meta-llama/Llama-3.1-8B"),
    ({"_name_or_path": "/data/runs/my llama/final", "architectures": ["LlamaForCausalLM"]}, "config.json",
     "local/final"),
    ({"_name_or_path": "", "architectures": ["LlamaForCausalLM"]}, "Qwen__Qwen3-0.6B.json", "Qwen/Qwen3-0.6B"),
    ({"architectures": ["LlamaForCausalLM"]}, "config.json", "local/LlamaForCausalLM"),
    ({}, None, "local/llama"),
    ({"architectures": ["LlamaForCausalLM"]}, "my model (v2).json", "local/my-model-v2"),
])
def test_a_dropped_config_is_named_as_it_names_itself(config: dict[str, Any], file_name: str | None,
                                                      name: str) -> None:
    assert dropped_model_name({"model_type": "llama", **config}, None, file_name) == name
    assert dropped_model_name({"model_type": "llama", **config}, "org/asked", file_name) == "org/asked"


def test_export_is_the_request_as_a_config_file(client: TestClient, tmp_path: Path) -> None:
    body = {"config": RUN, "overrides": {"seq_len": 1024, "pricing.spot": False, "lora.rank": 32}}
    text = client.post("/api/export", json=body).json()["yaml"]
    path = tmp_path / "run.yaml"
    path.write_text(text)
    from tunecast.config.load import load_spec

    catalog = load_catalog(None)
    exported = load_spec(path, [], catalog).spec
    requested = load_spec_text(RUN, overrides_from(body["overrides"]), catalog).spec
    assert exported == requested and exported.model_fields_set == requested.model_fields_set
    assert exported.seq_len == 1024 and exported.lora.rank == 32 and exported.pricing.spot is False


def test_sample_names_keep_their_format_suffix() -> None:
    assert sample_file_name("data/train.jsonl") == "train.jsonl"
    assert sample_file_name("C:\\data\\my set.CSV") == "my_set.CSV"
    assert sample_file_name("\x00.json") == "sample.json"
    with pytest.raises(TunecastError, match="cannot tell the format") as refused:
        sample_file_name("train.parquet")
    assert refused.value.field == "sample.name"


def test_errors_about_the_temporary_file_name_the_sample() -> None:
    error = ConfigError("/tmp/x/train.jsonl: 1 invalid row",
                        [Problem(None, "not valid JSON", "fix it", location="/tmp/x/train.jsonl, line 3")])
    named = renamed(error, "/tmp/x/train.jsonl", "train.jsonl")
    assert isinstance(named, ConfigError) and named.message == "train.jsonl: 1 invalid row: 1 problem"
    assert named.problems[0].location == "train.jsonl, line 3"


def test_the_lru_forgets_the_least_recently_used() -> None:
    kept: Lru[str, int] = Lru(2)
    kept.put("a", 1)
    kept.put("b", 2)
    assert kept.get("a") == 1
    kept.put("c", 3)
    assert kept.get("b") is None and kept.get("a") == 1 and kept.get("c") == 3 and len(kept) == 2


def test_closing_a_stream_cancels_a_cold_estimate_at_its_next_trace(
        client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model no template serves (the chunked loss) is traced: the stream says each trace; closing it stops the
    estimate before the next one. The tracer is stood in for by one that waits for the test."""
    release = threading.Event()
    calls: list[tuple[int, int]] = []

    def trace_step(_config: Any, _settings: Any, batch: int, seq: int, **_: Any) -> None:
        calls.append((batch, seq))
        release.wait(10)

    monkeypatch.setattr(tracer, "tracing_available", lambda: None)
    monkeypatch.setattr(tracer, "trace_step", trace_step)
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(shallow_gemma(vocab_size=520)))
    body = {"config": f"model: {model}\nmicro_batch: 2\nseq_len: 64\n"}
    with client.stream("POST", "/api/memory/stream", json=body) as stream:
        assert stream.headers["content-type"].startswith("application/x-ndjson")
        lines = stream.iter_lines()
        announced, first = json.loads(next(lines)), json.loads(next(lines))
    assert announced["kind"] == "notice" and "a gemma config" in announced["message"]  # what it traces, and why
    assert first["event"] == "progress" and "trace 1 of" in first["message"]
    release.set()  # the trace under way ends; the next progress point stops the estimate
    service = client.app.state.service  # type: ignore[attr-defined]
    assert service._estimating.acquire(timeout=10)  # the job is over
    service._estimating.release()
    assert len(calls) == 1


def test_loopback_hosts() -> None:
    from tunecast.cli.serve_cmds import is_loopback

    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.com")] == [False] * 4


def test_the_planner_fetches_a_model_outside_the_catalog_unless_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the command line: the config.json of a Hub id outside the catalog is fetched (said as the request's
    progress), and never with `serve --offline`."""
    from tunecast.estimate.progress import listening
    from tunecast.serve.service import RunRequest, Service

    with standing_hub(monkeypatch) as hub:
        client = TestClient(create_app(), raise_server_exceptions=False)
        body = {"config": "method: lora\n", "overrides": {"model": "acme/tiny"}}
        assert "model: acme/tiny" in client.post("/api/export", json=body).json()["yaml"]
        heard: list[tuple[str, str]] = []
        with listening(lambda kind, text: heard.append((kind, text))), pytest.raises(ConfigError) as refused:
            Service(load_catalog(None)).load(RunRequest("", {"model": "acme/gated"}))
    assert "acme/gated is gated" in refused.value.problems[0].message
    assert heard and heard[0][0] == "progress" and "fetching its config.json" in heard[0][1]
    with standing_hub(monkeypatch) as hub:
        offline = TestClient(create_app(offline=True), raise_server_exceptions=False)
        error = _error(offline.post("/api/export", json={"config": "", "overrides": {"model": "acme/other"}}), 400)
        assert "offline mode (--offline)" in error["problems"][0]["message"] and hub.asked == []
