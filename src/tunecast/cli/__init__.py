"""The command line: parse, call the library, render. The only place that prints or exits."""

import sys

# `tunecast train` must not lose a preemption notice that arrives while the libraries load: its signal
# handlers go in before anything else is imported (they only set a flag; see tunecast/train/signals.py).
if sys.argv[1:2] == ["train"]:
    from tunecast.train.signals import PROCESS_FLAG

    PROCESS_FLAG.install()
    from tunecast.train.determinism import fix_cpu_threads

    fix_cpu_threads()

# The Typer app is tunecast.cli.app.app: a name `app` here would hide the module tunecast.cli.app.
from tunecast.cli.app import main

__all__ = ["main"]
