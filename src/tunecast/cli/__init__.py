"""The command line: parse, call the library, render. The only place that prints or exits."""

import sys

# `tunecast train` must not lose a preemption notice that arrives while the libraries load: its signal
# handlers go in before anything else is imported (they only set a flag; see tunecast/train/signals.py).
if sys.argv[1:2] == ["train"]:
    from tunecast.train.signals import PROCESS_FLAG

    PROCESS_FLAG.install()
    from tunecast.train.determinism import fix_cpu_threads

    fix_cpu_threads()

from tunecast.cli.app import app, main  # noqa: E402  (after the handlers above)

__all__ = ["app", "main"]
