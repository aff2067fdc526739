"""A tied weight's two gradients: autograd sums them in place on real tensors when the first is a fresh dense
tensor, out of place under a dispatch mode. The tracer counts what real tensors do (tracer._sums_in_place)."""

import contextlib
from typing import Any

import pytest
from tests.models import shallow_llama

from tunecast.config.spec import RunSpec
from tunecast.estimate import tracer
from tunecast.step.settings import TraceSettings

BATCH, SEQ = 2, 64
VOCAB, HIDDEN = 4096, 64
TABLE_BYTES = VOCAB * HIDDEN * 4  # one fp32 copy of the tied embedding


def backward_tables(config: dict[str, Any], settings: TraceSettings) -> tuple[int, int]:
    """Allocations of a table-sized tensor in the measured step's backward pass, and the bytes live after the
    last of them (where the tied weight's two gradients meet)."""
    trace = tracer.trace_step(config, settings, BATCH, SEQ, count_flops=False)
    live = at_last = tables = 0
    sizes: dict[int, int] = {}
    for event in trace.events:
        if event.kind == tracer.ALLOC:
            sizes[event.key] = event.nbytes
            live += event.nbytes
            if event.step == tracer.STEPS and event.phase == "backward" and event.nbytes == TABLE_BYTES:
                tables, at_last = tables + 1, live
        elif event.kind == tracer.FREE:
            live -= sizes.pop(event.key)
    return tables, at_last


def out_of_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracer, "_sums_in_place", lambda loss, recorder: contextlib.nullcontext())


def settings(**spec: Any) -> TraceSettings:
    return TraceSettings.from_spec(RunSpec(model="x", method="full", precision="fp32", **spec))


def test_a_fresh_first_gradient_of_a_tied_weight_takes_the_second_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's fused head makes the head's gradient afresh: the embedding's is added into it, no third copy."""
    config = shallow_llama(tie_word_embeddings=True, vocab_size=VOCAB)
    fused = settings(runner="trl")
    assert "fused-head" in fused.runner_step
    tables, live = backward_tables(config, fused)
    out_of_place(monkeypatch)
    tables_as_dispatched, live_as_dispatched = backward_tables(config, fused)
    assert tables_as_dispatched == tables + 1
    # the sum's copy, less what the embedding's backward freed between its gradient and the sum (its indices)
    assert TABLE_BYTES // 2 < live_as_dispatched - live <= TABLE_BYTES


def test_a_view_first_gradient_is_summed_out_of_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard head's gradient is a transposed view (F.linear's backward): summed out of place on real
    tensors too, so the trace keeps the copy."""
    config = shallow_llama(tie_word_embeddings=True, vocab_size=VOCAB)
    traced = backward_tables(config, settings())
    out_of_place(monkeypatch)
    assert backward_tables(config, settings()) == traced


def test_untied_models_are_traced_without_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    config = shallow_llama(vocab_size=VOCAB)
    fused = settings(runner="trl")
    traced = backward_tables(config, fused)
    out_of_place(monkeypatch)
    assert backward_tables(config, fused) == traced
