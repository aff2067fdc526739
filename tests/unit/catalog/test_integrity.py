"""The bundled catalog: complete, consistent, sourced, and its parameter counts exact."""

import json
from datetime import date

import pytest

from tunecast.catalog.models import read_config_file
from tunecast.catalog.store import bundled_data_dir

CANONICAL = ["rtx-3090", "rtx-4090", "rtx-5090", "rtx-a6000", "rtx-6000-ada", "rtx-pro-6000", "l4", "l40s",
             "a10g", "a100-40gb", "a100-80gb", "a100-80gb-pcie", "h100-sxm", "h100-pcie", "h200", "b200",
             "mi300x"]


def test_every_canonical_gpu_is_present(catalog) -> None:
    assert set(CANONICAL) <= set(catalog.gpus.slugs)


@pytest.mark.parametrize(("alias", "slug"), [
    ("4090", "rtx-4090"), ("A100-80GB", "a100-80gb"), ("A100:80GB", "a100-80gb"), ("H100", "h100-sxm"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("rtx 6000 ada", "rtx-6000-ada"), ("MI300X", "mi300x"),
    ("a100-80gb-pcie", "a100-80gb-pcie"), ("L40S", "l40s"),
])
def test_forgiving_aliases(catalog, alias, slug) -> None:
    assert catalog.gpus.get(alias).slug == slug


def test_datasheet_figures_of_the_h100_sxm(catalog) -> None:
    h100 = catalog.gpus.get("h100-sxm")
    assert (h100.memory_gib, h100.bf16_tflops, h100.memory_bandwidth_gb_per_s) == (80, 989, 3350)
    assert h100.fp8_tflops == 1979 and h100.interconnect == "nvlink"


def test_gpu_rows_are_positive_sourced_and_dated(catalog) -> None:
    for gpu in catalog.gpus:
        assert gpu.usable_memory_gib <= gpu.memory_gib * 1.08 and gpu.usable_memory_gib > 0.85 * gpu.memory_gib
        assert gpu.source.startswith("http") and gpu.as_of <= date.today()
        assert gpu.bf16_tflops > 0 and gpu.memory_bandwidth_gb_per_s > 0 and gpu.tdp_w > 0


def test_quoted_prices_are_in_the_offers(catalog) -> None:
    quoted = {(o.provider, o.gpu, o.usd_per_hour) for o in catalog.offers}
    assert ("thunder-compute", "a100-80gb", 0.78) in quoted
    assert ("thunder-compute", "rtx-a6000", 0.35) in quoted
    assert ("market-median", "rtx-4090", 0.435) in quoted


def test_offers_use_canonical_slugs_and_are_sourced(catalog) -> None:
    keys = [o.key for o in catalog.offers]
    assert len(keys) == len(set(keys)), "duplicate offers"
    for offer in catalog.offers:
        assert offer.gpu in catalog.gpus.slugs
        assert offer.usd_per_hour > 0 and offer.source and offer.as_of <= date.today()
        assert offer.spot_usd_per_hour is None or 0 < offer.spot_usd_per_hour <= offer.usd_per_hour


def test_common_gpus_have_several_providers(catalog) -> None:
    for slug in ("a100-80gb", "h100-sxm", "h200", "rtx-4090", "l40s", "rtx-a6000"):
        assert len({o.provider for o in catalog.offers_for(slug)}) >= 3, slug


def test_bundled_offers_file_needs_no_alias_resolution() -> None:
    import csv

    slugs = {row["slug"] for row in csv.DictReader((bundled_data_dir() / "gpus.csv").open())}
    offers = list(csv.DictReader((bundled_data_dir() / "offers.csv").open()))
    assert {row["gpu"] for row in offers} <= slugs


def test_at_least_25_models_each_with_a_source(catalog) -> None:
    assert len(catalog.models) >= 25
    for name in catalog.models.names:
        entry = catalog.models.entry(name)
        assert "github.com/" in entry.source, name
        assert json.loads(catalog.models.config_path(name).read_text())["model_type"]


@pytest.mark.parametrize(("name", "params"), [
    ("meta-llama/Llama-3.1-8B", 8_030_261_248),
    ("meta-llama/Llama-3.2-1B", 1_235_814_400),
    ("Qwen/Qwen3-0.6B", 596_049_920),
])
def test_published_parameter_counts(catalog, name, params) -> None:
    assert catalog.models.entry(name).params == params


def test_every_stored_parameter_count_is_recomputed_on_the_meta_device(catalog) -> None:
    from tunecast.step.shape import build_meta_model, count_parameters

    wrong = {}
    for name in catalog.models.names:
        data = read_config_file(catalog.models.config_path(name))
        counted = count_parameters(build_meta_model(data, name=name))
        if counted != catalog.models.entry(name).params:
            wrong[name] = (catalog.models.entry(name).params, counted)
    assert not wrong


def test_the_text_config_defaults_filled_in_are_the_config_classes(catalog) -> None:
    """A multimodal config's text_config is completed with its config class's defaults (`TEXT_CONFIG_DEFAULTS`):
    they must be transformers' own, and then every reader sees Gemma 3 4B's heads and vocabulary."""
    from transformers import AutoConfig

    from tunecast.catalog.models import TEXT_CONFIG_DEFAULTS

    for model_type, defaults in TEXT_CONFIG_DEFAULTS.items():
        made = AutoConfig.for_model(model_type)
        for key, value in defaults.items():
            attribute = "_sliding_window_pattern" if key == "sliding_window_pattern" else key
            assert getattr(made, attribute) == value, (model_type, key)
    gemma = catalog.models.find("google/gemma-3-4b-it")
    assert (gemma.vocab_size, gemma.text_config["num_attention_heads"]) == (262_208, 8)
    assert gemma.text_config["hidden_size"] == 2560  # what the file states is kept
