"""Strict types where a person would be surprised, and bounds that keep any command from absurd work."""

import json
import time
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from tests.unit.config.helpers import problems_of

from tunecast.catalog.store import load_catalog
from tunecast.config.checks import CONTEXT_MARGIN, MAX_NODES, NODE_GPUS
from tunecast.config.load import load_spec, load_spec_text, overrides_from, parse_set
from tunecast.config.spec import MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, GpuSpec, LoraSpec, PlanSpec, RunSpec
from tunecast.errors import ConfigError

REPO = Path(__file__).parents[3]
TINY = REPO / "examples" / "tiny-lora.yaml"  # tiny-model: max_position_embeddings 1024


def _types(annotation: Any) -> set[Any]:
    """The plain types and literal values an annotation takes."""
    if typing.get_origin(annotation) is Literal:
        return set(typing.get_args(annotation))
    if isinstance(annotation, type):
        return {annotation}
    return set().union(*(_types(argument) for argument in typing.get_args(annotation)))


def _numeric_keys() -> list[str]:
    """Every int or float key of the config, sections included (true/false must be refused for each)."""
    keys = []
    for prefix, model in (("", RunSpec), ("lora.", LoraSpec), ("plan.", PlanSpec), ("gpus.", GpuSpec)):
        for name, field in model.model_fields.items():
            takes = _types(field.annotation)
            if takes & {int, float} and bool not in takes and True not in takes:
                keys.append(prefix + name)
    return keys


def test_every_numeric_key_is_found() -> None:
    keys = _numeric_keys()
    assert {"seq_len", "epochs", "micro_batch", "lora.rank", "plan.memory_margin", "gpus.count"} <= set(keys)
    assert "packing" not in keys and "grad_checkpointing" not in keys


@pytest.mark.parametrize("key", _numeric_keys())
def test_true_or_false_is_not_a_number(catalog, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set(f"{key}=true")], catalog)
    found = problems_of(error)[key]
    assert "not true or false (got true)" in found and found.startswith(f"--set {key}:")


@pytest.mark.parametrize("key", ["dataset.examples", "dataset.mean_tokens", "checkpoint.keep", "eval.examples",
                                 "pricing.usd_per_hour"])
def test_true_or_false_is_not_a_number_in_other_sections(key: str) -> None:
    section, leaf = key.split(".")
    with pytest.raises(ValueError, match="not true or false"):
        RunSpec.model_validate({"model": "m", section: {leaf: False}})


def test_a_json_override_of_true_is_refused_too(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec_text("model: meta-llama/Llama-3.1-8B\n", overrides_from(json.loads('{"seq_len": true}')), catalog)
    assert "overrides.seq_len: must be a whole number, not true or false" in problems_of(error)["seq_len"]


def test_true_and_false_stay_right_where_a_key_takes_them(catalog) -> None:
    spec = load_spec(TINY, [parse_set("grad_checkpointing=true"), parse_set("packing=true")], catalog).spec
    assert spec.grad_checkpointing is True and spec.packing is True


def test_a_huge_global_batch_is_refused_at_once(catalog) -> None:
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("global_batch=32000000000")], catalog)
    assert time.perf_counter() - started < 1.0
    assert f"must be ≤ {MAX_GLOBAL_BATCH:,} (got 32000000000)" in problems_of(error)["global_batch"]


def test_a_huge_micro_batch_is_refused(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set(f"micro_batch={MAX_MICRO_BATCH + 1}")], catalog)
    assert f"at most {MAX_MICRO_BATCH:,} sequences per GPU" in problems_of(error)["micro_batch"]


def test_micro_batch_times_grad_accum_is_bounded_like_a_global_batch(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("micro_batch=8192"), parse_set("grad_accum=1024")], catalog)
    assert "= 8,388,608 sequences per optimizer step" in problems_of(error)["micro_batch"]


def test_seq_len_far_over_the_context_names_the_context_and_its_file(catalog) -> None:
    load_spec(TINY, [parse_set(f"seq_len={1024 * CONTEXT_MARGIN}")], catalog)  # position interpolation's reach
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set(f"seq_len={1024 * CONTEXT_MARGIN + 1}")], catalog)
    found = problems_of(error)["seq_len"]
    assert "its context is 1,024 tokens (max_position_embeddings in" in found
    assert str(REPO / "examples" / "tiny-model" / "config.json") in found and f"at most {1024 * CONTEXT_MARGIN:,}" in found


def test_learned_positions_allow_no_length_past_the_context(tmp_path: Path, catalog) -> None:
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256,
                                  "n_positions": 512}))
    load_spec(None, [parse_set(f"model={config}"), parse_set("seq_len=512")], catalog)
    with pytest.raises(ConfigError) as error:
        load_spec(None, [parse_set(f"model={config}"), parse_set("seq_len=513")], catalog)
    assert "n_positions" in problems_of(error)["seq_len"] and "learned" in problems_of(error)["seq_len"]


def test_more_gpus_than_any_offer_has_is_refused(catalog) -> None:
    from tunecast.plan.cost import GPUS_PER_NODE

    assert NODE_GPUS == GPUS_PER_NODE  # one machine's GPUs, as the planner prices them
    largest = max(o.gpu_count * (MAX_NODES if o.internode_gb_per_s else 1) for o in catalog.offers)
    load_spec(TINY, [parse_set(f"gpus.count={largest}")], catalog)
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set(f"gpus.count={largest + 1}")], catalog)
    assert f"more than any offer in the catalog has ({largest}" in problems_of(error)["gpus.count"]


def test_a_machine_of_eight_is_always_allowed() -> None:
    """A catalog whose offers are single GPUs still plans one machine of 8 (priced as 8 of them)."""
    from tunecast.config.checks import catalog_problems

    spec = RunSpec.model_validate({"model": "m", "gpus": {"count": NODE_GPUS}})
    catalog = load_catalog(None)
    single = type(catalog)(**{**catalog.__dict__, "offers": tuple(o for o in catalog.offers if o.gpu_count == 1)})
    assert catalog_problems(spec, single, lambda key: None) == []
    too_many = spec.with_changes({"gpus.count": NODE_GPUS + 1})
    [problem] = catalog_problems(too_many, single, lambda key: None)
    assert problem.field == "gpus.count" and f"({NODE_GPUS}: {NODE_GPUS} GPUs on one machine)" in problem.message
