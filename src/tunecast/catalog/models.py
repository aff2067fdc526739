"""Model configs: published Hugging Face `config.json` files, indexed by model name.

The index (`models.csv`) stores each model's exact parameter count, computed from its config on the
meta device by `scripts/update_model_index.py` and recomputed by the tests, so that listing models
never needs torch.

Aliases (`model_aliases.csv`) are other Hub ids under which a catalog model's config is published: the old id of
a renamed repository, or a mirror that republishes the model. An alias is served with its model's config and keeps
its own name, since that is the repository the user's weights come from.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tunecast.catalog.rows import CatalogRow
from tunecast.errors import TunecastError, did_you_mean


class ModelEntry(CatalogRow):
    """One row of models.csv."""

    name: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    """Hugging Face model id, `org/name`."""
    file: str = Field(pattern=r"^[\w.-]+\.json$")
    """The config JSON file, in the `models/` folder next to models.csv."""
    params: int = Field(ge=1)
    """Exact parameter count of the causal-LM model built from the config (tied weights once)."""


MODEL_COLUMNS = ModelEntry.columns()

AliasKind = Literal["renamed", "mirror"]


class ModelAlias(CatalogRow):
    """One row of model_aliases.csv: another Hub id whose config.json is a catalog model's."""

    alias: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    """The other Hugging Face model id, `org/name`."""
    name: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    """The catalog model (a `name` of models.csv) whose config the alias's repository publishes."""
    kind: AliasKind
    """`renamed`: the Hub renamed the repository, and the old id leads to the new one. `mirror`: another
    organisation republishes the model, with a config.json of the same architecture (token ids, `torch_dtype` and
    `_name_or_path` may differ; none of them changes an estimate)."""


ALIAS_COLUMNS = ModelAlias.columns()

# Suffixes of fine-tuned variants whose architecture is that of the base model.
_VARIANT_SUFFIX = re.compile(r"[-_](instruct|chat|it|hf|base|sft|dpo)(-v?[\d.]+)?$", re.IGNORECASE)

Origin = Literal["catalog", "directory", "file", "downloaded"]


@dataclass(frozen=True)
class ModelConfig:
    """A model's config.json, read and checked; where it came from and what it is called."""

    name: str
    path: Path
    origin: Origin
    data: dict[str, Any] = field(repr=False)
    params: int | None = None
    """Exact parameter count when the catalog knows it."""
    source: str | None = None
    alias_of: str | None = None
    """The catalog model whose config this is, when `name` is an alias of it (model_aliases.csv)."""

    @property
    def model_type(self) -> str:
        return str(self.data["model_type"])

    @property
    def text_config(self) -> dict[str, Any]:
        """The language-model part: the config itself, or its `text_config` for multimodal configs."""
        inner = self.data.get("text_config")
        return inner if isinstance(inner, dict) else self.data

    def get_int(self, *keys: str) -> int | None:
        """First integer among `keys` in the text config (architectures name the same thing differently)."""
        config = self.text_config
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @property
    def num_layers(self) -> int | None:
        return self.get_int("num_hidden_layers", "n_layer", "num_layers")

    @property
    def hidden_size(self) -> int | None:
        return self.get_int("hidden_size", "n_embd", "d_model")

    @property
    def vocab_size(self) -> int | None:
        return self.get_int("vocab_size")

    @property
    def num_experts(self) -> int | None:
        return self.get_int("num_local_experts", "num_experts", "n_routed_experts")

    @property
    def max_position_embeddings(self) -> int | None:
        return self.get_int("max_position_embeddings", "n_positions")

    @property
    def architecture(self) -> str:
        architectures = self.data.get("architectures")
        if isinstance(architectures, list) and architectures:
            return str(architectures[0])
        return self.model_type


def read_config_file(path: Path, *, field_name: str = "model") -> dict[str, Any]:
    """Parse a config JSON file; a file that is not a model config is a user error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise TunecastError(f"cannot read {path}: {error.strerror}", field=field_name,
                            hint="check the path and its permissions") from None
    except json.JSONDecodeError as error:
        raise TunecastError(f"{path} is not valid JSON (line {error.lineno}: {error.msg})", field=field_name,
                            hint="point --model at a Hugging Face config.json") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise TunecastError(f"{path} has no model_type, so it is not a Hugging Face model config",
                            field=field_name, hint="point --model at the model's config.json") from None
    return completed_text_config(data)


# What the text config class of a multimodal model defaults to (transformers 5.x; checked in
# tests/unit/catalog/test_models.py), for the sizes a published `text_config` leaves out: Gemma 3 4B, 12B and 27B
# state their widths and depth there and leave the heads, head size and vocabulary to Gemma3TextConfig.
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "max_position_embeddings": 131_072, "sliding_window_pattern": 6},
}


def completed_text_config(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its nested `text_config` completed by the defaults of its config class (`TEXT_CONFIG_DEFAULTS`),
    as transformers builds the model, so that every reader sees its sizes; other configs unchanged."""
    inner = data.get("text_config")
    if not isinstance(inner, dict) or inner.get("model_type") not in TEXT_CONFIG_DEFAULTS:
        return data
    return {**data, "text_config": {**TEXT_CONFIG_DEFAULTS[inner["model_type"]], **inner}}


CONFIG_DEFAULTS_FILE = "config_defaults.json"


def class_defaults_table_path() -> Path:
    return Path(__file__).parent / "data" / CONFIG_DEFAULTS_FILE


@functools.lru_cache(maxsize=1)
def _class_defaults() -> dict[str, dict[str, Any]]:
    document = json.loads(class_defaults_table_path().read_text(encoding="utf-8"))
    return document["model_types"]  # type: ignore[no-any-return]


def with_class_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the entries it leaves out that its config class fills in (data/config_defaults.json, written
    by scripts/update_config_defaults.py: not the sizes, the depth or what the class derives from them), as
    transformers reads it; a type the table does not hold unchanged."""
    return {**_class_defaults().get(str(config.get("model_type")), {}), **config}


def file_name_for(model_name: str) -> str:
    """'meta-llama/Llama-3.1-8B' → 'meta-llama__Llama-3.1-8B.json'."""
    return model_name.replace("/", "__") + ".json"


def _compact(text: str) -> str:
    """Letters and digits only, lower case: `Llama 3.1 8B`, `llama-3.1-8b` and `Llama_3_1_8B` are all `llama318b`."""
    return "".join(character for character in text.lower() if character.isalnum())


def _words(text: str) -> list[str]:
    return [_compact(word) for word in re.split(r"[\s/_]+", text) if _compact(word)]


def search_names(names: list[str], text: str) -> list[str]:
    """The names a person typing `text` means, best first. Case, spaces, dashes, dots and underscores do not count
    (`Llama 3.1 8B` finds `meta-llama/Llama-3.1-8B`), the vendor may be left out or given (`meta llama 3.1 8b`), and
    words may come in any order (`8B llama 3.1`). Best: the name after the vendor is what was typed; then it starts
    with it; then the whole name holds it; then it holds every word; shorter names first within each."""
    wanted = _compact(text)
    if not wanted:
        return list(names)
    words = _words(text)
    found: list[tuple[int, int, str]] = []
    for name in names:
        whole = _compact(name)
        short = _compact(name.split("/")[-1])
        if short == wanted or whole == wanted:
            grade = 0
        elif short.startswith(wanted):
            grade = 1
        elif wanted in whole:
            grade = 2
        elif words and all(word in whole for word in words):
            grade = 3
        else:
            continue
        found.append((grade, len(name), name))
    return [name for _, _, name in sorted(found, key=lambda row: (row[0], row[1], row[2].lower()))]



class ModelIndex:
    """Catalog models by name: exact id, case-insensitive id, or the part after the slash when unique; then their
    aliases alike, a renamed id's part after the slash only where no model and no other alias has it
    (`Meta-Llama-3.1-8B-Instruct` is the renamed id). A mirror's part after the slash names nothing: `llama-3-8b`
    would otherwise train on unsloth's copy, and `Meta-Llama-3-8B` stays meta-llama's, whatever mirrors it."""

    def __init__(self, entries: dict[str, tuple[ModelEntry, Path]],
                 aliases: dict[str, ModelAlias] | None = None) -> None:
        self._entries = entries
        # a model of the same id replaces an alias (a user's own row wins over a bundled alias)
        taken = {name.lower() for name in entries}
        self._aliases = {alias.alias.lower(): alias for alias in (aliases or {}).values()
                         if alias.alias.lower() not in taken}
        unknown = [alias.alias for alias in self._aliases.values() if alias.name not in entries]
        assert not unknown, f"aliases of models not in the catalog: {unknown}"  # the store refuses them first
        self._by_key: dict[str, str] = {}
        short_names: dict[str, list[str]] = {}
        for name in entries:
            self._by_key[name.lower()] = name
            self._by_key[file_name_for(name).lower().removesuffix(".json")] = name
            short_names.setdefault(name.split("/")[-1].lower(), []).append(name)
        for short, names in short_names.items():
            if len(names) == 1:
                self._by_key.setdefault(short, names[0])
        self._alias_by_key = dict(self._aliases)
        alias_shorts: dict[str, list[ModelAlias]] = {}
        for alias in self._aliases.values():
            if alias.kind != "renamed":
                continue
            alias_shorts.setdefault(alias.alias.split("/")[-1].lower(), []).append(alias)
        for short, same in alias_shorts.items():
            if len(same) == 1 and short not in short_names:
                self._alias_by_key.setdefault(short, same[0])

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> list[str]:
        return sorted(self._entries, key=str.lower)

    @property
    def aliases(self) -> list[ModelAlias]:
        return sorted(self._aliases.values(), key=lambda alias: alias.alias.lower())

    def aliases_of(self, name: str) -> list[str]:
        """The alias ids of the catalog model `name`."""
        return [alias.alias for alias in self.aliases if alias.name == name]

    def with_entry(self, entry: ModelEntry, path: Path) -> ModelIndex:
        """This index with one more model (or that model's row replaced), its aliases kept."""
        return ModelIndex({**self._entries, entry.name: (entry, path)},
                          {alias.alias: alias for alias in self._aliases.values()})

    def find(self, name: str) -> ModelConfig | None:
        key = name.strip().lower()
        canonical = self._by_key.get(key)
        if canonical is not None:
            entry, path = self._entries[canonical]
            return ModelConfig(name=entry.name, path=path, origin="catalog", data=read_config_file(path),
                               params=entry.params, source=entry.source)
        alias = self._alias_by_key.get(key)
        if alias is None:
            return None
        entry, path = self._entries[alias.name]
        return ModelConfig(name=alias.alias, path=path, origin="catalog", data=read_config_file(path),
                           params=entry.params, source=alias.source, alias_of=entry.name)

    def entry(self, name: str) -> ModelEntry:
        return self._entries[name][0]

    def config_path(self, name: str) -> Path:
        return self._entries[name][1]

    def suggestion(self, name: str) -> str | None:
        """'Did you mean …?' over full ids, matching the part after the slash too. A chat or instruct
        variant of a catalog model comes first: fine-tuned variants share the base architecture."""
        full_by_short = {n.split("/")[-1]: n for n in self._entries}
        close = did_you_mean(name, [*self._entries, *full_by_short], n=6, cutoff=0.5)
        # what a search finds first (`Llama 3.1 8B` is meta-llama/Llama-3.1-8B), then what is spelled alike
        names = search_names(self.names, name)[:2] + [full_by_short.get(c, c) for c in close]
        base = _VARIANT_SUFFIX.sub("", name.strip())
        if base != name.strip() and base.lower() in self._by_key:
            names.insert(0, self._by_key[base.lower()])
        names = list(dict.fromkeys(names))[:3]
        if not names:
            return None
        return "Did you mean " + " or ".join(repr(n) for n in names) + "?"


# A repository of bitsandbytes-quantized weights by its name, as unsloth names its uploads: `llama-3-8b-bnb-4bit`,
# `Qwen2.5-7B-Instruct-unsloth-bnb-4bit` (its dynamic quantization, which leaves some layers in 16 bits).
_BNB_NAME = re.compile(r"(?:[-_]unsloth)?[-_]bnb[-_]([48])bit$", re.IGNORECASE)


def bnb_bits(model: ModelConfig) -> int | None:
    """4 or 8 when `model`'s weights are stored quantized by bitsandbytes: its config.json's `quantization_config`
    (quant_method `bitsandbytes`, load_in_4bit or load_in_8bit, as transformers' BitsAndBytesConfig writes it; older
    files hold `_load_in_4bit`); None otherwise. LoRA on such weights is QLoRA."""
    quantization = model.data.get("quantization_config")
    if not isinstance(quantization, dict) or str(quantization.get("quant_method", "")).lower() != "bitsandbytes":
        return None
    if quantization.get("load_in_4bit") or quantization.get("_load_in_4bit"):
        return 4
    if quantization.get("load_in_8bit") or quantization.get("_load_in_8bit"):
        return 8
    return None


def bnb_name(name: str) -> tuple[str, int] | None:
    """(the name without its bitsandbytes part, the bits) for a name that says its weights are bitsandbytes' 4 or 8
    bits (`unsloth/llama-3-8b-bnb-4bit` → (`unsloth/llama-3-8b`, 4)); None for another name."""
    found = _BNB_NAME.search(name.rstrip("/"))
    return (name.rstrip("/")[:found.start()], int(found.group(1))) if found else None


def bnb_quantization_config(bits: int) -> dict[str, object]:
    """The `quantization_config` transformers writes for a bitsandbytes checkpoint of `bits` bits (the part read
    here): what a repository named for its bitsandbytes weights holds beside its base model's config."""
    return {"quant_method": "bitsandbytes", "load_in_4bit": bits == 4, "load_in_8bit": bits == 8}
