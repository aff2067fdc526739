"""A stand-in Hugging Face Hub on loopback, answering `<org/name>/resolve/main/config.json` as huggingface.co does
(the X-Error-Code header, 401 for a repository an anonymous request may not see), for tests of fetching a model's
config. The suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py); `standing_hub` turns it off for its block only, and
points HF_ENDPOINT at the stand-in: no test ever asks the real Hub."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 1000}
TOKEN = "hf_test_token"


@dataclass
class Hub:
    endpoint: str
    asked: list[str] = field(default_factory=list)  # the path of every request, in order


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Answer(BaseHTTPRequestHandler):
        """acme/tiny: a config; acme/gated: one behind a licence (the token TOKEN has access); acme/renamed: moved to
        acme/tiny; acme/weights-only: no config.json; acme/down: the Hub failing; acme/portal: a sign-in page where
        the file should be; acme/proxied: a 404 from something that is not the Hub; acme/encoder: a config without
        model_type. Anything else does not exist."""

        def do_GET(self) -> None:
            hub.asked.append(self.path)
            repo, _, rest = self.path.strip("/").partition("/resolve/main/")
            token_given = self.headers.get("authorization")
            if repo == "acme/down":
                self._send(503)
            elif repo == "acme/renamed":
                self._send(307, {"Location": "/acme/tiny/resolve/main/config.json"})
            elif repo == "acme/portal":
                self._send(200, {"Content-Type": "text/html"}, b"<html><body>Sign in to the network</body></html>")
            elif repo == "acme/proxied":  # a server in between, not the Hub: no X-Error-Code
                self._send(404)
            elif repo == "acme/weights-only":
                self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": "0" * 40})
            elif repo not in ("acme/tiny", "acme/gated", "acme/encoder") or rest != "config.json":
                # huggingface.co answers 401 to an anonymous request for a repository it does not show
                self._send(401 if token_given is None else 404, {"X-Error-Code": "RepoNotFound"})
            elif repo == "acme/gated" and token_given != f"Bearer {TOKEN}":
                self._send(401 if token_given is None else 403,
                           {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model acme/gated is restricted."})
            else:
                config = {"architectures": ["BertModel"]} if repo == "acme/encoder" else CONFIG
                payload = json.dumps(config).encode()
                self._send(200, {"Content-Type": "application/json", "X-Repo-Commit": "0" * 40,
                                 "ETag": '"' + hashlib.sha1(payload).hexdigest() + '"'}, payload)

        def _send(self, status: int, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Answer


@contextmanager
def standing_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    """The stand-in Hub, with HF_ENDPOINT pointing at it and offline mode off, for the block. Only HF_TOKEN is sent:
    a test of the saved login's token unsets HF_HUB_DISABLE_IMPLICIT_TOKEN and gives its own."""
    hub = Hub(endpoint="")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")  # a token the developer saved is never sent
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
