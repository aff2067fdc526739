"""What the page hands the server as files: a sample of a dataset, counted as `tunecast data` counts a file, and a
model's config.json, named as it names itself (added to the catalog by the service)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunecast.errors import ConfigError, Problem, TunecastError

# The text formats `tunecast data` reads (data/readers.py); a compressed or Parquet file is no text to send.
SAMPLE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv")
_UNSAFE = re.compile(r"[^\w.-]+")
_LONGEST_NAME = 100


def sample_file_name(name: str) -> str:
    """The file name a sample is counted under: the name the page gave (its folder dropped), which must end in a
    text format's suffix (the suffix says how the file is read)."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1].strip()
    suffix = next((s for s in SAMPLE_SUFFIXES if base.lower().endswith(s)), None)
    if suffix is None:
        raise TunecastError(f"cannot tell the format of the sample {name!r} from its name", field="sample.name",
                            hint=f"send a file whose name ends in {', '.join(SAMPLE_SUFFIXES)}")
    stem = _UNSAFE.sub("_", base[: -len(suffix)])[:_LONGEST_NAME].strip("._") or "sample"
    return stem + base[-len(suffix):]


def with_sample(name: str, text: str, count: Callable[[Path], Any]) -> Any:
    """`count(path)` of the sample written to a temporary file named `name` (as `sample_file_name` makes it), the
    file removed afterwards. A user error that names the temporary file names the sample instead."""
    file_name = sample_file_name(name)
    with tempfile.TemporaryDirectory(prefix="tunecast-sample-") as folder:
        path = Path(folder) / file_name
        # a lone surrogate (JSON allows one) is no UTF-8: written as U+FFFD, as a reader would decode it
        path.write_text(text, encoding="utf-8", errors="replace")
        try:
            return count(path)
        except TunecastError as error:
            raise renamed(error, str(path), file_name) from None


def renamed(error: TunecastError, old: str, new: str) -> TunecastError:
    """`error` with every mention of `old` (a temporary path) written as `new`."""

    def text(value: str | None) -> str | None:
        return value.replace(old, new) if value is not None else None

    if isinstance(error, ConfigError):
        problems = [dataclasses.replace(p, message=text(p.message) or "", hint=text(p.hint),
                                        location=text(p.location)) for p in error.problems]
        return ConfigError(text(error.source) or "", problems)
    return TunecastError(text(error.message) or "", field=error.field, hint=text(error.hint))


# Decoder layers times experts of the largest model a dropped config may describe. Its parameters are counted on the
# meta device a module at a time, which nothing can interrupt: Qwen3-235B-A22B (94 layers × 128 experts) takes 12 s
# on two busy cores (docs/serve.md), so this bound is about half a minute, and a config of a million layers would hold
# a server thread for hours.
MAX_MODULES = 32_768
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def checked_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """A dropped config.json, if it is a Hugging Face model config (it names its model_type) of a size a model
    has."""
    from tunecast.step.shape import num_layers, text_config_data

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        raise ConfigError("config_json", [Problem(
            "config_json.model_type", "is missing, so this is not a Hugging Face model config",
            "drop the model's config.json (the file beside its weights, with model_type, hidden_size, …)")])
    try:
        layers = num_layers(config)
    except TunecastError as error:
        raise TunecastError(error.message, field="config_json", hint=error.hint) from None
    text = text_config_data(config)
    experts = max([1] + [value for key in _EXPERT_KEYS if isinstance(value := text.get(key), int)
                         and not isinstance(value, bool)])
    if layers * experts > MAX_MODULES:
        raise TunecastError(f"the config describes {layers:,} layers × {experts:,} experts: more than the "
                            f"{MAX_MODULES:,} layer-experts of any model the planner takes", field="config_json",
                            hint="check num_hidden_layers and the expert count in the config.json")
    return config


# Keys of a config.json that say where it came from or what wrote it, not what the model is.
_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash")
# File names that name no model: the file every model folder has.
_GENERIC_FILES = ("config", "config.json", "")


def model_part(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key not in _PROVENANCE}


def model_digest(config: dict[str, Any]) -> str:
    """The digest of what the model is (its provenance keys left out)."""
    return hashlib.sha256(json.dumps(model_part(config), sort_keys=True).encode()).hexdigest()


def same_model(one: dict[str, Any], other: dict[str, Any]) -> bool:
    return model_part(one) == model_part(other)


def dropped_model_name(config: dict[str, Any], name: str | None, file_name: str | None) -> str:
    """The `org/name` a dropped config is listed under: the name asked for; else its `_name_or_path` (the Hub id it
    was saved from, or the last folder of a local path); else the file's name when it is not the generic
    config.json (`Qwen__Qwen3-0.6B.json` is Qwen/Qwen3-0.6B, as the catalog names its files); else its architecture
    (`LlamaForCausalLM`); else its model_type. A name without an org is put under `local/`."""
    from_path = config.get("_name_or_path")
    stem = (file_name or "").replace("\\", "/").rsplit("/", 1)[-1].strip()
    stem = stem[: -len(".json")] if stem.lower().endswith(".json") else stem
    architectures = config.get("architectures")
    candidates = [
        name,
        _from_path(from_path) if isinstance(from_path, str) else None,
        stem.replace("__", "/", 1) if stem.lower() not in _GENERIC_FILES else None,
        architectures[0] if isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
        else None,
        str(config.get("model_type")),
    ]
    chosen = next(c for c in candidates if c and c.strip())
    org, _, rest = chosen.strip().rpartition("/")
    org = _UNSAFE.sub("-", org).strip(".-_")[:_LONGEST_NAME] or "local"
    rest = _UNSAFE.sub("-", rest).strip(".-_")[:_LONGEST_NAME] or "model"
    return f"{org}/{rest}"


def _from_path(value: str) -> str | None:
    """A Hub id as it is (`meta-llama/Llama-3.1-8B`); the last folder of a local path (`/data/run/final` → final)."""
    value = value.strip().rstrip("/\\")
    if not value:
        return None
    if value.startswith(("/", ".", "~")) or "\\" in value or ":" in value or value.count("/") > 1:
        return value.replace("\\", "/").rsplit("/", 1)[-1]
    return value
