"""User-facing errors: what went wrong, why, and how to fix it.

Library code raises these; only the CLI turns them into a message and exit status 2.
Anything else that escapes is a bug in tunecast, not a user error.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input.

    `field` is the key as the user wrote it (`lora.rank`, `--seq-len`, `offers.csv:12`), `message`
    says what is wrong and why, `hint` says how to fix it.
    """

    field: str | None
    message: str
    hint: str | None = None
    severity: str = "error"  # "error" stops the command; "warning" is reported and ignored
    location: str | None = None  # where the value came from: "line 7", "--seq-len"

    def as_dict(self) -> dict[str, str | None]:
        return {"field": self.field, "message": self.message, "hint": self.hint,
                "severity": self.severity, "location": self.location}


class TunecastError(Exception):
    """A user error: bad input, a missing file, an unknown name. Exit status 2 in the CLI."""

    def __init__(self, message: str, *, field: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.hint = hint

    @property
    def problems(self) -> list[Problem]:
        return [Problem(self.field, self.message, self.hint)]


class SharedError(TunecastError):
    """A user error that rank 0 of a run found and passed to the other ranks: rank 0 reports it, they only
    exit with its status."""


class ConfigError(TunecastError):
    """Several problems found at once in a configuration (or catalog) file."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        errors = [p for p in problems if p.severity == "error"]
        noun = "problem" if len(errors) == 1 else "problems"
        first = errors[0] if errors else None
        super().__init__(
            f"{source}: {len(errors)} {noun}",
            field=first.field if first else None,
            hint=first.hint if first else None,
        )
        self.source = source
        self.all_problems = problems

    @property
    def problems(self) -> list[Problem]:
        return self.all_problems


def error_document(error: TunecastError) -> dict[str, Any]:
    """The JSON document of a user error, as `--json` prints it and the web planner answers it:
    `{"error": {"message", "field", "hint"}}`, with `problems` when there are several (or the one differs from the
    message)."""
    body: dict[str, Any] = {"message": error.message, "field": error.field, "hint": error.hint}
    if len(error.problems) > 1 or error.problems[0].message != error.message:
        body["problems"] = [p.as_dict() for p in error.problems]
    return {"error": body}


def did_you_mean(word: str, candidates: Iterable[str], *, n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Close matches of `word` among `candidates`, best first, compared case-insensitively."""
    by_lower: dict[str, str] = {}
    for candidate in candidates:
        by_lower.setdefault(candidate.lower(), candidate)
    matches = difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=cutoff)
    return [by_lower[m] for m in matches]


def suggestion_text(word: str, candidates: Iterable[str], *, n: int = 3, cutoff: float = 0.6) -> str | None:
    """'Did you mean X?' / 'Did you mean X, Y or Z?', or None when nothing is close."""
    matches = did_you_mean(word, candidates, n=n, cutoff=cutoff)
    if not matches:
        return None
    if len(matches) == 1:
        return f"Did you mean '{matches[0]}'?"
    quoted = [f"'{m}'" for m in matches]
    return f"Did you mean {', '.join(quoted[:-1])} or {quoted[-1]}?"
