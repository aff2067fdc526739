"""Other tools on the command line: `--runner`, `--from TOOL FILE`, `train --dry-run`, `export axolotl|llamafactory`,
end to end on the tiny model (its traces take seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.conftest import REPO

TINY = str(REPO / "examples" / "tiny-model")
DATA = REPO / "tests" / "data" / "runners"
SHAPE = ["--micro-batch", "2", "--seq-len", "128", "--device", "cpu"]  # the CPU: no reserve ladder to trace


pytestmark = pytest.mark.usefixtures("profile_cache")


def test_runner_changes_the_estimate_and_says_how(cli) -> None:
    ours = cli("memory", "--model", TINY, "--method", "qlora", *SHAPE, "--json").json()
    theirs = cli("memory", "--model", TINY, "--method", "qlora", *SHAPE, "--runner", "hf-trainer", "--json").json()
    assert (ours["runner"], theirs["runner"]) == ("tunecast", "hf-trainer")
    assert theirs["grad_checkpointing"] is True  # peft's prepare_model_for_kbit_training turns it on
    assert theirs["breakdown_gib"]["weights"] >= ours["breakdown_gib"]["weights"]  # tiny: 0.001 GiB each
    assert any("prepare_model_for_kbit_training" in note for note in theirs["notes"])
    table = cli("memory", "--model", TINY, "--method", "qlora", *SHAPE, "--runner", "hf-trainer")
    assert table.code == 0 and "as hf-trainer runs it" in table.stdout


def test_unknown_runner_is_a_user_error(cli) -> None:
    result = cli("memory", "--model", TINY, "--runner", "axolot")
    assert result.code == 2 and "runner" in result.stderr


def test_from_reads_another_tools_config_and_lists_what_it_left(cli) -> None:
    result = cli("memory", "--from", "axolotl", str(DATA / "axolotl" / "lora.yml"), "--model", TINY, *SHAPE, "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert document["runner"] == "axolotl" and document["method"] == "lora"
    assert document["from"]["tool"] == "axolotl" and document["from"]["mapped_keys"]["lora_r"] == ["lora.rank"]
    reasons = {item["key"]: item["reason"] for item in document["unmapped_keys"]}
    assert "logging_steps" in reasons and all(reasons.values())
    text = cli("memory", "--from", "axolotl", str(DATA / "axolotl" / "lora.yml"), "--model", TINY, *SHAPE)
    assert "logging_steps" in text.stderr and "not" in text.stderr


def test_from_with_a_config_file_or_an_unknown_tool_is_a_user_error(cli) -> None:
    both = cli("memory", str(REPO / "examples" / "tiny-lora.yaml"), "--from", "trl", str(DATA / "trl" / "sft_peft.yaml"))
    assert both.code == 2 and "--from" in both.stderr
    unknown = cli("memory", "--from", "axolotol", str(DATA / "axolotl" / "lora.yml"))
    assert unknown.code == 2 and "did you mean axolotl" in unknown.stderr


def test_train_refuses_another_runner_and_dry_runs_it(cli, tmp_path: Path) -> None:
    config = REPO / "examples" / "tiny-lora.yaml"
    refused = cli("train", str(config), "--runner", "trl", "--output", str(tmp_path / "run"))
    assert refused.code == 2 and "runner" in refused.stderr and not (tmp_path / "run").exists()
    dry = cli("train", str(config), "--dry-run", "--runner", "trl", "--output", str(tmp_path / "run"), "--json")
    assert dry.code == 0, dry.stderr
    document = dry.json()
    assert document["dry_run"] is True and document["runner"] == "trl" and document["device"] == "the CPU"
    assert document["micro_batch"] * document["grad_accum"] == 8 and document["steps"] == 40
    assert document["grad_checkpointing"] is True  # TRL checkpoints by default
    assert document["resume_step"] is None and not (tmp_path / "run").exists()  # nothing written


def test_export_axolotl_reads_back_as_the_same_run(cli, tmp_path: Path) -> None:
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump({
        "model": TINY, "method": "lora", "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]},
        "precision": "bf16", "micro_batch": 2, "grad_accum": 2, "seq_len": 128, "grad_checkpointing": True,
        "gpus": {"gpu": "rtx-4090", "count": 1}}))  # GPU, count and micro-batch fixed: exported as they are
    exported = tmp_path / "axolotl.yml"
    assert cli("export", "axolotl", str(source), "-o", str(exported)).code == 0
    assert yaml.safe_load(exported.read_text())["adapter"] == "lora"
    plain = yaml.safe_load(source.read_text())
    del plain["gpus"]
    source.write_text(yaml.safe_dump(plain))  # a CPU estimate takes no GPU
    direct = cli("memory", str(source), "--runner", "axolotl", "--device", "cpu", "--json").json()
    back = cli("memory", "--from", "axolotl", str(exported), "--device", "cpu", "--json").json()
    for key in ("device_total_gib", "micro_batch", "seq_len", "grad_checkpointing", "method", "runner"):
        assert back[key] == direct[key], key


def test_export_llamafactory_registers_the_dataset_beside_the_file(cli, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text((REPO / "examples" / "data" / "alpaca.jsonl").read_text())
    (data / "dataset_info.json").write_text('{"other": {"file_name": "other.json"}}')
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump({
        "model": TINY, "method": "lora", "micro_batch": 2, "grad_accum": 1, "seq_len": 128,
        "dataset": {"path": "data/train.jsonl"}, "gpus": {"gpu": "rtx-4090", "count": 1}}))
    exported = tmp_path / "lf.yaml"
    result = cli("export", "llamafactory", str(source), "-o", str(exported))
    assert result.code == 0, result.stderr
    document = yaml.safe_load(exported.read_text())
    assert document["dataset"] == "train" and document["per_device_train_batch_size"] == 2
    registered = yaml.safe_load((data / "dataset_info.json").read_text())
    assert set(registered) == {"other", "train"}  # the entry already there is kept
    (data / "dataset_info.json").write_text('{"train": {"file_name": "elsewhere.json"}}')
    clash = cli("export", "llamafactory", str(source), "-o", str(tmp_path / "again.yaml"))
    assert clash.code == 2 and "already names" in clash.stderr


def test_dry_run_deals_the_global_batch_to_the_workers(cli, tmp_path: Path) -> None:
    """`train --gpus 2` starts two workers, each with half of a global batch: the dry run decides as they do."""
    config = yaml.safe_load((REPO / "examples" / "tiny-lora.yaml").read_text())
    del config["grad_accum"]
    config.update(model=TINY, global_batch=8, dataset={"path": str(REPO / "examples" / "data" / "alpaca.jsonl")})
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump(config))
    document = cli("train", str(source), "--dry-run", "--gpus", "2", "--output", str(tmp_path / "run"), "--json").json()
    assert document["micro_batch"] * document["grad_accum"] == 4  # each worker's share of the 8
    assert document["steps_per_epoch"] == 4 and document["steps"] == 40  # 32 examples, 8 per step, 10 epochs
