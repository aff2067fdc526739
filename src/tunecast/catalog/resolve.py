"""From what the user typed after `--model` to a model config.

Order, as transformers' `from_pretrained` does: an existing local path first (a model directory holding
config.json, or a config JSON file of any name), then the catalog, then configs fetched earlier with
`--allow-download`, then — only when the user allows it — the Hugging Face Hub.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import date
from pathlib import Path

from tunecast.catalog.models import ModelConfig, file_name_for, read_config_file
from tunecast.catalog.store import Catalog
from tunecast.errors import TunecastError
from tunecast.paths import cache_dir

DOWNLOADS_DIR = "downloaded-configs"


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
    if cached.is_file():
        return _downloaded(name, cached, field)
    if allow_download and _looks_like_repo_id(name):
        return _downloaded(name, download_config(name), field)
    raise TunecastError(f"unknown model {name!r}: not a local path and not in the catalog", field=field,
                        hint=_unknown_hint(name, catalog))


def _unknown_hint(name: str, catalog: Catalog) -> str:
    parts = []
    close = catalog.models.suggestion(name)
    if close:
        parts.append(close)
    if _looks_like_repo_id(name):
        parts.append("pass --allow-download to fetch its config.json from the Hugging Face Hub")
    parts.append("or give a model directory or a config JSON file; `tunecast models` lists the catalog")
    return "; ".join(parts)


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not name.endswith(".json")


def _as_local_path(name: str, base_dir: Path | None) -> Path | None:
    candidate = Path(name).expanduser()
    if not candidate.is_absolute() and base_dir is not None:
        relative = base_dir / candidate
        if relative.exists():
            return relative.resolve()
    return candidate.resolve() if candidate.exists() else None


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


def download_config(repo_id: str) -> Path:
    """Fetch `repo_id`'s config.json through huggingface_hub (honouring HF_ENDPOINT and HF_TOKEN) and keep
    a copy in tunecast's cache, so later commands find it without the network."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        fetched = hf_hub_download(repo_id, "config.json", cache_dir=cache_dir() / "hf", endpoint=endpoint,
                                  token=os.environ.get("HF_TOKEN") or None)
    except GatedRepoError:
        raise TunecastError(
            f"{repo_id} is gated: the Hub refused its config.json without access", field="model",
            hint=f"accept the model's licence on {endpoint}/{repo_id} and set HF_TOKEN to a token of that account",
        ) from None
    except RepositoryNotFoundError:
        raise TunecastError(
            f"{repo_id} was not found on {endpoint} (or it is private and HF_TOKEN does not grant access)",
            field="model", hint="check the model id's spelling and case; set HF_TOKEN for a private model",
        ) from None
    except EntryNotFoundError:
        raise TunecastError(f"{repo_id} has no config.json", field="model",
                            hint="give a model directory or a config JSON file instead") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        raise TunecastError(f"could not fetch {repo_id}'s config.json from {endpoint}: {error}", field="model",
                            hint="check the network (or HF_ENDPOINT), or give a local config JSON file") from None
    target = _downloaded_path(repo_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(fetched, target)
    target.with_suffix(".source.json").write_text(json.dumps({
        "source": f"{endpoint}/{repo_id}/resolve/main/config.json",
        "as_of": date.today().isoformat(),
    }))
    return target
