"""Steps whose loss a template cannot hold, composed: the template of the rest of the step, and the loss traced
alone at the asked shape.

TRL's fused LM head, TRL 1.7-1.14's chunked loss, torchtune's LinearCrossEntropyLoss and unsloth's fused
cross-entropy (step/variants.py SEGMENT_LOSSES) split the logits into chunks whose number follows the length, which
no polynomial in the length holds. Everything else in such a step is what a template holds: so the template is
built with a stand-in for the loss (step/loss.py SegmentStub), which keeps the loss's inputs as the loss does, marks
where the loss runs in each pass, and allocates its result and its gradients. An estimate at (b, s) traces the loss
alone on fake tensors of that size (tracer.trace_segment: no model, a fraction of a second) and puts its events in
place of each mark, its result and gradients where the stand-in's were, and the frees it makes of the step's
tensors (its inputs, its incoming gradient) where it makes them. The profiles hold that one shape; a sweep composes
each shape it asks for. `tests/unit/estimate/test_compose.py` checks composed profiles against direct traces of the
runners' steps, event by event.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

from tunecast.estimate import symbols
from tunecast.estimate.profile import BASIS_NAMES, ProfileEvent, StepProfile, basis
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


# What of a mark the loss's trace depends on (not the keys of the step's tensors, which differ with depth).
_TRACED = ("inputs_dtype", "weight_dtype", "trains", "bias", "bias_trains", "autocast", "category")


def _segment(variant: str, inputs_shape: tuple[int, ...], targets_shape: tuple[int, ...], hidden: int, vocab: int,
             forward: str, backward: str, softcap: float | None, compiled: bool) -> SegmentTrace:
    first, second = json.loads(forward), json.loads(backward)
    return _traced(variant, inputs_shape, targets_shape, hidden, vocab, tuple(first[name] for name in _TRACED),
                   second["category"], softcap, compiled, repeating_once())


@functools.lru_cache(maxsize=16)
def _traced(variant: str, inputs_shape: tuple[int, ...], targets_shape: tuple[int, ...], hidden: int, vocab: int,
            traced: tuple[Any, ...], backward_category: str, softcap: float | None, compiled: bool,
            once: bool) -> SegmentTrace:
    from tunecast.estimate.tracer import trace_segment

    fields = dict(zip(_TRACED, traced, strict=True))
    return trace_segment(variant, inputs_shape=inputs_shape, inputs_dtype=fields["inputs_dtype"],
                         targets_shape=targets_shape, hidden=hidden, vocab=vocab, weight_dtype=fields["weight_dtype"],
                         trains=fields["trains"], bias=fields["bias"], bias_trains=fields["bias_trains"],
                         autocast=fields["autocast"], category=fields["category"],
                         backward_category=backward_category, softcap=softcap, compiled=compiled, once=once)


def _marks(events: list[ProfileEvent]) -> dict[int, dict[str, str]]:
    """Each step's marks by pass, as their JSON."""
    marks: dict[int, dict[str, str]] = {}
    for event in events:
        if event.kind == RECLASS and event.key == -1 and event.category.startswith(SEGMENT_MARK):
            text = event.category.removeprefix(SEGMENT_MARK)
            marks.setdefault(event.step, {})[json.loads(text)["part"]] = text
    return marks


def compose(profile: StepProfile, settings: TraceSettings, config_data: dict[str, Any], batch: int,
            seq: int) -> StepProfile:
    """`profile` (of `stub_settings(settings)`) with the real loss of `settings` in place of its stand-in, at
    (batch, seq) only."""
    config = text_config_data(config_data)
    named = symbols.standard(config)  # GPT-2 names its hidden size n_embd
    hidden, vocab = int(named["hidden_size"]), int(named["vocab_size"])
    variant = segment_variant(settings)
    stub = STUBS[variant]
    if STUB_INPUTS[stub] == "hidden":
        inputs_shape: tuple[int, ...] = (batch, seq, hidden)
        targets_shape: tuple[int, ...] = (batch, seq)
    else:
        inputs_shape, targets_shape = (batch * (seq - 1), hidden), (batch * (seq - 1),)
    softcap = config.get("final_logit_softcapping") if variant in ("fused-chunks", "loss-chunks") else None
    terms = basis(batch, seq)

    def at(coefficients: tuple[float, ...]) -> float:
        return sum(c * t for c, t in zip(coefficients, terms, strict=True))

    events = list(profile.events)
    marks = _marks(events)
    composed: list[tuple[str, tuple[Any, ...], int, str, str, int]] = []
    replaced: set[int] = set()  # the stand-in's allocations, by index
    made_free: set[int] = set()  # the step's tensors the loss frees: their later free in the template is the loss's
    deferred: dict[int, list[tuple[str, tuple[Any, ...], int, str, str, int]]] = {}
    segment: SegmentTrace | None = None
    allocated: dict[int, set[tuple[Any, ...]]] = {}  # the loss's own tensors, by step: freed in its backward pass
    for index, event in enumerate(events):
        if index in replaced:
            continue
        if event.kind == FREE and event.key in made_free:
            made_free.discard(event.key)
            continue
        if event.phase != "forward" and deferred.get(event.step):
            composed.extend(deferred.pop(event.step))
        info = _mark(event)
        if info is None:
            composed.append(_step_event(event, at))
            continue
        if info["part"] not in ("forward", "backward"):
            continue  # an accumulation that stays where the step has it (a tied head's waits for the embedding's)
        step_marks = marks[event.step]
        segment = _segment(variant, inputs_shape, targets_shape, hidden, vocab, step_marks["forward"],
                           step_marks["backward"], softcap, "compiled-loss" in settings.runner_step)
        forward = info["part"] == "forward"
        results = [segment.result] if forward else [key for key in segment.grads if key is not None]
        stand_ins = [i for i in range(index + 1, len(events)) if events[i].kind == ALLOC][:len(results)]
        replaced.update(stand_ins)
        into_step = dict(zip(results, (events[i].key for i in stand_ins), strict=True))
        first = json.loads(step_marks["forward"])
        held = {"inputs": first["inputs"], "targets": first["targets"], "grad": info["grad"]}
        blocks = {} if forward else _accumulations(events, stand_ins[-1] if stand_ins else index, replaced)
        # A gradient that is a view (F.linear's transposed weight gradient, from one chunk) and waits for another of
        # the same weight (a tied head's, for the embedding's) is summed with it out of place by autograd, where the
        # stand-in's is summed in place: such a step is traced instead. One accumulated as the loss returns it (an
        # untied head's) is accumulated as the stand-in's is (test_compose.py checks both).
        if not forward and any(view and name != "inputs" and name not in blocks
                               for name, view in segment.views.items()):
            raise NotComposable("the loss returns a gradient that is a view, summed later with another of its weight")
        own = allocated.setdefault(event.step, set())
        if forward:  # the step's tensors the loss keeps for its backward pass die there, not where the step drops them
            made_free.update(key[1] for item in segment.backward if item.kind == FREE and segment.externals.get(
                item.key) in ("inputs", "targets") and (key := _mapped(item, segment, into_step, held, event.step)))
        for position, item in enumerate(segment.forward if forward else segment.backward):
            for name in [name for name in blocks if segment.accumulated.get(name) == position]:
                composed.extend(_step_event(events[i], at) for i in blocks.pop(name))
            key = _mapped(item, segment, into_step, held, event.step)
            if key is None or (item.kind != ALLOC and key[0] == "loss" and key not in own):
                continue  # a tensor of the harness, not of the loss
            if key[0] == "step" and item.kind == FREE and (forward or segment.externals.get(item.key) == "grad"):
                made_free.add(key[1])
            own.add(key)
            composed.append((item.kind, key, item.nbytes, item.category, event.phase, event.step))
        for indices in blocks.values():  # complete as the loss ends
            composed.extend(_step_event(events[i], at) for i in indices)
        if forward:
            deferred[event.step] = [(FREE, key, 0, "", event.phase, event.step) for item in segment.deferred
                                    if (key := _mapped(item, segment, into_step, held, event.step)) in own]
    for step in sorted(deferred):
        composed.extend(deferred[step])
    figures = _Figures(lambda: _figures(profile, segment, at, variant, inputs_shape, targets_shape, hidden, vocab,
                                        marks, softcap, "compiled-loss" in settings.runner_step))
    return StepProfile(profile.layers, _renumbered(composed), profile.facts, figures)


class NotComposable(Exception):
    """The loss's trace does not fit its stand-in's place in the template: the step is traced instead."""


def _mark(event: ProfileEvent) -> dict[str, Any] | None:
    if event.kind == RECLASS and event.key == -1 and event.category.startswith(SEGMENT_MARK):
        return json.loads(event.category.removeprefix(SEGMENT_MARK))  # type: ignore[no-any-return]
    return None


def _step_event(event: ProfileEvent, at: Any) -> tuple[str, tuple[Any, ...], int, str, str, int]:
    nbytes = round(at(event.size)) if event.kind == ALLOC else 0
    return (event.kind, ("step", event.key), nbytes, event.category, event.phase, event.step)


def _accumulations(events: list[ProfileEvent], last: int, replaced: set[int]) -> dict[str, list[int]]:
    """The accumulations of the head's gradients the step runs as soon as the stand-in returns them (only frees
    between): each moves to where the loss completes that gradient. Their indices, by parameter."""
    blocks: dict[str, list[int]] = {}
    index = last + 1
    while index < len(events):
        info = _mark(events[index])
        if info is None and events[index].kind == FREE:
            index += 1
            continue
        if info is None or not info["part"].startswith("accumulate-start:"):
            break
        name = info["part"].split(":", 1)[1]
        end = next(i for i in range(index + 1, len(events))
                   if (mark := _mark(events[i])) is not None and mark["part"] == f"accumulate-end:{name}")
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


def _renumbered(composed: list[tuple[str, tuple[Any, ...], int, str, str, int]]) -> list[ProfileEvent]:
    """Keys numbered in allocation order, as a direct trace numbers them."""
    numbers: dict[tuple[Any, ...], int] = {}
    zeros = (0.0,) * (len(BASIS_NAMES) - 1)
    out: list[ProfileEvent] = []
    for kind, key, nbytes, category, phase, step in composed:
        if kind == ALLOC:
            numbers[key] = len(numbers)
            out.append(ProfileEvent(ALLOC, numbers[key], (float(nbytes), *zeros), category, phase, step))
        elif key in numbers:
            out.append(ProfileEvent(kind, numbers[key], (), category, phase, step))
    return out


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
        loss = {**segment.sums, **_flops(variant, inputs_shape, targets_shape, hidden, vocab,
                                          tuple(first[name] for name in _TRACED), softcap, compiled)}
        for name, value in loss.items():
            figures[name] = figures.get(name, 0.0) + value
    return {name: (value, *zeros) for name, value in figures.items()}


@functools.lru_cache(maxsize=16)
def _flops(variant: str, inputs_shape: tuple[int, ...], targets_shape: tuple[int, ...], hidden: int, vocab: int,
           traced: tuple[Any, ...], softcap: float | None, compiled: bool) -> dict[str, float]:
    from tunecast.estimate.tracer import segment_flops

    fields = dict(zip(_TRACED, traced, strict=True))
    return segment_flops(variant, inputs_shape=inputs_shape, inputs_dtype=fields["inputs_dtype"],
                         targets_shape=targets_shape, hidden=hidden, vocab=vocab, weight_dtype=fields["weight_dtype"],
                         trains=fields["trains"], bias=fields["bias"], autocast=fields["autocast"], softcap=softcap,
                         compiled=compiled)
