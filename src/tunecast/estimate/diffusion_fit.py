"""A diffusion step's profile: every allocation's size exact in the micro-batch b, the latent pixels s of one image
and the LoRA rank r, fitted from a few traces, so that one fit answers any batch, resolution and rank by replay
(profile.py), not by a trace.

Why it is exact. A denoiser's tensors are the batch's images at some downsampling (b × channels × h × w), its tokens
(b × h·w × width), or the batch's conditioning (b × 77 × width, b × time embedding), or they are shared by the batch
(a positional table cropped to h·w, the weights). With attention through SDPA's memory-efficient kernels nothing is
quadratic in the tokens. So each size is c₀ + c₁·s + c₂·b + c₃·b·s, and four traces at (b, s) ∈ {2, 3} × {s₁, s₂}
determine it. A batch of one takes a few other operations (broadcasts that need no copy), so b = 1 has a profile of
its own, (1, s₁) and (1, s₂) over c₀ + c₁·s. The adapters' tensors (weights, gradients, optimizer states, their
activations) are proportional to the rank and nothing else depends on it: a trace at a second rank, at the check's
shape, tells each size's kind. The step's work (FLOPs, bytes, kernels: the plan's step time) is fitted over the fit's
and the check's shapes, with the attention's scores in b·s²; the rank's share of it taken as per b·s.

Conditions, each checked:
- the traces must hold the same events in the same order. The order of the frees within a run of frees follows
  Python's ids from one trace to the next, so such runs are put in the order of their keys first (`canonical`); the
  allocator's state after a run of frees does not depend on their order, so no replay changes;
- the sizes must follow the family: a trace at a third resolution, past the fit (b = 2, or b = 1), must have every
  size the fit gives there. A size that grows with a side instead (FLUX's rotary ids along an axis: `_side_form`)
  is fitted in the side and checked the same way; the VAE's padded temporaries (`_encoding`) are fitted in each
  image's area and side for a batch of more (`_padded_form`), else let through where the replay at the check is the
  trace's own;
- with LoRA, each size at the second rank must be the same or in the ranks' proportion.
A fit that misses any is not used, and the shape is traced directly (`why_not_fitted` says where it missed).

Sides are multiples of FIT_SIDE_STEP (64 px): the UNets downsample their latents three times by 2, and a side that
does not divide rounds a convolution's output, which no such polynomial follows. A run at another side is traced
directly. Profiles are shipped for the catalog's pipelines in common settings (scripts/build_diffusion_profiles.py,
data/diffusion-profiles/), and fitted ones kept in the cache folder, keyed by the pipeline's configs, the settings
but the rank, the libraries' versions and PROFILE_FORMAT: beyond the first question about a pipeline's run, or the
first at all where a profile ships, every answer at any batch, resolution and rank is a replay.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from importlib import resources
from typing import Any

from tunecast.catalog.diffusion import Pipeline
from tunecast.estimate.profile import (
    EventColumns,
    LazyEvents,
    ProfileEvent,
    StepProfile,
    _solve,
    basis,
    events_align,
    profile_from_trace,
    replay,
)
from tunecast.estimate.tracer import ALLOC, FREE, SMALL_TENSOR_NUMEL, Event, ModelFacts
from tunecast.paths import cache_file
from tunecast.step.diffusion import DiffusionSettings

FIT_SIDE_STEP = 64
# The fit's two sides and the check's, in pixels (a trace's cost hardly grows with them). At smaller sides FLUX's
# sizes do not yet follow the form (256 and 320 px fitted missed 1024 px; checked at 384 px, they passed), so the
# check is at the largest common training side, past the fit.
FIT_SIDES = (512, 640, 1024)
PROFILE_FORMAT = 2  # 2: by column, the rank a variable, the step's work fitted
# Where the shipped profiles are, in the package (scripts/build_diffusion_profiles.py writes them).
SHIPPED = "data/diffusion-profiles"


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


def latent_side(pipeline: Pipeline, width: int, height: int) -> int:
    """The larger side of one image's latents: what the sizes that grow with a side read (DiffusionProfile.sided)."""
    return max(width, height) // pipeline.vae_scale


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


def _at(coefficients: Sequence[float], batch: int, pixels: int) -> int:
    return round(sum(c * t for c, t in zip(coefficients, basis(batch, pixels), strict=True))) if coefficients else 0


def _flop_coefficients(single: bool, shapes: list[tuple[int, int]], values: list[float]) -> tuple[float, ...]:
    """A figure of the step's work (FLOPs, bytes, kernels) over BASIS_NAMES from its values at `shapes`: every
    shape of the fit and the check. Over (1, s, s²) for a batch of one; over (1, s, b, b·s, b·s²) for more (the
    attention's scores grow with each image's tokens squared; nothing else does)."""
    rows: list[tuple[int, ...]] = [(1, s, s * s) if single else (1, s, b, b * s, b * s * s) for b, s in shapes]
    solved = [float(c) for c in _solve(rows, [round(v) for v in values])]
    if single:
        return (*solved, 0.0, 0.0, 0.0)
    constant, per_pixel, per_image, per_image_pixel, per_image_pixel2 = solved
    return (constant, per_pixel, 0.0, per_image_pixel, per_image_pixel2, per_image)


@dataclass
class DiffusionProfile:
    """A pipeline's step in one regime (a batch of one, or of more), every allocation's size over (b, s) and, for
    LoRA, the rank: a size either does not change with the rank or is proportional to it (the adapters' weights,
    gradients, optimizer states and activations), found by a trace at a second rank (`scaled`, per distinct size).
    Its work (`flops`, over (b, s)), and the rank's share of it (`flops_per_rank`: per rank, times b·s; the
    optimizer's bytes scale with the trainable parameters instead). The facts at `rank`, the trainable tensors'
    element counts as (constant, per rank, count), and the resident text encoders' bytes."""

    columns: EventColumns
    scaled: tuple[bool, ...]
    rank: int | None  # the rank of `columns`' sizes; None for full fine-tuning
    facts: ModelFacts
    trainable: tuple[tuple[int, int, int], ...]
    flops: dict[str, tuple[float, ...]]
    flops_per_rank: dict[str, float]
    text_bytes: int
    sided: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Sizes that grow with a side, not the area (`_side_form`), by poly: bytes per latent pixel of the side, and per
    image and pixel of the side, on top of the poly's constant and per-image terms."""
    _steps: dict[tuple[int | None, int], StepProfile] = field(default_factory=dict, repr=False, compare=False)

    def _trainable_at(self, rank: int | None) -> list[tuple[int, int]]:
        """(element count, tensors) of the trainable tensors at `rank`."""
        return [(constant + per_rank * (rank or 0), count) for constant, per_rank, count in self.trainable]

    def facts_at(self, rank: int | None) -> ModelFacts:
        numels = self._trainable_at(rank)
        return replace(self.facts, trainable_numel=sum(n * count for n, count in numels),
                       trainable_small_numel=sum(n * count for n, count in numels if n < SMALL_TENSOR_NUMEL),
                       trainable_tensors=sum(count for _, count in numels))

    def step(self, rank: int | None, side: int = 0) -> StepProfile:
        """The profile of the step at `rank` (the run's LoRA rank; ignored for full fine-tuning) where the larger of
        the image's sides is `side` latent pixels (read only by the sizes that grow with a side: `sided`), made
        once."""
        rank = rank if self.rank is not None else None
        side = side if self.sided else 0
        if (rank, side) not in self._steps:
            factor = 1.0 if rank is None or self.rank is None else rank / self.rank
            polys = [tuple(c * factor for c in poly) if scaled else poly
                     for poly, scaled in zip(self.columns.polys, self.scaled, strict=True)]
            for index, (per_side, per_image_side) in self.sided.items():
                poly = polys[index]
                polys[index] = (poly[0] + per_side * side, *poly[1:5], poly[5] + per_image_side * side)
            columns = self.columns._replace(polys=polys)
            events = LazyEvents(lambda: [ProfileEvent(kind, key, polys[size], category, phase, step)
                                         for kind, key, size, category, phase, step in zip(
                                             columns.kinds, columns.keys, columns.sizes, columns.categories,
                                             columns.phases, columns.steps, strict=True)],
                                lambda: columns)
            self._steps[rank, side] = StepProfile(1, events, self.facts_at(rank), self.flops_at_rank(rank))
        return self._steps[rank, side]

    def flops_at_rank(self, rank: int | None) -> dict[str, tuple[float, ...]]:
        """The work's coefficients over BASIS_NAMES at `rank`."""
        if rank is None or self.rank is None or rank == self.rank:
            return dict(self.flops)
        trained = sum(n * count for n, count in self._trainable_at(self.rank))
        ratio = sum(n * count for n, count in self._trainable_at(rank)) / trained if trained else 1.0
        shifted = {}
        for kind, coefficients in self.flops.items():
            if kind == "optimizer_bytes":
                shifted[kind] = tuple(c * ratio for c in coefficients)
                continue
            per_image_pixel = coefficients[3] + (rank - self.rank) * self.flops_per_rank.get(kind, 0.0)
            shifted[kind] = (*coefficients[:3], per_image_pixel, *coefficients[4:])
        return shifted

    def to_json(self) -> dict[str, Any]:
        columns = self.columns
        categories = sorted(set(columns.categories))
        phases = sorted(set(columns.phases))
        return {"format": PROFILE_FORMAT, "rank": self.rank, "facts": asdict(self.facts),
                "trainable": [list(t) for t in self.trainable], "flops": {k: list(v) for k, v in self.flops.items()},
                "flops_per_rank": self.flops_per_rank, "text_bytes": self.text_bytes,
                "polys": [list(p) for p in columns.polys], "scaled": [int(s) for s in self.scaled],
                "sided": [[index, *terms] for index, terms in sorted(self.sided.items())],
                "kinds": "".join(columns.kinds), "keys": list(columns.keys), "sizes": list(columns.sizes),
                "category_names": categories, "categories": [categories.index(c) for c in columns.categories],
                "phase_names": phases, "phases": [phases.index(p) for p in columns.phases],
                "steps": list(columns.steps)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DiffusionProfile:
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"profile format {data.get('format')}, not {PROFILE_FORMAT}")
        categories, phases = data["category_names"], data["phase_names"]
        facts = data["facts"]
        facts["layer_linears"] = tuple(tuple(x) for x in facts.get("layer_linears", ()))
        facts["head_linear"] = tuple(facts.get("head_linear", (0, 0, False)))
        columns = EventColumns(list(data["kinds"]), data["keys"], data["sizes"],
                               [categories[i] for i in data["categories"]], [phases[i] for i in data["phases"]],
                               data["steps"], [tuple(p) for p in data["polys"]])
        return cls(columns, tuple(bool(s) for s in data["scaled"]), data["rank"], ModelFacts(**facts),
                   tuple((a, b, n) for a, b, n in data["trainable"]),
                   {k: tuple(v) for k, v in data["flops"].items()}, data["flops_per_rank"], data["text_bytes"],
                   {index: (per_side, per_image_side) for index, per_side, per_image_side in data.get("sided", ())})


class FitFailed(Exception):
    """The traces do not follow the profile's form (diffusion_fit's two conditions); the reason says where."""


def _ranked(check: list[Event], probe: list[Event], rank: int, other: int) -> list[bool]:
    """Per event of the check's trace, whether its size scales with the LoRA rank (at `rank` in `check`, `other` in
    `probe`, the same shape): the same size at both, or sizes in the ranks' proportion; FitFailed otherwise."""
    scaled = []
    for index, (one, two) in enumerate(zip(check, probe, strict=True)):
        if one.kind != ALLOC or one.nbytes == two.nbytes:
            scaled.append(False)
        elif one.nbytes * other == two.nbytes * rank:
            scaled.append(True)
        else:
            raise FitFailed(f"event {index}: {one.nbytes} bytes at rank {rank}, {two.nbytes} at {other}, neither "
                            "the same nor in the ranks' proportion")
    return scaled


def _trainable(check: Any, probe: Any | None, rank: int | None, other: int | None) -> tuple[tuple[int, int, int], ...]:
    """The trainable tensors' element counts as (constant, per rank, count), from the traces at two ranks."""
    first = check.terms["trainable_numels"]
    second = probe.terms["trainable_numels"] if probe is not None else first
    pairs: Counter[tuple[int, int]] = Counter()
    for one, two in zip(first, second, strict=True):
        per_rank, left = divmod(two - one, (other - rank) if rank is not None and other is not None else 1)
        if left or (rank is None and per_rank):
            raise FitFailed(f"a trainable tensor of {one} elements at rank {rank} has {two} at {other}")
        pairs[(one - per_rank * (rank or 0), per_rank)] += 1
    return tuple(sorted((constant, per_rank, count) for (constant, per_rank), count in pairs.items()))


def fit(single: bool, shapes: list[tuple[int, int]], traces: list[Any], check_shape: tuple[int, int], check: Any,
        rank: int | None, probe: Any | None = None, other: int | None = None, text_bytes: int = 0
        ) -> DiffusionProfile:
    """The profile over (b, s) of traces at `shapes` ((b, s) pairs) at `rank`, checked against `check`'s trace at
    `check_shape` event by event; with `probe`, a trace at `check_shape` at rank `other`, each size's dependence on
    the rank. FitFailed (with where) when the traces do not align, or a size misses the check or the rank's form."""
    lists = [canonical(trace.events) for trace in [*traces, check, *([probe] if probe is not None else [])]]
    if not events_align(lists):
        raise FitFailed("the traces at different shapes do not hold the same operations in the same order")
    rows: list[tuple[int, ...]] = [(1, s) if single else (1, s, b, b * s) for b, s in shapes]
    checked = lists[len(traces)]
    scaled = _ranked(checked, lists[-1], rank, other) if probe is not None and rank is not None and other else \
        [False] * len(checked)
    sizes: list[tuple[float, ...]] = []
    side_terms: list[tuple[float, float] | None] = []
    encoding_missed = False
    for index, event in enumerate(lists[0]):
        side_terms.append(None)
        if event.kind != ALLOC:
            sizes.append(())
            continue
        values = [each[index].nbytes for each in lists[:len(traces)]]
        coefficients = _coefficients(single, rows, values)
        if _at(coefficients, *check_shape) != checked[index].nbytes:
            sided = _side_form(single, shapes, values, check_shape, checked[index].nbytes)
            if sided is None and _encoding(event) and not single:
                sided = _padded_form(shapes, values, check_shape, checked[index].nbytes)
            if sided is not None:
                coefficients, side_terms[-1] = sided
            elif _encoding(event):
                encoding_missed = True
            else:
                raise FitFailed(f"event {index} ({event.category}, {event.phase}): {checked[index].nbytes} bytes at "
                                f"{check_shape}, the fit gives {_at(coefficients, *check_shape)}")
        sizes.append(coefficients)
    polys: dict[tuple[tuple[float, ...], bool, tuple[float, float] | None], int] = {}
    indices = [polys.setdefault((size, flag, terms), len(polys))
               for size, flag, terms in zip(sizes, scaled, side_terms, strict=True)]
    events = lists[0]
    columns = EventColumns([e.kind for e in events], [e.key for e in events], indices,
                           [e.category for e in events], [e.phase for e in events], [e.step for e in events],
                           [poly for poly, _, _ in polys])
    work_shapes = [*shapes, check_shape]
    work = [*traces, check]
    flops = {kind: _flop_coefficients(single, work_shapes, [trace.flops[kind] for trace in work])
             for kind in check.flops if all(kind in trace.flops for trace in work)}
    per_rank: dict[str, float] = {}
    if probe is not None and rank is not None and other:
        batch, pixels = check_shape
        per_rank = {kind: (probe.flops[kind] - check.flops[kind]) / ((other - rank) * batch * pixels)
                    for kind in flops if kind != "optimizer_bytes" and kind in probe.flops}
    profile = DiffusionProfile(columns, tuple(flag for _, flag, _ in polys), rank if probe is not None else None,
                               check.facts, _trainable(check, probe, rank, other), flops, per_rank, text_bytes,
                               {index: terms for (_, _, terms), index in polys.items() if terms is not None})
    if encoding_missed:  # the VAE's padded temporaries: the replay at the check must still be the trace's own
        direct = replay(profile_from_trace(1, replace(check, events=checked)), check_shape[0], 1, cuda=True)
        fitted = replay(profile.step(rank, _side(check_shape[1])), *check_shape, cuda=True)
        if direct.peak_reserved != fitted.peak_reserved or any(
                direct.phases[name].allocated != fitted.phases[name].allocated for name in direct.phases):
            raise FitFailed(f"the VAE's encoding misses the form and the replay at {check_shape} with it")
    return profile


def _side(pixels: int) -> int:
    """A square's side from its latent pixels."""
    return math.isqrt(pixels)


def _side_form(single: bool, shapes: list[tuple[int, int]], values: list[int], check_shape: tuple[int, int],
               checked: int) -> tuple[tuple[float, ...], tuple[float, float]] | None:
    """A size that grows with one side of the image, not its area (FLUX's rotary position ids along each axis, a few
    hundred bytes): c₀ + c₁·side + c₂·b + c₃·b·side from the fit's square shapes, if that meets the check; as
    (coefficients over BASIS_NAMES without the side's terms, (c₁, c₃)). The fit's squares cannot tell a side from
    the other, so on a shape that is not square the larger side is taken (an upper bound by those few bytes)."""
    rows: list[tuple[int, ...]] = [(1, _side(s)) if single else (1, _side(s), b, b * _side(s)) for b, s in shapes]
    solved = [float(c) for c in _solve(rows, values)]
    constant, per_side, per_image, per_image_side = solved if not single else (*solved, 0.0, 0.0)
    batch, pixels = check_shape
    side = _side(pixels)
    if round(constant + per_side * side + per_image * batch + per_image_side * batch * side) != checked:
        return None
    return (constant, 0.0, 0.0, 0.0, 0.0, per_image), (per_side, per_image_side)


def _padded_form(shapes: list[tuple[int, int]], values: list[int], check_shape: tuple[int, int], checked: int
                 ) -> tuple[tuple[float, ...], tuple[float, float]] | None:
    """A temporary of the VAE's encoding padded by a pixel on two sides: b·(c₁ + c₂·s + c₃·side), each image's
    (w + 1)(h + 1) pixels. Fitted per image at the three sides of the fit and the check, if every shape's size is
    its batch times that (the fit's second batch checks it); as for _side_form."""
    per_image: dict[int, set[Fraction]] = {}
    for (batch, pixels), value in [*zip(shapes, values, strict=True), (check_shape, checked)]:
        per_image.setdefault(pixels, set()).add(Fraction(value, batch))
    if len(per_image) != 3 or any(len(found) != 1 for found in per_image.values()):
        return None
    points = sorted((pixels, found.pop()) for pixels, found in per_image.items())
    solved = _solve([(1, pixels, _side(pixels)) for pixels, _ in points], [value for _, value in points])  # type: ignore[arg-type]
    constant, per_pixel, per_side = (float(c) for c in solved)
    return (0.0, 0.0, 0.0, per_pixel, 0.0, constant), (0.0, per_side)


def _encoding(event: Event) -> bool:
    """Whether an allocation is a temporary of the VAE's encoding (estimate/diffusion.py: the forward's temporaries).
    Before each stride-2 convolution the encoder pads its input by one pixel on two sides (diffusers' Downsample2D,
    pad (0, 1, 0, 1)), so these sizes hold (w + 1)(h + 1), a term in each side that c₀ + c₁·s + c₂·b + c₃·b·s misses
    by a few bytes in ten thousand; they are freed before the denoiser runs."""
    return event.category == "temporaries" and event.phase == "forward"


# Profiles fitted or read in this process, and the keys whose fit failed (traced directly instead), with why.
_PROFILES: dict[str, DiffusionProfile] = {}
_FAILED: dict[str, str] = {}


def _key_settings(pipeline: Pipeline, settings: DiffusionSettings) -> dict[str, Any]:
    """What of the settings a profile depends on: LoRA's targets as the modules they name, not its rank (a variable)
    or alpha (a scale); the optimizer as it is traced (bitsandbytes' as torch's AdamW, their states modelled)."""
    from tunecast.step.diffusion import lora_targets
    from tunecast.step.settings import TRACED_OPTIMIZERS

    fields = asdict(settings)
    fields["optimizer"] = settings.optimizer if settings.optimizer in TRACED_OPTIMIZERS else "adamw"
    for name in ("lora_rank", "lora_alpha", "lora_targets", "lora_layers"):
        fields.pop(name)
    if settings.method == "lora":
        fields["lora_targets"] = sorted(set(lora_targets(pipeline, settings)))
    return fields


def profile_key(pipeline: Pipeline, settings: DiffusionSettings, single: bool, frames: int, cache_latents: bool
                ) -> str:
    from tunecast.estimate.profiles import library_versions, release

    libraries = {**library_versions(), "diffusers": release("diffusers")}  # releases, without a build's label
    text = json.dumps({"configs": pipeline.configs, "settings": _key_settings(pipeline, settings), "single": single,
                       "frames": frames if pipeline.video else 1, "cache_latents": cache_latents,
                       "libraries": libraries,
                       "format": PROFILE_FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _shipped(key: str) -> DiffusionProfile | None:
    """A profile shipped with tunecast (scripts/build_diffusion_profiles.py), or None."""
    try:
        import lzma

        data = resources.files("tunecast.estimate").joinpath(f"{SHIPPED}/{key}.json.xz").read_bytes()
        return DiffusionProfile.from_json(json.loads(lzma.decompress(data)))
    except (OSError, ImportError, ValueError, KeyError, TypeError):
        return None


def cached_profile(pipeline: Pipeline, settings: DiffusionSettings, batch: int, frames: int, cache_latents: bool
                   ) -> DiffusionProfile | None:
    """The profile of this run's step for `batch`'s regime: fitted in this process, shipped, or in the cache folder."""
    key = profile_key(pipeline, settings, regime(batch).single, frames, cache_latents)
    if key not in _PROFILES:
        found = _shipped(key)
        path = cache_file("diffusion-profiles", f"{key}.json")
        if found is None and path.is_file():
            try:
                found = DiffusionProfile.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                found = None
        if found is None:
            return None
        _PROFILES[key] = found
    return _PROFILES[key]


def probe_rank(rank: int) -> int:
    """The second rank a LoRA profile is traced at, to find which sizes scale with the rank."""
    return rank + 3


def fit_regime(pipeline: Pipeline, settings: DiffusionSettings, batch: int, trace: Any,
               text_bytes: Any) -> DiffusionProfile:
    """The profile of `batch`'s regime from its traces (`trace(batch, side, rank)`: a tracer.Trace of a square
    shape, its work counted), checked at the third side, and for LoRA a trace there at a second rank; FitFailed."""
    single = regime(batch).single
    shapes = regime(batch).fit_shapes()
    rank = settings.lora_rank if settings.method == "lora" else None
    check_batch, check_side = regime(batch).check_shape()
    other = probe_rank(rank) if rank is not None else None
    return fit(single, [(b, latent_pixels(pipeline, side, side)) for b, side in shapes],
               [trace(b, side, rank) for b, side in shapes],
               (check_batch, latent_pixels(pipeline, check_side, check_side)), trace(check_batch, check_side, rank),
               rank, trace(check_batch, check_side, other) if other is not None else None, other, text_bytes())


def fitted_profile(pipeline: Pipeline, settings: DiffusionSettings, batch: int, frames: int, cache_latents: bool,
                   trace: Any, text_bytes: Any) -> DiffusionProfile | None:
    """The profile for `batch`'s regime: cached or shipped, or fitted now (fit_regime) and kept in the cache folder;
    None where the fit does not hold (kept so in this process, not retried)."""
    from tunecast.atomic import write_text_atomic

    found = cached_profile(pipeline, settings, batch, frames, cache_latents)
    key = profile_key(pipeline, settings, regime(batch).single, frames, cache_latents)
    if found is not None or key in _FAILED:
        return found
    try:
        profile = fit_regime(pipeline, settings, batch, trace, text_bytes)
    except FitFailed as failure:
        _FAILED[key] = str(failure)
        return None
    _PROFILES[key] = profile
    write_text_atomic(cache_file("diffusion-profiles", f"{key}.json"), json.dumps(profile.to_json()))
    return profile


def why_not_fitted(pipeline: Pipeline, settings: DiffusionSettings, batch: int, frames: int, cache_latents: bool
                   ) -> str | None:
    """Why this regime's fit failed in this process, if it did."""
    return _FAILED.get(profile_key(pipeline, settings, regime(batch).single, frames, cache_latents))
