"""The web planner's API against the CLI: for the same run, every endpoint answers the document the command's
`--json` prints (the CLI run in this process through the real entry point), errors carry the same fields and hints,
streams say their progress before the result, and `tunecast serve` starts and answers on a free port."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tests.conftest import REPO
from tests.models import shallow_gemma, shallow_llama

from tunecast.serve.app import create_app

pytestmark = pytest.mark.usefixtures("profile_cache")


@pytest.fixture
def client() -> Any:
    with TestClient(create_app(), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(shallow_llama()))
    return path


def run_yaml(model: Path) -> str:
    # one GPU model (every count) and a declared dataset: a plan of a few dozen options
    return (f"model: {model}\nmethod: lora\nseq_len: 256\nglobal_batch: 8\ngpus:\n  gpu: h100-sxm\n"
            "dataset:\n  examples: 1000000\n  mean_tokens: 200\n")


@pytest.fixture
def run_file(tmp_path: Path, model: Path, cli: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The run as a file, its profiles traced and cached once; then nothing the answers are made of is read from a
    cache of answers (TUNECAST_NO_CACHE: each plan is computed afresh, by the API and by the CLI alike)."""
    path = tmp_path / "run.yaml"
    path.write_text(run_yaml(model))
    warm = cli("plan", str(path), "--json")
    assert warm.code == 0, warm.stderr
    monkeypatch.setenv("TUNECAST_NO_CACHE", "1")
    return path


def _sets(overrides: dict[str, Any]) -> list[str]:
    words = []
    for key, value in overrides.items():
        words += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return words


def _cli_json(cli: Any, *args: str) -> Any:
    result = cli(*args, "--json")
    assert result.code == 0, result.stderr
    return result.json()


def test_plan_is_the_plan_the_cli_prints(client: TestClient, cli: Any, run_file: Path) -> None:
    overrides = {"seq_len": 512, "pricing.spot": False, "lora.rank": 16}
    options = {"optimize": "time", "budget_usd": 5000.0, "deadline_hours": None, "preemptions_per_hour": None}
    answer = client.post("/api/plan", json={"config": run_file.read_text(), "overrides": overrides,
                                            "options": options})
    assert answer.status_code == 200, answer.text
    printed = _cli_json(cli, "plan", str(run_file), *_sets(overrides), "--optimize", "time", "--budget", "5000")
    assert answer.json() == printed
    assert printed["schema_version"] == 1 and printed["options"] and printed["optimize"] == "time"


def test_a_plan_asked_again_or_changed_again_stays_the_clis(client: TestClient, cli: Any, run_file: Path) -> None:
    """The server keeps answers and estimates between requests: what it answers from them is still the CLI's."""
    text = run_file.read_text()
    for overrides in ({"seq_len": 384}, {"seq_len": 384, "pricing.spot": False}, {"seq_len": 384},
                      {"seq_len": 384, "epochs": 1}, {"seq_len": 400, "micro_batch": 2}):
        answer = client.post("/api/plan", json={"config": text, "overrides": overrides})
        assert answer.status_code == 200, answer.text
        assert answer.json() == _cli_json(cli, "plan", str(run_file), *_sets(overrides)), overrides


def test_memory_is_the_estimate_the_cli_prints(client: TestClient, cli: Any, run_file: Path) -> None:
    text = run_file.read_text()
    on_gpu = client.post("/api/memory", json={"config": text, "overrides": {"micro_batch": 4}})
    assert on_gpu.status_code == 200, on_gpu.text
    assert on_gpu.json() == _cli_json(cli, "memory", str(run_file), "--micro-batch", "4")
    assert on_gpu.json()["fits"] is True  # with gpus.gpu: the fit report too
    on_cpu = client.post("/api/memory", json={"config": text, "overrides": {"gpus.gpu": None},
                                              "options": {"device": "cpu"}})
    assert on_cpu.status_code == 200, on_cpu.text
    assert on_cpu.json() == _cli_json(cli, "memory", str(run_file), "--set", "gpus.gpu=null", "--device", "cpu")


def test_data_is_the_count_the_cli_prints(client: TestClient, cli: Any, model: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sample = (REPO / "examples" / "data" / "alpaca.jsonl").read_text()
    config = f"model: {model}\nseq_len: 64\nmicro_batch: 4\nseed: 7\ndataset:\n  examples: 10\n  mean_tokens: 20\n"
    answer = client.post("/api/data", json={"config": config, "sample": {"name": "alpaca.jsonl", "text": sample}})
    assert answer.status_code == 200, answer.text
    folder = tmp_path / "here"
    folder.mkdir()
    shutil.copy(REPO / "examples" / "data" / "alpaca.jsonl", folder / "alpaca.jsonl")
    monkeypatch.chdir(folder)
    printed = _cli_json(cli, "data", "alpaca.jsonl", "--model", str(model), "--seq-len", "64", "--micro-batch", "4",
                        "--seed", "7")
    assert answer.json() == printed and printed["source"] == "alpaca.jsonl" and printed["format"] == "alpaca"


def test_a_broken_sample_is_named_by_its_own_name(client: TestClient, model: Path) -> None:
    broken = '{"text": "fine"}\n{"text": \n'
    answer = client.post("/api/data", json={"config": f"model: {model}\n",
                                            "sample": {"name": "mine.jsonl", "text": broken}})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"].startswith("mine.jsonl: 1 invalid row") and "tunecast-sample" not in json.dumps(error)
    assert error["problems"][0]["location"] == "mine.jsonl, line 2"


def test_breakeven_is_the_cli_breakeven(client: TestClient, cli: Any, run_file: Path) -> None:
    plain = client.post("/api/breakeven", json={"options": {"gpu": "rtx-4090", "hours_per_month": 300}})
    assert plain.status_code == 200, plain.text
    assert plain.json() == _cli_json(cli, "breakeven", "--gpu", "rtx-4090", "--hours-per-month", "300")
    work = client.post("/api/breakeven", json={"config": run_file.read_text(),
                                               "options": {"gpu": "rtx-4090", "rent_gpu": "h100-sxm"}})
    assert work.status_code == 200, work.text
    printed = _cli_json(cli, "breakeven", "--gpu", "rtx-4090", "--rent-gpu", "h100-sxm", "--run", str(run_file))
    assert work.json() == printed and "work" in printed
    missing = client.post("/api/breakeven", json={"options": {"rent_usd_per_hour": 1.0}})
    assert missing.status_code == 400 and missing.json()["error"]["field"] == "--purchase-usd"


def test_the_catalog_lists_what_the_cli_lists(client: TestClient, cli: Any) -> None:
    answer = client.get("/api/catalog").json()
    assert answer["models"] == _cli_json(cli, "models")
    assert answer["gpus"] == _cli_json(cli, "gpus")
    offers = _cli_json(cli, "offers")
    assert {p["name"]: p["offers"] for p in answer["providers"]} == \
        {name: sum(o["provider"] == name for o in offers) for name in {o["provider"] for o in offers}}


def test_an_exported_config_plans_as_the_request_did(client: TestClient, cli: Any, run_file: Path,
                                                      tmp_path: Path) -> None:
    body: dict[str, Any] = {"config": run_file.read_text(), "overrides": {"seq_len": 320, "pricing.spot": False}}
    everything = client.post("/api/plan", json=body).json()
    priced = sorted(o["total_usd"] for o in everything["options"] if o["total_usd"] is not None)
    # the page's ranking, budget and deadline are the run's `plan:` keys; a client may send them as options too
    ranked = {**body, "overrides": {**body["overrides"], "plan.optimize": "time",
                                    "plan.budget_usd": priced[len(priced) // 2]}}
    hours = [o["hours"] for o in everything["options"] if o["total_usd"] is not None]
    optioned = {**body, "options": {"deadline_hours": (min(hours) + max(hours)) / 2}}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for number, request in enumerate((body, ranked, optioned)):
        exported = client.post("/api/export", json=request)
        assert exported.status_code == 200, exported.text
        path = elsewhere / f"exported-{number}.yaml"
        path.write_text(exported.json()["yaml"])
        served = client.post("/api/plan", json=request).json()
        printed = _cli_json(cli, "plan", str(path))
        if request is optioned:  # options are flags to /api/plan: its spec keeps no deadline; the file's does
            assert printed["spec"]["plan"]["deadline_hours"] == request["options"]["deadline_hours"]
            served["spec"]["plan"] = printed["spec"]["plan"]
        assert served == printed
        if request is not body:
            assert served["filtered_out"] > 0 and len(served["options"]) < len(everything["options"])


def test_a_dropped_config_plans_like_the_file(client: TestClient, cli: Any, run_file: Path) -> None:
    """A dropped config joins the user's catalog under its name: the CLI knows it by that name too."""
    dropped = {**shallow_llama(), "_name_or_path": "me/tiny"}
    added = client.post("/api/models", json={"config_json": dropped, "file_name": "config.json"}).json()
    assert added["model"] == "me/tiny" and added["params"] > 0
    answer = client.post("/api/memory", json={"config": run_file.read_text(), "overrides": {"model": "me/tiny"}})
    assert answer.status_code == 200, answer.text
    printed = _cli_json(cli, "memory", str(run_file), "--model", "me/tiny")
    assert answer.json() == printed and printed["model"] == "me/tiny" and printed["params"] == added["params"]


def test_errors_carry_the_clis_fields_and_hints(client: TestClient, cli: Any, run_file: Path) -> None:
    overrides = {"lora.rnak": 8, "optimizer": "adamm", "gpus.gpu": "h100-sxn"}
    answer = client.post("/api/plan", json={"config": run_file.read_text(), "overrides": overrides})
    assert answer.status_code == 400
    printed = cli("plan", str(run_file), *_sets(overrides), "--json")
    assert printed.code == 2

    def problems(error: dict[str, Any]) -> list[tuple[Any, ...]]:
        return sorted((p["field"], p["message"], p["hint"], p["severity"]) for p in error["problems"])

    served, cli_error = answer.json()["error"], printed.json()["error"]
    assert problems(served) == problems(cli_error) and len(served["problems"]) == 3
    assert (served["field"], served["hint"]) == (cli_error["field"], cli_error["hint"])
    assert {p["location"] for p in served["problems"]} == {f"overrides.{key}" for key in overrides}
    assert any("h100-sxm" in p["hint"] for p in served["problems"])  # the close match, as the CLI suggests it
    plan_flag = client.post("/api/plan", json={"config": run_file.read_text(), "options": {"optimize": "price"}})
    assert plan_flag.status_code == 400 and plan_flag.json()["error"]["field"] == "--optimize"


def _events(response: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.iter_lines() if line]


def test_the_plan_stream_says_its_progress_then_the_plan(client: TestClient, run_file: Path) -> None:
    body = {"config": run_file.read_text(), "overrides": {"seq_len": 448}}
    with client.stream("POST", "/api/plan/stream", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
        events = _events(response)
    *progress, result = events
    assert progress and all(e["event"] == "progress" for e in progress)
    assert "planning h100-sxm" in [e["message"] for e in progress]
    assert result["event"] == "result" and result["document"] == client.post("/api/plan", json=body).json()
    with client.stream("POST", "/api/plan/stream", json={"config": "model: nowhere/none\n"}) as response:
        (error,) = _events(response)
    assert error["event"] == "error" and error["status"] == 400 and error["error"]["field"] == "model"


def test_a_cold_estimate_streams_each_trace_then_the_clis_answer(client: TestClient, cli: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A model no template serves (a type no template reads), in an empty cache: traced, each trace said on the
    way."""
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path / "cold-cache"))
    model = tmp_path / "cold.json"
    model.write_text(json.dumps(shallow_gemma()))
    config = f"model: {model}\nmethod: lora\nmicro_batch: 2\nseq_len: 128\n"
    with client.stream("POST", "/api/memory/stream", json={"config": config}) as response:
        events = _events(response)
    *progress, result = events
    traces = [e["message"] for e in progress if "tracing the training step" in e["message"]]
    assert traces and traces[0].endswith("(trace 1 of 5)"), progress  # five shapes fit the profile of b ≥ 2
    assert result["event"] == "result"
    path = tmp_path / "cold.yaml"
    path.write_text(config)
    assert result["document"] == _cli_json(cli, "memory", str(path))


def _serve(*args: str) -> tuple[subprocess.Popen[str], str, str]:
    """`tunecast serve ARGS` in its own process: the process, the address it printed, and what it said before."""
    process = subprocess.Popen([sys.executable, "-m", "tunecast", "serve", "--port", "0", *args],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert process.stderr is not None
    said = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        said += line
        if "the planner is at " in line:
            return process, line.split("the planner is at ", 1)[1].split()[0], said
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError(f"tunecast serve did not start: {said}")


def _stop(process: subprocess.Popen[str]) -> int:
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()


def test_tunecast_serve_answers_on_a_free_loopback_port() -> None:
    process, url, said = _serve()
    try:
        assert url.startswith("http://127.0.0.1:") and "warning" not in said
        with urllib.request.urlopen(url + "api/health", timeout=10) as response:
            health = json.loads(response.read())
        assert health["schema_version"] == 1 and health["version"]
    finally:
        code = _stop(process)
    assert code == 0  # Ctrl-C stops it cleanly


def test_a_host_beyond_loopback_is_warned_about() -> None:
    process, url, said = _serve("--host", "0.0.0.0")
    try:
        assert "warning:" in said and "0.0.0.0 is not a loopback address" in said
        port = url.rsplit(":", 1)[1].rstrip("/")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=10) as response:
            assert response.status == 200
    finally:
        _stop(process)


def test_the_warning_names_the_host(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    started: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(sockets))
    result = cli("serve", "--host", "0.0.0.0", "--port", "0")
    assert result.code == 0 and started
    assert "warning:" in result.stderr and "0.0.0.0 is not a loopback address" in result.stderr
    quiet = cli("serve", "--port", "0")
    assert quiet.code == 0 and "warning" not in quiet.stderr and "http://127.0.0.1:" in quiet.stderr


def test_a_port_in_use_is_a_user_error(cli: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = cli("serve", "--port", str(port))
    assert result.code == 2 and "--port" in result.stderr and "Traceback" not in result.stderr
