"""A step's allocated peaks read off a table, and the caching allocator's part of a replay as a list of its calls.

What such a replay finds, per phase of the measured step, is the largest sum of live tensor bytes and what was live at
that moment by category. After each event, the live bytes are a sum over the profile's distinct sizes (a few dozen
polynomials in b and s): how many tensors of each size are live, times that size at the shape. How many are live
depends on the events alone, and on which sizes are positive at the shape (an allocation of no bytes is none), not on
the sizes themselves. So the counts are tabled once per profile and set of positive sizes, and a replay at another
shape is a product of the table with that shape's sizes: the same integers as the event-by-event replay
(`profile.replay_events`, which the tests hold this to), in a small fraction of its time. The table follows the
replay's rules exactly: an allocation under a key still live replaces it (what the first held stays counted), a free
or a reclassification of a key not live does nothing, and a phase's peak is the first event at its largest sum.

Where the allocator's reserve is simulated, the table gives the peaks, and the allocator is handed the table's
program: its mallocs and frees in order, the replay's bookkeeping done once, when the table was made.

Exact integers: a table is used only where no sum can exceed 2**62 (else the event-by-event replay runs, in Python's
unbounded integers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tunecast.estimate.tracer import ALLOC, CATEGORIES, FREE, RECLASS

if TYPE_CHECKING:
    from tunecast.estimate.profile import EventColumns

PHASES = ("forward", "backward", "optimizer")
_LIMIT = 2**62


@dataclass
class PeakTable:
    """Live tensors per distinct size after each event of the measured step, for one set of positive sizes."""

    rows: dict[str, np.ndarray]  # by phase: the events checked (their indices), in order
    live: dict[str, np.ndarray]  # by phase: (rows, sizes) live tensors of each size after each of those events
    most_live: int  # the most tensors live at once: bounds every sum
    moves: np.ndarray  # (4, moves): event, category, size, +1/-1: how each event changes what each category holds
    # what the caching allocator is asked, in order: (slot, size) allocates a block of that size for the slot,
    # (slot, -1) frees the slot's block (a slot per allocation: one replaced while live is never freed)
    program: list[tuple[int, int]]
    slots: int
    _held: dict[int, np.ndarray] = field(default_factory=dict)  # by event: (categories, sizes) live after it

    def held_after(self, event: int) -> np.ndarray:
        """Live tensors of each category and size after `event`."""
        if event not in self._held:
            upto = self.moves[0] <= event
            held = np.zeros((len(CATEGORIES), self.live_sizes), dtype=np.int64)
            np.add.at(held, (self.moves[1][upto], self.moves[2][upto]), self.moves[3][upto])
            self._held[event] = held
        return self._held[event]

    @property
    def live_sizes(self) -> int:
        return next(iter(self.live.values())).shape[1] if self.live else 0

    def peaks(self, counts: Sequence[int]) -> dict[str, tuple[int, dict[str, int]]] | None:
        """Per phase: the largest live bytes and the bytes of each category then, `counts` being each size's bytes
        (0 where it allocates nothing); None when a sum could leave exact 64-bit integers."""
        if max(counts, default=0) * max(self.most_live, 1) >= _LIMIT:
            return None
        sizes = np.array(counts, dtype=np.int64)
        found: dict[str, tuple[int, dict[str, int]]] = {}
        for phase in PHASES:
            rows = self.rows.get(phase)
            if rows is None or not len(rows):
                continue
            totals = self.live[phase] @ sizes
            best = int(np.argmax(totals))  # the first of the largest, as a replay keeps the first
            top = int(totals[best])
            if top > 0:
                by_category = self.held_after(int(rows[best])) @ sizes
                found[phase] = (top, {name: int(value) for name, value in zip(CATEGORIES, by_category, strict=True)})
        return found


def peak_table(columns: EventColumns, positive: tuple[bool, ...], measured_step: int) -> PeakTable:
    """The table of a profile's events (`columns`) where the sizes `positive` allocate."""
    category_of = {name: index for index, name in enumerate(CATEGORIES)}
    sizes = len(columns.polys)
    live: dict[int, tuple[int, int, int]] = {}  # key → (size, category, slot)
    program: list[tuple[int, int]] = []
    counts = [0] * sizes
    changes: list[tuple[int, int, int]] = []  # (event, size, ±1) of the live counts
    moves: list[tuple[int, int, int, int]] = []  # (event, category, size, ±1) of what each category holds
    checked: dict[str, list[int]] = {phase: [] for phase in PHASES}
    most = total = 0
    for event, (kind, key, size, category, phase, step) in enumerate(zip(
            columns.kinds, columns.keys, columns.sizes, columns.categories, columns.phases, columns.steps,
            strict=True)):
        if kind == ALLOC:
            if positive[size]:
                program.append((len(program), size))
                live[key] = (size, category_of[category], len(program) - 1)
                counts[size] += 1
                total += 1
                changes.append((event, size, 1))
                moves.append((event, category_of[category], size, 1))
        elif kind == FREE:
            entry = live.pop(key, None)
            if entry is not None:
                program.append((entry[2], -1))
                counts[entry[0]] -= 1
                total -= 1
                changes.append((event, entry[0], -1))
                moves.append((event, entry[1], entry[0], -1))
        elif kind == RECLASS:
            entry = live.get(key)
            if entry is not None and entry[1] != category_of[category]:
                moves.append((event, entry[1], entry[0], -1))
                moves.append((event, category_of[category], entry[0], 1))
                live[key] = (entry[0], category_of[category], entry[2])
        most = max(most, total)
        if step == measured_step and phase in checked:
            checked[phase].append(event)
    delta = np.zeros((len(columns.kinds), sizes), dtype=np.int64)
    if changes:
        at = np.array(changes, dtype=np.int64).T
        np.add.at(delta, (at[0], at[1]), at[2])
    after = np.cumsum(delta, axis=0)  # live tensors of each size after each event
    rows = {phase: np.array(events, dtype=np.int64) for phase, events in checked.items() if events}
    # kept as 32-bit counts (a few tensors of a size live at once): half the memory of a profile's table
    return PeakTable(rows, {phase: after[events].astype(np.int32) for phase, events in rows.items()}, most,
                     np.array(moves, dtype=np.int64).T if moves else np.zeros((4, 0), dtype=np.int64), program,
                     len(program))
