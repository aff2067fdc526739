"""Steps whose loss a template cannot hold, composed: the template of the rest of the step, and the loss alone at
the asked shape.

TRL's fused LM head, TRL 1.7-1.14's chunked loss, torchtune's LinearCrossEntropyLoss and unsloth's fused
cross-entropy (step/variants.py SEGMENT_LOSSES) split the logits into chunks whose number follows the length, which
no polynomial in the length holds. Everything else in such a step is what a template holds: so the template is
built with a stand-in for the loss (step/loss.py SegmentStub), which keeps the loss's inputs as the loss does, marks
where the loss runs in each pass, and allocates its result and its gradients. An estimate at (b, s) takes the loss
alone at that size, from its form where one holds it (forms.py: no torch), else traced on fake tensors of that size
(tracer.trace_segment: no model, a fraction of a second), and puts its events in place of each mark: its result
and gradients where the stand-in's were, and the frees it makes of the step's tensors (its inputs, its incoming
gradient) where it makes them. The profiles hold that one shape; a sweep composes
each shape it asks for. `tests/unit/estimate/test_compose.py` checks composed profiles against direct traces of the
runners' steps, event by event.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

from tunecast.catalog.models import with_class_defaults
from tunecast.estimate import forms, progress, symbols
from tunecast.estimate.profile import BASIS_NAMES, EventColumns, LazyEvents, ProfileEvent, StepProfile, basis
from tunecast.estimate.tracer import ALLOC, FREE, RECLASS, SEGMENT_MARK, Event, SegmentTrace
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import text_config_data
from tunecast.step.variants import SEGMENT_LOSSES, STUB_INPUTS, STUBS


def composable(settings: TraceSettings) -> bool:
    """Whether the step's loss is one a composition traces alone (the rest from a template)."""
    return _variant(settings) is not None


def _variant(settings: TraceSettings) -> str | None:
    """The runner's loss of SEGMENT_LOSSES, or `loss-chunks` for `loss: chunked`; None for a loss the step's
    template holds, and for `loss: chunked` under a runner's own loss (which of the two runs is not settled: traced)."""
    runners = [variant for variant in settings.runner_step if variant in SEGMENT_LOSSES]
    if settings.loss == "chunked":
        return None if runners else "loss-chunks"
    return runners[0] if runners else None


def segment_variant(settings: TraceSettings) -> str:
    variant = _variant(settings)
    assert variant is not None, "segment_variant of a step whose loss is not composed"
    return variant


def stub_settings(settings: TraceSettings) -> TraceSettings:
    """The settings whose template composes `settings`' step: the loss replaced by its stand-in (torch.compile's
    cross-entropy is part of the loss)."""
    variant = segment_variant(settings)
    if variant == "loss-chunks":  # the stand-in takes the hidden states, as the chunks do
        step = (*(v for v in settings.runner_step if v != "compiled-loss"), STUBS[variant])
        return replace(settings, loss="standard", runner_step=step)
    step = tuple(STUBS[v] if v == variant else v for v in settings.runner_step if v != "compiled-loss")
    return replace(settings, runner_step=step)


_ONCE: ContextVar[bool] = ContextVar("repeats_once", default=False)


@contextlib.contextmanager
def repeats_once() -> Iterator[None]:
    """Within: the loss is traced with its repeated chunks run once (step/observer.py REPEATS_ONCE), the same peak and
    reserve at a fraction of the trace, for a limit's checks (fit.py) that read memory only."""
    token = _ONCE.set(True)
    try:
        yield
    finally:
        _ONCE.reset(token)


def repeating_once() -> bool:
    return _ONCE.get()


_MAY_TRACE: ContextVar[bool] = ContextVar("may_trace", default=True)


class WouldTrace(Exception):
    """Within `tracing(False)`: the loss has no form at this size (forms.py), and would be traced."""


@contextlib.contextmanager
def tracing(allowed: bool) -> Iterator[None]:
    """Within: the loss is traced where no form holds it only if `allowed`; WouldTrace is raised instead."""
    token = _MAY_TRACE.set(allowed)
    try:
        yield
    finally:
        _MAY_TRACE.reset(token)


_NEAR: ContextVar[frozenset[tuple[int, int]] | None] = ContextVar("from_near_traces", default=None)


class NoNearTraces(Exception):
    """Within `from_near_traces`: the loss has not been traced at two of its shapes on a line with the asked one."""


@contextlib.contextmanager
def from_near_traces(shapes: Iterable[tuple[int, int]]) -> Iterator[None]:
    """Within: the loss is not traced but interpolated, event by event, between two of its traces in this process at
    `shapes` (micro-batch, length) along the same dimension (`_interpolated`), and NoNearTraces is raised where there
    are none such. A guide for a limit's search (fit.py), which checks its answer on traces: exact where the loss's
    sizes are linear along that dimension, within a chunk's rounding where they are not. Only the search's own
    shapes are taken, so that its answer does not depend on what else the process traced."""
    token = _NEAR.set(frozenset(shapes))
    try:
        yield
    finally:
        _NEAR.reset(token)


def near_shapes() -> frozenset[tuple[int, int]] | None:
    """The shapes a loss is interpolated between (`from_near_traces`); None where it is traced."""
    return _NEAR.get()


# The losses traced in this process, by what their trace depends on besides its size: (inputs' shape, targets' shape,
# the events' structure, the trace). What `_interpolated` interpolates between.
_TRACES: dict[tuple[Any, ...], list[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...], SegmentTrace]]] = {}
TRACES_KEPT = 64  # per loss


def _segment(variant: str, inputs_shape: tuple[int, ...], targets_shape: tuple[int, ...], hidden: int, vocab: int,
             forward: str, backward: str, softcap: float | None, compiled: bool) -> SegmentTrace:
    first, second = json.loads(forward), json.loads(backward)
    traced = tuple(first[name] for name in forms.TRACED)
    near = _NEAR.get()
    if near is not None:
        among = {_shapes(variant, batch, seq, hidden) for batch, seq in near}
        return _interpolated((variant, hidden, vocab, traced, second["category"], softcap, compiled, repeating_once()),
                             inputs_shape, targets_shape, among)
    return _traced(variant, inputs_shape, targets_shape, hidden, vocab, traced, second["category"], softcap, compiled,
                   repeating_once())


@functools.lru_cache(maxsize=16)
def _traced(variant: str, inputs_shape: tuple[int, ...], targets_shape: tuple[int, ...], hidden: int, vocab: int,
            traced: tuple[Any, ...], backward_category: str, softcap: float | None, compiled: bool,
            once: bool, figures: bool = False) -> SegmentTrace:
    """The loss at this size: from its form where one holds it (forms.py), else traced (with `figures`, traced:
    a form holds no summed figures)."""
    fields = dict(zip(forms.TRACED, traced, strict=True))
    family = forms.Family.of(variant, fields, backward_category, softcap)
    may_trace = figures or _MAY_TRACE.get()
    segment = None if compiled or figures else forms.segment(family, inputs_shape, hidden, vocab, once, may_trace)
    if segment is None:
        if not may_trace:
            raise WouldTrace(f"the loss {variant} has no form at {inputs_shape}")
        from tunecast.estimate.tracer import trace_segment

        if not once:
            progress.progress(f"tracing the loss ({variant}) alone at {' × '.join(map(str, inputs_shape))}, which no "
                              "form holds: a fraction of a second, after importing torch (about 3 s) the first time")

        segment = trace_segment(variant, inputs_shape=inputs_shape, inputs_dtype=fields["inputs_dtype"],
                                targets_shape=targets_shape, hidden=hidden, vocab=vocab,
                                weight_dtype=fields["weight_dtype"], trains=fields["trains"], bias=fields["bias"],
                                bias_trains=fields["bias_trains"], autocast=fields["autocast"],
                                category=fields["category"], backward_category=backward_category, softcap=softcap,
                                compiled=compiled, once=once)
    kept = _TRACES.setdefault((variant, hidden, vocab, traced, backward_category, softcap, compiled, once), [])
    if len(kept) >= TRACES_KEPT:
        del kept[0]
    kept.append((inputs_shape, targets_shape, _structure(segment), segment))
    return segment


def _structure(segment: SegmentTrace) -> tuple[Any, ...]:
    """A loss's trace without its sizes: two traces with the same structure differ only in how much each
    allocation takes."""
    def events(items: list[Event]) -> tuple[tuple[Any, ...], ...]:
        return tuple((e.kind, e.key, e.category, e.phase, e.step) for e in items)

    return (events(segment.forward), events(segment.deferred), events(segment.backward), segment.result,
            segment.grads, tuple(sorted(segment.accumulated.items())), tuple(sorted(segment.views.items())),
            tuple(sorted(segment.externals.items())))


def _axis(shape: tuple[int, ...], other: tuple[int, ...]) -> int | None:
    """The one dimension in which two shapes of the same rank differ; None for none or several."""
    if len(shape) != len(other):
        return None
    differ = [i for i, (a, b) in enumerate(zip(shape, other, strict=True)) if a != b]
    return differ[0] if len(differ) == 1 else None


def _shapes(variant: str, batch: int, seq: int, hidden: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The loss's inputs and targets at (batch, seq): the hidden states and labels, or the tokens that are scored."""
    if STUB_INPUTS[STUBS[variant]] == "hidden":
        return (batch, seq, hidden), (batch, seq)
    return (batch * (seq - 1), hidden), (batch * (seq - 1),)


def _interpolated(family: tuple[Any, ...], inputs_shape: tuple[int, ...], targets_shape: tuple[int, ...],
                  among: set[tuple[tuple[int, ...], tuple[int, ...]]]) -> SegmentTrace:
    """The loss at `inputs_shape`, interpolated (or extrapolated) event by event between two of its traces at shapes
    `among` (inputs, targets) whose inputs differ from it in one dimension only: the two that bracket it, else the two
    nearest. Only where every such trace holds the same events (a fixed number of chunks: torchtune's 8)."""
    found = [entry for entry in _TRACES.get(family, []) if entry[:2] in among]
    for shape, targets, _, segment in found:
        if shape == inputs_shape and targets == targets_shape:
            return segment
    along = [(axis, shape[axis], structure, segment) for shape, targets, structure, segment in found
             if (axis := _axis(shape, inputs_shape)) is not None and _axis(targets, targets_shape) in (axis, None)]
    if any(entry[2] != along[0][2] for entry in along[1:]):
        # the loss's events change along the line (unsloth's chunks follow the tokens): an interpolation within one
        # of its regimes guides a search across them badly, and the checks it misleads cost more than it saves
        raise NoNearTraces("the loss's events change between the traces along this dimension")
    x = {axis: inputs_shape[axis] for axis, *_ in along}
    pairs = [(*sorted((a[1:], b[1:]), key=lambda item: item[0]), x[a[0]]) for i, a in enumerate(along)
             for b in along[i + 1:] if a[0] == b[0] and a[1] != b[1]]
    if not pairs:
        raise NoNearTraces("no two traces of this loss along one dimension with the asked size")
    # the pair that brackets the asked size most closely, else the nearest pair beside it
    (x1, _, one), (x2, _, two), at = min(pairs, key=lambda pair: (not pair[0][0] <= pair[2] <= pair[1][0],
                                                                  max(abs(pair[0][0] - pair[2]),
                                                                      abs(pair[1][0] - pair[2]))))
    share = (at - x1) / (x2 - x1)

    def sized(a: list[Event], b: list[Event]) -> list[Event]:
        return [e if e.nbytes == f.nbytes else replace(e, nbytes=max(0, round(e.nbytes + (f.nbytes - e.nbytes)
                                                                                  * share)))
                for e, f in zip(a, b, strict=True)]

    sums = None if one.sums is None or two.sums is None else \
        {name: value + (two.sums[name] - value) * share for name, value in one.sums.items()}
    return replace(one, forward=sized(one.forward, two.forward), deferred=sized(one.deferred, two.deferred),
                   backward=sized(one.backward, two.backward), sums=sums)


def _marks(step: _Steps) -> dict[int, dict[str, str]]:
    """Each step's marks by pass, as their JSON."""
    marks: dict[int, dict[str, str]] = {}
    for index in range(len(step.kinds)):
        info = step.mark(index)
        if info is not None:
            marks.setdefault(step.steps[index], {})[info["part"]] = step.categories[index].removeprefix(SEGMENT_MARK)
    return marks


def compose(profile: StepProfile, settings: TraceSettings, config_data: dict[str, Any], batch: int,
            seq: int) -> StepProfile:
    """`profile` (of `stub_settings(settings)`) with the real loss of `settings` in place of its stand-in, at
    (batch, seq) only."""
    config = text_config_data(config_data)
    named = symbols.standard(config)  # GPT-2 names its hidden size n_embd
    hidden, vocab = int(named["hidden_size"]), int(named["vocab_size"])
    variant = segment_variant(settings)
    inputs_shape, targets_shape = _shapes(variant, batch, seq, hidden)
    softcap = with_class_defaults(config).get("final_logit_softcapping") \
        if variant in forms.HIDDEN_INPUTS else None
    terms = basis(batch, seq)

    def at(coefficients: tuple[float, ...]) -> float:
        return sum(c * t for c, t in zip(coefficients, terms, strict=True))

    step = _Steps(profile, at)
    marks = _marks(step)
    composed: list[tuple[str, tuple[Any, ...], int, str, str, int]] = []
    replaced: set[int] = set()  # the stand-in's allocations, by index
    made_free: set[int] = set()  # the step's tensors the loss frees: their later free in the template is the loss's
    deferred: dict[int, list[tuple[str, tuple[Any, ...], int, str, str, int]]] = {}
    segment: SegmentTrace | None = None
    allocated: dict[int, set[tuple[Any, ...]]] = {}  # the loss's own tensors, by step: freed in its backward pass
    for index in range(len(step.kinds)):
        if index in replaced:
            continue
        kind, key, number = step.kinds[index], step.keys[index], step.steps[index]
        if kind == FREE and key in made_free:
            made_free.discard(key)
            continue
        phase = step.phases[index]
        if phase != "forward" and deferred.get(number):
            composed.extend(deferred.pop(number))
        info = step.mark(index)
        if info is None:
            composed.append(step.event(index))
            continue
        if info["part"] not in ("forward", "backward"):
            continue  # an accumulation that stays where the step has it (a tied head's waits for the embedding's)
        step_marks = marks[number]
        segment = _segment(variant, inputs_shape, targets_shape, hidden, vocab, step_marks["forward"],
                           step_marks["backward"], softcap, "compiled-loss" in settings.runner_step)
        forward = info["part"] == "forward"
        results = [segment.result] if forward else [grad for grad in segment.grads if grad is not None]
        stand_ins = step.allocations_after(index, len(results))
        replaced.update(stand_ins)
        into_step = dict(zip(results, (step.keys[i] for i in stand_ins), strict=True))
        first = json.loads(step_marks["forward"])
        held = {"inputs": first["inputs"], "targets": first["targets"], "grad": info["grad"]}
        blocks = {} if forward else _accumulations(step, stand_ins[-1] if stand_ins else index, replaced)
        # A gradient that is a view (F.linear's transposed weight gradient, from one chunk) and waits for another of
        # the same weight (a tied head's, for the embedding's) is summed with it out of place by autograd, where the
        # stand-in's is summed in place: such a step is traced instead. One accumulated as the loss returns it (an
        # untied head's) is accumulated as the stand-in's is (test_compose.py checks both).
        if not forward and any(view and name != "inputs" and name not in blocks
                               for name, view in segment.views.items()):
            raise NotComposable("the loss returns a gradient that is a view, summed later with another of its weight")
        own = allocated.setdefault(number, set())
        if forward:  # the step's tensors the loss keeps for its backward pass die there, not where the step drops them
            made_free.update(kept[1] for item in segment.backward if item.kind == FREE and segment.externals.get(
                item.key) in ("inputs", "targets") and (kept := _mapped(item, segment, into_step, held, number)))
        for position, item in enumerate(segment.forward if forward else segment.backward):
            for name in [name for name in blocks if segment.accumulated.get(name) == position]:
                composed.extend(step.event(i) for i in blocks.pop(name))
            mapped = _mapped(item, segment, into_step, held, number)
            if mapped is None or (item.kind != ALLOC and mapped[0] == "loss" and mapped not in own):
                continue  # a tensor of the harness, not of the loss
            if mapped[0] == "step" and item.kind == FREE and (forward or segment.externals.get(item.key) == "grad"):
                made_free.add(mapped[1])
            own.add(mapped)
            composed.append((item.kind, mapped, item.nbytes, item.category, phase, number))
        for indices in blocks.values():  # complete as the loss ends
            composed.extend(step.event(i) for i in indices)
        if forward:
            deferred[number] = [(FREE, mapped, 0, "", phase, number) for item in segment.deferred
                                if (mapped := _mapped(item, segment, into_step, held, number)) in own]
    for number in sorted(deferred):
        composed.extend(deferred[number])
    figures = _Figures(lambda: _figures(profile, segment, at, variant, inputs_shape, targets_shape, hidden, vocab,
                                        marks, softcap, "compiled-loss" in settings.runner_step))
    return StepProfile(profile.layers, _renumbered(composed), profile.facts, figures)


class _Steps:
    """The template's events by column (profile.EventColumns), each allocation's size at the shape evaluated once
    per distinct polynomial."""

    def __init__(self, profile: StepProfile, at: Callable[[tuple[float, ...]], float]) -> None:
        columns = profile.columns()
        self.kinds, self.keys, self.sizes = columns.kinds, columns.keys, columns.sizes
        self.categories, self.phases, self.steps = columns.categories, columns.phases, columns.steps
        self.nbytes = [round(at(poly)) if len(poly) else 0 for poly in columns.polys]

    def event(self, index: int) -> tuple[str, tuple[Any, ...], int, str, str, int]:
        kind = self.kinds[index]
        return (kind, ("step", self.keys[index]), self.nbytes[self.sizes[index]] if kind == ALLOC else 0,
                self.categories[index], self.phases[index], self.steps[index])

    def mark(self, index: int) -> dict[str, Any] | None:
        """The stand-in's mark at `index` (its part, and what it holds), or None for an event of the step."""
        category = self.categories[index]
        if self.kinds[index] == RECLASS and self.keys[index] == -1 and category.startswith(SEGMENT_MARK):
            return json.loads(category.removeprefix(SEGMENT_MARK))  # type: ignore[no-any-return]
        return None

    def allocations_after(self, index: int, count: int) -> list[int]:
        """The indices of the next `count` allocations after `index` (the stand-in's results)."""
        found: list[int] = []
        for i in range(index + 1, len(self.kinds)):
            if len(found) == count:
                break
            if self.kinds[i] == ALLOC:
                found.append(i)
        return found


class NotComposable(Exception):
    """The loss's trace does not fit its stand-in's place in the template: the step is traced instead."""


def _accumulations(step: _Steps, last: int, replaced: set[int]) -> dict[str, list[int]]:
    """The accumulations of the head's gradients the step runs as soon as the stand-in returns them (only frees
    between): each moves to where the loss completes that gradient. Their indices, by parameter."""
    blocks: dict[str, list[int]] = {}
    index = last + 1
    while index < len(step.kinds):
        info = step.mark(index)
        if info is None and step.kinds[index] == FREE:
            index += 1
            continue
        if info is None or not info["part"].startswith("accumulate-start:"):
            break
        name = info["part"].split(":", 1)[1]
        end = next(i for i in range(index + 1, len(step.kinds))
                   if (mark := step.mark(i)) is not None and mark["part"] == f"accumulate-end:{name}")
        blocks[name] = list(range(index + 1, end))
        replaced.update(range(index, end + 1))
        index = end + 1
    return blocks


def _mapped(item: Event, segment: SegmentTrace, into_step: dict[int, int], held: dict[str, Any],
            step: int) -> tuple[Any, ...] | None:
    """The key of a loss's event in the composed step: the stand-in's where the loss's result or gradients stand
    in for it, the step's own for the step's tensors the loss frees, the loss's own (by step) otherwise; None for
    what the step does not hold."""
    if item.key in into_step:
        return ("step", into_step[item.key])
    if item.key in segment.externals:
        key = held[segment.externals[item.key]]
        return None if key is None or item.kind != FREE else ("step", key)
    return ("loss", step, item.key)


def _renumbered(composed: list[tuple[str, tuple[Any, ...], int, str, str, int]]) -> LazyEvents:
    """Keys numbered in allocation order, as a direct trace numbers them; by column, as a replay reads them."""
    numbers: dict[tuple[Any, ...], int] = {}
    zeros = (0.0,) * (len(BASIS_NAMES) - 1)
    polys: dict[tuple[float, ...], int] = {}
    kinds: list[str] = []
    keys: list[int] = []
    sizes: list[int] = []
    categories: list[str] = []
    phases: list[str] = []
    steps: list[int] = []
    for kind, key, nbytes, category, phase, step in composed:
        if kind == ALLOC:
            numbers[key] = len(numbers)
            size: tuple[float, ...] = (float(nbytes), *zeros)
        elif key in numbers:
            size = ()
        else:
            continue
        kinds.append(kind)
        keys.append(numbers[key])
        sizes.append(polys.setdefault(size, len(polys)))
        categories.append(category)
        phases.append(phase)
        steps.append(step)
    columns = EventColumns(kinds, keys, sizes, categories, phases, steps, list(polys))

    def build() -> list[ProfileEvent]:
        return [ProfileEvent(*event) for event in zip(kinds, keys, (columns.polys[size] for size in sizes),
                                                      categories, phases, steps, strict=True)]

    return LazyEvents(build, lambda: columns)


class _Figures(dict):  # type: ignore[type-arg]
    """A composed step's figures, filled on first read: the loss's FLOPs take a pass of their own, which a sweep
    of shapes (it reads memory only) does without."""

    def __init__(self, fill: Callable[[], dict[str, tuple[float, ...]]]) -> None:
        super().__init__()
        self._fill: Callable[[], dict[str, tuple[float, ...]]] | None = fill

    def _filled(self) -> None:
        if self._fill is not None:
            fill, self._fill = self._fill, None
            self.update(fill())

    def __getitem__(self, key: str) -> tuple[float, ...]:
        self._filled()
        return super().__getitem__(key)  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        self._filled()
        return super().__iter__()

    def __len__(self) -> int:
        self._filled()
        return super().__len__()

    def __contains__(self, key: object) -> bool:
        self._filled()
        return super().__contains__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._filled()
        return super().get(key, default)

    def items(self) -> Any:
        self._filled()
        return super().items()

    def keys(self) -> Any:
        self._filled()
        return super().keys()

    def values(self) -> Any:
        self._filled()
        return super().values()


def _figures(profile: StepProfile, segment: SegmentTrace | None, at: Any, variant: str, inputs_shape: tuple[int, ...],
             targets_shape: tuple[int, ...], hidden: int, vocab: int, marks: dict[int, dict[str, str]],
             softcap: float | None, compiled: bool) -> dict[str, tuple[float, ...]]:
    """The step's FLOPs and summed figures at the shape: the template's, and the loss's once (one counted pass)."""
    zeros = (0.0,) * (len(BASIS_NAMES) - 1)
    figures = {name: at(coefficients) for name, coefficients in profile.flops.items()}
    for name, pairs in profile.capped.items():
        figures[name] = figures.get(name, 0.0) + sum(min(at(a), at(b)) for a, b in pairs)
    if segment is not None:
        first = json.loads(marks[max(marks)]["forward"])
        traced = tuple(first[name] for name in forms.TRACED)
        sums = segment.sums
        if sums is None:  # a loss from its form holds no figures: they take its trace
            sums = _traced(variant, inputs_shape, targets_shape, hidden, vocab, traced,
                           json.loads(marks[max(marks)]["backward"])["category"], softcap, compiled, False,
                           figures=True).sums
        loss = {**(sums or {}), **_flops(variant, inputs_shape, targets_shape, hidden, vocab, traced, softcap,
                                         compiled)}
        for name, value in loss.items():
            figures[name] = figures.get(name, 0.0) + value
    return {name: (value, *zeros) for name, value in figures.items()}


@functools.lru_cache(maxsize=16)
def _flops(variant: str, inputs_shape: tuple[int, ...], targets_shape: tuple[int, ...], hidden: int, vocab: int,
           traced: tuple[Any, ...], softcap: float | None, compiled: bool) -> dict[str, float]:
    from tunecast.estimate.tracer import segment_flops

    fields = dict(zip(forms.TRACED, traced, strict=True))
    return segment_flops(variant, inputs_shape=inputs_shape, inputs_dtype=fields["inputs_dtype"],
                         targets_shape=targets_shape, hidden=hidden, vocab=vocab, weight_dtype=fields["weight_dtype"],
                         trains=fields["trains"], bias=fields["bias"], autocast=fields["autocast"], softcap=softcap,
                         compiled=compiled)
