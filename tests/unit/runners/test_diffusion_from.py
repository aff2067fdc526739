"""The diffusion runners (config/diffusion_runner.py) and the readers of their configs (`--from kohya`, `--from
ai-toolkit`): each tool's defaults applied where the config leaves a key unset, and named; the published example
configs (tests/data/runners/diffusion/README.md) read into a pipeline's config or refused in one line naming the key.
Only the tiny pipeline of test_diffusion.py is traced."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import REPO
from tests.unit.estimate.test_diffusion import tiny_pipeline
from tests.unit.runners.helpers import DATA

from tunecast.catalog.hub import HubAccess
from tunecast.catalog.store import load_catalog
from tunecast.config.diffusion_runner import DIFFUSION_RUNNERS, differences_table
from tunecast.config.load import LoadedPipeline, Override, load_run
from tunecast.errors import ConfigError, TunecastError
from tunecast.runners.imported import read_config

pytest.importorskip("diffusers")

PUBLISHED = DATA / "diffusion"
OFFLINE = HubAccess(True)


def _load(folder: Path, **sets: object) -> LoadedPipeline:
    overrides = [Override("model", str(folder), "--model")]
    overrides += [Override(key, value, f"--set {key}") for key, value in sets.items()]
    loaded = load_run(None, overrides, load_catalog(None), hub=OFFLINE)
    assert isinstance(loaded, LoadedPipeline)
    return loaded


@pytest.mark.parametrize(("runner", "expected"), [
    ("diffusers", {"lora.rank": 4, "optimizer": "adamw-foreach", "grad_checkpointing": False,
                   "diffusion.lora_layers": "examples", "diffusion.cache_text": None}),
    ("kohya", {"lora.rank": 4, "lora.alpha": 1, "precision": "fp32", "optimizer": "adamw-foreach",
               "diffusion.lora_layers": "blocks", "diffusion.cache_text": False, "diffusion.vae_fp32": False}),
    ("simpletuner", {"lora.rank": 16, "grad_checkpointing": True, "diffusion.cache_latents": True,
                     "diffusion.cache_text": True, "diffusion.lora_layers": "attention"}),
    ("ai-toolkit", {"lora.rank": 4, "precision": "fp32", "grad_checkpointing": True, "optimizer": "adamw-foreach",
                    "diffusion.lora_layers": "blocks", "diffusion.cache_text": False}),
])
def test_each_runner_s_defaults_apply_to_the_keys_left_unset_and_are_named(tmp_path: Path, runner: str,
                                                                           expected: dict[str, object]) -> None:
    loaded = _load(tiny_pipeline(tmp_path), runner=runner)
    for key, value in expected.items():
        section, _, leaf = key.rpartition(".")
        assert getattr(getattr(loaded.spec, section) if section else loaded.spec, leaf) == value, key
    applied = [d for d in DIFFUSION_RUNNERS[runner].defaults if f"{d.key} " in "\n".join(loaded.runner_notes)]
    assert len(applied) == len(DIFFUSION_RUNNERS[runner].defaults)  # every default named, with its source
    assert loaded.runner_notes[0].startswith(f"runner {DIFFUSION_RUNNERS[runner].label}: the defaults of")
    assert all("@" in note or "(" in note for note in loaded.runner_notes)


def test_a_key_the_config_sets_wins_over_the_runner_s_default(tmp_path: Path) -> None:
    loaded = _load(tiny_pipeline(tmp_path), runner="kohya", **{"lora.rank": 32, "precision": "bf16-mixed"})
    assert (loaded.spec.lora.rank, loaded.spec.precision, loaded.spec.lora.alpha) == (32, "bf16-mixed", 1)
    assert not any(note.startswith("runner kohya sd-scripts: lora.rank") for note in loaded.runner_notes)


def _refusal(folder: Path, **sets: object) -> list[tuple[str | None, str]]:
    with pytest.raises(ConfigError) as error:
        _load(folder, **sets)
    return [(p.field, p.message) for p in error.value.problems if p.severity == "error"]


def test_runners_of_the_other_kind_and_what_cannot_be_traced_are_refused_one_line_each(tmp_path: Path) -> None:
    folder = tiny_pipeline(tmp_path)
    [(field, message)] = _refusal(folder, runner="trl")
    assert field == "runner" and "trl trains language models" in message
    [(field, message)] = _refusal(folder, method="full", **{"diffusion.base_8bit": True})
    assert field == "diffusion.base_8bit" and "for LoRA" in message
    [(field, message)] = _refusal(folder, runner="kohya", **{"diffusion.base_8bit": True})
    assert field == "diffusion.base_8bit" and "fp32 does not run" in message
    with pytest.raises(ConfigError) as error:
        load_run(None, [Override("model", "meta-llama/Llama-3.1-8B", "--model"),
                        Override("runner", "kohya", "--runner")], load_catalog(None), hub=OFFLINE)
    [problem] = error.value.problems
    assert problem.field == "model" and "is not a diffusion pipeline tunecast reads" in problem.message


def test_the_runner_s_layers_and_8_bit_base_change_the_traced_step(tmp_path: Path) -> None:
    """kohya's layers (every linear of the transformer blocks) train more adapters than diffusers' examples'; 8-bit
    frozen linear weights hold less than bf16 ones."""
    from tunecast.catalog.diffusion import load_pipeline
    from tunecast.estimate.diffusion import DiffusionShape, estimate_diffusion_memory
    from tunecast.step.diffusion import DiffusionSettings

    pipeline = load_pipeline(str(tiny_pipeline(tmp_path)))
    overheads = load_catalog(None).overheads

    def breakdown(**settings: object) -> dict[str, float]:
        return estimate_diffusion_memory(pipeline, DiffusionSettings(**settings), DiffusionShape(1, 64, 64),  # type: ignore[arg-type]
                                         device="cpu", gpu=None, overheads=overheads).breakdown_gib

    examples, blocks, eight = breakdown(), breakdown(lora_layers="blocks"), breakdown(base_8bit=True)
    assert blocks["trainable_weights"] > examples["trainable_weights"]
    assert eight["weights"] < examples["weights"]


def test_ai_toolkit_s_flux_example_reads_into_a_pipeline_run_with_its_8_bit_base() -> None:
    imported = read_config("ai-toolkit", PUBLISHED / "ai-toolkit" / "train_lora_flux_24gb.yaml")
    assert not [u.key for u in imported.unmapped if "misspelt" in u.reason]
    loaded = load_run(None, [], load_catalog(None), hub=OFFLINE, imported=imported)
    assert isinstance(loaded, LoadedPipeline)
    spec = loaded.spec
    assert (spec.model, spec.runner, spec.lora.rank, spec.optimizer, spec.precision, spec.grad_checkpointing) == (
        "black-forest-labs/FLUX.1-dev", "ai-toolkit", 16, "adamw-8bit", "bf16-mixed", True)
    assert (spec.diffusion.base_8bit, spec.diffusion.cache_latents, spec.diffusion.resolution,
            spec.diffusion.cache_text, spec.max_steps) == (True, True, 1024, False, 2000)


@pytest.mark.parametrize(("name", "field"), [
    ("ai-toolkit/train_lora_sd35_large_24gb.yaml", "model"),  # not in the catalog: offline, said in one line
    ("ai-toolkit/train_lora_wan21_1b_24gb.yaml", "model"),
    ("kohya/lora_config.toml", "network_module"),  # LyCORIS
    ("kohya/loha_config.toml", "network_module"),
])
def test_published_configs_that_cannot_be_estimated_are_refused_naming_the_key(name: str, field: str) -> None:
    tool = name.split("/")[0]
    with pytest.raises(TunecastError) as error:
        load_run(None, [], load_catalog(None), hub=OFFLINE, imported=read_config(tool, PUBLISHED / name))
    problems = [p for p in getattr(error.value, "problems", []) if p.severity == "error"]
    assert [p.field for p in problems] == [field] if problems else error.value.field == field


def test_every_published_file_is_listed_with_its_source() -> None:
    listed = (PUBLISHED / "README.md").read_text()
    for path in sorted(PUBLISHED.rglob("*.*ml")) + sorted(PUBLISHED.rglob("*.toml")):
        assert f"`{path.relative_to(PUBLISHED).as_posix()}`" in listed


KOHYA = """[model_arguments]
pretrained_model_name_or_path = "{model}"

[network_arguments]
network_module = "networks.lora"
network_dim = 16
network_alpha = 8
network_train_unet_only = true

[training_arguments]
train_batch_size = 2
resolution = "64,48"
mixed_precision = "bf16"
gradient_checkpointing = true
cache_latents = true
fp8_base = true
optimizer_type = "AdamW8bit"
max_train_epochs = 3
max_train_steps = 100
xformers = true
"""


def test_memory_from_a_kohya_toml_traces_its_run_and_names_the_runner(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "pipeline").mkdir()
    folder = tiny_pipeline(tmp_path / "pipeline")
    config = tmp_path / "kohya.toml"
    config.write_text(KOHYA.format(model=folder))
    imported = read_config("kohya", config)
    assert imported.config["diffusion"] == {"resolution": "64x48", "cache_latents": True, "base_8bit": True}
    assert imported.config["epochs"] == 3.0 and "max_steps" not in imported.config  # max_train_epochs wins
    assert not [u.key for u in imported.unmapped if "misspelt" in u.reason]
    result = cli("memory", "--from", "kohya", str(config), "--device", "cpu", "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert (document["runner"], document["width"], document["height"], document["micro_batch"]) == (
        "kohya", 64, 48, 2)
    assert any("diffusion.lora_layers blocks" in note for note in document["runner_notes"])
    assert document["from"]["tool"] == "kohya"
    shown = cli("memory", "--from", "kohya", str(config), "--device", "cpu")
    assert "as kohya runs it" in shown.stdout and "runner kohya sd-scripts" in shown.stdout
    config.write_text(KOHYA.format(model=folder).replace("xformers = true", "blocks_to_swap = 8"))
    refused = cli("memory", "--from", "kohya", str(config))
    assert refused.code == 2 and "blocks_to_swap" in refused.stderr and "Traceback" not in refused.stderr


def test_the_documented_table_is_the_diffusion_runners_table() -> None:
    text = (REPO / "docs" / "diffusion.md").read_text()
    section = text.split("<!-- diffusion-runners:start -->\n", 1)[1].split("\n<!-- diffusion-runners:end -->", 1)[0]
    assert section == differences_table()
