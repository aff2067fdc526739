"""Command-line (and web) overrides win over the file: values replace, null unsets, a step limit caps the epochs."""

from pathlib import Path

import pytest
from tests.unit.config.helpers import problems_of

from tunecast.config.load import Override, load_spec, load_spec_text, merged_document, overrides_from, parse_set
from tunecast.config.spec import RunSpec
from tunecast.errors import ConfigError

REPO = Path(__file__).parents[3]
TINY = REPO / "examples" / "tiny-lora.yaml"  # sets epochs 10, grad_accum 2, warmup_steps 5


def test_max_steps_on_the_command_line_caps_the_files_epochs(catalog) -> None:
    loaded = load_spec(TINY, [parse_set("max_steps=20")], catalog)
    assert (loaded.spec.max_steps, loaded.spec.epochs, loaded.spec.fixed("epochs")) == (20, 10.0, True)
    assert loaded.warnings == ()  # both keep their meaning (train, plan and validate say how long the run is)


@pytest.mark.parametrize("null", ["null", "~", "Null"])
def test_null_unsets_an_optional_key_back_to_its_default(catalog, null: str) -> None:
    loaded = load_spec(TINY, [parse_set(f"epochs={null}")], catalog)
    assert loaded.spec.epochs == RunSpec.model_fields["epochs"].default
    assert not loaded.spec.fixed("epochs")


def test_null_unsets_a_key_in_a_section_and_a_whole_section(catalog) -> None:
    rank_gone = load_spec(TINY, [parse_set("lora.rank=null")], catalog).spec
    assert (rank_gone.lora.rank, rank_gone.lora.alpha) == (8, 16)  # the default rank; the file's alpha stays
    section_gone = load_spec(TINY, [parse_set("eval=~")], catalog).spec
    assert section_gone.eval.examples == 0 and not section_gone.fixed("eval.every_steps")


def test_unsetting_the_model_is_an_error_naming_it(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("model=null")], catalog)
    assert problems_of(error)["model"].startswith("--set model: is required: it cannot be unset")


def test_null_for_an_unknown_key_is_still_an_unknown_key(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("max_step=null")], catalog)
    assert "unknown key" in problems_of(error)["max_step"] and "max_steps" in problems_of(error)["max_step"]


def test_a_global_batch_on_the_command_line_replaces_the_files_grad_accum(catalog) -> None:
    loaded = load_spec(TINY, [parse_set("global_batch=16")], catalog)
    assert (loaded.spec.global_batch, loaded.spec.grad_accum, loaded.spec.fixed("grad_accum")) == (16, 1, False)
    [note] = [w for w in loaded.warnings if w.field == "grad_accum"]
    assert note.location.startswith("line ") and "gives way to --set global_batch" in note.message


def test_both_halves_of_a_pair_on_the_command_line_are_still_refused(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("warmup_ratio=0.1"), parse_set("warmup_steps=3")], catalog)
    assert "set together with warmup_steps" in problems_of(error)["warmup_ratio"]


def test_web_overrides_win_and_null_unsets(catalog) -> None:
    text = TINY.read_text().replace("model: tiny-model", f"model: {TINY.parent / 'tiny-model'}").replace(
        "path: data/alpaca.jsonl", f"path: {TINY.parent / 'data' / 'alpaca.jsonl'}")
    loaded = load_spec_text(text, overrides_from({"max_steps": 6, "seq_len": 128, "warmup_steps": None}), catalog)
    assert (loaded.spec.max_steps, loaded.spec.seq_len, loaded.spec.warmup_steps) == (6, 128, 0)
    assert not loaded.spec.fixed("warmup_steps")


def test_the_merged_document_drops_unset_keys() -> None:
    document = merged_document("model: m\nepochs: 2\nlora:\n  rank: 4\n",
                               [Override("epochs", None, "x"), Override("lora.rank", None, "x"),
                                Override("max_steps", 5, "x")])
    assert document == {"model": "m", "lora": {}, "max_steps": 5}


def test_with_changes_keeps_what_was_set() -> None:
    spec = RunSpec.model_validate({"model": "m", "max_steps": 6})
    changed = spec.with_changes({"gpus.count": 2})
    assert changed.fixed("gpus.count") and changed.fixed("max_steps")
    assert not changed.fixed("epochs") and not changed.fixed("grad_accum")
