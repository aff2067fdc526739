"""A loss traced alone (compose.py), at any size, from two traces of it at marker sizes: its form.

The losses a composition traces alone split their work into chunks (step/chunking.py). Within one layout (how
many chunks run, and for TRL's fused head how many vocabulary tiles) the loss allocates the same tensors in the
same order at every size, only of other sizes, and each size is a product of the sizes the layout names: the
micro-batch and length (or the tokens), the hidden size and the vocabulary, the chunks' and tiles' lengths. So a
trace of the loss at marker sizes (distinct primes, or one times a power of two where a length is a sum) reads as
polynomials in them (symbols.factor), a second trace at other markers checks the reading, and the loss at any
size of that layout is those polynomials evaluated: no torch, no trace. `tests/unit/estimate/test_forms.py` checks
forms against traces of each loss, event by event.

A layout holds where every chunk the loss runs is one of those it names: the chunks run once
(step/observer.py REPEATS_ONCE: the first two and the last, those between as one piece not run), or a loss of at
most three chunks (and tiles), which runs them all either way; torchtune's eight chunks always run, and so does
every vocabulary tile of TRL's fused head in a layout of more than three.
"""

from __future__ import annotations

import functools
import json
import lzma
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from tunecast.estimate import progress, symbols
from tunecast.estimate.tracer import ALLOC, Event, SegmentTrace
from tunecast.step.chunking import Chunks, chunks_of
from tunecast.step.variants import STUB_INPUTS, STUBS

# The losses whose inputs are the hidden states (batch, length, hidden), split along the length (and whose chunks cap
# their logits where the model does: step/loss.py _chunk_loss); the others take the trained tokens (tokens, hidden).
HIDDEN_INPUTS = tuple(variant for variant, stub in STUBS.items() if STUB_INPUTS[stub] == "hidden")
# What of a stand-in's mark a loss's trace depends on (compose.py), besides the backward pass's category.
TRACED = ("inputs_dtype", "weight_dtype", "trains", "bias", "bias_trains", "autocast", "category")
# The slot of symbols.VARIABLES each size of a form is written in.
_BATCH, _LENGTH, _HIDDEN, _VOCAB = "b", "s", "x", "V"
_CHUNK, _LAST, _REST = "k", "m", "r"  # a chunk's length, the last chunk's, the chunks not run as one piece
_TILE, _TILE_LAST = "e", "i"  # TRL's fused head: a vocabulary tile's width, the last tile's
# The vocabulary tiles a form of TRL's whole fused head holds (every one run, where its rows take at most three
# tiles): 10 tiles of 32,768 entries hold Gemma 3's 262,208 (9 tiles).
_TILES = 10
# Markers are drawn from the primes above 7, so that none is taken for a constant (symbols._CONSTANTS), below this.
_POOL_END = 20000
_LONG = 1000  # chunks and tiles are drawn above this, the pieces that end them below
SHIPPED = "loss-forms.json.xz"  # built by scripts/build_loss_forms.py
FORMAT = 2  # raised when a form's reading changes (or step/loss.py's losses do): shipped forms of another are not used

Layout = tuple[int, int, tuple[str, ...]]
"""(chunks the loss runs: 1, 2, 3, or 4 for three and a piece not run; for torchtune every chunk, up to 8;
vocabulary tiles of TRL's fused head: 1, 2 or 3, or 4 to 10 where every tile runs, else 0; the sizes that are 1 of
_ONES: a dimension of one is no size like the others, torch makes views where it copies others and broadcasts it)."""
_ONES = (_BATCH, _LAST)  # a micro-batch of one; a last chunk of one token (or position)


@dataclass(frozen=True)
class Family:
    """What a loss's trace depends on besides its sizes (compose.py's marks)."""

    variant: str
    inputs_dtype: str
    weight_dtype: str
    trains: bool
    bias: bool
    bias_trains: bool
    autocast: str | None
    category: str
    backward_category: str
    softcap: float | None

    @classmethod
    def of(cls, variant: str, fields: Mapping[str, Any], backward_category: str, softcap: float | None) -> Family:
        """The loss `variant` traced with a mark's `fields` (those of TRACED)."""
        return cls(variant, *(fields[name] for name in TRACED), backward_category, softcap)

    def key(self) -> str:
        return json.dumps([self.variant, self.inputs_dtype, self.weight_dtype, self.trains, self.bias,
                           self.bias_trains, self.autocast, self.category, self.backward_category, self.softcap])


@dataclass(frozen=True)
class Form:
    """A loss's events in one layout, each allocation's size a polynomial (symbols.Poly)."""

    passes: tuple[tuple[tuple[str, int, symbols.Poly, str, str, int], ...], ...]  # forward, deferred, backward
    result: int
    grads: tuple[int | None, ...]
    accumulated: tuple[tuple[str, int], ...]
    views: tuple[tuple[str, bool], ...]
    externals: tuple[tuple[int, str], ...]

    def at(self, values: Mapping[str, int]) -> SegmentTrace:
        """The loss's trace at these sizes (its summed figures are not held: `sums` is None)."""
        sized: dict[symbols.Poly, int] = {}

        def events(items: tuple[tuple[str, int, symbols.Poly, str, str, int], ...]) -> list[Event]:
            return [Event(kind, key, sized.setdefault(poly, symbols.evaluate(poly, values)) if poly else 0,
                          category, phase, step) for kind, key, poly, category, phase, step in items]

        forward, deferred, backward = (events(items) for items in self.passes)
        return SegmentTrace(forward, deferred, backward, self.result, self.grads, dict(self.accumulated),
                            dict(self.views), dict(self.externals), None)

    def to_json(self) -> dict[str, Any]:
        return {"passes": [[[kind, key, symbols.to_json(poly), category, phase, step]
                            for kind, key, poly, category, phase, step in items] for items in self.passes],
                "result": self.result, "grads": list(self.grads), "accumulated": [list(a) for a in self.accumulated],
                "views": [list(v) for v in self.views], "externals": [list(e) for e in self.externals]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Form:
        passes = tuple(tuple((kind, int(key), symbols.from_json(poly), category, phase, int(step))
                             for kind, key, poly, category, phase, step in items) for items in data["passes"])
        return cls(passes, int(data["result"]), tuple(data["grads"]),
                   tuple((name, int(index)) for name, index in data["accumulated"]),
                   tuple((name, bool(view)) for name, view in data["views"]),
                   tuple((int(key), name) for key, name in data["externals"]))


def layout(variant: str, inputs_shape: tuple[int, ...], hidden: int, vocab: int, chunks: Chunks,
           once: bool) -> tuple[Layout, dict[str, int]] | None:
    """The layout of the loss at this size and the values of its form's sizes there; None where no form holds it
    (the whole loss, not run once, in more than three chunks, or TRL's fused head in more than _TILES tiles)."""
    rows, columns = chunks.rows, chunks.columns
    # the whole loss: torchtune's chunks; a loss of at most three chunks (TRL's fused head: of every tile of them)
    runs_all = variant == "output-chunks" or (len(rows) <= 3 and len(columns) <= _TILES)
    if not once and not runs_all:
        return None
    hidden_inputs = variant in HIDDEN_INPUTS
    values = {_HIDDEN: hidden, _VOCAB: vocab}
    if hidden_inputs:
        values[_BATCH], values[_LENGTH] = inputs_shape[0], inputs_shape[1]
    else:
        values[_LENGTH] = inputs_shape[0]
    # torchtune runs every chunk; run once, a split runs three and a piece between them that is not run
    runs = len(rows) if variant == "output-chunks" or len(rows) <= 3 else 4 if hidden_inputs else 3
    if len(rows) >= 2:
        values[_CHUNK], values[_LAST] = rows[0], rows[-1]
    if runs == 4:
        values[_REST] = sum(rows[2:-1])
    tiles = 0
    if variant == "fused-head":
        tiles = min(len(columns), 3) if once else len(columns)
        values[_TILE] = chunks.tile[1]
        if len(columns) >= 2:
            values[_TILE_LAST] = columns[-1]
    ones = tuple(name for name in _ONES if values.get(name) == 1)
    if any(value == 1 for name, value in values.items() if name not in ones):
        return None  # another size of one (a chunk of one position: more chunks than positions): traced
    return (runs, tiles, ones), values


def segment(family: Family, inputs_shape: tuple[int, ...], hidden: int, vocab: int, once: bool,
            build: bool = True) -> SegmentTrace | None:
    """The loss's trace at this size from its form; None where no form holds it (or, without `build`, none is
    shipped or read in this process)."""
    found = layout(family.variant, inputs_shape, hidden, vocab, chunks_of(family.variant, inputs_shape, vocab), once)
    if found is None:
        return None
    shape, values = found
    form = shipped(family, shape)
    if form is None and (build or (family, shape) in _READ):
        form = read(family, shape)
    return None if form is None else form.at(values)


_READ: dict[tuple[Family, Layout], Form | None] = {}


def read(family: Family, shape: Layout) -> Form | None:
    """The form of the loss in this layout, read off a trace at marker sizes and checked on a second at others
    (torch, a fraction of a second each; kept for this process); None where the traces do not read as one form."""
    if (family, shape) not in _READ:
        progress.progress(f"tracing the loss ({family.variant}) at marker sizes to read its form: two traces of a "
                          "fraction of a second, after importing torch (about 3 s) the first time")
        _READ[family, shape] = _read(family, shape)
    return _READ[family, shape]


def _read(family: Family, shape: Layout) -> Form | None:
    first = _markers(family.variant, shape, frozenset())
    if first is None:
        return None
    second = _markers(family.variant, shape, frozenset(first[0].values()))
    if second is None:
        return None
    read_at, checked_at = _traced(family, first), _traced(family, second)
    passes = []
    for items, checks in zip(_passes(read_at), _passes(checked_at), strict=True):
        if len(items) != len(checks):
            return None
        events = []
        for item, check in zip(items, checks, strict=True):
            if (item.kind, item.key, item.category, item.phase, item.step) != \
                    (check.kind, check.key, check.category, check.phase, check.step):
                return None
            poly: symbols.Poly = ()
            if item.kind == ALLOC and item.nbytes:
                found = symbols.factor(item.nbytes, first[0])
                if found is None or symbols.evaluate(found, second[0]) != check.nbytes:
                    return None
                poly = found
            elif check.nbytes != item.nbytes:
                return None
            events.append((item.kind, item.key, poly, item.category, item.phase, item.step))
        passes.append(tuple(events))
    structure = (read_at.result, read_at.grads, read_at.accumulated, read_at.views, read_at.externals)
    if structure != (checked_at.result, checked_at.grads, checked_at.accumulated, checked_at.views,
                     checked_at.externals):
        return None
    return Form(tuple(passes), read_at.result, read_at.grads, tuple(sorted(read_at.accumulated.items())),
                tuple(sorted(read_at.views.items())), tuple(sorted(read_at.externals.items())))


def _passes(trace: SegmentTrace) -> tuple[list[Event], list[Event], list[Event]]:
    return trace.forward, trace.deferred, trace.backward


Markers = tuple[dict[str, int], tuple[int, ...], tuple[int, ...], Chunks]
"""(the marker value of each size, the inputs' shape, the targets' shape, the chunks)."""


@functools.cache
def _primes() -> tuple[int, ...]:
    return tuple(n for n in range(11, _POOL_END) if all(n % d for d in range(2, int(n ** 0.5) + 1)))


def _markers(variant: str, shape: Layout, avoid: frozenset[int]) -> Markers | None:
    """Marker sizes in this layout, none of them in `avoid`: distinct primes above 7, and each length that is a sum
    of chunks a prime times a power of two (so that it factors on its own); None where the pool runs out."""
    runs, tiles, ones = shape
    used = set(avoid)
    pool = _primes()
    primes = frozenset(pool)

    def take(low: int = 0) -> int:
        """The first unused prime of the pool above `low`: chunks and tiles are drawn above the pieces that end
        them, since no last chunk is longer than the others."""
        value = next(p for p in pool if p > low and p not in used)
        used.add(value)
        return value

    def core(total: int) -> int:
        while total % 2 == 0:
            total //= 2
        return total

    def private(total: int) -> bool:
        """Whether a length that is a sum factors on its own: an unused prime times a power of two."""
        return core(total) in primes and core(total) not in used and total not in used

    def sum_of(parts: int, *fixed: int) -> tuple[int, int]:
        """A last piece (an unused prime below `fixed[0]`) that makes `parts` pieces of `fixed[0]` plus `fixed[1:]`
        a length that factors on its own: (last, length)."""
        for last in pool:
            if last >= fixed[0]:
                break
            total = parts * fixed[0] + sum(fixed[1:]) + last
            if last not in used and private(total):
                used.update((last, total, core(total)))
                return last, total
        raise StopIteration

    def chunk_before_one(parts: int, rest: int) -> tuple[int, int]:
        """A chunk length (an unused prime above _LONG) that makes `parts` chunks of it, `rest` and a last chunk of
        one a length that factors on its own: (chunk, length)."""
        for chunk in pool:
            total = parts * chunk + rest + 1
            if chunk > _LONG and chunk not in used and private(total):
                used.update((chunk, total, core(total)))
                return chunk, total
        raise StopIteration

    try:
        values = {_HIDDEN: take(), _VOCAB: take()}
        hidden_inputs = variant in HIDDEN_INPUTS
        if hidden_inputs and _BATCH not in ones:
            values[_BATCH] = take()
        if runs == 1:
            rows: tuple[int, ...] = (take(),)
            length = rows[0]
        else:
            rest = take(_LONG) if runs == 4 and hidden_inputs else 0  # the piece not run (observer.pieces)
            repeats = 2 if rest else runs - 1
            if _LAST in ones:
                last = 1
                chunk, length = chunk_before_one(repeats, rest)
            else:
                chunk = take(_LONG)
                last, length = sum_of(repeats, chunk, *((rest,) if rest else ()))
            rows = (chunk,) * repeats + ((rest,) if rest else ()) + (last,)
            values.update({_CHUNK: chunk, **({_REST: rest} if rest else {}), **({} if last == 1 else {_LAST: last})})
        values[_LENGTH] = length
        columns: tuple[int, ...] = ()
        tile = (0, 0)
        if variant == "fused-head":
            width = take(_LONG)
            values[_TILE] = width
            if tiles == 1:
                columns = (values[_VOCAB],)
            else:
                used.discard(values[_VOCAB])
                tile_last, vocab = sum_of(tiles - 1, width)
                values[_VOCAB], values[_TILE_LAST] = vocab, tile_last
                columns = (width,) * (tiles - 1) + (tile_last,)
            tile = (rows[0], width)
    except StopIteration:
        return None
    if hidden_inputs:
        batch = values.get(_BATCH, 1)
        return values, (batch, length, values[_HIDDEN]), (batch, length), Chunks(rows, columns, tile)
    return values, (length, values[_HIDDEN]), (length,), Chunks(rows, columns, tile)


def _traced(family: Family, markers: Markers) -> SegmentTrace:
    from tunecast.estimate.tracer import trace_segment

    values, inputs_shape, targets_shape, chunks = markers
    return trace_segment(family.variant, inputs_shape=inputs_shape, inputs_dtype=family.inputs_dtype,
                         targets_shape=targets_shape, hidden=values[_HIDDEN], vocab=values[_VOCAB],
                         weight_dtype=family.weight_dtype, trains=family.trains, bias=family.bias,
                         bias_trains=family.bias_trains, autocast=family.autocast, category=family.category,
                         backward_category=family.backward_category, softcap=family.softcap, compiled=False,
                         once=family.variant != "fused-head" or len(chunks.columns) <= 3, chunks=chunks)


def layouts(variant: str) -> Iterator[Layout]:
    """Every layout of the loss `variant`."""
    runs = range(1, 9) if variant == "output-chunks" else range(1, 5 if variant in HIDDEN_INPUTS else 4)
    for count in runs:
        for tiles in range(1, _TILES + 1) if variant == "fused-head" else (0,):
            for batch in ((), (_BATCH,)) if variant in HIDDEN_INPUTS else ((),):
                for last in ((), (_LAST,)) if count >= 2 else ((),):
                    yield count, tiles, batch + last


def layout_key(shape: Layout) -> str:
    """A layout as the shipped forms are keyed."""
    return json.dumps([shape[0], shape[1], list(shape[2])])


@functools.cache
def shipped(family: Family, shape: Layout) -> Form | None:
    """The form shipped with the package for this loss and layout (scripts/build_loss_forms.py), if any."""
    found = _shipped_layouts(family.key()).get(layout_key(shape))
    return None if found is None else Form.from_json(found)


@functools.cache
def _shipped_layouts(key: str) -> dict[str, Any]:
    """The shipped forms of one loss, by layout (each loss's are kept as text, read when it is asked for)."""
    text = _shipped_forms().get(key)
    layouts: dict[str, Any] = json.loads(text) if text is not None else {}
    return layouts


@functools.cache
def _shipped_forms() -> dict[str, str]:
    """The shipped forms, where they were read at the installed torch's release (a trace runs through its code)."""
    from tunecast.estimate.profiles import release

    data = resources.files("tunecast.estimate").joinpath("data").joinpath(SHIPPED)
    if not data.is_file():
        return {}
    loaded: dict[str, Any] = json.loads(lzma.decompress(data.read_bytes()))
    if loaded.get("torch") != release("torch") or loaded.get("format") != FORMAT:
        return {}
    found: dict[str, str] = loaded["forms"]
    return found
