"""Time one fresh `tunecast` process, start to exit, as a user would see it, and tell whether it imported torch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Runs the CLI as the console script does (through the warm server when one is up: tunecast/cli/warm.py), then
# reports on stderr whether torch got imported in this process (a served command imports it in the server's child,
# not here: the in-process runs tell).
PROBE = ("import sys\nsys.argv = ['tunecast', *sys.argv[1:]]\nfrom tunecast.cli import main\ntry:\n    main()\n"
         "except SystemExit:\n    pass\nsys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules))\n")


def timed(args: list[str], cache: str, expect: str, warm_dir: str | None = None) -> tuple[float, bool, str]:
    """Seconds taken, whether torch was imported, and stdout of `tunecast ARGS` with TUNECAST_CACHE=`cache`;
    with `warm_dir` the warm server of that directory serves it (one is started if none is up), without it the
    command runs in its own process. Raises with the end of stderr when stdout lacks `expect`."""
    warm = {"TUNECAST_WARM": "1", "TUNECAST_WARM_DIR": warm_dir} if warm_dir else {"TUNECAST_WARM": "0"}
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                               env={**os.environ, "TUNECAST_CACHE": cache, **warm}, check=False)
    elapsed = time.perf_counter() - start
    if expect not in completed.stdout:
        raise RuntimeError(completed.stderr[-2000:])
    return elapsed, "TORCH=True" in completed.stderr, completed.stdout


def wait_for_server(warm_dir: str, timeout: float = 60.0) -> None:
    """Until the warm server a command started in `warm_dir` listens (it imports for about a second)."""
    deadline = time.monotonic() + timeout
    while not any(Path(warm_dir).glob("*.sock")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no warm server came up in {warm_dir}")
        time.sleep(0.1)


def stop_servers(warm_dir: str) -> None:
    for lock in Path(warm_dir).glob("*.lock"):
        text = lock.read_text().strip()
        if text:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(text), signal.SIGTERM)
