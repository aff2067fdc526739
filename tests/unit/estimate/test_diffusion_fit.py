"""A diffusion step's profile fitted over (b, s) (estimate/diffusion_fit.py): on the tiny UNet pipeline, the fitted
profile replays other batches and resolutions exactly as their own traces do, and the limits it answers hold."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tunecast.catalog.diffusion import load_pipeline
from tunecast.estimate import diffusion_fit
from tunecast.estimate.diffusion import DiffusionShape, trace_diffusion_step
from tunecast.estimate.diffusion_fit import canonical, fitted_profile, latent_pixels
from tunecast.estimate.profile import profile_from_trace, replay
from tunecast.step.diffusion import DiffusionSettings

pytest.importorskip("diffusers")

from tests.unit.estimate.test_diffusion import tiny_pipeline


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_fitted_profile_replays_other_shapes_and_ranks_to_the_byte(
        method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fitted from five traces (b = 2, 3 at 512 and 640 px; checked at 1024 px) and from three for a batch of one,
    LoRA's each with a trace at a second rank, the profile replays shapes outside the fit, square or not, at other
    ranks, with the same peaks in every phase and the same reserve as those shapes' own traces, and counts the same
    trainable parameters and work; the fit is kept in the cache folder and read back."""
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(diffusion_fit, "_PROFILES", {})
    pipeline = load_pipeline(str(tiny_pipeline(tmp_path)))
    settings = DiffusionSettings(method=method, lora_rank=4)
    traced: list[tuple[int, int, int | None]] = []

    def trace(batch: int, side: int, rank: int | None) -> object:
        traced.append((batch, side, rank))
        ranked = settings if rank is None else replace(settings, lora_rank=rank)
        return trace_diffusion_step(pipeline, ranked, DiffusionShape(batch, side, side), count_flops=True)

    profiles = {batch: fitted_profile(pipeline, settings, batch, 1, False, trace, lambda: 123) for batch in (1, 2)}
    assert len(traced) == (10 if method == "lora" else 8) and all(p is not None for p in profiles.values())
    ranks = (4, 16, 1) if method == "lora" else (None,)
    for rank in ranks:
        ranked = settings if rank is None else replace(settings, lora_rank=rank)
        for batch, width, height in ((5, 512, 512), (4, 448, 576), (1, 640, 640), (2, 192, 128)):
            own = trace_diffusion_step(pipeline, ranked, DiffusionShape(batch, width, height), count_flops=True)
            direct = replay(profile_from_trace(1, replace(own, events=canonical(own.events))), batch, 1, cuda=True)
            step = profiles[min(batch, 2)].step(rank)  # type: ignore[union-attr]
            pixels = latent_pixels(pipeline, width, height)
            fitted = replay(step, batch, pixels, cuda=True)
            assert fitted.peak_reserved == direct.peak_reserved, (rank, batch, width, height)
            assert {k: v.allocated for k, v in fitted.phases.items()} == \
                {k: v.allocated for k, v in direct.phases.items()}
            assert (step.facts.trainable_numel, step.facts.trainable_small_numel, step.facts.trainable_tensors) == \
                (own.facts.trainable_numel, own.facts.trainable_small_numel, own.facts.trainable_tensors)
            work = step.flops_at(batch, pixels)
            # the rank's share of the work is taken as b·s; the adapters on the text's tokens (b × 77) are not: a few
            # parts in a thousand on these tiny images, less on any real one (thousands of image tokens to 77)
            exact = rank in (None, settings.lora_rank)
            for kind in ("matmul", "attention"):
                assert work[kind] == pytest.approx(own.flops[kind], rel=1e-9 if exact else 1e-2), (kind, rank, batch)
    assert profiles[2].text_bytes == 123  # type: ignore[union-attr]
    monkeypatch.setattr(diffusion_fit, "_PROFILES", {})
    count = len(traced)
    assert fitted_profile(pipeline, replace(settings, lora_rank=32), 3, 1, False, trace, lambda: 0) is not None
    assert len(traced) == count  # from the cache, at any rank


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


def _synthetic(sizes: list[int], flops: float) -> Any:
    """A trace of allocations of `sizes`, each freed at once."""
    from tunecast.estimate.tracer import ALLOC, FREE, Event, ModelFacts, Trace

    events = [event for key, size in enumerate(sizes)
              for event in (Event(ALLOC, key, size, "activations", "forward", 1), Event(FREE, key, 0, "", "forward", 1))]
    facts = ModelFacts("sdpa", 0, 0, 10, 0, 1, 0, 0, 2)
    return Trace(events, facts, {"matmul": flops}, {"trainable_numels": [10]})


def test_a_size_that_grows_with_a_side_is_fitted_in_the_side_and_one_that_follows_no_form_is_named() -> None:
    """Sizes in the area (b·s) and in a side (FLUX's rotary ids along an axis) each meet the check past the fit; the
    side's is read at the larger side of a shape that is not square; a size that follows neither fails the fit,
    naming the event and the shape."""
    import math

    from tunecast.estimate.diffusion_fit import FitFailed, fit

    def sizes(b: int, s: int, odd: bool = False) -> list[int]:
        side = math.isqrt(s)
        return [1000 + 6 * b * s, 64 + 8 * side, 7 * s + (1 if odd and s > 5000 else 0)]

    shapes = [(2, 64 * 64), (2, 80 * 80), (3, 64 * 64), (3, 80 * 80)]
    check = (2, 128 * 128)
    traces = [_synthetic(sizes(b, s), 5.0 * b * s) for b, s in shapes]
    profile = fit(False, shapes, traces, check, _synthetic(sizes(*check), 5.0 * 2 * 128 * 128), None)
    step = profile.step(None, 96)  # 96 × 64 latent pixels: the side term at 96
    values = [round(sum(c * t for c, t in zip(poly, (1, 96 * 64, 0, 4 * 96 * 64, 0, 4), strict=True)))
              for poly in step.columns().polys if poly]
    assert sorted(values) == sorted([1000 + 6 * 4 * 96 * 64, 64 + 8 * 96, 7 * 96 * 64])
    assert step.flops_at(4, 96 * 64)["matmul"] == pytest.approx(5.0 * 4 * 96 * 64)
    odd = [_synthetic(sizes(b, s, odd=True), 1.0) for b, s in shapes]
    with pytest.raises(FitFailed, match=r"event 4 .*at \(2, 16384\)"):
        fit(False, shapes, odd, check, _synthetic(sizes(*check, odd=True), 1.0), None)
