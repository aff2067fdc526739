"""The training data as the loop consumes it: tokenized once, split, ordered per epoch, cut into batches.

* Every example is read and tokenized by `tunecast.data` exactly as `tunecast data` counts it (the same
  formats, chat templates and loss masks), truncated to `seq_len`. Bad rows stop the run with the same
  error as `tunecast data`, or with `dataset.skip_invalid` are skipped and counted.
* `eval.examples` examples are held out: a seeded choice, never trained on.
* Units: the examples themselves, or with `packing` the sequences best-fit-decreasing packs them into.
* The order of an epoch is a permutation of the units drawn from (seed, epoch) alone. A position in the
  data is therefore two integers — the epoch and how many units of it were consumed — and resuming sets
  them directly: no batch is replayed, and nothing depends on how often the run was interrupted.
* A micro-batch is padded on the right to its longest unit. Packed units carry position ids restarting at
  every example, and no attention mask, so that transformers keeps each example's attention to itself.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tunecast.config.spec import RunSpec
from tunecast.data.packing import IGNORE_INDEX, PackedSequence, Tokenized, pack, truncate
from tunecast.data.readers import BadRow
from tunecast.data.stats import bad_rows_error, examples_of
from tunecast.data.tokens import TokenizerCounter
from tunecast.errors import TunecastError


@dataclass(frozen=True)
class Unit:
    """One row of a micro-batch: an example, or a pack of examples."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None  # restarting at each packed example; None for a single example


@dataclass(frozen=True)
class TrainData:
    units: list[Unit]
    eval_units: list[Unit]
    examples: int  # training examples (before packing)
    skipped_rows: int
    untrained_examples: int  # dropped: no trained token within seq_len
    detection: str
    pad_id: int
    eval_examples: int = 0  # held-out examples (before packing: eval_units are packed sequences with packing)

    def epoch_order(self, seed: int, epoch: int) -> list[int]:
        """The units of `epoch` in the order they are trained: a permutation drawn from (seed, epoch) only."""
        return epoch_order(len(self.units), seed, epoch)


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """`count` items in the order `epoch` trains them: a permutation drawn from (seed, epoch) only (a diffusion
    run's images too)."""
    order = list(range(count))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _unit(example: Tokenized) -> Unit:
    labels = [token if trained else IGNORE_INDEX for token, trained in zip(example.ids, example.mask, strict=True)]
    return Unit(example.ids, labels, None)


def _packed_unit(sequence: PackedSequence) -> Unit:
    return Unit(sequence.input_ids, sequence.labels, sequence.position_ids)


def run_data(spec: RunSpec, counter: TokenizerCounter, *, check: Any = None, limit: int | None = None) -> TrainData:
    """The training data of `spec`'s run (its dataset file) as training reads it: load_train_data with the run's
    settings. `spec.dataset.path` must be set."""
    assert spec.dataset.path is not None
    from tunecast.train.model import pad_id

    return load_train_data(spec.dataset.path, counter, layout=spec.dataset.format, train_on=spec.dataset.train_on,
                           seq_len=spec.seq_len, packing=spec.packing, eval_examples=spec.eval.examples,
                           seed=spec.seed, skip_invalid=spec.dataset.skip_invalid, pad_id=pad_id(counter),
                           check=check, limit=limit)


def load_train_data(path: str, counter: TokenizerCounter, *, layout: str, train_on: str, seq_len: int,
                    packing: bool, eval_examples: int, seed: int, skip_invalid: bool, pad_id: int,
                    check: Any = None, limit: int | None = None) -> TrainData:
    """Read, tokenize, split and (optionally) pack the dataset at `path`. `check` is called every few hundred
    examples (the preemption check: tokenizing a large file takes a while). With `limit`, only the first
    `limit` examples are read (a measuring run's slice)."""
    bad: list[BadRow] = []
    detection, examples = examples_of(path, layout=layout, train_on=train_on, bad=bad)
    tokenized: list[Tokenized] = []
    untrained = 0
    for number, example in enumerate(examples, start=1):
        ids, mask = counter.encode(example)
        kept = truncate(Tokenized(ids, mask), seq_len)
        # a trained token needs a token before it: position 0 is never predicted
        if not any(kept.mask[1:]):
            untrained += 1
        else:
            tokenized.append(kept)
        if check is not None and number % 256 == 0:
            check()
        if limit is not None and number >= limit:
            break
    if bad and not skip_invalid:
        raise bad_rows_error(path, bad)
    if len(tokenized) <= eval_examples:
        raise TunecastError(f"{path} has {len(tokenized)} usable examples, not more than eval.examples "
                            f"({eval_examples})", field="eval.examples",
                            hint="lower eval.examples, or use a larger dataset")
    held_out = set(random.Random(seed).sample(range(len(tokenized)), eval_examples)) if eval_examples else set()
    train = [example for index, example in enumerate(tokenized) if index not in held_out]
    evaluation = [example for index, example in enumerate(tokenized) if index in held_out]
    if packing:
        units = [_packed_unit(sequence) for sequence in pack(train, seq_len, seed)]
        eval_units = [_packed_unit(sequence) for sequence in pack(evaluation, seq_len, seed)]
    else:
        units = [_unit(example) for example in train]
        eval_units = [_unit(example) for example in evaluation]
    return TrainData(units, eval_units, len(train), len(bad), untrained, detection.explanation, pad_id, len(evaluation))


@dataclass(frozen=True)
class Batch:
    """A micro-batch as tensors, and what it counts."""

    input_ids: torch.Tensor  # (batch, longest)
    labels: torch.Tensor  # (batch, longest), IGNORE_INDEX where no loss
    attention_mask: torch.Tensor | None  # (batch, longest); None when nothing is padded, or packed
    position_ids: torch.Tensor | None  # (batch, longest) for packed units
    tokens: int  # real (non-padding) tokens
    padded_tokens: int  # tokens computed: batch × longest

    @property
    def trained_tokens(self) -> int:
        """Positions whose next token counts in the loss (the loss shifts labels by one)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def to(self, device: torch.device) -> Batch:
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device, non_blocking=True)

        return Batch(self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                     move(self.attention_mask), move(self.position_ids), self.tokens, self.padded_tokens)


def collate(units: list[Unit], pad_id: int) -> Batch:
    """Units padded on the right to the longest. Padding of packed rows gets positions of its own (a
    separate 'example' that no real token attends to, and that has no loss)."""
    longest = max(len(unit.input_ids) for unit in units)
    ids, labels, mask, positions = [], [], [], []
    packed = any(unit.position_ids is not None for unit in units)
    for unit in units:
        padding = longest - len(unit.input_ids)
        ids.append(unit.input_ids + [pad_id] * padding)
        labels.append(unit.labels + [IGNORE_INDEX] * padding)
        mask.append([1] * len(unit.input_ids) + [0] * padding)
        own = unit.position_ids if unit.position_ids is not None else list(range(len(unit.input_ids)))
        positions.append(own + list(range(padding)))
    tokens = sum(len(unit.input_ids) for unit in units)
    padded = any(len(unit.input_ids) < longest for unit in units)
    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long) if padded and not packed else None,
        position_ids=torch.tensor(positions, dtype=torch.long) if packed else None,
        tokens=tokens,
        padded_tokens=len(units) * longest,
    )


def micro_batches(data: TrainData, order: list[int], start: int, *, micro_batch: int, grad_accum: int
                  ) -> list[list[Unit]]:
    """The micro-batches of the optimizer step that starts at `start` in an epoch's `order` (the last step
    of an epoch may have fewer, or a smaller last micro-batch)."""
    chosen = order[start:start + micro_batch * grad_accum]
    return [[data.units[i] for i in chosen[at:at + micro_batch]] for at in range(0, len(chosen), micro_batch)]


def rank_passes(micro: list[list[Unit]], *, rank: int, world: int) -> list[list[Unit] | None]:
    """This rank's share of a step's micro-batches: micro-batch k goes to rank k mod `world`. Every rank gets
    as many passes as the busiest one, so that each runs the collectives of every pass; a pass with no
    micro-batch left (the short last step of an epoch) is None, run on a stand-in batch whose loss counts for
    nothing. One process gets them all, in order."""
    passes = -(-len(micro) // world)
    return [micro[k] if (k := at * world + rank) < len(micro) else None for at in range(passes)]


def eval_batches(data: TrainData, micro_batch: int, *, rank: int = 0, world: int = 1) -> Iterator[list[Unit] | None]:
    """This rank's share of the held-out micro-batches (rank_passes' rule)."""
    chunks = [data.eval_units[at:at + micro_batch] for at in range(0, len(data.eval_units), micro_batch)]
    yield from rank_passes(chunks, rank=rank, world=world)
