"""Steps whose loss is composed onto a template (compose.py) against direct traces of those steps: event by event."""

from __future__ import annotations

import pytest
from tests.unit.estimate.test_templates import assert_exact, config

from tunecast.config.runner import apply_runner
from tunecast.config.spec import RunSpec
from tunecast.estimate import compose, profiles
from tunecast.step.settings import TraceSettings


def _settings(runner: str, method: str, version: str | None = None, loss: str = "standard") -> TraceSettings:
    spec = apply_runner(RunSpec.model_validate({"model": "x", "runner": runner, "method": method, "loss": loss,
                                                "runner_version": version, "lora": {"dropout": 0.05}}))
    return TraceSettings.from_spec(spec)


@pytest.mark.parametrize("runner, version, method, name, batch, seq, loss", [
    # TRL's fused head under autocast; tied embeddings whose head trains (full); QLoRA's casts
    ("trl", None, "lora", "Qwen/Qwen3-0.6B", 2, 64, "standard"),
    ("trl", None, "full", "Qwen/Qwen3-0.6B", 1, 48, "standard"),
    ("trl", None, "qlora", "meta-llama/Llama-2-7b-hf", 2, 40, "standard"),
    ("trl", "1.10", "lora", "meta-llama/Llama-2-7b-hf", 2, 40, "standard"),  # 256-token chunks, each recomputed
    # torchtune's 8 chunks: no autocast; full fine-tuning steps the optimizer in the backward pass
    ("torchtune", None, "lora", "Qwen/Qwen2.5-0.5B", 2, 40, "standard"),
    ("torchtune", None, "full", "mistralai/Mistral-7B-v0.1", 2, 40, "standard"),
    # unsloth's chunks over the hidden states themselves, soft-capped logits
    ("unsloth", None, "lora", "google/gemma-2-2b", 2, 40, "standard"),
    ("unsloth", None, "lora", "meta-llama/Llama-2-7b-hf", 1, 48, "standard"),
    # full fine-tuning in one chunk: the untied head's gradient is F.linear's transposed view, accumulated at once
    ("unsloth", None, "full", "meta-llama/Llama-2-7b-hf", 1, 48, "standard"),
    ("unsloth", None, "full", "mistralai/Mistral-7B-v0.1", 2, 40, "standard"),
    # `loss: chunked` (tunecast's own; axolotl's Liger fused cross-entropy): 8 checkpointed chunks of the hidden
    # states, soft-capped on Gemma 2; under the Trainer's autocast; tied embeddings whose head trains
    ("tunecast", None, "lora", "meta-llama/Llama-2-7b-hf", 2, 40, "chunked"),
    ("axolotl", None, "lora", "google/gemma-2-2b", 1, 48, "chunked"),
    ("axolotl", None, "full", "Qwen/Qwen3-0.6B", 2, 40, "chunked"),
])
def test_a_composed_step_equals_a_trace_of_that_runner_s_step(runner: str, version: str | None, method: str,
                                                               name: str, batch: int, seq: int, loss: str) -> None:
    settings = _settings(runner, method, version, loss)
    assert compose.composable(settings), "the runner's loss is not composed: this would test nothing new"
    data = config(name, layers=4)
    pair = profiles.templated_profiles(data, settings, batch, seq)
    assert pair is not None and pair.exact_shape == (batch, seq) and (pair.origin or "").startswith("composed")
    assert_exact(data, settings, batch, seq)


@pytest.mark.parametrize("name", ["google/gemma-2-2b", "Qwen/Qwen3-0.6B"])
def test_a_loss_whose_gradient_is_a_view_summed_with_a_tied_embedding_s_is_traced_instead(name: str) -> None:
    """unsloth's loss in one chunk returns F.linear's transposed weight gradient, which autograd sums with the tied
    embedding's out of place where the stand-in's is summed in place: no composition serves it."""
    settings = _settings("unsloth", "full")
    data = config(name, layers=4)
    assert profiles.templated_profiles(data, settings, 1, 48) is None


def test_a_template_at_the_sliding_window_s_own_length_equals_a_trace() -> None:
    """At the window's length transformers already builds the sliding mask: the template above the window serves
    it."""
    data = {**config("mistralai/Mistral-7B-v0.1", layers=4), "sliding_window": 48}
    assert_exact(data, _settings("tunecast", "lora"), 2, 48)


@pytest.mark.parametrize("runner, version, name, batch, seq", [
    ("trl", None, "Qwen/Qwen3-0.6B", 1, 4 * 4096 + 40),  # four tiles of TRL's fused head, the last partial
    ("trl", "1.10", "meta-llama/Llama-2-7b-hf", 2, 700),  # six 256-token chunks
    ("unsloth", None, "google/gemma-2-2b", 2, 9000),  # five chunks of the logits' bytes
])
def test_a_loss_traced_with_its_repeated_chunks_once_holds_the_same_memory(runner: str, version: str | None,
                                                                            name: str, batch: int, seq: int) -> None:
    """A limit's checks trace the loss with its middle chunks run once (compose.repeats_once): its peak allocated
    and reserved are those of the whole loss."""
    from tunecast.catalog.store import load_catalog
    from tunecast.estimate.memory import estimate_memory

    spec = apply_runner(RunSpec.model_validate({"model": "x", "runner": runner, "method": "lora", "runner_version": version,
                                                "lora": {"dropout": 0.05}, "micro_batch": batch, "seq_len": seq}))
    data = config(name, layers=4)
    overheads = load_catalog(None).overheads

    def memory() -> tuple[float, float, bool]:
        found = estimate_memory(spec, data, device="cuda", gpu=None, overheads=overheads)
        return found.peak_allocated_gib, found.peak_reserved_gib, found.composed

    whole = memory()
    with compose.repeats_once():
        once = memory()
    assert whole[2] and whole == once


def _events(pair: profiles.ProfilePair | None) -> list[tuple[object, ...]]:
    assert pair is not None
    return [tuple(profile.columns()) for profile in (pair.shallow, pair.deeper)]


def test_a_loss_interpolated_between_two_traces_along_the_micro_batch_equals_its_trace() -> None:
    """A limit's search (fit.py) solves the composed step with its loss interpolated between the traces its checks
    took (compose.from_near_traces): torchtune's 8 chunks of 40 × b tokens grow linearly in b, so the interpolated
    step is the traced one, event by event; only the search's own shapes are taken, and fewer than two raise."""
    settings = _settings("torchtune", "lora")
    data = config("Qwen/Qwen2.5-0.5B", layers=4)
    for batch in (1, 4):
        assert profiles.templated_profiles(data, settings, batch, 41) is not None  # traces the loss at (b, 41)
    with compose.from_near_traces([(1, 41), (4, 41)]):
        between = profiles.templated_profiles(data, settings, 2, 41)
        beyond = profiles.templated_profiles(data, settings, 6, 41)
    assert between is not None and between.origin is None  # a guide's: its replays are not kept
    assert _events(between) == _events(profiles.templated_profiles(data, settings, 2, 41))
    assert _events(beyond) == _events(profiles.templated_profiles(data, settings, 6, 41))
    with pytest.raises(compose.NoNearTraces), compose.from_near_traces([(1, 41), (3, 41)]):  # (3, 41) not traced
        profiles.templated_profiles(data, settings, 5, 41)
    with pytest.raises(compose.NoNearTraces), compose.from_near_traces([(1, 41), (2, 80)]):  # not on one line
        profiles.templated_profiles(data, settings, 7, 41)


def test_a_loss_whose_events_change_along_the_line_is_not_interpolated() -> None:
    """unsloth's chunks follow the tokens: between traces in two chunk regimes the interpolation would guide a limit's
    search badly, so it is refused (NoNearTraces) and the search closes on its checks."""
    from tunecast.estimate.tracer import ALLOC, Event, SegmentTrace

    def segment(tokens: int, chunks: int) -> SegmentTrace:
        forward = [Event(ALLOC, key, tokens * 4) for key in range(chunks)]
        return SegmentTrace(forward, [], [], 0, (None, None, None), {}, {}, {}, {})

    family = ("test-loss", 8, 16, (), "temporaries", None, False, False)
    compose._TRACES[family] = [((t, 8), (t,), compose._structure(segment(t, c)), segment(t, c))
                               for t, c in ((100, 2), (200, 2), (400, 3))]
    try:
        among = {((100, 8), (100,)), ((200, 8), (200,))}
        assert compose._interpolated(family, (150, 8), (150,), among).forward[0].nbytes == 600
        with pytest.raises(compose.NoNearTraces):
            compose._interpolated(family, (150, 8), (150,), among | {((400, 8), (400,))})
    finally:
        del compose._TRACES[family]
