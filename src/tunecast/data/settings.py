"""Checks of `tunecast data`'s options, with the RunSpec's own vocabulary of formats."""

from __future__ import annotations

import typing

from tunecast.config.spec import DatasetFormat, TrainOn
from tunecast.errors import ConfigError, Problem, suggestion_text


def validate_data_options(*, layout: str, seq_len: int, micro_batch: int, train_on: str) -> None:
    problems: list[Problem] = []
    formats = typing.get_args(DatasetFormat)
    if layout not in formats:
        problems.append(Problem("--format", f"unknown format {layout!r}",
                                suggestion_text(layout, formats) or f"use one of: {', '.join(formats)}"))
    modes = typing.get_args(TrainOn)
    if train_on not in modes:
        problems.append(Problem("--train-on", f"unknown value {train_on!r}", f"use one of: {', '.join(modes)}"))
    if seq_len < 1:
        problems.append(Problem("--seq-len", f"must be ≥ 1 (got {seq_len})", "for example --seq-len 2048"))
    if micro_batch < 1:
        problems.append(Problem("--micro-batch", f"must be ≥ 1 (got {micro_batch})", "for example --micro-batch 4"))
    if problems:
        raise ConfigError("options", problems)
