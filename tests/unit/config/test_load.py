"""Loading a RunSpec: YAML with line numbers, overrides, and every problem reported at once."""

from pathlib import Path

import pytest
from tests.unit.config.helpers import problems_of

from tunecast.config.load import Override, load_spec, parse_set
from tunecast.errors import ConfigError, TunecastError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_three_mistakes_are_reported_together_with_keys_lines_and_fixes(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\nlora:\n  rnak: 16\nseq_len: -5\ngpus:\n  gpu: h1000\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    found = problems_of(error)
    assert set(found) == {"lora.rnak", "seq_len", "gpus.gpu"}
    assert found["lora.rnak"].startswith("line 3: unknown key") and "Did you mean 'lora.rank'?" in found["lora.rnak"]
    assert found["seq_len"].startswith("line 4: must be ≥ 1 (got -5)") and "for example 2048" in found["seq_len"]
    assert found["gpus.gpu"].startswith("line 6: unknown GPU 'h1000'") and "h100-sxm" in found["gpus.gpu"]


def test_a_key_of_another_section_points_to_its_section(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\nrank: 16\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert "lora.rank" in problems_of(error)["rank"]


def test_bad_choice_suggests_the_close_one(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\nmethod: lorra\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert "must be one of: full, lora, qlora (got 'lorra')" in problems_of(error)["method"]
    assert "Did you mean 'lora'" in problems_of(error)["method"]


def test_duplicate_keys_are_an_error_not_a_silent_override(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\nseq_len: 512\nseq_len: 1024\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert "appears twice (lines 2 and 3)" in problems_of(error)["seq_len"]


def test_yaml_syntax_error_names_the_line(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: m\nlora:\n  rank: [16\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert any("YAML syntax error" in p.message for p in error.value.problems)


def test_missing_model_names_the_flag(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(None, [Override("seq_len", 512, "--seq-len")], catalog)
    assert "--model" in problems_of(error)["model"]


def test_unknown_model_suggests_catalog_names_and_how_to_fetch_it(catalog) -> None:
    with pytest.raises(ConfigError) as error:
        load_spec(None, [Override("model", "meta-llama/Llama-3.1-8b-chat", "--model")], catalog)
    text = problems_of(error)["model"]
    assert "meta-llama/Llama-3.1-8B" in text and "HF_HUB_OFFLINE" in text  # the suite runs offline


def test_overrides_apply_on_top_of_the_file_and_name_their_flag(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\nseq_len: 512\n")
    loaded = load_spec(path, [Override("seq_len", 4096, "--seq-len"), parse_set("lora.dropout=0.1"),
                              parse_set("lora.targets=q_proj,v_proj"), parse_set("packing=true")], catalog)
    assert loaded.spec.seq_len == 4096
    assert loaded.spec.lora.dropout == 0.1 and loaded.spec.lora.targets == ["q_proj", "v_proj"]
    assert loaded.spec.packing is True
    with pytest.raises(ConfigError) as error:
        load_spec(path, [Override("seq_len", 0, "--seq-len")], catalog)
    assert problems_of(error)["seq_len"].startswith("--seq-len:")


def test_set_needs_key_and_value() -> None:
    with pytest.raises(TunecastError, match="key=value"):
        parse_set("lora.dropout")


def test_gpu_alias_is_resolved_to_its_slug(catalog) -> None:
    loaded = load_spec(None, [Override("model", "meta-llama/Llama-3.1-8B", "--model"),
                              Override("gpus.gpu", "A100:80GB", "--gpu")], catalog)
    assert loaded.spec.gpus.gpu == "a100-80gb" and loaded.gpu is not None


@pytest.mark.parametrize(("settings", "field", "text"), [
    ({"grad_accum": 4, "global_batch": 64}, "global_batch", "one follows from the other"),
    ({"micro_batch": 3, "global_batch": 64}, "global_batch", "set global_batch to 63 or 66"),
    ({"warmup_steps": 10, "warmup_ratio": 0.1}, "warmup_ratio", "keep one"),
    ({"optimizer_in_backward": True, "grad_accum": 4}, "optimizer_in_backward", "cannot be accumulated"),
    ({"method": "qlora", "precision": "fp8"}, "precision", "4-bit"),
    ({"attention": "flash", "precision": "fp32"}, "attention", "bf16 or fp16"),
    ({"gpus": {"offload": "optimizer"}}, "gpus.offload", "sharded strategy"),
    ({"gpus": {"strategy": "zero2", "offload": "params"}}, "gpus.offload", "fsdp or zero3"),
    ({"dataset": {"examples": 100}}, "dataset.mean_tokens", "is needed"),
    ({"dataset": {"mean_tokens": 100}}, "dataset.examples", "is needed"),
    ({"dataset": {"examples": 10, "mean_tokens": 100, "mean_trained_tokens": 200}}, "dataset.mean_trained_tokens",
     "exceeds"),
    ({"dataset": {"path": "train.jsonl", "length_spread": 0}}, "dataset.length_spread", "declared size"),
    ({"gpus": {"gpu": "l4"}, "precision": "fp8"}, None, None),
    ({"gpus": {"gpu": "a100-80gb"}, "precision": "fp8"}, "precision", "FP8 tensor cores"),
    ({"pricing": {"providers": ["lamda"]}}, "pricing.providers[0]", "Did you mean 'lambda'"),
])
def test_cross_field_rules(tmp_path, catalog, settings, field, text) -> None:  # type: ignore[no-untyped-def]
    import yaml

    path = write(tmp_path, yaml.safe_dump({"model": "meta-llama/Llama-3.1-8B", **settings}))
    if field is None:
        load_spec(path, [], catalog)
        return
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert text in problems_of(error)[field]


def test_cross_field_rules_still_run_when_another_field_is_bad(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\nseq_len: x\ngrad_accum: 2\nglobal_batch: 16\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert set(problems_of(error)) == {"seq_len", "global_batch"}


def test_relative_paths_in_the_file_are_relative_to_the_file(tmp_path, catalog) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    config = tmp_path / "configs"
    config.mkdir()
    path = config / "run.yaml"
    path.write_text("model: meta-llama/Llama-3.1-8B\ndataset:\n  path: ../data/train.jsonl\noutput: out\n")
    loaded = load_spec(path, [], catalog)
    assert loaded.spec.dataset.path == str(tmp_path / "data" / "train.jsonl")
    assert loaded.spec.output == str(config / "out")


def test_missing_dataset_file_is_an_error(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\ndataset:\n  path: nowhere.jsonl\n")
    with pytest.raises(ConfigError) as error:
        load_spec(path, [], catalog)
    assert "does not exist" in problems_of(error)["dataset.path"]


def test_full_with_lora_section_is_a_warning_not_an_error(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\nmethod: full\nlora:\n  rank: 4\n")
    loaded = load_spec(path, [], catalog)
    assert [w.field for w in loaded.warnings] == ["lora"]


def test_missing_config_file_says_how_to_start(tmp_path, catalog) -> None:
    with pytest.raises(TunecastError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml", [], catalog)


def test_an_eval_interval_without_examples_is_a_warning(tmp_path, catalog) -> None:
    path = write(tmp_path, "model: meta-llama/Llama-3.1-8B\neval:\n  every_steps: 100\n")
    loaded = load_spec(path, [], catalog)
    [warning] = loaded.warnings
    assert warning.field == "eval.every_steps" and "no effect" in warning.message


def test_another_tools_file_keeps_a_repeated_keys_last_value_with_a_warning() -> None:
    from tunecast.config.yamlfile import read_yaml

    data, lines, problems = read_yaml("a:\n  b: 1\n  c: 2\na:\n  b: 3\n", last_wins=True)
    assert data == {"a": {"b": 3}} and lines == {"a": 4, "a.b": 5}
    assert [(p.field, p.severity) for p in problems] == [("a", "warning")]
    _, _, refused = read_yaml("a: 1\na: 2\n")
    assert [(p.field, p.severity) for p in refused] == [("a", "error")]
