"""Best-fit-decreasing packing and the batch layouts' contract."""

import random

from tunecast.data.packing import IGNORE_INDEX, Tokenized, best_fit_decreasing, pack, pad_batch


def test_every_example_placed_once_and_no_bin_overflows() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 3000) for _ in range(2000)]
    bins = best_fit_decreasing(lengths, 2048)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(min(lengths[i], 2048) for i in b) <= 2048 for b in bins)


def test_best_fit_decreasing_on_a_known_case() -> None:
    # Decreasing: 7 opens bin A, 5 opens B, 4 fits B (best: 1 left… A has 3, B has 5 → B leaves 1), 3 fits A.
    assert best_fit_decreasing([3, 7, 4, 5], 10) == [[1, 0], [3, 2]]
    assert best_fit_decreasing([], 10) == []


def test_deterministic() -> None:
    lengths = [random.Random(1).randint(1, 500) for _ in range(300)]
    assert best_fit_decreasing(lengths, 512) == best_fit_decreasing(lengths, 512)


def test_packed_sequences_follow_the_collator_contract() -> None:
    examples = [Tokenized([1, 2, 3], [False, True, True]), Tokenized([4, 5], [True, True]),
                Tokenized(list(range(10, 20)), [True] * 10)]
    packs = pack(examples, seq_len=6, seed=0)
    assert sum(len(p.input_ids) for p in packs) == 3 + 2 + 6  # the long one truncated to 6
    for packed in packs:
        assert len(packed.input_ids) == len(packed.labels) == len(packed.position_ids) <= 6
        assert sum(packed.seq_lengths) == len(packed.input_ids)
        start = 0
        for length in packed.seq_lengths:
            assert packed.position_ids[start:start + length] == list(range(length))
            assert packed.labels[start] == IGNORE_INDEX  # never trained to predict the next example's start
            start += length
    first_two = next(p for p in packs if p.seq_lengths == [3, 2])
    assert first_two.labels == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5]
    assert pack(examples, seq_len=6, seed=0) == packs


def test_padded_batch() -> None:
    batch = pad_batch([Tokenized([1, 2, 3], [False, True, True]), Tokenized([4], [True])], seq_len=8, pad_id=0)
    assert batch.input_ids == [[1, 2, 3], [4, 0, 0]]
    assert batch.labels == [[IGNORE_INDEX, 2, 3], [4, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.attention_mask == [[1, 1, 1], [1, 0, 0]]
