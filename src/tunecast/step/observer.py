"""Where a traced step's loss stand-in (loss.py SegmentStub) reports to the tracer, which installs the observer
while it records a step (estimate/tracer.py): the step's code does not import the estimator. Outside a trace there
is none, and the stand-in only allocates."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class SegmentObserver(Protocol):
    def segment_mark(self, part: str, stub: str, inputs: Any, weight: Any, bias: Any, targets: Any,
                     grad: Any) -> None: ...

    def uncounted(self) -> AbstractContextManager[None]: ...

    def head_called(self) -> None: ...

    def mark_accumulation(self, name: str, parameter: Any) -> None: ...


OBSERVER: SegmentObserver | None = None


# A loss traced for its memory alone (estimate/compose.py `repeats_once`, a limit's checks) runs the repeated chunks of
# its loops once, where every chunk but the last is the same size and frees what it makes before the next (TRL's
# tiles and checkpointed chunks, unsloth's checkpointed chunks; not torchtune's, whose logits stay for the backward
# pass): after the second the allocator is where the first left it, and the chunks between change no peak
# (tests/unit/estimate/test_compose.py). The full trace serves every estimate.
REPEATS_ONCE = False


def chunks_run(chunks: Sequence[T]) -> Sequence[T]:
    """A loss's chunks in order: all of them, or under REPEATS_ONCE the first two and the last."""
    if not REPEATS_ONCE or len(chunks) <= 3:
        return chunks
    return [chunks[0], chunks[1], chunks[-1]]


def pieces(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """The lengths a loss splits a tensor into when chunks_run runs some of them: all, or under REPEATS_ONCE (more
    than three) the first two, those between as one piece (not run), and the last. The backward pass of a split
    makes zeros for each piece that was not run: as many bytes at once either way, and the same events at any
    number of chunks (estimate/forms.py)."""
    if not REPEATS_ONCE or len(lengths) <= 3:
        return lengths
    return (lengths[0], lengths[1], sum(lengths[2:-1]), lengths[-1])
