"""Pre-quantized checkpoints (AWQ, GPTQ) refused before anything is estimated: one problem on `model`, exit 2,
naming what says so and pointing at the unquantized model."""

import json
from pathlib import Path

import pytest

from tunecast.config.load import load_spec, parse_set
from tunecast.config.prequantized import prequantized_name, unquantized_name

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
