"""RunSpec: one source of defaults, each documented; list fields accept comma strings."""

import pytest
from pydantic import BaseModel, ValidationError

from tunecast.config.spec import LoraSpec, RunSpec


def _fields(model: type[BaseModel], prefix: str = ""):  # type: ignore[no-untyped-def]
    for name, field in model.model_fields.items():
        yield prefix + name, field
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _fields(annotation, f"{prefix}{name}.")


@pytest.mark.parametrize(("key", "field"), list(_fields(RunSpec)))
def test_every_field_is_documented_with_its_default(key: str, field) -> None:  # type: ignore[no-untyped-def]
    assert field.description, f"{key} has no docstring"
    section = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    if not section and key != "model":
        assert "Default" in field.description, f"{key}'s docstring does not state its default"


def test_defaults_follow_transformers_and_peft() -> None:
    spec = RunSpec(model="m")
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout) == (8, 8, 0.0)
    assert (spec.learning_rate, spec.schedule, spec.seed, spec.epochs) == (5e-5, "linear", 42, 3.0)
    assert (spec.micro_batch, spec.grad_accum, spec.max_grad_norm) == (8, 1, 1.0)
    assert (spec.precision, spec.optimizer, spec.attention, spec.loss) == ("bf16", "adamw", "sdpa", "standard")
    assert spec.grad_checkpointing is False and spec.packing is False


def test_comma_string_becomes_a_list() -> None:
    assert LoraSpec(targets="q_proj, v_proj").targets == ["q_proj", "v_proj"]
    assert LoraSpec(targets="all-linear").targets == "all-linear"


def test_targets_of_the_wrong_type_say_what_is_expected() -> None:
    with pytest.raises(ValidationError, match="list of module names"):
        LoraSpec(targets=5)


def test_fixed_tells_user_values_from_defaults() -> None:
    spec = RunSpec.model_validate({"model": "m", "lora": {"rank": 16}, "micro_batch": 8})
    assert spec.fixed("micro_batch") and spec.fixed("lora.rank")
    assert not spec.fixed("seq_len") and not spec.fixed("lora.alpha") and not spec.fixed("gpus.count")


def test_unknown_keys_are_refused_in_every_section() -> None:
    with pytest.raises(ValidationError, match="rnak"):
        RunSpec.model_validate({"model": "m", "lora": {"rnak": 4}})
