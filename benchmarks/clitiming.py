"""Time one fresh `tunecast` process, start to exit, as a user would see it, and tell whether it imported torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

# Runs the CLI, then reports on stderr whether torch got imported in this process.
PROBE = ("import sys\nfrom tunecast.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules))\n")


def timed(args: list[str], cache: str, expect: str) -> tuple[float, bool, str]:
    """Seconds taken, whether torch was imported, and stdout of `tunecast ARGS` with TUNECAST_CACHE=`cache`;
    raises with the end of stderr when stdout lacks `expect`."""
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                               env={**os.environ, "TUNECAST_CACHE": cache}, check=False)
    elapsed = time.perf_counter() - start
    if expect not in completed.stdout:
        raise RuntimeError(completed.stderr[-2000:])
    return elapsed, "TORCH=True" in completed.stderr, completed.stdout
