"""Step profiles for a model and its training settings: traced once, cached on disk, read without torch.

Every decoder layer holds the same memory, so two shallow copies are traced — 4 and 8 periods of the
layer pattern (a period is 2 layers for alternating sliding/full attention, else 1) — and every figure
is extrapolated linearly to the full depth; a model of at most 8 periods is traced whole. Depths below 4
are avoided because the caching allocator's reserve grows linearly only from a few layers on.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from tunecast.atomic import write_text_atomic
from tunecast.estimate import progress, tracetime
from tunecast.estimate.memo import Memo, config_digest
from tunecast.estimate.profile import StepProfile, fit_points, fit_profile, profile_from_trace
from tunecast.paths import cache_file
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import (
    layer_period,
    num_layers,
    shallow_config_data,
    sliding_window,
    sliding_window_offset,
    text_config_data,
)

PROFILE_FORMAT = 18  # bump when what a profile holds changes


@dataclass(frozen=True)
class ProfilePair:
    """Profiles of the same settings at two depths, and the model's full depth."""

    shallow: StepProfile
    deeper: StepProfile
    layers: int
    exact_shape: tuple[int, int] | None  # set when the profiles hold one (b, s) only
    single: bool | None = None  # from a template: True when it serves micro-batch 1 only, False for 2 and up
    longest: int | None = None  # from a template below a sliding window: the window
    shortest: int | None = None  # from a template above a sliding window: the window + 1
    origin: str | None = None  # what names these profiles (their cache key), for kept replays (replays.py)
    stand_in: ProfilePair | None = None  # composed (compose.py): the template's pair, with the loss's stand-in

    def covers(self, batch: int, seq: int) -> bool:
        if self.single is not None and self.single != (batch == 1):
            return False
        if self.longest is not None and seq > self.longest:
            return False
        if self.shortest is not None and seq < self.shortest:
            return False
        return self.exact_shape is None or self.exact_shape == (batch, seq)


@functools.cache
def library_versions() -> dict[str, str]:
    """The versions of the libraries whose code a trace runs through: each release, without a build's local label
    (torch 2.13.0+cpu from PyTorch's CPU index, 2.13.0 from PyPI, 2.13.0+cu130: one release). A trace runs on fake
    tensors on the host, through the same Python code on any build of a release, so the templates shipped, built
    with one build, serve the others (before, a key held the label, and a user with PyPI's torch traced what
    tunecast ships)."""
    return {package: release(package) for package in ("torch", "transformers", "peft")}


@functools.cache
def release(package: str) -> str:
    """The installed release of `package` (its version without a build's local label), or "absent"."""
    try:
        return _version(package).split("+")[0]
    except PackageNotFoundError:
        return "absent"


def _version(package: str) -> str:
    """The installed version: the `Version:` line of the package's metadata, read without parsing the whole
    file as email headers (`importlib.metadata.version` does; a tenth of a warm estimate's own time)."""
    dist = distribution(package)
    for line in (dist.read_text("METADATA") or "").splitlines():
        if line.startswith("Version:"):
            return line.removeprefix("Version:").strip()
        if not line:  # the headers end at the first blank line
            break
    return dist.version


def _versions() -> dict[str, str]:
    return {"format": str(PROFILE_FORMAT), **library_versions()}


_KEYS = Memo()  # profile keys: a plan asks for the same few hundreds of times


def profile_key(config_data: dict[str, Any], settings: TraceSettings, batch: int, offset: int,
                exact_shape: tuple[int, int] | None) -> str:
    regime = {"offset": offset, "single": batch == 1, "shape": exact_shape}
    return _KEYS.get((config_digest(config_data), settings, batch == 1, offset, exact_shape),
                     lambda: settings.key({"config": text_config_data(config_data), "regime": regime}, _versions()))


_TEXTS = Memo()


def config_text(config_data: dict[str, Any]) -> str:
    """The language-model part of the config as canonical JSON (what names a template's instance)."""
    return _TEXTS.get(config_digest(config_data),
                      lambda: json.dumps(text_config_data(config_data), sort_keys=True, default=str))


def _cache_path(key: str) -> Path:
    return cache_file("profiles", f"{key}.json")


# Profiles read in this process, by cache file: a fit search reads the same ones dozens of times.
_READ: dict[Path, ProfilePair] = {}


def cached_profiles(config_data: dict[str, Any], settings: TraceSettings, batch: int, seq: int
                    ) -> ProfilePair | None:
    """The cached profiles for these settings (no torch import), or None."""
    offset = sliding_window_offset(config_data, seq)
    for shape in (None, (batch, seq)):
        path = _cache_path(profile_key(config_data, settings, batch, offset, shape))
        if path in _READ:
            return _READ[path]
        if path.is_file():
            try:
                pair = _read_pair(path, path.stem)
            except (OSError, ValueError, KeyError, TypeError, IndexError) as damaged:
                progress.warning(f"the cached step profile {path} is damaged ({type(damaged).__name__}: "
                                 f"{damaged}); tracing it again")
                continue
            _READ[path] = pair
            return pair
    return None


def _read_pair(path: Path, origin: str) -> ProfilePair:
    data = json.loads(path.read_text())
    shallow = StepProfile.from_json(data["shallow"])
    deeper = shallow if data["deeper"] == data["shallow"] else StepProfile.from_json(data["deeper"])
    shape = tuple(data["exact_shape"]) if data["exact_shape"] else None
    return ProfilePair(shallow, deeper, int(data["layers"]), shape, origin=origin)


class TracingUnavailable(Exception):
    """This torch build lacks the fake-tensor API the tracer needs."""


class NeedsTrace(Exception):
    """Asked not to trace, and neither a template nor the cache serves these settings."""


def trace_profiles(config_data: dict[str, Any], settings: TraceSettings, batch: int, seq: int, *,
                   exact: bool = False) -> ProfilePair:
    """Trace the two shallow depths and fit their profiles; cache the result. With `exact`, trace the
    shape (batch, seq) alone: a fifth of the work, for an answer needed at that shape only."""
    from tunecast.estimate.tracer import trace_step, tracing_available

    missing = tracing_available()
    if missing is not None:
        raise TracingUnavailable(missing)

    period = layer_period(config_data)
    full_depth = num_layers(config_data)
    depths = (4 * period, 8 * period) if full_depth > 8 * period else (full_depth,)
    offset = sliding_window_offset(config_data, seq)
    points = fit_points(batch, offset)
    fit_key = profile_key(config_data, settings, batch, offset, None)

    if not exact and _fit_failed(fit_key):  # traced here before: its shapes do not align, so trace the one asked
        exact = True
    total = len(depths) * (1 if exact else len(points))
    from tunecast.estimate.templates import why_traced

    progress.notice(f"no step template serves this model and these settings ({why_traced(config_data, settings)}): "
                      f"tracing the step {total} times at {' and '.join(map(str, depths))} layers, about "
                      f"{tracetime.expected(depths, total)} s on this machine")
    started = time.perf_counter()

    def say(done: int, depth: int, b: int, s: int) -> None:
        progress.progress(f"tracing the training step: {depth} layers at micro-batch {b} × {s} tokens "
                          f"(trace {done + 1} of {total})")

    def fitted(number: int, depth: int) -> StepProfile | None:
        shallow = shallow_config_data(config_data, depth)
        traces = []
        for index, (b, s) in enumerate(points):
            say(number * len(points) + index, depth, b, s)
            traces.append(trace_step(shallow, settings, b, s))
        return fit_profile(depth, points, traces)

    def at_shape(number: int, depth: int) -> StepProfile:
        say(number, depth, batch, seq)
        return profile_from_trace(depth, trace_step(shallow_config_data(config_data, depth), settings, batch, seq))

    fits = [None] * len(depths) if exact else [fitted(number, depth) for number, depth in enumerate(depths)]
    shape: tuple[int, int] | None = None
    if any(profile is None for profile in fits):  # operations differ between shapes: trace the one asked for
        if not exact:
            _remember_fit_failed(fit_key)
        shape = (batch, seq)
        total = len(depths)
        profiles = [at_shape(number, depth) for number, depth in enumerate(depths)]
    else:
        profiles = [profile for profile in fits if profile is not None]
    tracetime.remember(time.perf_counter() - started, depths, total if shape is not None else len(depths) * len(points))
    key = fit_key if shape is None else profile_key(config_data, settings, batch, offset, shape)
    pair = ProfilePair(profiles[0], profiles[-1], full_depth, shape, origin=key)
    if os.environ.get("TUNECAST_NO_CACHE") != "1":
        path = _cache_path(key)
        write_text_atomic(path, json.dumps({"shallow": pair.shallow.to_json(), "deeper": pair.deeper.to_json(),
                                            "layers": pair.layers, "exact_shape": shape}))
        _READ[path] = pair
    return pair


def _nofit_path(fit_key: str) -> Path:
    return cache_file("profiles", f"{fit_key}.nofit")


def _fit_failed(fit_key: str) -> bool:
    """Whether the fit of these settings was traced before and its shapes did not align (a chunked loss whose
    chunks follow the length): trying again would cost the same traces for the same answer."""
    return _nofit_path(fit_key).is_file()


def _remember_fit_failed(fit_key: str) -> None:
    if os.environ.get("TUNECAST_NO_CACHE") != "1":
        write_text_atomic(_nofit_path(fit_key), "the traces at the fit's shapes did not align\n")


# Profiles instantiated from templates in this process, by template (its cache file) and the values put in.
_INSTANTIATED: dict[tuple[Path, str], ProfilePair] = {}


def templated_profiles(config_data: dict[str, Any], settings: TraceSettings, batch: int, seq: int, *,
                       trace: bool = True) -> ProfilePair | None:
    """The profiles from the template of this model's structure (templates.py), or None when no template
    serves it. No torch is imported unless the template has to be built (without `trace`: NeedsTrace)."""
    from tunecast.estimate import templates

    if not templates.applies(config_data, settings):
        return None
    multi = batch >= 2
    above = templates.above_window(config_data, seq)
    window = sliding_window(config_data)
    key = templates.template_key(config_data, settings, multi, above)
    instance = (templates.cache_path(key), config_text(config_data) + str(settings.adapters.rank))
    if instance in _INSTANTIATED:
        return _composed(_INSTANTIATED[instance], config_data, settings, batch, seq, trace)
    try:
        profiles = templates.instantiate(templates.get_template(config_data, settings, multi, above=above,
                                                                trace=trace), config_data, settings)
    except templates.NoTemplate:
        return None
    pair = ProfilePair(profiles[0], profiles[-1], num_layers(config_data), None, single=not multi,
                       longest=None if above or window is None else window - 1,
                       shortest=window if above else None,
                       origin="template " + instance[0].stem + " " + instance[1])
    _INSTANTIATED[instance] = pair
    return _composed(pair, config_data, settings, batch, seq, trace)


_COMPOSED: dict[tuple[int, TraceSettings, int, int, bool], ProfilePair | None] = {}
COMPOSED_KEPT = 64


def _composed(pair: ProfilePair, config_data: dict[str, Any], settings: TraceSettings, batch: int,
              seq: int, trace: bool = True) -> ProfilePair | None:
    """`pair` itself, or for a loss composed onto its template (compose.py) the pair at (batch, seq) with that loss
    traced alone in place of its stand-in; None where it does not fit there (the step is then traced). Without
    `trace`, a loss with no form there (forms.py) is traced alone only where this process has traced before
    (NeedsTrace otherwise): a first trace imports the fake-tensor machinery, seconds that a suggestion (fit.py) is not
    worth."""
    from tunecast.estimate import compose
    from tunecast.estimate.tracer import traced_before

    if not compose.composable(settings):
        return pair
    once, near = compose.repeating_once(), compose.near_shapes()
    key = (id(pair), settings, batch, seq, once, near)
    if key not in _COMPOSED:
        if len(_COMPOSED) >= COMPOSED_KEPT:
            _COMPOSED.clear()
        if near is None:
            progress.progress(f"composing the loss at micro-batch {batch} × {seq} tokens")
        try:
            with compose.tracing(trace or traced_before()):
                profiles = [compose.compose(profile, settings, config_data, batch, seq)
                            for profile in (pair.shallow, pair.deeper)]
        except compose.WouldTrace as reason:
            raise NeedsTrace("the loss would be traced alone, the first trace of this process") from reason
        except compose.NotComposable as reason:
            if near is not None:  # a guide only: the step is not traced for it
                raise compose.NoNearTraces(str(reason)) from reason
            _COMPOSED[key] = None
        else:  # an interpolated loss's replays are not kept (no origin): they are a guide's, not an estimate's
            origin = None if near is not None else \
                f"composed {batch}x{seq}{' once' if once else ''} {'-'.join(settings.runner_step)} {pair.origin}"
            _COMPOSED[key] = ProfilePair(profiles[0], profiles[1], pair.layers, (batch, seq), single=pair.single,
                                         longest=pair.longest, shortest=pair.shortest, origin=origin, stand_in=pair)
    return _COMPOSED[key]


def get_profiles(config_data: dict[str, Any], settings: TraceSettings, batch: int, seq: int, *,
                 exact: bool = False, trace: bool = True) -> ProfilePair:
    """The profiles for these settings at (batch, seq): from a template where one serves the model, else
    from the cache, else traced (without `trace`: NeedsTrace instead)."""
    cached = cached_profiles(config_data, settings, batch, seq)
    if cached is not None and cached.covers(batch, seq):
        return cached
    templated = templated_profiles(config_data, settings, batch, seq, trace=trace)
    if templated is not None:
        return templated
    if not trace:
        raise NeedsTrace("neither a template nor the cache serves these settings")
    return trace_profiles(config_data, settings, batch, seq, exact=exact)
