"""Packing examples into fixed-length sequences (best-fit decreasing), and the two batch layouts the trainer
feeds the model.

Packed batches — the collator's contract:

* `input_ids` (1, total): the examples of the pack, one after another, no padding between them;
* `position_ids` (1, total): 0, 1, 2, … restarting at 0 at every example. transformers reads a restart as
  the start of a new sequence (its `find_packed_sequence_indices`) and builds a block-diagonal causal mask
  (or passes cumulative lengths to flash-attention), so an example never attends to another;
* `labels` (1, total): the token ids where the loss counts, -100 elsewhere — and -100 on each example's
  first token, so that no example is trained to predict the start of the next;
* `seq_lengths`: the examples' lengths, in order (their sum is the pack's length).

Padded batches: `input_ids` and `labels` (b, longest) padded on the right with the pad id and -100, and an
`attention_mask` of 1 for real tokens and 0 for padding.

Everything here is deterministic: ties are broken by example order, and the order of packs by `seed`.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

IGNORE_INDEX = -100


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`: longest first, each into the bin it
    fills most tightly. Lengths above `capacity` are placed as `capacity` (they are truncated)."""
    order = sorted(range(len(lengths)), key=lambda i: (-min(lengths[i], capacity), i))
    bins: list[list[int]] = []
    # Free space → bins with that much free space (first opened first). Free space takes at most
    # capacity + 1 distinct values, so the sorted list of them stays short.
    by_space: dict[int, deque[int]] = {}
    spaces: list[int] = []
    for index in order:
        size = min(lengths[index], capacity)
        position = bisect.bisect_left(spaces, size)
        if position < len(spaces):
            space = spaces[position]
            waiting = by_space[space]
            chosen = waiting.popleft()
            if not waiting:
                del by_space[space]
                spaces.pop(position)
        else:
            chosen, space = len(bins), capacity
            bins.append([])
        bins[chosen].append(index)
        left = space - size
        if left > 0:
            if left not in by_space:
                bisect.insort(spaces, left)
                by_space[left] = deque()
            by_space[left].append(chosen)
    return bins


@dataclass(frozen=True)
class Tokenized:
    ids: list[int]
    mask: list[bool]  # True where the token counts in the loss


@dataclass(frozen=True)
class PackedSequence:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    seq_lengths: list[int]


def truncate(example: Tokenized, seq_len: int) -> Tokenized:
    return Tokenized(example.ids[:seq_len], example.mask[:seq_len])


def pack(examples: Sequence[Tokenized], seq_len: int, seed: int) -> list[PackedSequence]:
    """Examples (truncated to seq_len) packed into sequences of at most seq_len tokens."""
    kept = [truncate(example, seq_len) for example in examples]
    bins = best_fit_decreasing([len(example.ids) for example in kept], seq_len)
    random.Random(seed).shuffle(bins)
    packs = []
    for members in bins:
        input_ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        lengths: list[int] = []
        for index in sorted(members):
            example = kept[index]
            input_ids += example.ids
            example_labels = [token if trained else IGNORE_INDEX for token, trained in zip(example.ids, example.mask,
                                                                                           strict=True)]
            if example_labels:
                example_labels[0] = IGNORE_INDEX
            labels += example_labels
            positions += list(range(len(example.ids)))
            lengths.append(len(example.ids))
        packs.append(PackedSequence(input_ids, labels, positions, lengths))
    return packs


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: list[list[int]]
    labels: list[list[int]]
    attention_mask: list[list[int]]


def pad_batch(examples: Sequence[Tokenized], seq_len: int, pad_id: int) -> PaddedBatch:
    """A micro-batch padded on the right to its longest (truncated) example."""
    kept = [truncate(example, seq_len) for example in examples]
    longest = max(len(example.ids) for example in kept)
    input_ids, labels, attention = [], [], []
    for example in kept:
        padding = longest - len(example.ids)
        input_ids.append(example.ids + [pad_id] * padding)
        labels.append([t if m else IGNORE_INDEX for t, m in zip(example.ids, example.mask, strict=True)]
                      + [IGNORE_INDEX] * padding)
        attention.append([1] * len(example.ids) + [0] * padding)
    return PaddedBatch(input_ids, labels, attention)
