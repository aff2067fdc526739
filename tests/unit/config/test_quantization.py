"""`quantization.bits`: QLoRA on an 8-bit base (LLM.int8), and the settings that go with it."""

from pathlib import Path

import pytest
from tests.unit.config.helpers import problems_of

from tunecast.config.checks import cross_field_problems, distributed_problems
from tunecast.config.load import load_spec, parse_set
from tunecast.config.spec import RunSpec
from tunecast.errors import ConfigError
from tunecast.step.variants import STEP_VARIANTS, runner_notes, runner_step

REPO = Path(__file__).parents[3]
TINY = REPO / "examples" / "tiny-lora.yaml"


def spec_of(**fields: object) -> RunSpec:
    return RunSpec.model_validate({"model": "x", **fields})


def errors(spec: RunSpec) -> dict[str, str]:
    return {p.field or "": p.message for p in cross_field_problems(spec, lambda _: None) if p.severity == "error"}


def test_four_bits_by_default_and_eight_with_qlora(catalog) -> None:
    assert RunSpec(model="x").quantization.bits == 4
    loaded = load_spec(TINY, [parse_set("method=qlora"), parse_set("quantization.bits=8")], catalog)
    assert (loaded.spec.method, loaded.spec.quantization.bits) == ("qlora", 8)
    assert loaded.spec.fixed("quantization.bits")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_eight_bits_without_qlora_is_one_problem_naming_the_key(catalog, method: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set(f"method={method}"), parse_set("quantization.bits=8")], catalog)
    [problem] = [p for p in error.value.problems if p.severity == "error"]
    assert problem.field == "quantization.bits"
    assert problem.location == "--set quantization.bits" and "\n" not in problem.message
    assert f"method is {method}" in problem.message and "set method: qlora" in (problem.hint or "")


def test_bits_other_than_4_or_8_are_refused(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("method=qlora"), parse_set("quantization.bits=2")], catalog)
    assert "must be one of: 4, 8 (got 2)" in problems_of(error)["quantization.bits"]


def test_the_4bit_settings_do_not_go_with_8_bits() -> None:
    assert errors(spec_of(method="qlora", quantization={"bits": 8})) == {}
    assert "4-bit NF4" in errors(spec_of(method="qlora", quantization={"bits": 8}, lora={"double_quant": False}))[
        "lora.double_quant"]
    assert errors(spec_of(method="qlora", lora={"double_quant": False})) == {}
    assert "QLoRA's 8-bit weights" in errors(spec_of(method="qlora", quantization={"bits": 8}, precision="fp8"))[
        "precision"]
    sharded = spec_of(method="qlora", quantization={"bits": 8}, gpus={"strategy": "fsdp"})
    [problem] = distributed_problems(sharded, 2)
    assert problem.message.startswith("QLoRA's 8-bit weights cannot be sharded")


def test_bitsandbytes_versions_of_the_8bit_layers() -> None:
    old = errors(spec_of(method="qlora", quantization={"bits": 8}, bitsandbytes_version="0.45"))
    assert "bitsandbytes LLM.int8 0.45 is not one tunecast models: it knows 0.50 and later" in \
        old["bitsandbytes_version"]
    assert errors(spec_of(method="qlora", quantization={"bits": 8}, bitsandbytes_version="0.50.2")) == {}
    assert errors(spec_of(method="qlora", bitsandbytes_version="0.45")) == {}  # the 4-bit layers' 0.43.2 and later


def test_the_8bit_layers_keep_their_inputs_for_every_runner() -> None:
    eight = spec_of(method="qlora", quantization={"bits": 8})
    assert runner_step(eight) == ("int8-keeps-input",)
    assert runner_step(spec_of(method="qlora")) == ()
    trainer = runner_step(spec_of(method="qlora", quantization={"bits": 8}, runner="hf-trainer", precision="bf16"))
    assert trainer == ("autocast", "fp32-outputs", "kbit-fp32", "int8-keeps-input")
    assert runner_notes(eight) == [f"bitsandbytes 0.50 and later (8-bit layers): {STEP_VARIANTS['int8-keeps-input']}"]
