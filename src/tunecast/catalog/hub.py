"""The Hugging Face Hub, for one file: the config.json of a model that is not in the catalog.

When it is asked: `--model org/name` that is no local path, not in the catalog and not fetched before. Not when
offline mode is on: `--offline`, or HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE read as huggingface_hub reads them
(`constants.HF_HUB_OFFLINE = _is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))`,
true being 1, ON, YES or TRUE in any case: the first of the two that is set and not empty decides, so
HF_HUB_OFFLINE=0 lets the Hub be asked even with TRANSFORMERS_OFFLINE=1, as in transformers and huggingface_hub).

How: one GET of `{HF_ENDPOINT}/{org/name}/resolve/main/config.json` with the user's token (HF_TOKEN, else the one
`hf auth login` saved, unless HF_HUB_DISABLE_IMPLICIT_TOKEN is set), following redirects (a renamed repository;
httpx drops the token on a redirect to another host), all of it within TIMEOUT_S: finding the token, name lookup,
connection, answer. `hf_hub_download` is not used for this: after a refused or timed-out connection it asks again
with a 60 s timeout and five retries 1, 2, 4, 8 and 8 s apart (huggingface_hub 2.4, file_download.py and
utils/_http.py), a minute or more of silence before a user is told the Hub is out of reach.

What the Hub answers decides the error, as huggingface_hub's `hf_raise_for_status` reads it: the X-Error-Code header
first (RepoNotFound comes with 401 to a request without a token, so that a private repository is not revealed;
GatedRepo; EntryNotFound), then the status.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunecast.errors import TunecastError

# The whole fetch, from name lookup to the last byte. A config.json is a few kilobytes: the Hub answers in well under
# a second from anywhere; 10 s is huggingface_hub's own timeout for one request (constants.DEFAULT_ETAG_TIMEOUT).
TIMEOUT_S = 10.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})  # huggingface_hub's constants.ENV_VARS_TRUE_VALUES
DEFAULT_ENDPOINT = "https://huggingface.co"
# A Hub id as huggingface_hub's validate_repo_id takes it, with the namespace required: ASCII letters, digits, '-', '_'
# and '.', neither part starting or ending with '-' or '.', at most 96 characters each; no '--' or '..'; no '.git'.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(f"{_PART}/{_PART}")


@dataclass(frozen=True)
class HubAccess:
    """What a command lets model resolution do with the Hub, and who hears that it is asked."""

    offline: bool = False  # `--offline`: never ask the Hub, whatever the environment says
    progress: Callable[[str], None] | None = None  # told, before the fetch, what is fetched and how long it may take


def is_hub_id(name: str) -> bool:
    """`org/name` as the Hub spells a model id."""
    return bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name and not name.endswith(".git")


def offline_reason(offline: bool) -> str | None:
    """Why the Hub may not be asked (`--offline`, `HF_HUB_OFFLINE=1`, …), or None when it may."""
    if offline:
        return "--offline"
    for variable in OFFLINE_VARIABLES:
        value = os.environ.get(variable)
        if value:  # the first one set decides, as in huggingface_hub
            return f"{variable}={value}" if _is_true(value) else None
    return None


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/") or DEFAULT_ENDPOINT


def fetch_config(repo_id: str, *, field: str, instead: str, progress: Callable[[str], None] | None = None) -> str:
    """The text of `repo_id`'s config.json on the Hub: a JSON object with a model_type. Otherwise a user error that
    says what the Hub answered, or that it did not answer within TIMEOUT_S, ending its hint with `instead` (what to
    give in its place)."""
    timeout_s = TIMEOUT_S
    where = endpoint()
    url = f"{where}/{repo_id}/resolve/main/config.json"
    if progress is not None:
        progress(f"{repo_id} is not in the catalog: fetching its config.json from {where} (at most {timeout_s:g} s; "
                 "--offline or HF_HUB_OFFLINE=1 skip the Hub)")
    response = _get(url, timeout_s, repo_id=repo_id, where=where, field=field, instead=instead)
    status = response.status_code
    if status != 200:
        raise _refused(repo_id, where, status, response.headers, field=field, instead=instead)
    try:
        text: str = response.content.decode("utf-8")
        data: Any = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _unreachable(repo_id, where, f"{where} answered with something that is not JSON (a proxy or a sign-in "
                           "page in between, or an HF_ENDPOINT that is not a Hub?)", field=field, instead=instead,
                           fix="check HF_ENDPOINT and the proxy settings") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise TunecastError(f"{repo_id}'s config.json on {where} has no model_type: it is not a transformers model "
                            "config (a sentence-transformers, diffusers or adapter-only repository?)", field=field,
                            hint=f"give the base model's id; or {instead}")
    return text


def _headers() -> dict[str, str]:
    """tunecast's user agent, and the user's token as huggingface_hub chooses it: HF_TOKEN, else the one `hf auth
    login` saved, unless HF_HUB_DISABLE_IMPLICIT_TOKEN. (Not `build_hf_headers`: huggingface_hub 2.4's may first
    ask the Hub for a list of coding agents, a request of its own with a timeout of its own.)"""
    from tunecast.version import __version__

    headers = {"user-agent": f"tunecast/{__version__}"}
    token = os.environ.get("HF_TOKEN") or None
    if token is None and not _is_true(os.environ.get("HF_HUB_DISABLE_IMPLICIT_TOKEN")):
        from huggingface_hub import get_token

        token = get_token()
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def _is_true(value: str | None) -> bool:
    return value is not None and value.upper() in _TRUE


def _get(url: str, timeout_s: float, *, repo_id: str, where: str, field: str, instead: str) -> Any:
    """The answer to GET `url` within `timeout_s` in all. httpx's timeouts bound each phase, not their sum, and not
    the name lookup, and finding the token may ask a server too (huggingface_hub's OIDC exchange, an OAuth refresh);
    so all of it runs in a thread of its own, abandoned after `timeout_s` (a daemon thread: it keeps no process
    alive and writes nothing when it ends)."""
    import httpx

    outcome: list[Any] = []

    def ask() -> None:
        try:
            headers = _headers()
            with httpx.Client(timeout=timeout_s, follow_redirects=True, max_redirects=5) as client:
                outcome.append(client.get(url, headers=headers))
        except Exception as error:  # handed to the caller's thread, which says what it was
            outcome.append(error)

    worker = threading.Thread(target=ask, name=f"tunecast-hub-{repo_id}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise _unreachable(repo_id, where, f"no answer within {timeout_s:g} s", field=field, instead=instead)
    answer = outcome[0]
    if isinstance(answer, httpx.TimeoutException):
        raise _unreachable(repo_id, where, f"no answer within {timeout_s:g} s", field=field, instead=instead)
    if isinstance(answer, httpx.TooManyRedirects):
        raise _unreachable(repo_id, where, "too many redirects", field=field, instead=instead,
                           fix="check HF_ENDPOINT and the proxy settings")
    if isinstance(answer, (httpx.HTTPError, OSError)):
        raise _unreachable(repo_id, where, _first_line(answer), field=field, instead=instead)
    if isinstance(answer, httpx.InvalidURL):
        raise TunecastError(f"cannot ask the Hugging Face Hub for {repo_id}'s config.json: {url} is not a URL "
                            f"({_first_line(answer)})", field=field,
                            hint=f"set HF_ENDPOINT to a Hub's address, such as {DEFAULT_ENDPOINT}; or {instead}")
    if isinstance(answer, Exception):
        raise answer
    return answer


def _refused(repo_id: str, where: str, status: int, headers: Any, *, field: str, instead: str) -> TunecastError:
    code = headers.get("X-Error-Code")
    said = headers.get("X-Error-Message")
    page = f"{where}/{repo_id}"
    disabled = said == "Access to this resource is disabled."  # how the Hub says it (as hf_raise_for_status reads it)
    if status == 401 and said == "Invalid credentials in Authorization header":
        return TunecastError(f"the Hugging Face Hub at {where} refused the token sent for {repo_id}'s config.json: "
                             "it is not valid", field=field,
                             hint=f"set HF_TOKEN to a valid token, or run `hf auth login` again; or {instead}")
    if code == "GatedRepo" or (code is None and status in (401, 403) and not disabled):
        why = ("the token sent has no access to it" if status == 403 else
               "it needs a token of an account that was granted access")
        return TunecastError(
            f"{repo_id} is gated or private on the Hugging Face Hub: {why} (HTTP {status})", field=field,
            hint=f"accept the model's licence on {page}, then set HF_TOKEN to a token of that account or run "
                 f"`hf auth login` (`huggingface-cli login` before huggingface_hub 1.0); or {instead}")
    if code == "RepoNotFound":
        return TunecastError(f"{repo_id} is not in the catalog and was not found on {where} (or it is private and "
                             "no token with access was sent)", field=field,
                             hint=f"check the model id's spelling; set HF_TOKEN for a private model; or {instead}")
    if code == "EntryNotFound":
        return TunecastError(f"config.json was not found in {repo_id} on {where}", field=field,
                             hint=f"the repository holds no transformers config (a GGUF or adapter-only one?); "
                                  f"{instead}")
    if disabled:
        return TunecastError(f"{repo_id} is disabled on {where}: its files cannot be fetched", field=field,
                             hint=instead)
    if status in (408, 429) or status >= 500:
        return _unreachable(repo_id, where, f"it answered HTTP {status}", field=field, instead=instead,
                            fix="the Hub may be down or busy: try again later")
    if code is None:  # the Hub names what is missing or refused; a proxy or another server in between does not
        return _unreachable(repo_id, where, f"it answered HTTP {status} without the Hub's X-Error-Code (a proxy, or an "
                            "HF_ENDPOINT that is not a Hub?)", field=field, instead=instead,
                            fix="check HF_ENDPOINT and the proxy settings")
    return TunecastError(f"the Hugging Face Hub at {where} refused {repo_id}'s config.json: HTTP {status} ({code}"
                         + (f": {said})" if said else ")"), field=field,
                         hint=f"check HF_TOKEN and HF_ENDPOINT; or {instead}")


def _unreachable(repo_id: str, where: str, reason: str, *, field: str, instead: str,
                 fix: str = "check the network connection (and HF_ENDPOINT or the proxy, if set)") -> TunecastError:
    return TunecastError(f"unknown model {repo_id!r}: not a local path nor in the catalog, and the Hugging Face Hub at "
                         f"{where} did not give its config.json: {reason}", field=field,
                         hint=f"{fix}; or {instead}")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
