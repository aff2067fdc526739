"""--model: catalog names, model directories, config files of any name, and the config.json of a model outside the
catalog fetched from a stand-in Hub served on loopback (tests/hub.py) — by default, never in offline mode — and what
a user is told when the Hub cannot be reached, or says no."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from tests.hub import CONFIG, TOKEN, Hub, standing_hub

from tunecast.catalog import hub as hub_module
from tunecast.catalog.hub import HubAccess, is_hub_id, offline_reason
from tunecast.catalog.resolve import resolve_model
from tunecast.errors import TunecastError


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B", "META-LLAMA/llama-3.1-8b", "Llama-3.1-8B",
                                  "meta-llama__Llama-3.1-8B"])
def test_catalog_names(catalog, name) -> None:
    model = resolve_model(name, catalog)
    assert (model.name, model.origin, model.params) == ("meta-llama/Llama-3.1-8B", "catalog", 8_030_261_248)


def test_model_directory_and_config_file_of_any_name(tmp_path, catalog) -> None:
    import shutil

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


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    with standing_hub(monkeypatch) as served:
        yield served


# Fetched by default


def test_a_model_outside_the_catalog_is_fetched_without_a_flag_and_kept(catalog, hub, monkeypatch) -> None:
    heard: list[str] = []
    model = resolve_model("acme/tiny", catalog, hub=HubAccess(progress=heard.append))
    assert (model.origin, model.data) == ("downloaded", CONFIG)
    assert model.source == f"{hub.endpoint}/acme/tiny/resolve/main/config.json"
    assert len(heard) == 1 and "acme/tiny" in heard[0] and hub.endpoint in heard[0] and "10 s" in heard[0]
    assert hub.asked == ["/acme/tiny/resolve/main/config.json"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # found again without the Hub, even offline
    assert resolve_model("acme/tiny", catalog, hub=HubAccess(offline=True)).data == CONFIG
    assert len(hub.asked) == 1


def test_a_redirect_of_a_renamed_repository_is_followed(catalog, hub) -> None:
    assert resolve_model("acme/renamed", catalog).data == CONFIG
    assert hub.asked == ["/acme/renamed/resolve/main/config.json", "/acme/tiny/resolve/main/config.json"]


# Offline: the flag, and the variables as huggingface_hub reads them


@pytest.mark.parametrize(("flag", "variables", "reason", "fix"), [
    (True, {}, "--offline", "without --offline"),
    (False, {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1", "with HF_HUB_OFFLINE unset"),
    (False, {"HF_HUB_OFFLINE": "true"}, "HF_HUB_OFFLINE=true", "with HF_HUB_OFFLINE unset"),
    (False, {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "yes"}, "TRANSFORMERS_OFFLINE=yes",
     "with TRANSFORMERS_OFFLINE unset"),
])
def test_offline_mode_never_asks_the_hub_and_says_what_to_pass(catalog, hub, monkeypatch, flag, variables, reason,
                                                                fix) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TunecastError, match=rf"unknown model 'acme/tiny': .*offline mode \({reason}\)") as error:
        resolve_model("acme/tiny", catalog, hub=HubAccess(offline=flag))
    assert hub.asked == []
    assert error.value.field == "model" and "\n" not in error.value.message
    hint = error.value.hint or ""
    assert "local model directory holding config.json, a config JSON file, or a catalog name" in hint and fix in hint


def test_offline_names_close_catalog_models(catalog) -> None:
    """The suite's own HF_HUB_OFFLINE=1: a misspelt catalog id is answered with the close names, at once."""
    with pytest.raises(TunecastError, match=r"offline mode \(HF_HUB_OFFLINE=1\)") as error:
        resolve_model("meta-llama/Llama-3.1-8b-chat", catalog)
    assert "meta-llama/Llama-3.1-8B" in (error.value.hint or "")


ENVIRONMENTS = [{}, {"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "TRUE"}, {"HF_HUB_OFFLINE": "Yes"},
                {"HF_HUB_OFFLINE": "on"}, {"HF_HUB_OFFLINE": "0"}, {"HF_HUB_OFFLINE": "false"},
                {"HF_HUB_OFFLINE": "2"}, {"HF_HUB_OFFLINE": ""}, {"TRANSFORMERS_OFFLINE": "1"},
                {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "1"},
                {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "0"}]
# huggingface_hub reads the variables once, at import: each environment is read by a fresh import of its constants
HUGGINGFACE_HUB_READS = """
import importlib, json, os, sys
from huggingface_hub import constants
answers = []
for environment in json.loads(sys.argv[1]):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.pop(name, None)
    os.environ.update(environment)
    answers.append(importlib.reload(constants).HF_HUB_OFFLINE)
print(json.dumps(answers))
"""


def test_offline_variables_are_read_as_huggingface_hub_reads_them(monkeypatch) -> None:
    done = subprocess.run([sys.executable, "-c", HUGGINGFACE_HUB_READS, json.dumps(ENVIRONMENTS)],
                          capture_output=True, text=True, timeout=120, check=True)
    theirs = json.loads(done.stdout)
    ours = []
    for environment in ENVIRONMENTS:
        with monkeypatch.context() as scoped:
            for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
                scoped.delenv(name, raising=False)
            for name, value in environment.items():
                scoped.setenv(name, value)
            ours.append(offline_reason(False) is not None)
    assert ours == theirs and True in ours and False in ours


@pytest.mark.parametrize(("name", "valid"), [("acme/tiny", True), ("Qwen/Qwen2.5-0.5B", True), ("a/b", True),
                                             ("acme/two words", False), ("acme/x--y", False), ("acme/x..y", False),
                                             ("acme/-x", False), ("acme/x.git", False), ("a/b/c", False),
                                             ("acme/" + "x" * 97, False), ("tiny", False), ("acme/café", False)])
def test_hub_ids_as_the_hub_takes_them(name, valid) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
        theirs = "/" in name
    except HFValidationError:
        theirs = False
    assert is_hub_id(name) is valid is theirs


def test_a_name_that_is_no_hub_id_is_never_sent(catalog, hub) -> None:
    with pytest.raises(TunecastError, match="unknown model 'acme/two words': not a local path") as error:
        resolve_model("acme/two words", catalog)
    assert "org/name" in (error.value.hint or "") and hub.asked == []


# What the Hub answers


def test_a_gated_model_needs_a_token_with_access(catalog, hub, monkeypatch) -> None:
    with pytest.raises(TunecastError, match=r"acme/gated is gated or private .* \(HTTP 401\)") as error:
        resolve_model("acme/gated", catalog)
    hint = error.value.hint or ""
    assert "HF_TOKEN" in hint and "hf auth login" in hint and f"{hub.endpoint}/acme/gated" in hint
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(TunecastError, match=r"the token sent has no access to it \(HTTP 403\)"):
        resolve_model("acme/gated", catalog)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert resolve_model("acme/gated", catalog).origin == "downloaded"


def test_the_token_of_the_saved_login_is_sent_unless_disabled(catalog, hub, monkeypatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: TOKEN)  # what `hf auth login` saved
    with pytest.raises(TunecastError, match=r"\(HTTP 401\)"):  # HF_HUB_DISABLE_IMPLICIT_TOKEN=1: not sent
        resolve_model("acme/gated", catalog)
    monkeypatch.delenv("HF_HUB_DISABLE_IMPLICIT_TOKEN")
    assert resolve_model("acme/gated", catalog).origin == "downloaded"


@pytest.mark.parametrize("token", [None, "hf_someone"])
def test_no_such_repository(catalog, hub, monkeypatch, token) -> None:
    """Anonymous, the Hub answers 401 for a repository it does not show; RepoNotFound says which it is."""
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(TunecastError, match=r"acme/nothing is not in the catalog and was not found on http://127\."):
        resolve_model("acme/nothing", catalog)


def test_a_404_that_is_not_the_hubs_is_no_missing_model(catalog, hub) -> None:
    """A proxy or a non-Hub HF_ENDPOINT answering 404 (without the Hub's X-Error-Code) is not "no such model"."""
    with pytest.raises(TunecastError, match=r"did not give its config\.json: it answered HTTP 404 without the Hub's "
                                            "X-Error-Code") as error:
        resolve_model("acme/proxied", catalog)
    assert "HF_ENDPOINT" in (error.value.hint or "") and "not found" not in error.value.message


def test_a_repository_without_a_config_json(catalog, hub) -> None:
    with pytest.raises(TunecastError, match=r"config\.json was not found in acme/weights-only") as error:
        resolve_model("acme/weights-only", catalog)
    assert "config JSON file" in (error.value.hint or "")


def test_a_config_that_is_no_transformers_model(catalog, hub) -> None:
    with pytest.raises(TunecastError, match=r"acme/encoder's config\.json .* has no model_type"):
        resolve_model("acme/encoder", catalog)


def test_a_page_in_place_of_the_file_is_not_kept(catalog, hub) -> None:
    """A proxy's or network's sign-in page answering 200 is the Hub out of reach, and nothing is cached: the next
    command asks again."""
    for _ in range(2):
        with pytest.raises(TunecastError, match=r"did not give its config\.json: .* not JSON") as error:
            resolve_model("acme/portal", catalog)
    assert "HF_ENDPOINT" in (error.value.hint or "") and len(hub.asked) == 2


def test_the_hub_failing_is_not_a_missing_model(catalog, hub) -> None:
    with pytest.raises(TunecastError, match=r"did not give its config\.json: it answered HTTP 503") as error:
        resolve_model("acme/down", catalog)
    assert "try again later" in (error.value.hint or "") and len(hub.asked) == 1  # asked once: no retries


# The Hub out of reach: told in one line, within the time


@pytest.fixture
def closed_endpoint(monkeypatch: pytest.MonkeyPatch) -> str:
    """HF_ENDPOINT at a loopback port that nothing listens on: every connection is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return endpoint


def test_a_refused_connection_says_so_and_what_to_pass(catalog, closed_endpoint) -> None:
    with pytest.raises(TunecastError) as error:
        resolve_model("meta-llama/Llama-3.1-8b-chat", catalog)
    assert error.value.message.startswith(
        "unknown model 'meta-llama/Llama-3.1-8b-chat': not a local path nor in the catalog, and the Hugging Face Hub "
        f"at {closed_endpoint} did not give its config.json: ")
    assert "refused" in error.value.message.lower() and "\n" not in error.value.message
    assert error.value.field == "model" and "not found" not in error.value.message
    hint = error.value.hint or ""
    assert "check the network" in hint and "local model directory holding config.json" in hint
    assert "meta-llama/Llama-3.1-8B" in hint  # the catalog's close names, as when offline


@pytest.fixture
def silent_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """HF_ENDPOINT at a loopback port that takes connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    yield endpoint
    listener.close()


def test_a_hub_that_does_not_answer_is_given_up_in_time(catalog, silent_endpoint, monkeypatch) -> None:
    monkeypatch.setattr(hub_module, "TIMEOUT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(TunecastError, match=r"did not give its config\.json: no answer within 0\.5 s"):
        resolve_model("someorg/some-model", catalog)
    assert time.monotonic() - started < 3


def test_the_time_bounds_what_the_http_client_does_not(catalog, hub, monkeypatch) -> None:
    """A name lookup that hangs (the HTTP client's timeouts do not cover it) is given up in time too."""
    import httpx

    release = threading.Event()

    def hang(*args: object, **kwargs: object) -> None:
        release.wait(30)
        raise httpx.ConnectError("gave up")

    monkeypatch.setattr(httpx.Client, "get", hang)
    monkeypatch.setattr(hub_module, "TIMEOUT_S", 0.3)
    started = time.monotonic()
    try:
        with pytest.raises(TunecastError, match=r"no answer within 0\.3 s"):
            resolve_model("acme/tiny", catalog)
        assert time.monotonic() - started < 3
    finally:
        release.set()


def test_a_proxy_that_refuses_is_the_hub_out_of_reach(catalog, hub, monkeypatch) -> None:
    import httpx

    def refuse(*args: object, **kwargs: object) -> None:
        raise httpx.ProxyError("407 Proxy Authentication Required")

    monkeypatch.setattr(httpx.Client, "get", refuse)
    with pytest.raises(TunecastError, match=r"did not give its config\.json: 407 Proxy Authentication Required"):
        resolve_model("acme/tiny", catalog)


def test_an_endpoint_that_is_no_url(catalog, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "huggingface.co")
    with pytest.raises(TunecastError, match="acme/tiny") as error:
        resolve_model("acme/tiny", catalog)
    assert "HF_ENDPOINT" in (error.value.hint or "") or "HF_ENDPOINT" in error.value.message


# On the command line


def test_the_cli_fetches_by_default_and_says_so_on_stderr(cli, hub) -> None:
    result = cli("validate", "--model", "acme/tiny", "--method", "lora")
    assert result.code == 0, result.stderr
    assert "acme/tiny is not in the catalog: fetching its config.json from" in result.stderr
    assert "fetching" not in result.stdout
    again = cli("validate", "--model", "acme/tiny", "--method", "lora", "--allow-download")  # deprecated: no-op
    assert again.code == 0 and "fetching" not in again.stderr and len(hub.asked) == 1


def test_the_cli_offline_flag(cli, hub) -> None:
    result = cli("validate", "--model", "acme/tiny", "--offline")
    assert result.code == 2 and "Traceback" not in result.stderr and hub.asked == []
    assert "offline mode (--offline)" in result.stderr
    document = cli("memory", "--model", "acme/tiny", "--offline", "--json")
    problem = document.json()["error"]["problems"][0]
    assert document.code == 2 and problem["field"] == "model" and "offline mode (--offline)" in problem["message"]


def test_the_cli_when_the_hub_is_out_of_reach(cli, closed_endpoint) -> None:
    started = time.monotonic()
    result = cli("memory", "--model", "someorg/some-model")
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr
    assert "did not give its config.json" in result.stderr and "not found" not in result.stderr
    document = cli("plan", "--model", "someorg/some-model", "--json")
    problem = document.json()["error"]["problems"][0]
    assert document.code == 2 and problem["message"].startswith("unknown model 'someorg/some-model'")
    assert time.monotonic() - started < 10


def test_the_help_names_offline_and_the_old_flag_as_deprecated(cli, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    text = cli("memory", "--help").stdout
    assert "--offline" in text and "HF_HUB_OFFLINE" in text
    assert "Deprecated, does nothing" in next(line for line in text.splitlines() if "--allow-download" in line)


def test_the_suite_itself_is_offline() -> None:
    """tests/conftest.py: no test, and no process a test starts, asks the real Hub."""
    assert os.environ["HF_HUB_OFFLINE"] == "1" and "HF_ENDPOINT" not in os.environ
