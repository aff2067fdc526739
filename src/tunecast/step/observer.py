"""Where a traced step's loss stand-in (loss.py SegmentStub) reports to the tracer, which installs the observer
while it records a step (estimate/tracer.py): the step's code does not import the estimator. Outside a trace there
is none, and the stand-in only allocates."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class SegmentObserver(Protocol):
    def segment_mark(self, part: str, stub: str, inputs: Any, weight: Any, bias: Any, targets: Any,
                     grad: Any) -> None: ...

    def uncounted(self) -> AbstractContextManager[None]: ...

    def head_called(self) -> None: ...

    def mark_accumulation(self, name: str, parameter: Any) -> None: ...


OBSERVER: SegmentObserver | None = None
