"""The table of a profile's peaks (peaks.py) against the event-by-event replay: the same Replay, integer for integer,
at every shape, on CUDA and on a CPU, with and without the allocator's reserve, and past the table's integers."""

from __future__ import annotations

import random

import pytest

from tunecast.catalog.store import load_catalog
from tunecast.config.load import load_spec_text
from tunecast.estimate.profile import replay, replay_events
from tunecast.estimate.profiles import get_profiles
from tunecast.step.settings import TraceSettings

WORKSPACES = ((), (8519680,), (33554432,))  # none, and the two cuBLAS workspaces of catalog/data/overheads.csv


@pytest.mark.parametrize(("model", "method", "checkpointing", "batch"), [
    ("Qwen/Qwen3-0.6B", "lora", False, 2),
    ("Qwen/Qwen3-0.6B", "full", True, 1),
    ("meta-llama/Llama-3.2-1B", "qlora", True, 3),
])
def test_the_table_replays_what_the_events_replay(model: str, method: str, checkpointing: bool, batch: int) -> None:
    loaded = load_spec_text(f"model: {model}\nmethod: {method}\n", [], load_catalog(None))
    settings = TraceSettings.from_spec(loaded.spec, grad_checkpointing=checkpointing)
    pair = get_profiles(loaded.model.data, settings, batch, 1024, trace=False)  # a shipped template
    rng = random.Random(f"{model} {method}")
    for profile in {id(p): p for p in (pair.shallow, pair.deeper)}.values():
        for _ in range(4):
            b = batch if batch == 1 else rng.randint(2, 24)
            s = rng.choice([1, 2, 17, 511, 512, 700, 1536, 4096])  # tiny lengths: sizes that allocate nothing
            for cuda in (True, False):
                for reserve in (True, False):
                    blocks = rng.choice(WORKSPACES) if cuda else ()
                    assert replay(profile, b, s, cuda=cuda, fixed_blocks=blocks, reserve=reserve) == \
                        replay_events(profile, b, s, cuda=cuda, fixed_blocks=blocks, reserve=reserve), (b, s, cuda)


def test_sizes_past_the_tables_integers_are_replayed_event_by_event() -> None:
    loaded = load_spec_text("model: Qwen/Qwen3-0.6B\n", [], load_catalog(None))
    pair = get_profiles(loaded.model.data, TraceSettings.from_spec(loaded.spec), 2, 1024, trace=False)
    huge = replay(pair.shallow, 2, 10**14, cuda=False, reserve=False)  # sums beyond 64-bit integers
    assert huge == replay_events(pair.shallow, 2, 10**14, cuda=False, reserve=False)
    assert huge.phases["forward"].allocated > 2**63
