"""A diffusion step's profile fitted over (b, s) (estimate/diffusion_fit.py): on the tiny UNet pipeline, the fitted
profile replays other batches and resolutions exactly as their own traces do, and the limits it answers hold."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tunecast.catalog.diffusion import load_pipeline
from tunecast.estimate import diffusion_fit
from tunecast.estimate.diffusion import DiffusionShape, trace_diffusion_step
from tunecast.estimate.diffusion_fit import canonical, fitted_profile, latent_pixels
from tunecast.estimate.profile import profile_from_trace, replay
from tunecast.step.diffusion import DiffusionSettings

pytest.importorskip("diffusers")

from tests.unit.estimate.test_diffusion import tiny_pipeline


def test_a_fitted_profile_replays_other_shapes_to_the_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fitted from five traces (b = 2, 3 at 512 and 640 px; checked at 1024 px) and from three for a batch of one, the
    profile replays shapes outside the fit, square or not, with the same peaks in every phase and the same reserve as
    those shapes' own traces; the fit is kept in the cache folder and read back."""
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(diffusion_fit, "_PROFILES", {})
    pipeline = load_pipeline(str(tiny_pipeline(tmp_path)))
    settings = DiffusionSettings(method="full")
    traced: list[tuple[int, int]] = []

    def trace(batch: int, side: int) -> object:
        traced.append((batch, side))
        return trace_diffusion_step(pipeline, settings, DiffusionShape(batch, side, side))

    profiles = {batch: fitted_profile(pipeline, settings, batch, 1, False, trace) for batch in (1, 2)}
    assert len(traced) == 8 and all(profile is not None for profile in profiles.values())
    for batch, width, height in ((5, 512, 512), (4, 448, 576), (1, 640, 640), (2, 192, 128)):
        own = trace_diffusion_step(pipeline, settings, DiffusionShape(batch, width, height))
        direct = replay(profile_from_trace(1, replace(own, events=canonical(own.events))), batch, 1, cuda=True)
        fitted = replay(profiles[min(batch, 2)], batch, latent_pixels(pipeline, width, height), cuda=True)
        assert fitted.peak_reserved == direct.peak_reserved
        assert {k: v.allocated for k, v in fitted.phases.items()} == {k: v.allocated for k, v in direct.phases.items()}
    monkeypatch.setattr(diffusion_fit, "_PROFILES", {})
    assert fitted_profile(pipeline, settings, 3, 1, False, trace) is not None and len(traced) == 8  # from the cache


def test_frees_in_another_order_replay_alike_and_align_once_canonical(tmp_path: Path) -> None:
    """Two traces at different resolutions free the same tensors in a different order within a run of frees; put in
    the order of their keys they align, and a replay of either order gives the same peaks."""
    from tunecast.estimate.profile import events_align

    pipeline = load_pipeline(str(tiny_pipeline(tmp_path)))
    traces = [trace_diffusion_step(pipeline, DiffusionSettings(), DiffusionShape(2, side, side)) for side in (256, 320)]
    assert events_align([canonical(t.events) for t in traces])
    one = traces[0]
    plain = replay(profile_from_trace(1, one), 2, 1, cuda=True)
    ordered = replay(profile_from_trace(1, replace(one, events=canonical(one.events))), 2, 1, cuda=True)
    assert plain.peak_reserved == ordered.peak_reserved
    assert {k: v.allocated for k, v in plain.phases.items()} == {k: v.allocated for k, v in ordered.phases.items()}
