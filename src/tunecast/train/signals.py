"""Preemption: a signal sets a flag; the run checks it at every micro-step and stops at a clean point.

Cloud providers give a preempted machine a short notice (SIGTERM from the shutdown sequence, about 30 s on
the big clouds, sometimes less); SkyPilot and Slurm send SIGTERM or SIGUSR1 before they kill a job. The
handlers do nothing but set a flag — saving a checkpoint from inside a signal handler would run in the middle
of whatever the interpreter was doing. The loop checks the flag at every micro-step, in evaluation and while
the data is prepared, so a notice is seen within one micro-step (not one optimizer step, nor one epoch); a
one-process run also checks it at every decoder layer's forward and backward pass (`stop_within_layers`).

The handlers are installed when the `train` command starts, before torch and transformers are imported,
so a signal that arrives while the libraries load is not lost either. Once the flag is set further signals
change nothing: a second SIGTERM during the save cannot interrupt the write (and a SIGKILL leaves the
previous checkpoint intact, see storage/store.py).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "preempted, run the same command again to resume"


class Preempted(Exception):
    """Raised at a check point after a preemption signal; the run saves what it has and stops."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"received {signal_name}")
        self.signal_name = signal_name


class PreemptionFlag:
    """Set by a signal handler, read by the loop. `check()` raises `Preempted` once the flag is set."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionFlag:
        for number in PREEMPTION_SIGNALS:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def uninstall(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous.clear()
        self.received = None

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(number).name

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def check(self) -> None:
        if self.received is not None:
            raise Preempted(self.received)


def stop_within_layers(model: Any, flag: PreemptionFlag) -> None:
    """A preemption notice seen at every decoder layer's forward and backward pass, not only between micro-batches:
    the step in progress is abandoned either way (weights and optimizer untouched until its optimizer step, its
    gradients dropped), so a notice is answered within one layer's pass instead of a whole micro-batch's (seconds
    to minutes on a CPU). One process only: ranks stop together at a micro-batch (distributed.py), and an
    optimizer stepped inside the backward pass must not stop half-way."""
    import torch

    from tunecast.step.setup import decoder_layers

    def check_forward(module: Any, args: Any) -> None:
        flag.check()

    def check_backward(grad: Any) -> None:
        flag.check()

    def watch_output(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(check_backward)  # called as the backward pass reaches this layer

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(check_forward)
        layer.register_forward_hook(watch_output)


PROCESS_FLAG = PreemptionFlag()  # the `train` command's flag, installed at process start (tunecast/cli/__init__.py)
