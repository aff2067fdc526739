"""Time one fresh `tunecast` process, start to exit, as a user would see it, and tell whether it imported torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

# Runs the CLI as the console script does, and reports on stderr whether torch got imported, from an exit handler:
# `memory` and `plan` leave through os._exit once their answer is out (cli/app.py _quick_exit), after the handlers.
PROBE = ("import atexit, sys\n"
         "atexit.register(lambda: sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules)))\n"
         "sys.argv = ['tunecast', *sys.argv[1:]]\nfrom tunecast.cli import main\ntry:\n    main()\n"
         "except SystemExit:\n    pass\n")


def timed(args: list[str], cache: str, expect: str) -> tuple[float, bool, str]:
    """Seconds taken, whether torch was imported, and stdout of `tunecast ARGS` with TUNECAST_CACHE=`cache`, in
    a process of its own. Raises with the end of stderr when stdout lacks `expect`."""
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                               env={**os.environ, "TUNECAST_CACHE": cache}, check=False)
    elapsed = time.perf_counter() - start
    if expect not in completed.stdout:
        raise RuntimeError(completed.stderr[-2000:])
    return elapsed, "TORCH=True" in completed.stderr, completed.stdout
