"""Step profiles: sizes fitted as polynomials in (b, s) reproduce a direct trace at any other shape, and
depth extrapolation reproduces a full-depth trace."""

import pytest
from tests.models import tiny_llama

from tunecast.config.spec import RunSpec
from tunecast.estimate.profile import fit_points, fit_profile, profile_from_trace, replay
from tunecast.estimate.profiles import trace_profiles
from tunecast.estimate.tracer import trace_step
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import shallow_config_data


def _direct(config, settings, batch, seq, cuda=True):  # type: ignore[no-untyped-def]
    return replay(profile_from_trace(0, trace_step(config, settings, batch, seq)), batch, seq, cuda=cuda)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(("batch", "seq"), [(1, 700), (3, 333), (5, 2000)])
def test_fitted_profile_equals_a_direct_trace(attention, batch, seq) -> None:
    config = shallow_config_data(tiny_llama(), 2)
    settings = TraceSettings.from_spec(RunSpec(model="x", method="lora", attention=attention))
    points = fit_points(batch)
    traced = [trace_step(config, settings, b, s) for b, s in points]
    profile = fit_profile(2, points, traced)
    assert profile is not None
    fitted = replay(profile, batch, seq, cuda=True)
    direct = _direct(config, settings, batch, seq)
    for phase in ("forward", "backward", "optimizer"):
        assert fitted.phases[phase].allocated == direct.phases[phase].allocated
        assert fitted.phases[phase].breakdown == direct.phases[phase].breakdown
    assert fitted.peak_reserved == direct.peak_reserved


def test_depth_extrapolation_equals_the_full_depth_trace(monkeypatch) -> None:
    from tunecast.estimate import memory

    monkeypatch.setenv("TUNECAST_NO_CACHE", "1")
    config = tiny_llama(num_hidden_layers=12)
    spec = RunSpec(model="x", method="full", micro_batch=2, seq_len=256)
    settings = TraceSettings.from_spec(spec)
    pair = trace_profiles(config, settings, 2, 256)
    assert (pair.shallow.layers, pair.deeper.layers, pair.layers) == (4, 8, 12)
    assert pair.exact_shape is None  # fitted: valid at every shape
    extrapolated = memory._replayed(pair, 2, 256, cuda=False, workspace=0)
    full = _direct(config, settings, 2, 256, cuda=False)
    for phase in ("forward", "backward", "optimizer"):
        assert extrapolated.phases[phase].total == pytest.approx(full.phases[phase].allocated, rel=1e-9)


def test_an_exact_request_traces_the_one_shape(monkeypatch) -> None:
    monkeypatch.setenv("TUNECAST_NO_CACHE", "1")
    pair = trace_profiles(tiny_llama(), TraceSettings.from_spec(RunSpec(model="x")), 2, 300, exact=True)
    assert pair.exact_shape == (2, 300)


def test_shapes_that_trace_differently_fall_back_to_the_exact_shape(monkeypatch) -> None:
    from tunecast.estimate import profiles

    monkeypatch.setenv("TUNECAST_NO_CACHE", "1")
    monkeypatch.setattr(profiles, "fit_profile", lambda *args: None)
    pair = trace_profiles(tiny_llama(), TraceSettings.from_spec(RunSpec(model="x")), 2, 300)
    assert pair.exact_shape == (2, 300) and pair.covers(2, 300) and not pair.covers(2, 301)


def test_fitted_flops_equal_a_direct_count(monkeypatch) -> None:
    monkeypatch.setenv("TUNECAST_NO_CACHE", "1")
    config = tiny_llama(num_hidden_layers=8)
    settings = TraceSettings.from_spec(RunSpec(model="x", method="lora"))
    pair = trace_profiles(config, settings, 3, 700)
    direct = trace_step(config, settings, 3, 700).flops
    fitted = pair.deeper.flops_at(3, 700)
    for kind in ("matmul", "attention", "elementwise_bytes"):
        assert fitted[kind] == pytest.approx(direct[kind], abs=2)
