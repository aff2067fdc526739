"""The command line: parse, call the library, render. The only place that prints or exits."""

import sys

# `tunecast train` must not lose a preemption notice that arrives while the libraries load: its signal
# handlers go in before anything else is imported (they only set a flag; see tunecast/train/signals.py).
if sys.argv[1:2] == ["train"]:
    from tunecast.train.signals import PROCESS_FLAG

    PROCESS_FLAG.install()
    from tunecast.train.determinism import fix_cpu_threads

    fix_cpu_threads()

from typing import Any

_VALUED_OPTIONS = ("--catalog",)  # global options followed by a value


def command_word(argv: list[str]) -> str | None:
    """The command `argv` runs (its first word that is not an option or an option's value), or None: no
    command, or help or the version asked before it. Read before anything heavy is imported (cli/warm.py)."""
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help", "--version"):
            return None
        if word in _VALUED_OPTIONS:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> None:
    """The console script. A quick command is run by the warm server when one is up (cli/warm.py); any other,
    or one given `argv` (tests, embedding), runs in this process."""
    if argv is None:
        from tunecast.cli.warm import run_warm

        try:
            status = run_warm(sys.argv[1:])
        except KeyboardInterrupt:  # before a served command started (it is stopped with its caller)
            sys.exit(130)
        if status is not None:
            sys.exit(status)
    from tunecast.cli.app import main as run

    run(argv)


def __getattr__(name: str) -> Any:  # `from tunecast.cli import app` without importing it on the warm path
    if name == "app":
        from tunecast.cli.app import app

        return app
    raise AttributeError(name)


__all__ = ["app", "main"]
