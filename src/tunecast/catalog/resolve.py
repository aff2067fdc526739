"""From what the user typed after `--model` to a model config.

Order, as transformers' `from_pretrained` does: an existing local path first (a model directory holding
config.json, or a config JSON file of any name), then the catalog, then configs fetched from the Hub earlier,
then the Hugging Face Hub itself for a name written as a Hub id (`org/name`): its config.json only, within a few
seconds, unless offline mode is on (`--offline`, HF_HUB_OFFLINE; catalog/hub.py). A name that reads as a local path
(`./x`, `models/x` beside a `models` folder, `x.json`) is never sent to the Hub.
"""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

from tunecast.atomic import write_text_atomic
from tunecast.catalog.hub import HubAccess, endpoint, fetch_config, is_hub_id, offline_reason
from tunecast.catalog.models import ModelConfig, bnb_name, bnb_quantization_config, file_name_for, read_config_file
from tunecast.catalog.store import Catalog
from tunecast.errors import TunecastError, did_you_mean, suggestion_text
from tunecast.paths import cache_dir

DOWNLOADS_DIR = "downloaded-configs"


def resolve_model(name: str, catalog: Catalog, *, base_dir: Path | None = None, hub: HubAccess | None = None,
                  field: str = "model") -> ModelConfig:
    """The config of the model `name`; a user error with close matches when it cannot be found. `hub`: whether a
    Hub id outside the catalog may be fetched, and who hears it (default: it may, unless HF_HUB_OFFLINE says no;
    nobody hears)."""
    hub = hub or HubAccess()
    path = _as_local_path(name, base_dir)
    if path is not None:
        return _local(path, field)
    found = catalog.models.find(name) or _bnb_copy(name, catalog)
    if found is not None:
        return found
    cached = _downloaded_path(name)
    try:
        fetched_before = cached.is_file()
    except (OSError, ValueError):  # a name no file can have
        fetched_before = False
    if fetched_before:
        return _downloaded(name, cached, field)
    local = _meant_as_path(name, base_dir)
    if local is not None:
        raise _missing_path(name, local, field)
    if not is_hub_id(name):
        raise TunecastError(f"unknown model {name!r}: not a local path and not in the catalog", field=field,
                            hint=_unknown_hint(name, catalog, base_dir))
    instead = _instead(name, catalog)
    offline = offline_reason(hub.offline)
    if offline is not None:
        turn_on = "without --offline" if offline == "--offline" else f"with {offline.split('=')[0]} unset"
        raise TunecastError(f"unknown model {name!r}: not a local path nor in the catalog, and offline mode ({offline})"
                            " kept tunecast from fetching its config.json from the Hugging Face Hub", field=field,
                            hint=f"{instead}; or, where the Hub can be reached, run {turn_on} to fetch it")
    text = fetch_config(name, field=field, instead=instead, progress=hub.progress)
    return _downloaded(name, _keep(name, text, field), field)


def _bnb_copy(name: str, catalog: Catalog) -> ModelConfig | None:
    """A repository named for bitsandbytes weights (`unsloth/llama-3-8b-bnb-4bit`) of a catalog model: that model's
    config with the `quantization_config` such a repository holds (its name is all that says so offline; online its
    config.json is that too). Looked up by the whole name without its bitsandbytes part, then by its last part."""
    from dataclasses import replace

    parsed = bnb_name(name)
    if parsed is None:
        return None
    base, bits = parsed
    found = catalog.models.find(base) or catalog.models.find(base.rsplit("/", 1)[-1])
    if found is None:
        return None
    return replace(found, name=name, data={**found.data, "quantization_config": bnb_quantization_config(bits)},
                   alias_of=found.alias_of or found.name)


def _instead(name: str, catalog: Catalog) -> str:
    """What to give in place of a Hub id the Hub did not give: a local config, or a catalog name (the close ones)."""
    close = catalog.models.suggestion(name)
    return ("give a local model directory holding config.json, a config JSON file, or a catalog name "
            + (f"({close})" if close else "(`tunecast models` lists them)"))


def _unknown_hint(name: str, catalog: Catalog, base_dir: Path | None) -> str:
    parts = []
    close = catalog.models.suggestion(name)
    if close:
        parts.append(close)
    nearby = did_you_mean(name, _model_folders(base_dir or Path.cwd()), n=1)
    if nearby:
        parts.append(f"Did you mean the model folder {nearby[0]!r}?")
    if "/" in name:
        parts.append("a Hugging Face model id is org/name in ASCII letters, digits, '-', '_' and '.'")
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


def _keep(repo_id: str, text: str, field: str) -> Path:
    """The fetched config in tunecast's cache, with where and when it came from, so that later commands find it
    without the network (the config last: its presence is what "fetched before" means)."""
    target = _downloaded_path(repo_id)
    try:
        write_text_atomic(target.with_suffix(".source.json"), json.dumps({
            "source": f"{endpoint()}/{repo_id}/resolve/main/config.json", "as_of": date.today().isoformat()}))
        write_text_atomic(target, text)
    except OSError as error:
        raise TunecastError(f"cannot keep {repo_id}'s fetched config.json in {target.parent}: "
                            f"{error.strerror or error}", field=field,
                            hint="set TUNECAST_CACHE to a folder you can write") from None
    return target
