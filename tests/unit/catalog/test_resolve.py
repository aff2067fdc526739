"""--model: catalog names, model directories, config files of any name, and opt-in downloads from a
stand-in Hub served on loopback — and what a user is told when the Hub cannot be reached, or says no."""

import hashlib
import json
import shutil
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from tunecast.catalog.resolve import resolve_model
from tunecast.errors import TunecastError

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 1000}


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B", "META-LLAMA/llama-3.1-8b", "Llama-3.1-8B",
                                  "meta-llama__Llama-3.1-8B"])
def test_catalog_names(catalog, name) -> None:
    model = resolve_model(name, catalog)
    assert (model.name, model.origin, model.params) == ("meta-llama/Llama-3.1-8B", "catalog", 8_030_261_248)


def test_model_directory_and_config_file_of_any_name(tmp_path, catalog) -> None:
    source = catalog.models.config_path("Qwen/Qwen3-0.6B")
    (tmp_path / "qwen").mkdir()
    shutil.copy(source, tmp_path / "qwen" / "config.json")
    shutil.copy(source, tmp_path / "my settings.json")
    by_dir = resolve_model(str(tmp_path / "qwen"), catalog)
    by_file = resolve_model(str(tmp_path / "my settings.json"), catalog)
    assert by_dir.origin == "directory" and by_file.origin == "file"
    assert by_dir.data == by_file.data == resolve_model("Qwen/Qwen3-0.6B", catalog).data


def test_a_json_file_that_is_not_a_model_config(tmp_path, catalog) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(TunecastError, match="no model_type"):
        resolve_model(str(path), catalog)


def test_nothing_is_downloaded_unless_allowed(catalog) -> None:
    with pytest.raises(TunecastError) as error:
        resolve_model("someone/unknown-model", catalog)
    assert "--allow-download" in (error.value.hint or "")


class _Hub(BaseHTTPRequestHandler):
    """Answers huggingface_hub's HEAD and GET for <repo>/resolve/main/config.json; one gated repo, one repo
without a config.json, one the Hub is down for."""

    configs = {"acme/tiny": CONFIG, "acme/gated": CONFIG}
    token = "hf_test_token"

    def _reply(self, body: bool) -> None:
        parts = self.path.split("/resolve/")
        repo = parts[0].strip("/")
        if repo == "acme/down":
            self.send_response(503)
            self.end_headers()
            return
        if repo == "acme/weights-only":
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", "0" * 40)
            self.end_headers()
            return
        if len(parts) != 2 or repo not in self.configs or not parts[1].endswith("config.json"):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
            return
        if repo == "acme/gated" and self.headers.get("authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("X-Error-Message", "Access to model acme/gated is restricted.")
            self.end_headers()
            return
        payload = json.dumps(self.configs[repo]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("ETag", '"' + hashlib.sha1(payload).hexdigest() + '"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def do_HEAD(self) -> None:
        self._reply(body=False)

    def do_GET(self) -> None:
        self._reply(body=True)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    yield endpoint
    server.shutdown()


def test_download_is_cached_and_found_later_without_the_network(catalog, hub, monkeypatch) -> None:
    model = resolve_model("acme/tiny", catalog, allow_download=True)
    assert (model.origin, model.data["hidden_size"]) == ("downloaded", 64)
    assert model.source == f"{hub}/acme/tiny/resolve/main/config.json"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert resolve_model("acme/tiny", catalog).data == CONFIG


def test_gated_model_needs_hf_token(catalog, hub, monkeypatch) -> None:
    with pytest.raises(TunecastError, match="gated") as error:
        resolve_model("acme/gated", catalog, allow_download=True)
    assert "HF_TOKEN" in (error.value.hint or "")
    monkeypatch.setenv("HF_TOKEN", _Hub.token)
    assert resolve_model("acme/gated", catalog, allow_download=True).origin == "downloaded"


def test_unknown_repo_on_the_hub(catalog, hub) -> None:
    with pytest.raises(TunecastError, match=r"acme/nothing was not found on http://127\.0\.0\.1"):
        resolve_model("acme/nothing", catalog, allow_download=True)


def test_repo_without_a_config_json(catalog, hub) -> None:
    with pytest.raises(TunecastError, match=r"config\.json was not found in acme/weights-only") as error:
        resolve_model("acme/weights-only", catalog, allow_download=True)
    assert "config JSON file" in (error.value.hint or "")


def test_not_a_hub_model_id(catalog, hub) -> None:
    with pytest.raises(TunecastError, match="'acme/two words' is not a Hugging Face model id"):
        resolve_model("acme/two words", catalog, allow_download=True)


# The Hub out of reach. huggingface_hub retries a failed connection five times with back-off (23 s in all)
# before it gives up; the waits are skipped here so that each test takes a fraction of a second.


@pytest.fixture
def no_retry_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http, "time", SimpleNamespace(sleep=lambda seconds: None))


@pytest.fixture
def closed_endpoint(monkeypatch: pytest.MonkeyPatch, no_retry_waits: None) -> str:
    """HF_ENDPOINT at a loopback port that nothing listens on: every connection is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    return endpoint


def test_unreachable_hub_is_not_a_missing_config(catalog, closed_endpoint) -> None:
    with pytest.raises(TunecastError, match="could not reach the Hugging Face Hub") as error:
        resolve_model("someorg/some-model", catalog, allow_download=True)
    assert error.value.message.startswith(f"could not reach the Hugging Face Hub at {closed_endpoint} to fetch "
                                          "someorg/some-model's config.json: ")
    assert "not found" not in error.value.message and "no config.json" not in error.value.message
    assert error.value.field == "model" and "\n" not in error.value.message
    assert "local model directory holding config.json, or at a config JSON file" in (error.value.hint or "")


def test_offline_mode_says_so(catalog, closed_endpoint, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TunecastError, match="HF_HUB_OFFLINE is set") as error:
        resolve_model("someorg/some-model", catalog, allow_download=True)
    assert "unset HF_HUB_OFFLINE" in (error.value.hint or "")


def test_hub_down_is_not_a_missing_model(catalog, hub, no_retry_waits) -> None:
    with pytest.raises(TunecastError, match=r"did not serve acme/down's config\.json: it answered HTTP 503") as error:
        resolve_model("acme/down", catalog, allow_download=True)
    assert "try again later" in (error.value.hint or "")


def test_a_connection_lost_outside_the_metadata_call(catalog, monkeypatch) -> None:
    """Errors of the HTTP client that huggingface_hub passes on unwrapped (a proxy that refuses, a connection
    lost mid-download) are the Hub out of reach too."""
    import huggingface_hub

    httpx = pytest.importorskip("httpx2")

    def refuse(*args: object, **kwargs: object) -> str:
        raise httpx.ProxyError("407 Proxy Authentication Required")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    with pytest.raises(TunecastError, match=r"could not reach the Hugging Face Hub .*: 407 Proxy Authentication"):
        resolve_model("someorg/some-model", catalog, allow_download=True)


def test_cli_exit_status_and_message_when_the_hub_is_out_of_reach(cli, closed_endpoint) -> None:
    result = cli("memory", "--model", "someorg/some-model", "--allow-download")
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr
    assert "could not reach the Hugging Face Hub" in result.stderr and "no config.json" not in result.stderr
    document = cli("memory", "--model", "someorg/some-model", "--allow-download", "--json")
    assert document.code == 2
    problem = document.json()["error"]["problems"][0]
    assert problem["field"] == "model" and problem["message"].startswith("could not reach the Hugging Face Hub")
