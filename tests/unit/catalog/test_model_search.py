"""The catalog's model search as a person types a name: case, spaces, dashes, dots and the vendor do not matter,
the closest name comes first, and an unknown name typed that way is pointed at the model it means."""

from __future__ import annotations

import pytest

from tunecast.catalog.listing import model_documents
from tunecast.catalog.models import search_names
from tunecast.catalog.store import load_catalog

NAMES = ["meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.2-1B", "Qwen/Qwen3-0.6B",
         "Qwen/Qwen3-8B", "mistralai/Mixtral-8x7B-v0.1", "microsoft/phi-1_5"]


@pytest.mark.parametrize(("typed", "first"), [
    ("Llama 3.1 8B", "meta-llama/Llama-3.1-8B"),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),
    ("LLAMA_3_1_8B", "meta-llama/Llama-3.1-8B"),
    ("meta llama 3.1 8b", "meta-llama/Llama-3.1-8B"),
    ("8B llama 3.1", "meta-llama/Llama-3.1-8B"),
    ("qwen3 0.6b", "Qwen/Qwen3-0.6B"),
    ("mixtral 8x7b", "mistralai/Mixtral-8x7B-v0.1"),
    ("phi 1.5", "microsoft/phi-1_5"),
])
def test_a_name_typed_as_people_type_it_is_found_first(typed: str, first: str) -> None:
    assert search_names(NAMES, typed)[0] == first


def test_closer_names_come_first_and_unrelated_ones_not_at_all() -> None:
    assert search_names(NAMES, "qwen3") == ["Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"]  # both start so: the shorter first
    assert search_names(NAMES, "llama 3.1") == ["meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B"]
    assert search_names(NAMES, "gemma") == [] and search_names(NAMES, " ") == NAMES


def test_the_cli_and_an_unknown_name_use_the_same_search() -> None:
    catalog = load_catalog(None)
    assert [d["name"] for d in model_documents(catalog, search="Llama 3.1 8B")] == [
        "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"]
    # spelled alike, `meta-llama/Meta-Llama-3-8B` and `Llama-3.2-1B` are closer than the model these words name
    assert (catalog.models.suggestion("meta llama 3.1 8b") or "").startswith("Did you mean 'meta-llama/Llama-3.1-8B'")
    assert (catalog.models.suggestion("8B llama 3.1") or "").startswith("Did you mean 'meta-llama/Llama-3.1-8B'")
