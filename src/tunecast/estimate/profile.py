"""A step profile: the allocation events of a traced training step, with every size as a polynomial in
micro-batch b and sequence length s, so that one set of traces answers for any b and s.

Tensor shapes are products of b, s and fixed dimensions, so every allocation's size is a combination of
1, s, s², b·s, b·s² and b (s² for seq × seq attention scores and masks; b-free terms for tensors shared by
the batch, such as rotary tables; b alone for the loss's labels padded by one position, b·(s + 1)).
Profiles instantiated from a template (templates.py) hold all six exactly. Profiles fitted from traces of
the model itself read the first five: five traces at different (b, s) determine them for every allocation
(the b term, a few bytes, is left out), provided the traces perform the same operations in the same order
— which is checked; when they differ the profile is not built and the caller traces the requested shape
directly. A batch of one takes a few different operations (some `.contiguous()` copies are no-ops on it),
so b = 1 has its own profile, fitted from three lengths over 1, s and s².

Replaying a profile at (b, s) gives, per phase of the second step, the peak of live tensor bytes, the
category breakdown at that peak, and (on CUDA) the caching allocator's rounding and reserve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple, overload

from tunecast.estimate.allocator import CachingAllocator, round_size
from tunecast.estimate.tracer import ALLOC, CATEGORIES, FREE, RECLASS, Event, ModelFacts, Trace

BASIS_NAMES = ("1", "s", "s2", "bs", "bs2", "b")
FIT_SHAPES_SINGLE = ((1, 512), (1, 1024), (1, 1536))
FIT_SHAPES_MULTI = ((2, 512), (2, 1024), (2, 1536), (3, 512), (3, 1024))
MEASURED_STEP = 2


def basis(batch: int, seq: int) -> tuple[int, ...]:
    return (1, seq, seq * seq, batch * seq, batch * seq * seq, batch)


def fit_points(batch: int, offset: int = 0) -> list[tuple[int, int]]:
    """The (b, s) shapes traced to fit the profile that serves micro-batch `batch` (b = 1, or b ≥ 2);
    `offset` moves the lengths past a sliding window."""
    shapes = FIT_SHAPES_SINGLE if batch == 1 else FIT_SHAPES_MULTI
    return [(b, s + offset) for b, s in shapes]


def _rows(shapes: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Basis rows of the fit: 1, s, s² alone for b = 1 (where b·s is s), all five terms otherwise."""
    if all(b == 1 for b, _ in shapes):
        return [basis(b, s)[:3] for b, s in shapes]
    return [basis(b, s)[:5] for b, s in shapes]


def _solve(rows: list[tuple[int, ...]], values: list[int]) -> tuple[Fraction, ...]:
    """Exact solution of the square system rows · x = values (Gauss-Jordan over fractions)."""
    n = len(rows)
    matrix = [[Fraction(v) for v in row] + [Fraction(values[i])] for i, row in enumerate(rows)]
    for column in range(n):
        pivot = next(r for r in range(column, n) if matrix[r][column] != 0)
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        lead = matrix[column][column]
        matrix[column] = [v / lead for v in matrix[column]]
        for r in range(n):
            if r != column and matrix[r][column] != 0:
                factor = matrix[r][column]
                matrix[r] = [a - factor * b for a, b in zip(matrix[r], matrix[column], strict=True)]
    return tuple(matrix[r][n] for r in range(n))


class ProfileEvent(NamedTuple):  # a tuple: a profile holds thousands, built on every read of a template
    kind: str
    key: int
    size: tuple[float, ...] = ()  # coefficients over BASIS_NAMES
    category: str = ""
    phase: str = ""
    step: int = 0


class EventColumns(NamedTuple):
    """A profile's events by column, each size an index into `polys`, the profile's distinct size polynomials
    (a step allocates thousands of tensors of a few dozen sizes): a replay evaluates each polynomial once."""

    kinds: Sequence[str]
    keys: Sequence[int]
    sizes: Sequence[int]
    categories: Sequence[str]
    phases: Sequence[str]
    steps: Sequence[int]
    polys: Sequence[tuple[float, ...]]


def event_columns(events: Sequence[ProfileEvent]) -> EventColumns:
    """The events by column: a template's read from its table (templates.py) without building its events."""
    columns = getattr(events, "columns", None)
    if columns is not None:
        return columns()  # type: ignore[no-any-return]
    polys: dict[tuple[float, ...], int] = {}
    return EventColumns([e.kind for e in events], [e.key for e in events],
                        [polys.setdefault(e.size, len(polys)) for e in events], [e.category for e in events],
                        [e.phase for e in events], [e.step for e in events], list(polys))


class LazyEvents(Sequence[ProfileEvent]):
    """Events built on first use from their columns, which are what a replay reads: a template's (a warm estimate
    whose replays are kept, replays.py, reads none of them, and building a 70B model's four profiles' tens of
    thousands of events is a tenth of it) and a composed step's (compose.py)."""

    def __init__(self, build: Callable[[], list[ProfileEvent]], columns: Callable[[], EventColumns]) -> None:
        self._build: Callable[[], list[ProfileEvent]] | None = build
        self._events: list[ProfileEvent] = []
        self.columns = columns  # what a replay reads (profile.event_columns), without building the events

    def _built(self) -> list[ProfileEvent]:
        if self._build is not None:
            self._events, self._build = self._build(), None
        return self._events

    @overload
    def __getitem__(self, index: int) -> ProfileEvent: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ProfileEvent]: ...

    def __getitem__(self, index: int | slice) -> ProfileEvent | Sequence[ProfileEvent]:
        return self._built()[index]

    def __len__(self) -> int:
        return len(self._built())

    def __iter__(self) -> Iterator[ProfileEvent]:
        return iter(self._built())


@dataclass
class StepProfile:
    """The events of one traced configuration at one depth, sizes as polynomials in (b, s)."""

    layers: int
    events: Sequence[ProfileEvent]
    facts: ModelFacts
    flops: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """FLOPs of one step's forward and backward by kind (`matmul`, `attention`), and the other summed
    figures of the trace (bytes moved, kernels), as coefficients over BASIS_NAMES like the sizes."""
    capped: dict[str, list[tuple[tuple[float, ...], tuple[float, ...]]]] = field(default_factory=dict)
    """Terms of those figures that are the smaller of two sizes (a lookup reads at most as much of its
    table as it writes: the embedding's whole table when the batch has more tokens than the vocabulary)."""

    _columns: EventColumns | None = field(default=None, repr=False, compare=False)
    _peaks: dict[tuple[bool, ...], Any] = field(default_factory=dict, repr=False, compare=False)

    def columns(self) -> EventColumns:
        if self._columns is None:
            self._columns = event_columns(self.events)
        return self._columns

    def peak_table(self, positive: tuple[bool, ...]) -> Any:
        """The table of this profile's peaks where the sizes `positive` allocate (peaks.py), made once."""
        if positive not in self._peaks:
            from tunecast.estimate.peaks import peak_table

            self._peaks[positive] = peak_table(self.columns(), positive, MEASURED_STEP)
        return self._peaks[positive]

    def flops_at(self, batch: int, seq: int) -> dict[str, float]:
        terms = basis(batch, seq)

        def at(coefficients: tuple[float, ...]) -> float:
            return sum(c * t for c, t in zip(coefficients, terms, strict=True))

        figures = {kind: at(coefficients) for kind, coefficients in self.flops.items()}
        for kind, pairs in self.capped.items():
            figures[kind] = figures.get(kind, 0.0) + sum(min(at(a), at(b)) for a, b in pairs)
        return figures

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "facts": asdict(self.facts),
                "flops": {k: list(v) for k, v in self.flops.items()},
                "capped": {k: [[list(a), list(b)] for a, b in v] for k, v in self.capped.items()},
                "events": [[e.kind, e.key, list(e.size), e.category, e.phase, e.step] for e in self.events]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepProfile:
        events = [ProfileEvent(kind, key, tuple(size), category, phase, step)
                  for kind, key, size, category, phase, step in data["events"]]
        facts = data["facts"]
        facts["layer_linears"] = tuple(tuple(x) for x in facts.get("layer_linears", ()))
        facts["head_linear"] = tuple(facts.get("head_linear", (0, 0, False)))
        capped = {k: [(tuple(a), tuple(b)) for a, b in v] for k, v in data.get("capped", {}).items()}
        return cls(layers=data["layers"], events=events, facts=ModelFacts(**facts),
                   flops={k: tuple(v) for k, v in data.get("flops", {}).items()}, capped=capped)


def events_align(traces: list[list[Event]]) -> bool:
    """Same operations in the same order: every trace has the same kinds, keys, categories, phases."""
    first = traces[0]
    return all(
        len(trace) == len(first)
        and all((a.kind, a.key, a.category, a.phase, a.step) == (b.kind, b.key, b.category, b.phase, b.step)
                for a, b in zip(first, trace, strict=True))
        for trace in traces[1:]
    )


def _fit(rows: list[tuple[int, ...]], values: list[int | float]) -> tuple[float, ...]:
    """Coefficients over BASIS_NAMES of values measured at the rows' shapes."""
    if len(set(values)) == 1:
        return (float(values[0]),) + (0.0,) * (len(BASIS_NAMES) - 1)
    exact = _solve(rows, [round(v) for v in values])
    return tuple(float(c) for c in exact) + (0.0,) * (len(BASIS_NAMES) - len(exact))


def fit_profile(layers: int, shapes: list[tuple[int, int]], traces: list[Trace]) -> StepProfile | None:
    """Fit every allocation's size, and the FLOPs, over the basis; None when the traces do not align."""
    rows = _rows(shapes)
    event_lists = [trace.events for trace in traces]
    if len(shapes) != len(rows[0]) or not events_align(event_lists):
        return None
    events: list[ProfileEvent] = []
    for index, event in enumerate(event_lists[0]):
        if event.kind == ALLOC:
            coefficients = _fit(rows, [events_[index].nbytes for events_ in event_lists])
            events.append(ProfileEvent(ALLOC, event.key, coefficients, event.category, event.phase, event.step))
        else:
            events.append(ProfileEvent(event.kind, event.key, (), event.category, event.phase, event.step))
    flops = {kind: _fit(rows, [trace.flops[kind] for trace in traces])
             for kind in ("elementwise_bytes", "moved_bytes", "optimizer_bytes", "kernels", "random_elements",
                          "transcendental_bytes")}
    # FLOPs are read from the first two traces that count them: every FLOP scales with the
    # batch's tokens, b·s (matmuls) or b·s² (attention scores), so two shapes determine them.
    counted = [(shape, trace) for shape, trace in zip(shapes, traces, strict=True) if "matmul" in trace.flops][:2]
    if len(counted) == 2:
        flop_rows: list[tuple[int, ...]] = [(b * s, b * s * s) for (b, s), _ in counted]
        for kind in ("matmul", "attention"):
            per_token, per_pair = _solve(flop_rows, [round(trace.flops[kind]) for _, trace in counted])
            flops[kind] = (0.0, 0.0, 0.0, float(per_token), float(per_pair), 0.0)
    return StepProfile(layers, events, traces[0].facts, flops)


def profile_from_trace(layers: int, trace: Trace) -> StepProfile:
    """A profile valid at the traced shape only (used when traces at different shapes do not align)."""
    zeros = (0.0,) * (len(BASIS_NAMES) - 1)
    events = [ProfileEvent(e.kind, e.key, (float(e.nbytes), *zeros) if e.kind == ALLOC else (),
                           e.category, e.phase, e.step) for e in trace.events]
    flops = {kind: (value, *zeros) for kind, value in trace.flops.items()}
    return StepProfile(layers, events, trace.facts, flops)


@dataclass
class PhasePeak:
    """Peak of live tensor bytes in one phase, and what was live at that moment."""

    allocated: int = 0
    breakdown: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))


@dataclass
class Replay:
    phases: dict[str, PhasePeak]
    peak_reserved: int
    extra_allocated: int  # bytes allocated before the step (fixed blocks, e.g. cuBLAS workspaces)
    peak_pinned: int = 0  # the most the segments holding a live block took (allocator.py): 0 where not simulated


def _sizes(profile: StepProfile, batch: int, seq: int, cuda: bool) -> tuple[list[int], list[int]]:
    """Each distinct size's bytes at (b, s), and the bytes it counts for (on CUDA, the allocator's rounding)."""
    _, s1, s2, bs1, bs2, b1 = basis(batch, seq)
    raws = [round(c[0] + c[1] * s1 + c[2] * s2 + c[3] * bs1 + c[4] * bs2 + c[5] * b1) if c else 0
            for c in profile.columns().polys]
    counts = [round_size(raw) if raw > 0 else 0 for raw in raws] if cuda else raws
    return raws, counts


def replay(profile: StepProfile, batch: int, seq: int, *, cuda: bool,
           fixed_blocks: tuple[int, ...] = (), reserve: bool = True) -> Replay:
    """Replay the profile at (b, s). On CUDA every block is rounded as the caching allocator does and the
    allocator's reserve is simulated (unless `reserve` is False: then `peak_reserved` is 0, and the rest is
    the same); `fixed_blocks` are allocated first (library workspaces). What simulates no allocator is read off
    the profile's table of peaks (peaks.py), the same integers as `replay_events` finds event by event."""
    raws, counts = _sizes(profile, batch, seq, cuda)
    positive = tuple(raw > 0 for raw in raws)
    table = profile.peak_table(positive)
    tabled = table.peaks([c if p else 0 for c, p in zip(counts, positive, strict=True)])
    if tabled is None:  # sizes beyond the table's integers
        return replay_events(profile, batch, seq, cuda=cuda, fixed_blocks=fixed_blocks, reserve=reserve)
    allocator = CachingAllocator()
    for size in fixed_blocks:
        allocator.malloc(size)
    extra = allocator.allocated
    phases = {name: PhasePeak() for name in ("forward", "backward", "optimizer")}
    for name, (allocated, breakdown) in tabled.items():
        phases[name] = PhasePeak(allocated, breakdown)
    if not cuda:  # a CPU keeps no cache: what it holds at the peak is what is allocated
        return Replay(phases, max(p.allocated for p in phases.values()), extra)
    if not reserve:
        return Replay(phases, 0, extra)
    malloc, free = allocator.malloc, allocator.free
    addresses = [0] * table.slots
    for slot, size in table.program:
        if size >= 0:
            addresses[slot] = malloc(raws[size])
        else:
            free(addresses[slot])
    return Replay(phases, allocator.peak_reserved, extra, allocator.peak_pinned)


def replay_events(profile: StepProfile, batch: int, seq: int, *, cuda: bool,
                  fixed_blocks: tuple[int, ...] = (), reserve: bool = True) -> Replay:
    """`replay`, event by event: every allocation and free on the simulated allocator (the reserve), and the live
    bytes after each event (the peaks)."""
    columns = profile.columns()
    raws, counts = _sizes(profile, batch, seq, cuda)
    allocator = CachingAllocator()
    for size in fixed_blocks:
        allocator.malloc(size)
    extra = allocator.allocated
    simulate = cuda and reserve
    live: dict[int, tuple[int, str, int]] = {}  # key -> (counted bytes, category, allocator address)
    totals = dict.fromkeys(CATEGORIES, 0)
    current = 0
    phases = {name: PhasePeak() for name in ("forward", "backward", "optimizer")}
    for kind, key, size, category, phase, step in zip(columns.kinds, columns.keys, columns.sizes,
                                                      columns.categories, columns.phases, columns.steps,
                                                      strict=True):
        if kind == ALLOC:
            raw = raws[size]
            if raw > 0:
                counted = counts[size]
                address = allocator.malloc(raw) if simulate else 0
                live[key] = (counted, category, address)
                totals[category] += counted
                current += counted
        elif kind == FREE:
            entry = live.pop(key, None)
            if entry is not None:
                counted, held, address = entry
                totals[held] -= counted
                current -= counted
                if simulate:
                    allocator.free(address)
        elif kind == RECLASS:
            entry = live.get(key)
            if entry is not None and entry[1] != category:
                counted, held, address = entry
                totals[held] -= counted
                totals[category] += counted
                live[key] = (counted, category, address)
        # Every event, not only allocations: a phase's peak may be what it inherits from the one before.
        if step == MEASURED_STEP:
            peak = phases.get(phase)
            if peak is not None and current > peak.allocated:
                peak.allocated = current
                peak.breakdown = dict(totals)
    if not cuda:  # a CPU keeps no cache: what it holds at the peak is what is allocated
        return Replay(phases, max(p.allocated for p in phases.values()), extra)
    return Replay(phases, allocator.peak_reserved if simulate else 0, extra, allocator.peak_pinned if simulate else 0)
