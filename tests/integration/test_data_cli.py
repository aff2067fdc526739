"""`tunecast data` end to end on the bundled samples and on broken files."""

from pathlib import Path

import pytest
from tests.conftest import REPO

SAMPLES = sorted(p for p in (REPO / "examples" / "data").iterdir() if not p.name.startswith("."))
KEYS = {"examples", "total_tokens", "trained_tokens", "truncated_examples", "length_percentiles",
        "padding_efficiency", "packing_efficiency", "tokenizer", "schema_version"}


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name for p in SAMPLES])
def test_every_sample_is_measured(cli, sample: Path) -> None:
    document = cli("data", str(sample), "--seq-len", "64", "--micro-batch", "4", "--json").json()
    assert set(document) >= KEYS
    assert set(document["length_percentiles"]) == {"p50", "p90", "p99", "max"}
    assert 0 < document["trained_tokens"] <= document["total_tokens"]
    assert 0 < document["padding_efficiency"] <= 1 and 0 < document["packing_efficiency"] <= 1
    human = cli("data", str(sample), "--seq-len", "64")
    assert human.code == 0 and "processed tokens" in human.stdout and "detected" in human.stdout


def test_formats_are_detected(cli) -> None:
    detected = {p.name: cli("data", str(p), "--json").json()["format"] for p in SAMPLES}
    assert detected == {"alpaca.json": "alpaca", "alpaca.jsonl": "alpaca", "alpaca.parquet": "alpaca",
                        "messages.jsonl": "messages", "prompt-completion.csv": "prompt-completion",
                        "prompt-completion.jsonl": "prompt-completion", "sharegpt.json": "sharegpt",
                        "text-saved": "text", "text.jsonl": "text"}


def test_alpaca_as_one_array_and_as_jsonl_give_the_same_counts(cli) -> None:
    array = cli("data", str(REPO / "examples/data/alpaca.json"), "--json").json()
    lines = cli("data", str(REPO / "examples/data/alpaca.jsonl"), "--json").json()
    for document in (array, lines):
        document.pop("source")
    assert array == lines


BROKEN = ('{"instruction": "a", "input": "", "output": "b"}\n'
          '{"instruction": "c", "input": "", "output": "d"}\n'
          '{"instruction": "e", "input": "", "output": \n'
          '{"instruction": "g", "input": "", "output": "h"}\n'
          '{"instruction": "i", "input": ""}\n'
          '{"instruction": "k", "input": "", "output": "l"}\n')


def test_broken_rows_stop_with_both_line_numbers(cli, tmp_path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(BROKEN)
    result = cli("data", str(path))
    assert result.code == 2 and "Traceback" not in result.stderr
    assert "line 3" in result.stderr and "not valid JSON" in result.stderr
    assert "line 5" in result.stderr and "has no 'output' field" in result.stderr
    assert "--skip-invalid" in result.stderr
    document = cli("data", str(path), "--json").json()
    assert [p["location"].split(", ")[-1] for p in document["error"]["problems"]] == ["line 3", "line 5"]


def test_skip_invalid_reports_the_rows_and_counts_the_rest(cli, tmp_path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(BROKEN)
    result = cli("data", str(path), "--skip-invalid", "--json")
    assert result.code == 0
    document = result.json()
    assert document["examples"] == 4 and document["skipped_rows"] == 2
    assert [s["where"] for s in document["skipped"]] == ["line 3", "line 5"]
    human = cli("data", str(path), "--skip-invalid")
    assert "Skipped 2 invalid row(s)" in human.stderr and "line 3" in human.stderr


def test_bad_options_are_user_errors(cli) -> None:
    result = cli("data", str(REPO / "examples/data/text.jsonl"), "--format", "alpacca", "--seq-len", "0")
    assert result.code == 2 and "Did you mean 'alpaca'" in result.stderr and "--seq-len" in result.stderr


def test_a_missing_file(cli, tmp_path) -> None:
    result = cli("data", str(tmp_path / "nope.jsonl"))
    assert result.code == 2 and "does not exist" in result.stderr


def test_a_run_config_is_measured_with_its_dataset_settings_and_tokenizer(cli, tmp_path) -> None:
    config = REPO / "examples" / "tiny-lora.yaml"
    from_config = cli("data", str(config), "--json").json()
    by_hand = cli("data", str(REPO / "examples/data/alpaca.jsonl"), "--tokenizer", str(REPO / "examples/tiny-model"),
                  "--seq-len", "256", "--micro-batch", "4", "--json").json()
    assert from_config == by_hand  # the config's file, tokenizer, seq_len and micro_batch
    assert from_config["tokenizer_exact"] is True
    shorter = cli("data", str(config), "--seq-len", "32", "--json").json()  # a flag still wins over the config
    assert shorter["seq_len"] == 32 and shorter["micro_batch"] == 4
    bare = tmp_path / "run.yaml"
    bare.write_text("model: meta-llama/Llama-3.1-8B\n")
    result = cli("data", str(bare))
    assert result.code == 2 and "has no dataset.path" in result.stderr
