"""The catalog's rows as `tunecast gpus --json`, `tunecast models --json` and the web planner list them."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tunecast.catalog.gpus import Gpu
from tunecast.catalog.models import search_names
from tunecast.catalog.store import Catalog


def listed_gpus(catalog: Catalog, *, min_memory_gib: float | None = None) -> list[Gpu]:
    """The catalog's GPUs with at least `min_memory_gib` usable, smallest memory (then slowest) first."""
    gpus = [g for g in catalog.gpus if min_memory_gib is None or g.usable_memory_gib >= min_memory_gib]
    gpus.sort(key=lambda g: (g.usable_memory_gib, g.bf16_tflops))
    return gpus


def model_documents(catalog: Catalog, *, search: str | None = None) -> list[dict[str, Any]]:
    """Each catalog model (those `search` finds, best first, as `search_names` matches them): its shape, exact
    parameter count, source, and the other Hub ids that publish its config (model_aliases.csv)."""
    documents = []
    names = catalog.models.names if search is None else search_names(catalog.models.names, search)
    for name in names:
        model = catalog.models.find(name)
        assert model is not None  # a listed name
        documents.append({
            "name": name, "model_type": model.model_type, "architecture": model.architecture,
            "params": model.params, "num_layers": model.num_layers, "hidden_size": model.hidden_size,
            "vocab_size": model.vocab_size, "num_experts": model.num_experts,
            "max_position_embeddings": model.max_position_embeddings,
            "source": model.source, "as_of": catalog.models.entry(name).as_of.isoformat(),
            "aliases": catalog.models.aliases_of(name),
        })
    return documents


def provider_documents(catalog: Catalog) -> list[dict[str, Any]]:
    """Each provider of the offers, with how many offers it has and how many GPU models they cover."""
    offers = Counter(o.provider for o in catalog.offers)
    gpus = {provider: len({o.gpu for o in catalog.offers if o.provider == provider}) for provider in offers}
    return [{"name": provider, "offers": offers[provider], "gpus": gpus[provider]} for provider in catalog.providers]
