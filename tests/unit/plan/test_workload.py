"""The workload's padding: measured lengths are padded as the run pads them; a declared size is padded as the
assumed length distribution would be (and says so), never left unpadded."""

from __future__ import annotations

from array import array

import pytest

from tunecast.catalog.store import load_catalog
from tunecast.plan.workload import Workload, assumed_lengths


def declared(mean: int, seq_len: int, *, packed: bool = False) -> Workload:
    sigma = load_catalog(None).throughput.get("declared_length_sigma")
    return Workload(8000, 8000 * mean, 8000 * mean, 1, seq_len, packed, False, "declared", 0, length_sigma=sigma)


def test_a_declared_size_pads_as_the_measured_orca_math_runs_did() -> None:
    # the catalog row's source: 289.3 real tokens per example padded to 445 (micro-batch 4) and 524 (8)
    workload = declared(289, 4096)
    assert workload.tokens_per_sequence(1) == pytest.approx(289, rel=0.01)
    assert workload.tokens_per_sequence(4) / 289 == pytest.approx(445 / 289.3, rel=0.03)
    assert workload.tokens_per_sequence(8) / 289 == pytest.approx(524 / 289.3, rel=0.03)
    assert workload.real_fraction(8) == pytest.approx(289.3 / 524, rel=0.03)
    assert "log-normal" in workload.as_dict()["padding_assumption"]


def test_truncation_caps_the_padding_and_packing_has_none() -> None:
    assert declared(600, 700).tokens_per_sequence(16) <= 700
    assert declared(600, 2048).tokens_per_sequence(16) > 700
    packed = declared(600, 2048, packed=True)
    assert packed.tokens_per_sequence(16) == 2048 and packed.as_dict()["padding_assumption"] is None


def test_assumed_lengths_keep_the_declared_mean() -> None:
    lengths = assumed_lengths(300, 0.46, 100_000)
    assert sum(lengths) / len(lengths) == pytest.approx(300, rel=0.01)


def test_measured_lengths_are_padded_to_the_longest_of_each_micro_batch() -> None:
    workload = Workload(4, 10, 10, 1, 64, False, True, "file", 0, array("i", [1, 2, 3, 4]), seed=0)
    assert workload.tokens_per_sequence(4) == 4 and workload.tokens_per_sequence(1) == 2.5


def test_a_declared_spread_replaces_the_assumed_one(tmp_path) -> None:
    from tunecast.config.load import load_spec
    from tunecast.plan.workload import workload_for

    catalog = load_catalog(None)
    run = tmp_path / "run.yaml"
    for spread, padded in ((None, True), (0, False), (0.2, True)):
        extra = "" if spread is None else f"  length_spread: {spread}\n"
        run.write_text("model: openai-community/gpt2\nseq_len: 1024\nmicro_batch: 8\n"
                       f"dataset:\n  examples: 1000\n  mean_tokens: 300\n{extra}")
        workload = workload_for(load_spec(run, [], catalog), catalog)
        assert (workload.tokens_per_sequence(8) > 300 * 1.05) is padded
        said = workload.as_dict()["padding_assumption"]
        assert ("dataset.length_spread" in said) is (spread is not None)
    assert declared(300, 1024).tokens_per_sequence(8) > Workload(
        8000, 8000 * 300, 8000 * 300, 1, 1024, False, False, "declared", 0, length_sigma=0.2).tokens_per_sequence(8)
