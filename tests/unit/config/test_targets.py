"""LoRA targets: every name must adapt a layer, known without torch from the catalog's table of modules, and on the
built model for an architecture the table lacks."""

import json
from pathlib import Path

import pytest
from tests.unit.config.helpers import problems_of

from tunecast.catalog.models import read_config_file
from tunecast.catalog.modules import _table, patterns
from tunecast.catalog.store import MODELS_DIR, bundled_data_dir
from tunecast.config.load import load_spec, load_spec_text, overrides_from, parse_set
from tunecast.config.targets import modules_problem
from tunecast.errors import ConfigError, TunecastError

REPO = Path(__file__).parents[3]
TINY = REPO / "examples" / "tiny-lora.yaml"
# a model of two layers, as the table and a built model name them
LAYERS = {"model.embed_tokens": True, "model.layers.0.self_attn": False, "model.layers.0.self_attn.q_proj": True,
          "model.layers.0.self_attn.v_proj": True, "model.layers.0.mlp": False, "model.layers.0.mlp.up_proj": True,
          "model.layers.1.self_attn.q_proj": True, "lm_head": True}


def test_names_that_adapt_layers_pass_by_peft_suffix_rule() -> None:
    assert modules_problem(["q_proj", "self_attn.v_proj", "layers.1.self_attn.q_proj", "lm_head"], LAYERS, "m") is None


def test_one_misspelt_name_among_good_ones_is_named_with_a_suggestion() -> None:
    problem = modules_problem(["q_proj", "v_prj"], LAYERS, "m")
    assert problem is not None and problem.field == "lora.targets"
    assert problem.message.startswith("'v_prj' matches no module of m") and "other names alone" in problem.message
    assert problem.hint is not None and problem.hint.startswith("Did you mean 'v_proj'?")


def test_every_unmatched_name_is_named() -> None:
    problem = modules_problem(["foo", "v_prj", "q_proj", "layers.7.mlp.up_proj"], LAYERS, "m")
    assert problem is not None
    assert problem.message.startswith("'foo', 'v_prj', 'layers.7.mlp.up_proj' match no module of m")
    assert "For 'v_prj': did you mean 'v_proj'?" in str(problem.hint)


def test_a_block_is_not_a_layer_and_its_layers_are_named() -> None:
    problem = modules_problem(["mlp"], LAYERS, "m")
    assert problem is not None and "'mlp' names only modules LoRA cannot adapt" in problem.message
    assert "'mlp' holds up_proj: name those" in str(problem.hint)


def test_validate_refuses_a_misspelt_target_on_a_catalog_model(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(None, [parse_set("model=meta-llama/Llama-3.1-8B"), parse_set("lora.targets=q_proj,v_prj")], catalog)
    found = problems_of(error)["lora.targets"]
    assert found.startswith("--set lora.targets: 'v_prj' matches no module of meta-llama/Llama-3.1-8B (llama)")
    assert "Did you mean 'v_proj'?" in found


def test_a_target_list_that_matches_nothing_is_a_config_error_in_the_web_path_too(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec_text("model: Qwen/Qwen3-0.6B\n", overrides_from({"lora.targets": ["foo"]}), catalog)
    assert "overrides.lora.targets: 'foo' matches no module of Qwen/Qwen3-0.6B (qwen3)" in \
        problems_of(error)["lora.targets"]


def test_full_fine_tuning_and_all_linear_are_not_checked(catalog) -> None:
    load_spec(TINY, [parse_set("method=full"), parse_set("lora.targets=foo")], catalog)
    load_spec(TINY, [parse_set("lora.targets=all-linear")], catalog)


def test_an_empty_target_list_is_refused(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("lora.targets=[]")], catalog)
    assert "must name at least one module" in problems_of(error)["lora.targets"]


def test_the_table_holds_what_transformers_builds_for_every_catalog_architecture() -> None:
    from tunecast.step.shape import build_meta_model, shallow_config_data, text_config_data
    from tunecast.step.targets import module_table

    table = _table()
    checked = set()
    for path in sorted((bundled_data_dir() / MODELS_DIR).glob("*.json")):
        data = read_config_file(path)
        model_type = text_config_data(data)["model_type"]
        if model_type in checked:
            continue
        built = patterns(module_table(build_meta_model(shallow_config_data(data, 2), name=path.name)))
        assert built is not None
        assert {name: adaptable for name, adaptable in table[model_type].items() if name in built} == built, \
            f"{model_type}: run scripts/update_module_names.py"
        checked.add(model_type)
    assert checked == set(table)


def test_an_architecture_the_table_lacks_is_checked_on_the_built_model(tmp_path: Path, catalog) -> None:
    from tunecast.step.settings import AdapterSettings
    from tunecast.step.setup import apply_adapters
    from tunecast.step.shape import build_meta_model

    config = {"model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
              "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    assert config["model_type"] not in _table()
    path = tmp_path / "olmo2.json"
    path.write_text(json.dumps(config))
    load_spec(None, [parse_set(f"model={path}"), parse_set("lora.targets=q_proj,o_prj")], catalog)  # no table
    model = build_meta_model(config)
    adapters = AdapterSettings(rank=4, alpha=8, dropout=0.0, targets=("q_proj", "o_prj"), dora=False,
                               modules_to_save=())
    with pytest.raises(TunecastError, match=r"'o_prj' matches no module of this model \(olmo2\)") as error:
        apply_adapters(model, adapters)
    assert error.value.field == "lora.targets" and "Did you mean 'o_proj'?" in str(error.value.hint)
