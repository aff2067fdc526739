"""Output: JSON documents on stdout (and nothing else there), human text and tables via Rich,
errors on stderr."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from tunecast.errors import Problem, TunecastError, error_document
from tunecast.estimate.progress import listening
from tunecast.version import stamped

if TYPE_CHECKING:
    from rich.status import Status

# `--check` (memory, plan): the exit status of a run that does not fit, apart from 0 (fits), 1 (a bug) and 2 (a user
# error), so that a CI job or launch script can tell "does not fit" from "could not tell".
DOES_NOT_FIT = 3

# Piped or captured output is not squeezed to 80 columns: tables stay readable in files and READMEs.
out = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 130)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 130)


def estimate_line(kind: str, text: str) -> None:
    """What an estimate says (progress of a cold trace, warnings), a line on stderr."""
    err.print(f"[yellow]warning:[/] {escape(text)}" if kind == "warning" else f"[dim]{escape(text)}[/]")


@contextmanager
def working(message: str) -> Iterator[Status]:
    """A spinner on stderr while an estimate works. What the estimate says (each trace of a cold estimate)
    updates the spinner on a terminal and is printed a line each elsewhere; its warnings are printed."""
    with err.status(message) as status:
        def hear(kind: str, text: str) -> None:
            if kind == "progress" and err.is_terminal:
                status.update(f"{message} {escape(text)}")
            else:
                estimate_line(kind, text)

        @contextmanager
        def stopped() -> Iterator[None]:  # no refresh thread while the estimate forks (estimate/prewarm.py)
            # rich's stop() only signals its refresh thread; the thread is waited for here (where rich keeps it
            # elsewhere, the thread runs on and the estimate does not fork: it solves both limits itself)
            refresh = getattr(getattr(status, "_live", None), "_refresh_thread", None)
            status.stop()
            if isinstance(refresh, threading.Thread):
                refresh.join()
            try:
                yield
            finally:
                status.start()

        with listening(hear, stopped):
            yield status


def print_json(document: dict[str, Any] | list[dict[str, Any]]) -> None:
    """One JSON document on stdout. Every object (or every item of a list) carries schema_version."""
    sys.stdout.write(json.dumps(stamped(document), indent=2, default=str, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _problem_line(problem: Problem) -> str:
    mark = "[red]✗[/]" if problem.severity == "error" else "[yellow]![/]"
    where = f" ({escape(problem.location)})" if problem.location else ""
    key = f"[bold]{escape(problem.field)}[/]{where}: " if problem.field else (f"{where.strip()}: " if where else "")
    text = f"  {mark} {key}{escape(problem.message)}"
    if problem.hint:
        text += f"\n      [dim]→[/] {escape(problem.hint)}"
    return text


def print_problems(problems: list[Problem]) -> None:
    for problem in problems:
        err.print(_problem_line(problem))


def report_error(error: TunecastError, *, json_output: bool) -> None:
    """A user error: a short message on stderr and, with --json, a JSON document on stdout."""
    if json_output:
        print_json(error_document(error))
    err.print(f"[red bold]error:[/] {escape(error.message)}")
    if len(error.problems) > 1 or error.problems[0].message != error.message:
        print_problems(error.problems)
    elif error.hint:
        err.print(f"  [dim]→[/] {escape(error.hint)}")
