"""`tunecast train --gpus N` on one machine: N worker processes, one per GPU (or N CPU processes with gloo on a
machine without GPUs), each the same `tunecast train` command with the rank variables torchrun would set.

Why not torchrun itself: its exit status is 1 whenever a worker exits non-zero, so a preempted run's 75
("run the same command again") would read as a failure. This launcher keeps the contract of one process:

* signals (SIGTERM, SIGINT, SIGUSR1) are passed to every worker, which save together and exit 75; one that
  arrived before the workers started stops them as they start; a worker that stops with 75 on its own (a
  signal only it received while the others were not yet in step) makes the launcher pass SIGTERM to the rest;
* the status is 0 when every worker finished, 75 when they stopped on a preemption or because another
  worker was lost, else the status of the first worker that failed (a crash is not hidden as "resume me");
* a worker that dies makes the others fail their next collective and stop (distributed.py); any still
  running `LOST_GRACE_S` later are killed, so nothing hangs.

No torch here: the workers import it, all at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from tunecast.train.signals import EXIT_PREEMPTED

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # the workers' preemption signals (train/signals.py)
LOST_GRACE_S = 60.0
POLL_S = 0.1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_env(rank: int, count: int, port: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of worker `rank` of `count` on this machine: torchrun's variables, and on the CPU an
    even share of the cores (torchrun's default of one thread a worker starves a big machine)."""
    env = dict(base)
    env.update({"WORLD_SIZE": str(count), "RANK": str(rank), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(count), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
    return env


@dataclass(frozen=True)
class Ended:
    rank: int
    code: int  # exit status, or minus the signal that killed it

    def describe(self) -> str:
        if self.code < 0:
            with contextlib.suppress(ValueError):
                return f"rank {self.rank} was killed by {signal.Signals(-self.code).name}"
        return f"rank {self.rank} exited with status {self.code}"


def combined_status(ended: Sequence[Ended]) -> int:
    """One status for the run: the first failure's (a signal as 128 + its number), else 75 if any worker
    stopped to resume later, else 0."""
    for one in ended:
        if one.code not in (0, EXIT_PREEMPTED):
            return 128 - one.code if one.code < 0 else one.code
    return EXIT_PREEMPTED if any(one.code == EXIT_PREEMPTED for one in ended) else 0


def launch(argv: Sequence[str], count: int, *, already: int | None = None) -> tuple[int, list[Ended]]:
    """Run `tunecast ARGV` as `count` workers; returns the combined status and how each ended (in order).
    `already`: a preemption signal received before the launch, passed to the workers as they start."""
    port = free_port()
    workers: list[subprocess.Popen[bytes]] = []
    received: list[int] = [already] if already is not None else []

    def forward(number: int, frame: FrameType | None = None) -> None:
        received.append(number)
        for worker in workers:
            if worker.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.send_signal(number)

    previous = {number: signal.signal(number, forward) for number in FORWARDED}  # before any worker exists
    ended: list[Ended] = []
    try:
        workers.extend(subprocess.Popen([sys.executable, "-m", "tunecast", *argv],
                                        env=rank_env(rank, count, port, os.environ)) for rank in range(count))
        if received:
            forward(received[0])
        failed_at: float | None = None
        while len(ended) < count:
            for rank, worker in enumerate(workers):
                code = worker.poll()
                if code is None or any(one.rank == rank for one in ended):
                    continue
                ended.append(Ended(rank, code))
                if code not in (0, EXIT_PREEMPTED) and failed_at is None:
                    failed_at = time.monotonic()
                if code != 0 and not received:  # stopped on its own: the others stop too, not wait for it
                    forward(signal.SIGTERM)
            if failed_at is not None and time.monotonic() - failed_at > LOST_GRACE_S:
                for worker in workers:
                    if worker.poll() is None:
                        worker.kill()
            time.sleep(POLL_S)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return combined_status(ended), ended
