"""Combinations refused before anything starts, by `validate` and by the run itself, and the hints on paths."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.unit.config.helpers import problems_of

from tunecast.config.checks import distributed_problems
from tunecast.config.load import load_spec, parse_set
from tunecast.config.spec import RunSpec
from tunecast.errors import ConfigError, SharedError, TunecastError

REPO = Path(__file__).parents[3]
TINY = REPO / "examples" / "tiny-lora.yaml"


@pytest.mark.parametrize(("settings", "field", "text"), [
    (["loss=chunked"], "loss", "outside the model's forward pass"),
    (["optimizer_in_backward=true", "grad_accum=1"], "optimizer_in_backward", "before its gradient is averaged"),
])
def test_validate_refuses_what_several_gpus_cannot_run(catalog, settings: list[str], field: str, text: str) -> None:
    overrides = [parse_set(s) for s in [*settings, "gpus.count=2"]]
    load_spec(TINY, [parse_set(s) for s in settings], catalog)  # one GPU runs it
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, overrides, catalog)
    assert text in problems_of(error)[field] and "2 processes" in problems_of(error)[field]


@pytest.mark.parametrize(("settings", "text"), [
    (["method=qlora", "gpus.strategy=fsdp"], "QLoRA's 4-bit weights cannot be sharded"),
    (["method=qlora", "gpus.strategy=fsdp-grad-op"], "cannot be sharded"),
    (["gpus.strategy=zero3"], "DeepSpeed ZeRO-3, which tunecast's own loop does not run"),
])
def test_what_other_tools_run_is_estimated_with_a_warning_and_refused_by_train(catalog, settings: list[str],
                                                                               text: str) -> None:
    loaded = load_spec(TINY, [parse_set(s) for s in [*settings, "gpus.count=2"]], catalog)
    [warning] = [p for p in loaded.warnings if p.field == "gpus.strategy"]
    assert text in warning.message and "tunecast train refuses it" in warning.message
    [refusal] = [p for p in distributed_problems(loaded.spec, 2) if p.field == "gpus.strategy"]
    assert refusal.severity == "error" and text in refusal.message


def test_another_runner_keeps_its_own_limits(catalog) -> None:
    load_spec(TINY, [parse_set("runner=axolotl"), parse_set("method=qlora"), parse_set("gpus.strategy=fsdp"),
                     parse_set("gpus.count=2")], catalog)


def test_the_run_refuses_with_the_same_rules_at_its_real_number_of_processes() -> None:
    from tunecast.train.session import _check_distributed

    spec = RunSpec.model_validate({"model": "m", "method": "qlora", "gpus": {"strategy": "fsdp"}, "global_batch": 6})
    assert [p.field for p in distributed_problems(spec, 4)] == ["gpus.strategy", "global_batch"]
    assert distributed_problems(spec, 1) == []

    def engine(rank: int) -> SimpleNamespace:
        return SimpleNamespace(world=SimpleNamespace(distributed=True, size=4, main=rank == 0, rank=rank))

    with pytest.raises(TunecastError, match="cannot be sharded by FSDP2 full shard") as error:
        _check_distributed(spec, engine(0))
    assert not isinstance(error.value, SharedError) and error.value.field == "gpus.strategy"
    with pytest.raises(SharedError, match="cannot be sharded"):
        _check_distributed(spec, engine(1))


def test_a_global_batch_that_does_not_divide_over_the_processes_offers_the_nearest() -> None:
    spec = RunSpec.model_validate({"model": "m", "global_batch": 10})
    [problem] = distributed_problems(spec, 4)
    assert problem.message == "10 does not divide over 4 processes" and problem.hint == "set global_batch to 8 or 12"


def test_no_note_when_max_steps_stands_alone(catalog) -> None:
    loaded = load_spec(TINY, [parse_set("epochs=null"), parse_set("max_steps=6")], catalog)
    assert not [w for w in loaded.warnings if w.field == "max_steps"]


def test_a_dataset_path_from_the_command_line_is_said_relative_to_the_current_directory(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set("dataset.path=nowhere.jsonl")], catalog)
    found = problems_of(error)["dataset.path"]
    assert f"relative to the current directory ({Path.cwd()})" in found and "config file" not in found


def test_a_dataset_path_from_the_file_is_said_relative_to_its_folder(tmp_path: Path, catalog) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: meta-llama/Llama-3.1-8B\ndataset:\n  path: nowhere.jsonl\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert f"relative to the config file's folder ({tmp_path.resolve()})" in problems_of(error)["dataset.path"]


def test_deepspeed_is_estimated_for_the_tools_that_run_it(catalog) -> None:
    for runner in ("hf-trainer", "trl", "axolotl", "llamafactory"):
        spec = load_spec(TINY, [parse_set(s) for s in (f"runner={runner}", "gpus.strategy=zero3", "gpus.count=2")],
                         catalog).spec
        assert spec.gpus.strategy == "zero3"
    with pytest.raises(ConfigError) as error:
        load_spec(TINY, [parse_set(s) for s in ("runner=torchtune", "gpus.strategy=zero2", "gpus.count=2")], catalog)
    assert "torchtune does not run" in problems_of(error)["gpus.strategy"]
