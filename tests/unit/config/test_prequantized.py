"""Pre-quantized checkpoints (AWQ, GPTQ) refused before anything is estimated: one problem on `model`, exit 2,
naming what says so and pointing at the unquantized model."""

import json
from pathlib import Path

import pytest

from tunecast.catalog.hub import HubAccess
from tunecast.catalog.models import bnb_name
from tunecast.config.load import load_spec, parse_set
from tunecast.config.prequantized import prequantized_name, unquantized_name
from tunecast.errors import ConfigError

REPO = Path(__file__).parents[3]


def _llama_config(folder: Path, **extra: object) -> Path:
    folder.mkdir(parents=True)
    config = json.loads((REPO / "src/tunecast/catalog/data/models/meta-llama__Llama-2-7b-hf.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **extra}), encoding="utf-8")
    return folder


@pytest.mark.parametrize(("name", "method", "base"), [
    ("TheBloke/Llama-2-7B-GPTQ", "gptq", "Llama-2-7B"),
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "awq", "Meta-Llama-3.1-8B-Instruct"),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "gptq", "Qwen2.5-7B-Instruct"),
    ("models/mistral_awq", "awq", "mistral"),
    ("meta-llama/Llama-2-7b-hf", None, "Llama-2-7b-hf"),
    ("someone/gptqlike-7b", None, "gptqlike-7b"),  # a part of a word is no name part
])
def test_names_that_say_awq_or_gptq(name: str, method: str | None, base: str) -> None:
    assert prequantized_name(name) == method
    assert unquantized_name(name).strip("-_.") == base


def _refused(cli, *args: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The one problem of `tunecast memory ARGS --json`, which must exit 2; and the same on stderr without --json."""
    result = cli("memory", *args)
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr
    assert "1 problem" in result.stderr and result.stdout == ""
    document = cli("memory", *args, "--json")
    assert document.code == 2
    [problem] = document.json()["error"]["problems"]
    assert problem["field"] == "model" and "\n" not in problem["message"] and "\n" not in problem["hint"]
    return problem


def test_a_gptq_config_is_refused_naming_its_key(cli, tmp_path: Path) -> None:
    folder = _llama_config(tmp_path / "llama-gptq", quantization_config={"quant_method": "gptq", "bits": 4})
    problem = _refused(cli, "--model", str(folder))
    assert problem["message"].startswith(f"{folder / 'config.json'} has quantization_config.quant_method 'gptq': "
                                         "its weights are already quantized by GPTQ")
    assert problem["hint"].startswith("give the unquantized model it was made from")
    assert "quantization.bits: 4 or 8" in problem["hint"]


def test_an_awq_folder_is_refused_by_the_file_autoawq_writes(cli, tmp_path: Path) -> None:
    folder = _llama_config(tmp_path / "llama-2-7b-quantized")
    (folder / "quant_config.json").write_text('{"w_bit": 4, "q_group_size": 128}', encoding="utf-8")
    problem = _refused(cli, "--model", str(folder), "--method", "qlora")
    assert problem["message"].startswith(f"{folder} holds quant_config.json (AutoAWQ's): its weights are already "
                                         "quantized by AWQ")


def test_a_hub_id_naming_gptq_is_refused_offline_with_the_base_model_suggested(cli) -> None:
    problem = _refused(cli, "--model", "TheBloke/Llama-2-7B-GPTQ", "--offline")
    assert problem["message"].startswith("model 'TheBloke/Llama-2-7B-GPTQ' is a GPTQ checkpoint by its name")
    assert "meta-llama/Llama-2-7b-hf" in problem["hint"]


def test_other_quantization_configs_are_not_refused(tmp_path: Path, catalog) -> None:
    """gpt-oss's published config carries an mxfp4 quantization_config, which transformers dequantizes to train."""
    folder = _llama_config(tmp_path / "llama", quantization_config={"quant_method": "mxfp4"})
    load_spec(None, [parse_set(f"model={folder}")], catalog)
    load_spec(None, [parse_set("model=openai/gpt-oss-20b")], catalog)


@pytest.mark.parametrize(("name", "found"), [
    ("unsloth/llama-3-8b-bnb-4bit", ("unsloth/llama-3-8b", 4)),
    ("unsloth/Qwen2.5-7B-Instruct-unsloth-bnb-4bit", ("unsloth/Qwen2.5-7B-Instruct", 4)),
    ("someone/Mistral-7B-v0.1_bnb_8bit", ("someone/Mistral-7B-v0.1", 8)),
    ("someone/bnb-4bit-notes", None),  # not the name's end
    ("meta-llama/Llama-2-7b-hf", None),
])
def test_names_that_say_bitsandbytes_weights(name: str, found: tuple[str, int] | None) -> None:
    assert bnb_name(name) == found


def test_lora_on_bitsandbytes_weights_is_estimated_as_qlora_with_their_bits(tmp_path: Path, catalog) -> None:
    """By its config (a folder), and offline by its name (unsloth's upload of a catalog model): QLoRA with a warning
    on `method`; full fine-tuning of such weights is refused naming `method`."""
    folder = _llama_config(tmp_path / "llama", quantization_config={"quant_method": "bitsandbytes",
                                                                       "load_in_8bit": True})
    loaded = load_spec(None, [parse_set(f"model={folder}"), parse_set("method=lora")], catalog)
    assert (loaded.spec.method, loaded.spec.quantization.bits) == ("qlora", 8)
    assert [w.field for w in loaded.warnings] == ["method"] and "LoRA on them is QLoRA" in loaded.warnings[0].message
    named = load_spec(None, [parse_set("model=unsloth/llama-3-8b-bnb-4bit"), parse_set("method=lora")], catalog,
                      hub=HubAccess(offline=True))
    assert (named.spec.method, named.spec.quantization.bits) == ("qlora", 4)
    assert named.model.alias_of == "meta-llama/Meta-Llama-3-8B"
    assert named.model.data["quantization_config"]["load_in_4bit"] is True
    with pytest.raises(ConfigError) as refused:
        load_spec(None, [parse_set(f"model={folder}"), parse_set("method=full")], catalog)
    assert [p.field for p in refused.value.problems if p.severity == "error"] == ["method"]


def test_training_bitsandbytes_weights_is_refused_pointing_at_the_model_they_were_made_from(catalog) -> None:
    from tunecast.errors import TunecastError
    from tunecast.train.model import load_base

    named = load_spec(None, [parse_set("model=unsloth/llama-3-8b-bnb-4bit"), parse_set("method=qlora")], catalog,
                      hub=HubAccess(offline=True))
    with pytest.raises(TunecastError) as refused:
        load_base(named.spec, named.model, offline=True)
    assert refused.value.problems[0].field == "model" and "meta-llama/Meta-Llama-3-8B" in (refused.value.hint or "")
