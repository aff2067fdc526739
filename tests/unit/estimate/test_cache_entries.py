"""Cache entries of the estimator: a damaged one is rebuilt with a warning, an interrupted trace leaves none,
and a cold estimate says which trace it is on (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.models import tiny_llama

from tunecast.config.spec import RunSpec
from tunecast.estimate import profiles, templates, tracer, tracetime
from tunecast.estimate.progress import listening
from tunecast.step.settings import TraceSettings

SPEC = RunSpec(model="x", method="lora", micro_batch=2, seq_len=64)


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path))
    monkeypatch.setattr(profiles, "_READ", {})
    monkeypatch.setattr(templates, "_READ", {})
    return tmp_path


def _heard() -> tuple[list[tuple[str, str]], Any]:
    lines: list[tuple[str, str]] = []
    return lines, listening(lambda kind, text: lines.append((kind, text)))


@pytest.mark.parametrize("damage", ["{\"shallow\": [1, 2", "[]", "{\"shallow\": {}, \"deeper\": {}}", "\x00\xff"])
def test_a_damaged_profile_is_traced_again_with_a_warning(own_cache: Path, damage: str) -> None:
    config, settings = tiny_llama(), TraceSettings.from_spec(SPEC)
    key = profiles.profile_key(config, settings, 2, 0, None)
    path = own_cache / "profiles" / f"{key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(damage)
    lines, hearing = _heard()
    with hearing:
        assert profiles.cached_profiles(config, settings, 2, 64) is None
    assert [kind for kind, _ in lines] == ["warning"]
    assert str(path) in lines[0][1] and "damaged" in lines[0][1]


def test_a_damaged_template_is_built_again_with_a_warning(own_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # biased attention: a structure no shipped template serves, so the cache's is the one read
    config, settings = tiny_llama(attention_bias=True), TraceSettings.from_spec(SPEC)
    key = templates.template_key(config, settings, True)
    path = templates.cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("{\"depths\": [4")
    built: list[bool] = []

    def build(*_: Any) -> None:
        built.append(True)
        return None  # no reading: recorded as failed

    monkeypatch.setattr(templates, "build_template", build)
    lines, hearing = _heard()
    with hearing, pytest.raises(templates.NoTemplate):
        templates.get_template(config, settings, True)
    assert built == [True]
    assert [kind for kind, _ in lines] == ["warning", "notice"] and "damaged" in lines[0][1]
    assert lines[1][1].startswith("no shipped step template serves this model's structure")
    assert "failed" in path.read_text()  # rewritten whole


def test_an_interrupted_trace_leaves_no_cache_entry_and_said_what_it_traced(own_cache: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    config, settings = tiny_llama(), TraceSettings.from_spec(SPEC)
    calls: list[tuple[int, int]] = []

    def trace_step(_config: Any, _settings: Any, batch: int, seq: int, **_: Any) -> None:
        calls.append((batch, seq))
        if len(calls) == 2:  # Ctrl-C during the second trace (the first one's result is only kept in memory)
            raise KeyboardInterrupt

    monkeypatch.setattr(tracer, "trace_step", trace_step)
    lines, hearing = _heard()
    with hearing, pytest.raises(KeyboardInterrupt):
        profiles.trace_profiles(config, settings, 2, 64)
    assert not list(own_cache.rglob("*.json")), "an interrupted trace wrote a cache entry"
    [announced] = [text for kind, text in lines if kind == "notice"]
    said = [text for kind, text in lines if kind == "progress"]
    assert announced.startswith("no step template serves this model") and "10 times at 4 and 8 layers" in announced
    assert len(said) == 2 and said[0].endswith("(trace 1 of 10)") and said[1].endswith("(trace 2 of 10)")
    assert "4 layers" in said[0]


def test_a_fit_whose_shapes_did_not_align_is_not_traced_again(own_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the fit's shapes failed to align for these settings (a loss in chunks that follow the length), the next
    estimate at another shape traces that shape alone, and says how long it expects that to take."""
    from tunecast.estimate import profile as profile_module

    config, settings = tiny_llama(), TraceSettings.from_spec(SPEC)
    monkeypatch.setattr(profiles, "fit_profile", lambda *_: None)  # as when the traces' operations differ
    traced: list[tuple[int, int]] = []
    real = tracer.trace_step
    monkeypatch.setattr(tracer, "trace_step", lambda c, s, b, n, **k: traced.append((b, n)) or real(c, s, b, n, **k))
    first = profiles.trace_profiles(config, settings, 2, 64)
    fit_shapes = len(profile_module.fit_points(2)) * 2
    assert first.exact_shape == (2, 64) and len(traced) == fit_shapes + 2
    traced.clear()
    rate = json.loads((own_cache / "profiles" / "seconds-per-layer.json").read_text())["seconds_per_layer"]
    lines, hearing = _heard()
    with hearing:
        second = profiles.trace_profiles(config, settings, 2, 96)
    assert second.exact_shape == (2, 96) and traced == [(2, 96), (2, 96)]
    assert lines[0][0] == "notice"
    announced = lines[0][1]
    assert "tracing the step 2 times" in announced
    assert rate != tracetime.DEFAULT_SECONDS_PER_LAYER["model"], "the first estimate's traces were timed"
    depths = (4, 8)
    assert f"about {max(1, round(rate * 2 * sum(depths) / 2))} s on this machine" in announced


def test_kept_replays_give_the_estimate_a_fresh_replay_gives(own_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm estimate reads its replays from disk (replays.py): the same figures, and nothing replayed."""
    from tunecast.catalog.store import load_catalog
    from tunecast.estimate import profile as profile_module
    from tunecast.estimate import replays
    from tunecast.estimate.memory import estimate_memory

    catalog = load_catalog(None)

    def estimate() -> dict[str, Any]:
        return estimate_memory(SPEC, tiny_llama(), device="cuda", gpu=catalog.gpus.get("h100"),
                               overheads=catalog.overheads).as_dict()

    monkeypatch.setattr(replays, "_BY_ORIGIN", {})
    fresh = estimate()
    assert list((own_cache / "replays").glob("*.json"))
    monkeypatch.setattr(replays, "_BY_ORIGIN", {})  # as a new process would: read from disk
    replayed: list[int] = []
    real = profile_module.replay
    monkeypatch.setattr(replays, "replay", lambda *a, **k: replayed.append(1) or real(*a, **k))
    assert estimate() == fresh and not replayed
    for path in (own_cache / "replays").glob("*.json"):
        path.write_text("{\"format\": \"1-\", \"origin\"")
    monkeypatch.setattr(replays, "_BY_ORIGIN", {})
    lines, hearing = _heard()
    with hearing:
        assert estimate() == fresh
    assert replayed and any(kind == "warning" and "damaged" in text for kind, text in lines)


def test_replays_made_inside_a_deferred_block_are_written_once_as_it_ends(own_cache: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit search or a plan is dozens of estimates: their replays are written when the block ends, also when
    it ends by an error, not by each estimate."""
    from tunecast.catalog.store import load_catalog
    from tunecast.estimate import replays
    from tunecast.estimate.memory import estimate_memory

    catalog = load_catalog(None)
    monkeypatch.setattr(replays, "_BY_ORIGIN", {})
    writes: list[Path] = []
    real = replays.write_text_atomic
    monkeypatch.setattr(replays, "write_text_atomic", lambda path, text: writes.append(path) or real(path, text))
    with pytest.raises(RuntimeError), replays.deferred():
        for seq in (64, 96, 128):
            estimate_memory(SPEC, tiny_llama(), device="cuda", gpu=catalog.gpus.get("h100"),
                            overheads=catalog.overheads, seq_len=seq)
        assert not writes
        raise RuntimeError("stopped")
    assert writes and len(writes) == len(set(writes))  # each file once
    assert set(writes) == set((own_cache / "replays").glob("*.json"))


def test_marker_traces_and_model_traces_keep_a_rate_each(own_cache: Path) -> None:
    """A template's marker traces are a few dozen tokens: timing them must not make the next model trace's
    announcement five times too short, nor the other way round."""
    assert tracetime.expected((4, 8), 10) == round(tracetime.DEFAULT_SECONDS_PER_LAYER["model"] * 60)
    tracetime.remember(60.0, (4, 8), 10)  # 1 s a layer
    tracetime.remember(6.0, (12, 12), 2, "marker")  # 0.25 s a layer
    assert (tracetime.expected((4, 8), 10), tracetime.expected((34, 34), 2, "marker")) == (60, 17)
    tracetime.remember(24.0, (12, 12), 2, "marker")  # 1 s a layer: the mean with the last one
    assert (tracetime.expected((4, 8), 10), tracetime.expected((10,), 1, "marker")) == (60, 6)
    (own_cache / "profiles" / "seconds-per-layer.json").write_text("[damaged")
    assert tracetime.expected((4, 8), 10, "marker") == round(tracetime.DEFAULT_SECONDS_PER_LAYER["marker"] * 60)
