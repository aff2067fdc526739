"""Dataset statistics in one streaming pass: what the planner uses to turn a dataset into tokens, and what
`tunecast data` shows. Memory use is a few bytes per example (the lengths), whatever the file size.

* processed tokens (`total_tokens`): every token a step computes, prompts included, after truncation at
  `seq_len`; `trained_tokens`: those that count in the loss.
* padding: micro-batches of `micro_batch` examples in a seeded random order (as a shuffling sampler draws
  them), each padded to its longest example: efficiency = real tokens ÷ padded tokens.
* packing: examples (truncated) placed into `seq_len` sequences by best-fit decreasing: efficiency = real
  tokens ÷ (sequences × seq_len).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tunecast.data.formats import Detection, Example, detect_format, to_example
from tunecast.data.packing import best_fit_decreasing
from tunecast.data.readers import BadRow, Row, read_rows
from tunecast.data.tokens import TokenCounter
from tunecast.errors import ConfigError, Problem

MAX_REPORTED_BAD_ROWS = 20


@dataclass
class DatasetStats:
    source: str
    format: str
    detection: str
    tokenizer: str
    tokenizer_exact: bool
    seq_len: int
    micro_batch: int
    examples: int
    total_tokens: int
    trained_tokens: int
    untruncated_tokens: int
    truncated_examples: int
    truncated_tokens: int
    length_percentiles: dict[str, int]
    histogram: list[dict[str, int]]
    padded_tokens: int
    padding_efficiency: float
    packed_sequences: int
    packing_efficiency: float
    skipped_rows: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    kept_lengths: array[int] | None = field(default=None, repr=False)  # per example, after truncation

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "format": self.format, "detection": self.detection,
            "tokenizer": self.tokenizer, "tokenizer_exact": self.tokenizer_exact,
            "seq_len": self.seq_len, "micro_batch": self.micro_batch, "examples": self.examples,
            "total_tokens": self.total_tokens, "trained_tokens": self.trained_tokens,
            "untruncated_tokens": self.untruncated_tokens, "truncated_examples": self.truncated_examples,
            "truncated_tokens": self.truncated_tokens, "length_percentiles": self.length_percentiles,
            "histogram": self.histogram, "padded_tokens": self.padded_tokens,
            "padding_efficiency": round(self.padding_efficiency, 4), "packed_sequences": self.packed_sequences,
            "packing_efficiency": round(self.packing_efficiency, 4), "skipped_rows": self.skipped_rows,
            "skipped": self.skipped,
        }


def _percentile(sorted_values: array[int], fraction: float) -> int:
    """Nearest-rank percentile."""
    if not sorted_values:
        return 0
    rank = max(1, min(len(sorted_values), int(-(-fraction * len(sorted_values) // 1))))
    return sorted_values[rank - 1]


def _histogram(sorted_values: array[int], seq_len: int) -> list[dict[str, int]]:
    """Counts in power-of-two length bins, with one bin for lengths above seq_len."""
    if not sorted_values:
        return []
    bins: list[dict[str, int]] = []
    low = 0
    high = 64
    index = 0
    top = sorted_values[-1]
    while low <= top:
        limit = min(high, seq_len + 1) if low <= seq_len else top + 1
        count = 0
        while index < len(sorted_values) and sorted_values[index] < limit:
            count += 1
            index += 1
        bins.append({"from": low, "to": limit - 1, "examples": count})
        low = limit
        high = limit * 2 if limit < seq_len else top + 1
    return bins


def padded_tokens(lengths: array[int], micro_batch: int, seed: int) -> int:
    """Tokens computed when micro-batches of shuffled examples are padded to their longest."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    total = 0
    for start in range(0, len(order), micro_batch):
        batch = order[start:start + micro_batch]
        total += len(batch) * max(lengths[i] for i in batch)
    return total


def examples_of(source: str, *, layout: str, train_on: str, bad: list[BadRow]) -> tuple[Detection, Iterator[Example]]:
    """The examples of a file, after format detection; bad rows go to `bad` (the caller decides)."""
    rows = read_rows(source)
    head: list[Row | BadRow] = []
    for item in rows:
        head.append(item)
        if len(head) >= 1000:
            break
    if layout == "auto":
        detection = detect_format(r.data for r in head if isinstance(r, Row))
    else:
        detection = Detection(layout, f"format {layout} (set in the config)")
    mode = "completion" if train_on == "auto" else train_on
    if detection.format == "text" and train_on == "auto":
        mode = "all"

    def generate() -> Iterator[Example]:
        for item in _chain(head, rows):
            example = item if isinstance(item, BadRow) else to_example(item, detection.format, mode)
            if isinstance(example, BadRow):
                bad.append(example)
                continue
            yield example

    return detection, generate()


def _chain(first: list[Row | BadRow], rest: Iterator[Row | BadRow]) -> Iterator[Row | BadRow]:
    yield from first
    yield from rest


def bad_rows_error(source: str, bad: list[BadRow]) -> ConfigError:
    problems = [Problem(row.field, row.message, row.hint, location=f"{source}, {row.where}")
                for row in bad[:MAX_REPORTED_BAD_ROWS]]
    if len(bad) > MAX_REPORTED_BAD_ROWS:
        problems.append(Problem(None, f"and {len(bad) - MAX_REPORTED_BAD_ROWS} more invalid rows",
                                "pass --skip-invalid to skip and count them"))
    return ConfigError(f"{source}: {len(bad)} invalid row{'s' if len(bad) != 1 else ''}", problems)


def measure(source: str, counter: TokenCounter, *, seq_len: int, micro_batch: int, layout: str = "auto",
            train_on: str = "auto", skip_invalid: bool = False, seed: int = 42,
            progress: Callable[[int], None] | None = None) -> DatasetStats:
    """Statistics of the dataset at `source` under `counter`. Invalid rows raise ConfigError listing them,
    unless `skip_invalid`, when they are counted and reported instead."""
    bad: list[BadRow] = []
    detection, examples = examples_of(source, layout=layout, train_on=train_on, bad=bad)
    lengths = array("I")  # untruncated tokens per example
    kept_lengths = array("I")
    total = trained = untruncated = truncated_examples = 0
    for number, example in enumerate(examples, start=1):
        counted = counter.count(example, seq_len)
        lengths.append(counted.tokens)
        kept_lengths.append(counted.kept)
        total += counted.kept
        trained += counted.trained_kept
        untruncated += counted.tokens
        truncated_examples += counted.tokens > seq_len
        if progress is not None and number % 10_000 == 0:
            progress(number)
    if bad and not skip_invalid:
        raise bad_rows_error(source, bad)
    if not lengths:
        raise ConfigError(source, [Problem("dataset.path", "has no valid examples",
                                           "check the file and its format")])
    ordered = array("I", sorted(lengths))
    padded = padded_tokens(kept_lengths, micro_batch, seed)
    bins = best_fit_decreasing(kept_lengths, seq_len)
    return DatasetStats(
        source=source, format=detection.format, detection=detection.explanation,
        tokenizer=counter.description, tokenizer_exact=counter.exact, seq_len=seq_len, micro_batch=micro_batch,
        examples=len(lengths), total_tokens=total, trained_tokens=trained, untruncated_tokens=untruncated,
        truncated_examples=truncated_examples, truncated_tokens=untruncated - total,
        length_percentiles={"p50": _percentile(ordered, 0.5), "p90": _percentile(ordered, 0.9),
                            "p99": _percentile(ordered, 0.99), "max": ordered[-1]},
        histogram=_histogram(ordered, seq_len), padded_tokens=padded, padding_efficiency=total / padded,
        packed_sequences=len(bins), packing_efficiency=total / (len(bins) * seq_len),
        skipped_rows=len(bad),
        skipped=[{"where": row.where, "field": row.field, "message": row.message}
                 for row in bad[:MAX_REPORTED_BAD_ROWS]],
        kept_lengths=kept_lengths,
    )

