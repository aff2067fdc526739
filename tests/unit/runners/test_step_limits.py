"""Other tools' step limits read into tunecast's semantics, and command-line overrides winning over their files."""

from pathlib import Path

import pytest
from tests.unit.runners.helpers import DATA, checked, reason

from tunecast.config.load import load_spec, parse_set
from tunecast.runners import axolotl, llamafactory, torchtune, trl

TORCHTUNE = DATA / "torchtune" / "lora_single_device.yaml"  # epochs 2, max_steps_per_epoch 100


def test_a_torchtune_recipe_with_epochs_and_a_step_cap_per_epoch_is_accepted(catalog) -> None:
    imported = torchtune.read(TORCHTUNE)
    loaded = load_spec(None, [], catalog, imported=imported)
    assert (loaded.spec.epochs, loaded.spec.max_steps, loaded.spec.fixed("epochs")) == (2.0, 200, True)
    # accepted without a warning (a step limit beside epochs is a run of its own); the import says how torchtune's
    # per-epoch cap was read
    assert not [w for w in loaded.warnings if w.field == "max_steps"]
    [note] = [n for n in imported.notes if n.startswith("max_steps_per_epoch")]
    assert "torchtune ends each epoch early where tunecast ends the run" in note


def test_overrides_win_over_an_imported_config(catalog) -> None:
    imported = torchtune.read(TORCHTUNE)
    spec = load_spec(None, [parse_set("max_steps=6"), parse_set("seq_len=1024"), parse_set("micro_batch=1")], catalog,
                     imported=imported).spec
    assert (spec.max_steps, spec.seq_len, spec.micro_batch, spec.epochs) == (6, 1024, 1, 2.0)
    unset = load_spec(None, [parse_set("max_steps=null")], catalog, imported=imported).spec
    assert (unset.max_steps, unset.epochs) == (None, 2.0)


@pytest.mark.parametrize(("reader", "source", "epochs_key", "steps"), [
    (trl, DATA / "trl" / "sft_qlora.yaml", "num_train_epochs", 500),
    (llamafactory, DATA / "llamafactory" / "qlora.yaml", "num_train_epochs", 300),
    (axolotl, DATA / "axolotl" / "lora.yml", "num_epochs", 40),
])
def test_a_trainer_max_steps_replaces_the_epochs(tmp_path: Path, reader, source: Path, epochs_key: str,  # type: ignore[no-untyped-def]
                                                  steps: int) -> None:
    """In the transformers Trainer (axolotl, LLaMA-Factory and TRL) max_steps > 0 is the run's length whatever the
    epochs: carried over as max_steps alone, so that tunecast trains (and estimates) that many steps."""
    lines = [line for line in source.read_text().splitlines()
             if not line.startswith((f"{epochs_key}:", "max_steps:"))]
    path = tmp_path / source.name
    path.write_text("\n".join([*lines, f"{epochs_key}: 3", f"max_steps: {steps}", ""]))
    (tmp_path / "data").symlink_to(source.parent / "data")  # the datasets it names, where it names them
    imported = reader.read(path)
    spec = checked(imported)
    assert (spec.max_steps, spec.fixed("epochs")) == (steps, False)
    assert "replaces the epochs in the transformers Trainer" in reason(imported, epochs_key)


def test_a_trainer_max_steps_of_minus_one_leaves_the_epochs(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text((DATA / "trl" / "sft_peft.yaml").read_text() + "max_steps: -1\n")
    imported = trl.read(path)
    spec = checked(imported)
    assert (spec.max_steps, spec.epochs) == (None, 1.0)
    assert "the number of epochs decides" in reason(imported, "max_steps")
