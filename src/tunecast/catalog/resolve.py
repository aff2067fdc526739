"""From what the user typed after `--model` to a model config.

Order, as transformers' `from_pretrained` does: an existing local path first (a model directory holding
config.json, or a config JSON file of any name), then the catalog, then configs fetched earlier with
`--allow-download`, then — only when the user allows it — the Hugging Face Hub.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from datetime import date
from pathlib import Path

from tunecast.catalog.models import ModelConfig, file_name_for, read_config_file
from tunecast.catalog.store import Catalog
from tunecast.errors import TunecastError, did_you_mean, suggestion_text
from tunecast.paths import cache_dir

DOWNLOADS_DIR = "downloaded-configs"
# How to go on without the Hub, as `--model` accepts it.
_LOCAL = "point --model at a local model directory holding config.json, or at a config JSON file"


def resolve_model(name: str, catalog: Catalog, *, base_dir: Path | None = None,
                  allow_download: bool = False, field: str = "model") -> ModelConfig:
    """The config of the model `name`; a user error with close matches when it cannot be found."""
    path = _as_local_path(name, base_dir)
    if path is not None:
        return _local(path, field)
    found = catalog.models.find(name)
    if found is not None:
        return found
    cached = _downloaded_path(name)
    try:
        fetched_before = cached.is_file()
    except (OSError, ValueError):  # a name no file can have
        fetched_before = False
    if fetched_before:
        return _downloaded(name, cached, field)
    if allow_download and _looks_like_repo_id(name):
        return _downloaded(name, download_config(name, field=field), field)
    local = _meant_as_path(name, base_dir)
    if local is not None:
        raise _missing_path(name, local, field)
    raise TunecastError(f"unknown model {name!r}: not a local path and not in the catalog", field=field,
                        hint=_unknown_hint(name, catalog, base_dir))


def _unknown_hint(name: str, catalog: Catalog, base_dir: Path | None) -> str:
    parts = []
    close = catalog.models.suggestion(name)
    if close:
        parts.append(close)
    nearby = did_you_mean(name, _model_folders(base_dir or Path.cwd()), n=1)
    if nearby:
        parts.append(f"Did you mean the model folder {nearby[0]!r}?")
    if _looks_like_repo_id(name):
        parts.append("pass --allow-download to fetch its config.json from the Hugging Face Hub")
    parts.append(f"{'or ' if parts else ''}give a model directory or a config JSON file; `tunecast models` lists the "
                 "catalog")
    return "; ".join(parts)


def _model_folders(directory: Path) -> list[str]:
    """The folders in `directory` that hold a config.json: local models a misspelt name may mean."""
    try:
        return [entry.name for entry in directory.iterdir() if (entry / "config.json").is_file()]
    except OSError:
        return []


def _meant_as_path(name: str, base_dir: Path | None) -> Path | None:
    """Where `name` points when it reads as a local path rather than a Hub id: it starts with `.`, `/` or `~`, ends in
    .json, or its first folder exists here (`models/my-model` with a `models` folder). None for a name like an id."""
    try:
        candidate = Path(name).expanduser()
        root = base_dir if base_dir is not None and (base_dir / candidate.parts[0]).exists() else Path.cwd()
        explicit = name.startswith((".", "/", "~")) or name.endswith(".json")
        if explicit or (len(candidate.parts) > 1 and (root / candidate.parts[0]).is_dir()):
            return candidate if candidate.is_absolute() else root / candidate
    except (OSError, ValueError, RuntimeError, IndexError):  # no path this system can have
        return None
    return None


def _missing_path(name: str, path: Path, field: str) -> TunecastError:
    """A local model path that does not exist: what is there instead (no download: it is no Hub id)."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        entries = [entry.name for entry in parent.iterdir()]
    except OSError:
        entries = []
    missing = path.relative_to(parent).parts[0] if path.is_relative_to(parent) else path.name
    close = suggestion_text(missing, entries)
    return TunecastError(f"model {name!r}: {path} does not exist ({parent} has no {missing!r})", field=field,
                         hint=(f"{close} " if close else "") + "Give the folder that holds the model's config.json (as "
                         "save_pretrained writes it), or a config JSON file; a relative path in a config file is "
                         "taken relative to the file's folder, on the command line to the current directory")


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not name.endswith(".json")


def _as_local_path(name: str, base_dir: Path | None) -> Path | None:
    try:
        candidate = Path(name).expanduser()
        if not candidate.is_absolute() and base_dir is not None:
            relative = base_dir / candidate
            if relative.exists():
                return relative.resolve()
        return candidate.resolve() if candidate.exists() else None
    except (OSError, ValueError, RuntimeError):  # no path this system can have (a NUL, too long, ~nobody)
        return None


def _local(path: Path, field: str) -> ModelConfig:
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise TunecastError(f"model directory {path} has no config.json", field=field,
                                hint="point --model at a directory saved by save_pretrained, or at the JSON file")
        return ModelConfig(name=path.name, path=config_path, origin="directory",
                           data=read_config_file(config_path, field_name=field))
    return ModelConfig(name=path.stem, path=path, origin="file", data=read_config_file(path, field_name=field))


def _downloaded_path(name: str) -> Path:
    return cache_dir() / DOWNLOADS_DIR / file_name_for(name)


def _downloaded(name: str, path: Path, field: str) -> ModelConfig:
    meta_path = path.with_suffix(".source.json")
    source = json.loads(meta_path.read_text())["source"] if meta_path.exists() else None
    return ModelConfig(name=name, path=path, origin="downloaded",
                       data=read_config_file(path, field_name=field), source=source)


def download_config(repo_id: str, *, field: str = "model") -> Path:
    """Fetch `repo_id`'s config.json through huggingface_hub (honouring HF_ENDPOINT and HF_TOKEN) and keep
    a copy in tunecast's cache, so later commands find it without the network.

    What the Hub said and what kept it from being asked are different user errors: a 404 is "not found", a
    refused connection, a timeout or offline mode is "could not reach the Hub" (huggingface_hub reports those
    as LocalEntryNotFoundError, a subclass of EntryNotFoundError, so it is caught first)."""
    from huggingface_hub import hf_hub_download

    # huggingface_hub.utils exports these in every version tunecast accepts; .errors lacks most in 0.24.
    from huggingface_hub.utils import (
        DisabledRepoError,
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        fetched = hf_hub_download(repo_id, "config.json", cache_dir=cache_dir() / "hf", endpoint=endpoint,
                                  token=os.environ.get("HF_TOKEN") or None)
    except HFValidationError:
        raise TunecastError(f"{repo_id!r} is not a Hugging Face model id", field=field,
                            hint=f"an id is org/name in letters, digits, '-', '_' and '.'; or {_LOCAL}") from None
    except GatedRepoError:
        raise TunecastError(
            f"{repo_id} is gated: the Hub refused its config.json without access", field=field,
            hint=f"accept the model's licence on {endpoint}/{repo_id} and set HF_TOKEN to a token of that account",
        ) from None
    except RepositoryNotFoundError:
        raise TunecastError(
            f"{repo_id} was not found on {endpoint} (or it is private and HF_TOKEN does not grant access)",
            field=field, hint="check the model id's spelling and case; set HF_TOKEN for a private model",
        ) from None
    except DisabledRepoError:
        raise TunecastError(f"{repo_id} is disabled on {endpoint}: its files cannot be fetched", field=field,
                            hint=_LOCAL) from None
    except LocalEntryNotFoundError as error:
        raise _unreachable(repo_id, endpoint, error.__cause__, field) from None
    except EntryNotFoundError:
        raise TunecastError(f"config.json was not found in {repo_id} on {endpoint}", field=field,
                            hint=f"the repository holds no transformers config; {_LOCAL}") from None
    except HfHubHTTPError as error:
        raise TunecastError(f"the Hub at {endpoint} refused {repo_id}'s config.json: {_first_line(error)}",
                            field=field, hint=f"check HF_TOKEN and HF_ENDPOINT, or {_LOCAL}") from None
    except _connection_errors() as error:
        raise _unreachable(repo_id, endpoint, error, field) from None
    except OSError as error:
        raise TunecastError(f"could not fetch {repo_id}'s config.json from {endpoint}: {_first_line(error)}",
                            field=field, hint=f"check the network and the cache directory, or {_LOCAL}") from None
    target = _downloaded_path(repo_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(fetched, target)
    target.with_suffix(".source.json").write_text(json.dumps({
        "source": f"{endpoint}/{repo_id}/resolve/main/config.json",
        "as_of": date.today().isoformat(),
    }))
    return target


def _unreachable(repo_id: str, endpoint: str, cause: BaseException | None, field: str) -> TunecastError:
    """The Hub was not asked, or did not answer: offline mode, no connection, a timeout, a proxy, the Hub
    down, or an HF_ENDPOINT that is not a Hub. `cause` is what huggingface_hub met, when it says."""
    from huggingface_hub import constants
    from huggingface_hub.utils import FileMetadataError, HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(cause, OfflineModeIsEnabled) or (cause is None and constants.HF_HUB_OFFLINE):
        return TunecastError(f"did not contact the Hugging Face Hub for {repo_id}'s config.json: HF_HUB_OFFLINE is set",
                             field=field, hint=f"unset HF_HUB_OFFLINE to let --allow-download fetch it, or {_LOCAL}")
    if isinstance(cause, HfHubHTTPError):
        return TunecastError(f"the Hugging Face Hub at {endpoint} did not serve {repo_id}'s config.json: it answered "
                             f"HTTP {cause.response.status_code}", field=field,
                             hint=f"the Hub may be down or busy: try again later, or {_LOCAL}")
    message = f"could not reach the Hugging Face Hub at {endpoint} to fetch {repo_id}'s config.json"
    if isinstance(cause, FileMetadataError):
        return TunecastError(f"{message}: {endpoint} does not answer as a Hub does", field=field,
                             hint=f"check HF_ENDPOINT and the proxy settings, or {_LOCAL}")
    reason = f": {_first_line(cause)}" if cause is not None else ""
    return TunecastError(f"{message}{reason}", field=field,
                         hint=f"check the network connection (and HF_ENDPOINT or the proxy, if set), or {_LOCAL}")


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub's HTTP client raises when it cannot connect at all and huggingface_hub passes it
    on (a refusing proxy; a connection lost mid-download): httpx2 or httpx from huggingface_hub 1.0, requests
    before; whichever is installed."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            client = importlib.import_module(module)
        except ImportError:
            continue
        errors.extend(getattr(client, name) for name in names)
    return tuple(errors)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
