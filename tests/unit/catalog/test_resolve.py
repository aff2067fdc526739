"""--model: catalog names, model directories, config files of any name, and opt-in downloads from a
stand-in Hub served on loopback."""

import hashlib
import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tunecast.catalog.resolve import resolve_model
from tunecast.catalog.store import load_catalog
from tunecast.errors import TunecastError

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 1000}


@pytest.fixture
def catalog():  # type: ignore[no-untyped-def]
    return load_catalog(None)


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
    """Answers huggingface_hub's HEAD and GET for <repo>/resolve/main/config.json; one gated repo."""

    configs = {"acme/tiny": CONFIG, "acme/gated": CONFIG}
    token = "hf_test_token"

    def _reply(self, body: bool) -> None:
        parts = self.path.split("/resolve/")
        repo = parts[0].strip("/")
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
    with pytest.raises(TunecastError, match="not found"):
        resolve_model("acme/nothing", catalog, allow_download=True)
