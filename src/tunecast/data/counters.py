"""Which token counter a command uses: the tokenizer given, the model's own tokenizer when it is on disk,
else an estimate from the tokenizer family's bytes-per-token ratio (catalog/data/token_ratios.csv)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from tunecast.catalog.hub import HubAccess
from tunecast.catalog.resolve import resolve_model
from tunecast.catalog.rows import CatalogRow, parse_rows
from tunecast.catalog.store import Catalog, bundled_data_dir
from tunecast.data.tokens import EstimateCounter, TokenCounter, cached_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from tunecast.config.load import LoadedSpec

RATIOS_FILE = "token_ratios.csv"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TokenRatio(CatalogRow):
    """Average characters per token of a tokenizer family, measured on English text."""

    family: str
    model_types: tuple[str, ...] = ()
    """The model_type values whose tokenizers belong to the family, `;`-separated in the file."""
    vocab_sizes: tuple[int, ...] = ()
    """The vocabulary sizes that tell the family apart within a model_type; empty: any."""
    chars_per_token: float = Field(gt=0)

    @field_validator("model_types", "vocab_sizes", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(";") if part.strip())
        return value

    def covers(self, model_type: str, vocab_size: int | None) -> bool:
        return model_type in self.model_types and (not self.vocab_sizes or vocab_size in self.vocab_sizes)


def _ratios() -> list[TokenRatio]:
    return parse_rows((bundled_data_dir() / RATIOS_FILE).read_text(encoding="utf-8"), TokenRatio, RATIOS_FILE)


def estimate_for(model_type: str | None, vocab_size: int | None = None) -> EstimateCounter:
    """The characters-per-token estimate of a tokenizer family, or the generic one."""
    ratios = _ratios()
    chosen = next((r for r in ratios if model_type and r.covers(model_type, vocab_size)), None)
    generic = next(r for r in ratios if r.family == "generic")
    row = chosen or generic
    basis = f"{row.family} tokenizer on English text, {row.source.split(' ; ')[0]}"
    if chosen is None and model_type:
        basis = f"no measured figure for {model_type} with a {vocab_size}-token vocabulary; generic: " \
                f"{row.source.split(' ; ')[0]}"
    return EstimateCounter(row.chars_per_token, basis)


def choose_counter(*, model: str | None, tokenizer: str | None, catalog: Catalog, base_dir: Path,
                   hub: HubAccess | None = None) -> TokenCounter:
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if model is None:
        return estimate_for(None)
    folder = Path(model).expanduser()
    if folder.is_dir() and any((folder / name).exists() for name in TOKENIZER_FILES):
        return load_tokenizer(str(folder))
    resolved = resolve_model(model, catalog, base_dir=base_dir, hub=hub, field="--model")
    cached = cached_tokenizer(resolved.name) if resolved.origin == "catalog" else None
    return cached if cached is not None else estimate_for(resolved.model_type, resolved.vocab_size)


def spec_counter(loaded: LoadedSpec, catalog: Catalog) -> TokenCounter:
    """The counter of a run's dataset: `dataset.tokenizer`, else the model's as the config resolved it (a model
    folder is relative to the config file, not to here)."""
    resolved = loaded.model
    model = str(resolved.path.parent) if resolved.origin == "directory" else loaded.spec.model
    tokenizer = loaded.spec.dataset.tokenizer
    return choose_counter(model=model if tokenizer is None else None, tokenizer=tokenizer, catalog=catalog,
                          base_dir=Path.cwd())
