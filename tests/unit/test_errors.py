from tunecast.errors import ConfigError, Problem, did_you_mean, suggestion_text


def test_did_you_mean_ignores_case_and_keeps_original_spelling() -> None:
    assert did_you_mean("RNAK", ["rank", "alpha"]) == ["rank"]


def test_suggestion_text_lists_up_to_three() -> None:
    assert suggestion_text("lora", ["lora", "qlora", "full"]) == "Did you mean 'lora' or 'qlora'?"
    assert suggestion_text("zzz", ["rank"]) is None


def test_config_error_counts_only_errors_and_leads_with_the_first() -> None:
    error = ConfigError("run.yaml", [
        Problem("lora", "ignored", severity="warning"),
        Problem("seq_len", "must be ≥ 1", "set it to 2048"),
    ])
    assert error.message == "run.yaml: 1 problem"
    assert error.field == "seq_len"
    assert len(error.problems) == 2
