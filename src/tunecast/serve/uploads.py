"""What the page hands the server as files: a sample of a dataset, counted as `tunecast data` counts a file, and a
model's config.json, kept where `model:` can point at it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunecast.atomic import write_text_atomic
from tunecast.errors import ConfigError, Problem, TunecastError
from tunecast.paths import cache_dir

# The text formats `tunecast data` reads (data/readers.py); a compressed or Parquet file is no text to send.
SAMPLE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv")
MODELS_DIR = ("serve", "models")  # under the cache directory: <digest>/<name>.json
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


def store_model_config(config: dict[str, Any], name: str | None) -> Path:
    """Keep a dropped config.json under the cache directory, named by its content (the same config is kept once),
    as `<name>.json` so that plans name the model `name`; the path is what `model:` takes."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        raise ConfigError("config_json", [Problem(
            "config_json.model_type", "is missing, so this is not a Hugging Face model config",
            "drop the model's config.json (the file beside its weights, with model_type, hidden_size, …)")])
    stem = _UNSAFE.sub("_", (name or "").replace("/", "__"))[:_LONGEST_NAME].strip("._") or \
        _UNSAFE.sub("_", model_type)[:_LONGEST_NAME].strip("._") or "model"
    text = json.dumps(config, indent=2, sort_keys=True)  # ASCII: any text a request held is kept as escapes
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = cache_dir().joinpath(*MODELS_DIR, digest, f"{stem}.json")
    if not path.is_file():
        write_text_atomic(path, text)
    return path
