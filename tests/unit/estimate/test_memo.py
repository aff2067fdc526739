"""The estimator's memos of a config's pure functions: the same config (any copy of it) finds its results, an edited
one does not."""

from __future__ import annotations

import copy

from tests.models import tiny_llama

from tunecast.estimate.memo import Memo, config_digest


def test_a_config_is_digested_by_its_contents() -> None:
    config = tiny_llama()
    digest = config_digest(config)
    assert config_digest(copy.deepcopy(config)) == digest == config_digest(config)
    config["hidden_size"] = 128  # edited in place after it was digested
    assert config_digest(config) != digest
    assert config_digest(tiny_llama(hidden_size=128)) == config_digest(config)


def test_a_memo_computes_once_per_key_and_always_for_keys_it_cannot_hold() -> None:
    memo, calls = Memo(), []

    def compute() -> int:
        calls.append(1)
        return len(calls)

    assert memo.get(("a", 1), compute) == memo.get(("a", 1), compute) == 1
    assert memo.get(("b", [1]), compute) == 2 and memo.get(("b", [1]), compute) == 3  # a list: no key
