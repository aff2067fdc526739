"""A diffusion step's profile: every allocation's size exact in the micro-batch b and the latent pixels s of one image,
fitted from a few traces, so that one fit answers any batch and resolution by replay (profile.py), not by a trace.

Why it is exact. A denoiser's tensors are the batch's images at some downsampling (b × channels × h × w), its tokens
(b × h·w × width), or the batch's conditioning (b × 77 × width, b × time embedding), or they are shared by the batch
(a positional table cropped to h·w, the weights). With attention through SDPA's memory-efficient kernels nothing is
quadratic in the tokens. So each size is c₀ + c₁·s + c₂·b + c₃·b·s, and four traces at (b, s) ∈ {2, 3} × {s₁, s₂}
determine it. A batch of one takes a few other operations (broadcasts that need no copy), so b = 1 has a profile of
its own, (1, s₁) and (1, s₂) over c₀ + c₁·s. benchmarks/diffusion_profile_check.py replays the catalog's pipelines'
profiles at shapes outside the fit against their own traces (docs/validation/memory.md, section 7).

Two conditions, each checked:
- the traces must hold the same events in the same order. The order of the frees within a run of frees follows
  Python's ids from one trace to the next, so such runs are put in the order of their keys first (`canonical`); the
  allocator's state after a run of frees does not depend on their order, so no replay changes;
- the sizes must follow the family. A fifth trace at a third resolution, past the fit (b = 2, or b = 1), is compared
  with the fitted profile's replay there; a profile that misses it is not used, and the shape is traced directly.

Sides are multiples of FIT_SIDE_STEP (64 px): the UNets downsample their latents three times by 2, and a side that
does not divide rounds a convolution's output, which no such polynomial follows. A run at another side is traced
directly. Fitted profiles are kept in the cache folder, keyed by the pipeline's configs, the settings, the libraries'
versions and PROFILE_FORMAT: the second question about a pipeline's run, at any batch and resolution, is a replay.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from tunecast.catalog.diffusion import Pipeline
from tunecast.estimate.profile import ProfileEvent, StepProfile, _solve, events_align, profile_from_trace, replay
from tunecast.estimate.tracer import ALLOC, FREE, Event
from tunecast.paths import cache_file
from tunecast.step.diffusion import DiffusionSettings

FIT_SIDE_STEP = 64
# The fit's two sides and the check's, in pixels (a trace's cost hardly grows with them). At smaller sides FLUX's
# sizes do not yet follow the form (256 and 320 px fitted missed 1024 px; checked at 384 px, they passed), so the
# check is at the largest common training side, past the fit.
FIT_SIDES = (512, 640, 1024)
PROFILE_FORMAT = 1


@dataclass(frozen=True)
class Regime:
    """The shapes a profile serves and is fitted from: b = 1, or b ≥ 2."""

    single: bool

    def fit_shapes(self) -> list[tuple[int, int]]:
        """(batch, side) of the fit's traces."""
        first, second, _ = FIT_SIDES
        if self.single:
            return [(1, first), (1, second)]
        return [(2, first), (2, second), (3, first), (3, second)]

    def check_shape(self) -> tuple[int, int]:
        return (1 if self.single else 2), FIT_SIDES[2]


def regime(batch: int) -> Regime:
    return Regime(single=batch == 1)


def latent_pixels(pipeline: Pipeline, width: int, height: int) -> int:
    """s: one image's latent pixels (times the frames of a video clip, which a profile keeps fixed)."""
    return (width // pipeline.vae_scale) * (height // pipeline.vae_scale)


def fits_grid(width: int, height: int) -> bool:
    """Whether a profile can answer at these sides (each a multiple of FIT_SIDE_STEP)."""
    return width % FIT_SIDE_STEP == 0 and height % FIT_SIDE_STEP == 0


def canonical(events: list[Event]) -> list[Event]:
    """`events` with each run of consecutive frees in the order of their keys (the allocator's state after the run is
    the same in any order)."""
    ordered: list[Event] = []
    run: list[Event] = []
    for event in events:
        if event.kind == FREE:
            run.append(event)
            continue
        ordered.extend(sorted(run, key=lambda free: free.key))
        run = []
        ordered.append(event)
    ordered.extend(sorted(run, key=lambda free: free.key))
    return ordered


def _coefficients(single: bool, rows: list[tuple[int, ...]], values: list[int]) -> tuple[float, ...]:
    """A size's coefficients over profile.BASIS_NAMES (1, s, s², b·s, b·s², b) from its values at the fit's shapes."""
    if len(set(values)) == 1:
        return (float(values[0]), 0.0, 0.0, 0.0, 0.0, 0.0)
    solved = [float(c) for c in _solve(rows, values)]
    if single:  # over (1, s)
        return (solved[0], solved[1], 0.0, 0.0, 0.0, 0.0)
    constant, per_pixel, per_image, per_image_pixel = solved  # over (1, s, b, b·s)
    return (constant, per_pixel, 0.0, per_image_pixel, 0.0, per_image)


def fit(single: bool, shapes: list[tuple[int, int]], traces: list[Any]) -> StepProfile | None:
    """The profile over (b, s) of traces at `shapes` ((b, s) pairs); None where their events do not align."""
    lists = [canonical(trace.events) for trace in traces]
    if not events_align(lists):
        return None
    rows: list[tuple[int, ...]] = [(1, s) if single else (1, s, b, b * s) for b, s in shapes]
    events = [ProfileEvent(ALLOC, event.key, _coefficients(single, rows, [each[index].nbytes for each in lists]),
                           event.category, event.phase, event.step) if event.kind == ALLOC else
              ProfileEvent(event.kind, event.key, (), event.category, event.phase, event.step)
              for index, event in enumerate(lists[0])]
    return StepProfile(1, events, traces[0].facts)


def _same(one: Any, other: Any) -> bool:
    """Two replays alike: each phase's peak and breakdown, the reserve."""
    return one.peak_reserved == other.peak_reserved and all(
        one.phases[name].allocated == other.phases[name].allocated for name in one.phases)


# Profiles fitted or read in this process, and the keys whose fit failed (traced directly instead).
_PROFILES: dict[str, StepProfile] = {}
_FAILED: set[str] = set()


def profile_key(pipeline: Pipeline, settings: DiffusionSettings, single: bool, frames: int, cache_latents: bool
                ) -> str:
    from tunecast.estimate.profiles import library_versions

    text = json.dumps({"configs": pipeline.configs, "settings": asdict(settings), "single": single,
                       "frames": frames if pipeline.video else 1, "cache_latents": cache_latents,
                       "libraries": library_versions(), "format": PROFILE_FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cached_profile(pipeline: Pipeline, settings: DiffusionSettings, batch: int, frames: int, cache_latents: bool
                   ) -> StepProfile | None:
    """The profile of this run's step for `batch`'s regime, if one was fitted here or is in the cache folder."""
    key = profile_key(pipeline, settings, regime(batch).single, frames, cache_latents)
    if key not in _PROFILES:
        path = cache_file("diffusion-profiles", f"{key}.json")
        if not path.is_file():
            return None
        try:
            _PROFILES[key] = StepProfile.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return _PROFILES[key]


def fitted_profile(pipeline: Pipeline, settings: DiffusionSettings, batch: int, frames: int, cache_latents: bool,
                   trace: Any) -> StepProfile | None:
    """The profile for `batch`'s regime: cached, or fitted from FIT_SIDES' traces (`trace(batch, side)`: a tracer.Trace
    of a square shape) and checked at the third side; None where the fit does not hold (kept so, not retried)."""
    from tunecast.atomic import write_text_atomic

    found = cached_profile(pipeline, settings, batch, frames, cache_latents)
    key = profile_key(pipeline, settings, regime(batch).single, frames, cache_latents)
    if found is not None or key in _FAILED:
        return found
    shapes = regime(batch).fit_shapes()
    profile = fit(regime(batch).single, [(b, latent_pixels(pipeline, side, side)) for b, side in shapes],
                  [trace(b, side) for b, side in shapes])
    check_batch, check_side = regime(batch).check_shape()
    checked = trace(check_batch, check_side)
    direct = replay(profile_from_trace(1, replace(checked, events=canonical(checked.events))), check_batch, 1,
                    cuda=True)
    pixels = latent_pixels(pipeline, check_side, check_side)
    if profile is None or not _same(direct, replay(profile, check_batch, pixels, cuda=True)):
        _FAILED.add(key)
        return None
    _PROFILES[key] = profile
    write_text_atomic(cache_file("diffusion-profiles", f"{key}.json"), json.dumps(profile.to_json()))
    return profile
