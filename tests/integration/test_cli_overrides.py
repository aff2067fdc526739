"""The first hour's config mistakes, at the command line: overrides win, and mistakes are one-line errors (exit 2)."""

from tests.conftest import PYTHON, REPO, run_subprocess
from tests.integration.test_cli import NO_TORCH

TINY = str(REPO / "examples" / "tiny-lora.yaml")


def test_a_smoke_run_of_a_real_config_is_a_max_steps_away(cli) -> None:
    result = cli("validate", TINY, "--max-steps", "6")
    assert result.code == 0, result.stderr
    said = " ".join((result.stdout + result.stderr).split())
    assert "length max_steps 6 ends the run early, or the 10 epochs if they end first" in said and "is valid" in said
    assert "warning" not in said.lower() and "!" not in said  # a smoke run is no mistake


def test_set_null_unsets_a_key(cli) -> None:
    result = cli("validate", TINY, "--set", "epochs=null", "--set", "max_steps=3", "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert (document["spec"]["epochs"], document["spec"]["max_steps"], document["warnings"]) == (3.0, 3, [])


def test_true_is_not_a_length(cli) -> None:
    result = cli("validate", TINY, "--set", "seq_len=true")
    assert result.code == 2 and "seq_len (--set seq_len): must be a whole number, not true or false" in \
        " ".join(result.stderr.split())


def test_a_misspelt_lora_target_is_refused_by_validate_and_memory(cli) -> None:
    validated = cli("validate", TINY, "--lora-targets", "q_proj,v_prj")
    assert validated.code == 2 and "Did you mean 'v_proj'?" in " ".join(validated.stderr.split())
    estimated = cli("memory", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm", "--lora-targets", "foo",
                    "--json")
    assert estimated.code == 2
    error = estimated.json()["error"]
    assert error["field"] == "lora.targets" and "'foo' matches no module" in error["problems"][0]["message"]


def test_checking_lora_targets_imports_no_torch() -> None:
    result = run_subprocess(PYTHON, "-c", NO_TORCH, "validate", "--model", "meta-llama/Llama-3.1-8B",
                            "--lora-targets", "q_proj,v_prj")
    assert "HEAVY=[] CODE=2" in result.stderr, result.stderr


def test_qlora_sharded_over_several_gpus_is_estimated_but_not_trained(cli) -> None:
    checked = cli("validate", TINY, "--method", "qlora", "--gpus", "2", "--strategy", "fsdp")
    assert checked.code == 0 and "tunecast train refuses it" in " ".join(checked.stderr.split())
    result = cli("train", TINY, "--method", "qlora", "--gpus", "2", "--strategy", "fsdp")
    assert result.code == 2 and "QLoRA's 4-bit weights cannot be sharded" in " ".join(result.stderr.split())


def test_a_torchtune_recipe_with_a_step_cap_validates(cli) -> None:
    result = cli("validate", "--from", "torchtune", str(REPO / "tests/data/runners/torchtune/lora_single_device.yaml"))
    assert result.code == 0, result.stderr
    assert "carried over" in result.stderr
