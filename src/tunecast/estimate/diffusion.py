"""Peak GPU memory of a diffusion fine-tuning step: the step of step/diffusion.py traced on fake tensors (the same
recorder as a language model's step, estimate/tracer.py), replayed through the allocator model (profile.py), with the
frozen parts that stay resident: the VAE, which encodes each batch of images unless the latents are cached (its
encoding is traced within the step), and the text encoders unless their outputs are cached.

Residency and dtypes follow diffusers' training examples (docs/research/diffusion/NOTES.md): the text encoders in
the weight dtype; the VAE in fp32 for SDXL and SD3 ("to avoid NaN losses"), in the weight dtype otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tunecast.catalog.diffusion import Pipeline
from tunecast.catalog.gpus import Gpu
from tunecast.catalog.overheads import Overhead, overhead_bytes
from tunecast.config.spec import RunSpec
from tunecast.estimate.diffusion_fit import (
    FIT_SIDE_STEP,
    DiffusionProfile,
    cached_profile,
    fits_grid,
    fitted_profile,
    latent_pixels,
    latent_side,
)
from tunecast.estimate.fit import Suggestion, _largest_along, _solved
from tunecast.estimate.memory import MemoryEstimate, optimizer_state_bytes
from tunecast.step.diffusion import DiffusionSettings, supports_checkpointing
from tunecast.units import BYTES_PER_GIB


@dataclass(frozen=True)
class DiffusionShape:
    batch: int
    height: int
    width: int
    frames: int = 1  # video models: frames per clip
    cache_latents: bool = False  # the VAE's latents precomputed: the VAE is not resident and encodes nothing
    cache_text: bool = False  # the text encoders' outputs precomputed: the encoders are not resident


def _text_encoder_bytes(pipeline: Pipeline, settings: DiffusionSettings) -> int:
    """The resident text encoders' weights, counted on the meta device."""
    from tunecast.step.diffusion import build_text_encoders

    return sum(p.numel() * p.element_size() for encoder in build_text_encoders(pipeline, settings)
               for p in encoder.parameters())


# This process's traces, by pipeline, settings and shape: a plan, a limit's search and a suggestion meet the same
# shapes; a trace takes seconds, its replay on another GPU milliseconds.
_TRACES: dict[tuple[str, DiffusionSettings, DiffusionShape], Any] = {}


def _pipeline_key(pipeline: Pipeline) -> str:
    return pipeline.name + json.dumps(pipeline.configs, sort_keys=True, default=str)


def traced_step(pipeline: Pipeline, settings: DiffusionSettings, shape: DiffusionShape) -> Any:
    """`trace_diffusion_step`, once per pipeline, settings and shape in this process, its work counted."""
    key = (_pipeline_key(pipeline), settings, shape)
    if key not in _TRACES:
        _TRACES[key] = trace_diffusion_step(pipeline, settings, shape, count_flops=True)
    return _TRACES[key]


def trace_diffusion_step(pipeline: Pipeline, settings: DiffusionSettings, shape: DiffusionShape, *,
                         count_flops: bool = False) -> Any:
    """Two training steps on fake tensors (tracer.STEPS): the VAE's encoding of the batch (unless its latents are
    cached), the denoiser's loss, its backward pass and the optimizer's step. A tracer.Trace; with `count_flops`, its
    `flops` also hold the second step's matmul and attention FLOPs (torch's formulas: convolutions count as
    matmuls), counted as it runs, as for a language model (tracer._trace_step)."""
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tunecast.estimate import tracer
    from tunecast.step.diffusion import build_denoiser, build_vae, train_step, weight_dtype
    from tunecast.step.settings import TRACED_OPTIMIZERS
    from tunecast.step.setup import make_optimizer

    tracer._register_attention_flops()
    model = build_denoiser(pipeline, settings)
    vae = None if shape.cache_latents else build_vae(pipeline, settings)
    mode = FakeTensorMode()
    tracer._fakeify(model, mode)
    if vae is not None:
        tracer._fakeify(vae, mode)
    recorder = tracer._Recorder()
    params = [p for p in model.parameters() if p.requires_grad]
    for parameter in model.parameters():
        recorder.track(parameter, "trainable_weights" if parameter.requires_grad else "weights")
    for buffer in model.buffers():
        recorder.track(buffer, "weights")
    if vae is not None:
        for tensor in [*vae.parameters(), *vae.buffers()]:
            recorder.track(tensor, "weights")

    def mark_gradient(parameter: Any) -> None:
        recorder.reclassify(parameter.grad, "gradients")

    def on(part: str) -> None:  # the VAE's encoding holds temporaries; the latents it makes are the step's
        if part == "backward":
            recorder.phase, recorder.category = "backward", "temporaries"
        else:
            recorder.category = "temporaries" if part == "encoding" else "activations"

    hooks = [p.register_post_accumulate_grad_hook(mark_gradient) for p in params]
    optimizer = make_optimizer(settings.optimizer if settings.optimizer in TRACED_OPTIMIZERS else "adamw", params)
    recorder.flops = {"matmul": 0.0, "attention": 0.0} if count_flops else None
    try:
        with warnings.catch_warnings(), mode, tracer._no_gc():
            warnings.simplefilter("ignore")
            with tracer._dispatch_mode(recorder), tracer._active(recorder):
                for step in range(1, tracer.STEPS + 1):
                    recorder.step = step
                    recorder.phase, recorder.category = "forward", "activations"
                    recorder.counting = step == tracer.STEPS
                    train_step(model, vae, lambda step=step: tracer.optimizer_step(recorder, optimizer, step),
                               pipeline, settings, shape.batch, shape.height, shape.width, shape.frames, on=on)
                events = recorder.close()
    finally:
        for hook in hooks:
            hook.remove()
    flops = dict(recorder.flops) if recorder.flops is not None else {}
    trainable = sum(p.numel() for p in params)
    element = torch.empty((), dtype=weight_dtype(settings)).element_size()
    small = sum(p.numel() for p in params if p.numel() < tracer.SMALL_TENSOR_NUMEL)
    facts = tracer.ModelFacts(attention="sdpa", quantizable_numel=0, largest_quantizable_numel=0,
                              trainable_numel=int(trainable), trainable_small_numel=int(small),
                              trainable_tensors=len(params),
                              layer_numel=0, layer_bytes=0, param_dtype_bytes=element)
    sums = {name: float(getattr(recorder, name)) for name in tracer.SUMMED}
    return tracer.Trace(events, facts, {**flops, **sums}, {"trainable_numels": [p.numel() for p in params]}, 0)


def estimate_diffusion_memory(pipeline: Pipeline, settings: DiffusionSettings, shape: DiffusionShape, *,
                              device: str, gpu: Gpu | None, overheads: tuple[Overhead, ...]) -> MemoryEstimate:
    """Per-GPU memory of a diffusion training step on `device` ("cuda" or "cpu"), as the language models' estimate
    reports it (MemoryEstimate): `micro_batch` is the images (or clips) per step and `seq_len` the latent tokens of
    one (latent pixels, times frames for video)."""
    from tunecast.estimate.profile import profile_from_trace, replay

    cuda = device == "cuda"
    architecture = gpu.architecture if gpu is not None else "hopper"
    workspace = overhead_bytes(overheads, "cublas_workspace", architecture) if cuda else 0
    fixed = (workspace,) if workspace else ()
    profile = grid_profile(pipeline, settings, shape)
    if profile is not None:  # fitted for any batch, resolution and rank (diffusion_fit.py): a replay, no trace
        step = profile.step(settings.lora_rank, latent_side(pipeline, shape.width, shape.height))
        result = replay(step, shape.batch, latent_pixels(pipeline, shape.width, shape.height), cuda=cuda,
                        fixed_blocks=fixed)
        facts = step.facts
    else:
        trace = traced_step(pipeline, settings, shape)
        result = replay(profile_from_trace(1, trace), shape.batch, 1, cuda=cuda, fixed_blocks=fixed)
        facts = trace.facts
    text = 0 if shape.cache_text else profile.text_bytes if profile is not None else \
        _text_encoder_bytes(pipeline, settings)
    # bitsandbytes' optimizers are traced as torch's AdamW and their states modelled (memory.optimizer_state_bytes)
    traced_states = max(peak.breakdown["optimizer"] for peak in result.phases.values())
    states, managed = optimizer_state_bytes(settings.optimizer, facts.trainable_numel, facts.trainable_small_numel,
                                            traced_states)
    moved = {name: (states - traced_states if peak.breakdown["optimizer"] else 0.0)
             for name, peak in result.phases.items()}
    phases = {name: peak.allocated + text + moved[name] for name, peak in result.phases.items()}
    peak_phase = max(phases, key=lambda name: phases[name])
    breakdown = {name: float(value) for name, value in result.phases[peak_phase].breakdown.items()}
    breakdown["weights"] += text
    if breakdown["optimizer"]:
        breakdown["optimizer"] = float(states)
    breakdown["overhead"] = float(result.extra_allocated)
    allocated = phases[peak_phase] + result.extra_allocated
    reserved = max(allocated, result.peak_reserved + text + moved[peak_phase]) if cuda else allocated
    context = overhead_bytes(overheads, "cuda_context", architecture) if cuda else \
        overhead_bytes(overheads, "cpu_framework", "*")
    least = min(reserved, allocated + result.peak_pinned + text) if result.peak_pinned else reserved
    scale = pipeline.vae_scale
    tokens = (shape.height // scale) * (shape.width // scale) * (shape.frames if pipeline.video else 1)
    notes = [f"{pipeline.name}: the {pipeline.classes[pipeline.denoiser]} traced at {shape.batch} × "
             f"{shape.width}×{shape.height} px" + (f" × {shape.frames} frames" if pipeline.video else ""),
             "latents cached: the VAE is not loaded" if shape.cache_latents else
             "the VAE resident, encoding each batch (traced)",
             "text encoder outputs cached: the encoders are not loaded" if shape.cache_text else
             f"text encoders resident ({', '.join(pipeline.text_encoders)}): {text / BYTES_PER_GIB:.2f} GiB"]
    if states != traced_states or managed:
        notes.append(f"{settings.optimizer}: bitsandbytes states modelled on the traced AdamW (8-bit: 1 byte per "
                     "state and an fp32 constant per 256 values; paged: in CUDA managed memory)")
    gib = BYTES_PER_GIB
    return MemoryEstimate(
        device=device, peak_allocated_gib=allocated / gib, peak_reserved_gib=reserved / gib,
        device_total_gib=(reserved + context) / gib, least_reserved_gib=least / gib,
        least_device_total_gib=(least + context) / gib, peak_phase=peak_phase, host_ram_gib=0.0,
        managed_gib=managed / gib,
        breakdown_gib={name: value / gib for name, value in breakdown.items()},
        phases_gib={name: (value + result.extra_allocated) / gib for name, value in phases.items()},
        micro_batch=shape.batch, seq_len=tokens, notes=tuple(notes))


# Frames per clip of a video model where the run does not say (the text-to-video examples' 16).
DEFAULT_FRAMES = 16
# Pixels per side where neither the run nor the denoiser's config (`sample_size`) says.
DEFAULT_RESOLUTION = 1024


def diffusion_settings(spec: RunSpec) -> DiffusionSettings:
    """The step's settings from the run's: LoRA's rank, alpha and targets (`all-linear`: those of
    `diffusion.lora_layers`), the VAE's dtype and the frozen weights' 8-bit storage."""
    targets = None if isinstance(spec.lora.targets, str) else tuple(spec.lora.targets)
    return DiffusionSettings(method=spec.method, precision=spec.precision, optimizer=spec.optimizer,
                             grad_checkpointing=spec.grad_checkpointing is True, lora_rank=spec.lora.rank,
                             lora_alpha=spec.lora.alpha, lora_targets=targets, lora_layers=spec.diffusion.lora_layers,
                             vae_fp32=spec.diffusion.vae_fp32, base_8bit=spec.diffusion.base_8bit)


def diffusion_shape(spec: RunSpec, pipeline: Pipeline) -> DiffusionShape:
    """The batch the step trains on: the run's micro-batch of images (or clips) at its resolution, the pipeline's own
    where the run does not say; the text encoders' outputs cached where diffusers' example for the model caches
    them (SD3 and FLUX), unless the run says."""
    sample = pipeline.configs[pipeline.denoiser].get("sample_size")
    native = int(sample) * pipeline.vae_scale if isinstance(sample, int) else DEFAULT_RESOLUTION
    width, height = spec.diffusion.sides or (native, native)
    cache_text = spec.diffusion.cache_text if spec.diffusion.cache_text is not None else \
        pipeline.family in ("sd3", "flux")
    assert isinstance(spec.micro_batch, int), "micro_batch: auto is refused for a pipeline (config/load.py)"
    batch = spec.micro_batch
    return DiffusionShape(batch, height, width, spec.diffusion.frames or DEFAULT_FRAMES,
                          cache_latents=spec.diffusion.cache_latents, cache_text=cache_text)


def checkpointing_options(spec: RunSpec, pipeline: Pipeline) -> list[bool]:
    """Gradient checkpointing as the run sets it, else off first and on where nothing fits without it (where
    diffusers can checkpoint the denoiser)."""
    if spec.fixed("grad_checkpointing") and spec.grad_checkpointing != "auto":
        return [spec.grad_checkpointing is True]
    return [False, True] if supports_checkpointing(pipeline) else [False]


def largest_fitting(estimate: Callable[[int], MemoryEstimate], candidates: list[int], capacity: float,
                    ) -> tuple[int | None, float]:
    """The largest of `candidates` (micro-batches) whose `estimate` fits `capacity` GiB, and the least device total
    seen. The largest is traced first; where it does not fit, the smallest too, and the others are screened along the
    line of what is allocated through those two (allocations grow linearly with the batch), each that passes traced
    exactly, largest first: at most one trace more than two where the line holds."""
    largest, smallest = max(candidates), min(candidates)
    top = estimate(largest)
    if top.device_total_gib <= capacity:
        return largest, top.device_total_gib
    if largest == smallest:
        return None, top.device_total_gib
    low = estimate(smallest)
    per_image = (top.peak_allocated_gib - low.peak_allocated_gib) / (largest - smallest)
    for batch in sorted(candidates, reverse=True)[1:]:
        if low.device_total_gib + per_image * (batch - smallest) > capacity:
            continue
        memory = estimate(batch)
        if memory.device_total_gib <= capacity:
            return batch, memory.device_total_gib
    return None, low.device_total_gib


# The largest side the resolution limit considers, in pixels: past every catalog pipeline's training sizes.
MAX_SIDE = 4096
# The largest micro-batch the batch limit considers, in images (or clips).
MAX_IMAGES = 1024


def resolution_step(pipeline: Pipeline) -> int:
    """The pixels a side must be a multiple of: the VAE's downsampling, twice that for FLUX (its latents are packed
    in 2 × 2 patches)."""
    return pipeline.vae_scale * (2 if pipeline.family == "flux" else 1)


@dataclass(frozen=True)
class DiffusionLimits:
    """How far the run's shape can go on a GPU: each limit verified to fit, and the next value verified not to."""

    max_micro_batch: int  # images (clips) per step at the run's resolution; 0 when not one fits
    max_resolution: int  # the largest square side in pixels at the run's micro-batch (a multiple of `step`); 0: none
    step: int  # resolution_step

    def as_dict(self) -> dict[str, int]:
        return {"max_micro_batch": self.max_micro_batch, "max_resolution": self.max_resolution,
                "resolution_step": self.step}


def grid_profile(pipeline: Pipeline, settings: DiffusionSettings, shape: DiffusionShape) -> DiffusionProfile | None:
    """The profile that serves `shape` (shipped, cached or fitted in this process), if one does and the shape is on
    its grid."""
    if not fits_grid(shape.width, shape.height):
        return None
    return cached_profile(pipeline, settings, shape.batch, shape.frames, shape.cache_latents)


def step_work(pipeline: Pipeline, settings: DiffusionSettings, shape: DiffusionShape) -> dict[str, float]:
    """One step's work (FLOPs, bytes moved, kernels: what plan/diffusion.step_time reads) at `shape`: from the
    profile that serves it (fitted over the fit's and the check's shapes, diffusion_fit.py), else counted by a trace."""
    profile = grid_profile(pipeline, settings, shape)
    if profile is not None and "matmul" in profile.flops:
        step = profile.step(settings.lora_rank, latent_side(pipeline, shape.width, shape.height))
        return step.flops_at(shape.batch, latent_pixels(pipeline, shape.width, shape.height))
    return dict(traced_step(pipeline, settings, shape).flops)


def fit_profiles(pipeline: Pipeline, settings: DiffusionSettings, shape: DiffusionShape) -> bool:
    """Whether the step's profiles for a batch of one and of more (diffusion_fit.py) serve `shape`'s run: shipped,
    read from the cache, or fitted now (eleven traces at 512-1024 px for LoRA, nine for full fine-tuning); False off
    their grid or where a fit does not hold."""
    def traced(batch: int, side: int, rank: int | None) -> Any:
        ranked = settings if rank is None else replace(settings, lora_rank=rank, lora_alpha=rank)
        return traced_step(pipeline, ranked, replace(shape, batch=batch, width=side, height=side))

    return fits_grid(shape.width, shape.height) and all(
        fitted_profile(pipeline, settings, batch, shape.frames, shape.cache_latents, traced,
                       lambda: _text_encoder_bytes(pipeline, settings)) is not None
        for batch in (1, 2))


def diffusion_limits(spec: RunSpec, pipeline: Pipeline, gpu: Gpu, overheads: tuple[Overhead, ...]) -> DiffusionLimits:
    """The largest micro-batch at the run's resolution and the largest square resolution at its micro-batch that
    fit `gpu`.

    Where the run's sides are on the profiles' grid (diffusion_fit.py: multiples of 64 px), the step's profiles for a
    batch of one and of more are fitted (or read from the cache), and every value is a replay, exact: the limits are
    searched along the replays (fit._largest_along), the resolution on the same 64 px grid. Elsewhere (or where a fit
    does not hold) they are solved, not searched: a step's allocations grow linearly with the pixels of its batch, so
    the device total along the line through the run's trace and one at a micro-batch more is solved for the GPU's
    capacity, then checked by traces on both sides of the answer (fit._solved: the answer fits, the next value does
    not), the gap to the line corrected after each check."""

    settings = diffusion_settings(spec)
    asked = diffusion_shape(spec, pipeline)
    capacity = gpu.usable_memory_gib

    def estimate(shape: DiffusionShape) -> MemoryEstimate:
        return estimate_diffusion_memory(pipeline, settings, shape, device="cuda", gpu=gpu, overheads=overheads)

    def total(shape: DiffusionShape) -> float:
        return estimate(shape).device_total_gib

    def pixels(shape: DiffusionShape) -> int:
        return shape.batch * shape.width * shape.height

    def batched(n: int) -> DiffusionShape:
        return replace(asked, batch=n)

    if fit_profiles(pipeline, settings, asked):
        # every estimate below replays a fitted profile: exact, in milliseconds
        grid = FIT_SIDE_STEP
        largest = _largest_along(lambda n: total(batched(n)), capacity, 1, MAX_IMAGES)
        sides = _largest_along(lambda k: total(replace(asked, width=k * grid, height=k * grid)), capacity, 1,
                               MAX_SIDE // grid)
        return DiffusionLimits(max(largest, 0), max(sides, 0) * grid, grid)

    # the slope of what is allocated, which is linear; the allocator's rounding on top is the gap the checks measure
    step = resolution_step(pipeline)
    at_asked = total(asked)
    more = replace(asked, batch=asked.batch + 1)
    slope = (estimate(more).peak_allocated_gib - estimate(asked).peak_allocated_gib) / (pixels(more) - pixels(asked))

    def line(shape: DiffusionShape) -> float:
        return at_asked + slope * (pixels(shape) - pixels(asked))

    def square(k: int) -> DiffusionShape:
        return replace(asked, width=k * step, height=k * step)

    batch = _solved(lambda n: total(batched(n)), lambda n: line(batched(n)), (asked.batch, at_asked), capacity,
                    1, MAX_IMAGES)
    known = (asked.width // step, at_asked) if asked.width == asked.height else (0, 0.0)  # (0, …): none known
    side = _solved(lambda k: total(square(k)), lambda k: line(square(k)), known, capacity, 1, MAX_SIDE // step)
    return DiffusionLimits(max(batch, 0), max(side, 0) * step, step)


@dataclass(frozen=True)
class DiffusionAnswer:
    """A diffusion run's memory, and on a named GPU whether it fits and what would make it fit."""

    pipeline: Pipeline
    shape: DiffusionShape
    estimate: MemoryEstimate
    gpu: Gpu | None
    suggestions: tuple[Suggestion, ...] = ()
    limits: DiffusionLimits | None = None

    @property
    def fits(self) -> bool | None:
        return None if self.gpu is None else self.estimate.device_total_gib <= self.gpu.usable_memory_gib

    @property
    def at_edge(self) -> bool:
        return self.gpu is not None and not self.fits and \
            self.estimate.least_device_total_gib <= self.gpu.usable_memory_gib

    def as_dict(self, spec: RunSpec) -> dict[str, Any]:
        document: dict[str, Any] = {
            "model": self.pipeline.name, "pipeline": self.pipeline.pipeline_class,
            "denoiser": self.pipeline.classes[self.pipeline.denoiser], "objective": self.pipeline.objective,
            "method": spec.method, "precision": spec.precision, "optimizer": spec.optimizer,
            "grad_checkpointing": spec.grad_checkpointing is True, "width": self.shape.width,
            "height": self.shape.height,
            "frames": self.shape.frames if self.pipeline.video else None, "cache_latents": self.shape.cache_latents,
            "cache_text": self.shape.cache_text, **self.estimate.as_dict()}
        if self.gpu is not None:
            capacity = self.gpu.usable_memory_gib
            reserved, device_total = self.estimate.on_device(capacity)
            document.update({"gpu": self.gpu.slug, "capacity_gib": round(capacity, 3), "fits": self.fits,
                             "fits_at_edge": self.at_edge, "reserved_on_gpu_gib": round(reserved, 3),
                             "device_total_on_gpu_gib": round(device_total, 3),
                             "headroom_gib": round(capacity - self.estimate.device_total_gib, 3),
                             "suggestions": [suggestion.as_dict() for suggestion in self.suggestions],
                             **(self.limits.as_dict() if self.limits is not None else {})})
        return document


def _suggestions(spec: RunSpec, pipeline: Pipeline, gpu: Gpu, overheads: tuple[Overhead, ...],
                 trace: bool) -> tuple[Suggestion, ...]:
    """The single changes that save memory in a diffusion step, each with its peak where `trace` lets it be traced
    (each a trace of its own, 10-30 s on a laptop CPU), without one otherwise."""
    from tunecast.estimate import progress

    candidates: list[tuple[str, dict[str, Any]]] = []
    if spec.grad_checkpointing is not True and supports_checkpointing(pipeline):
        candidates.append(("turn on gradient checkpointing", {"grad_checkpointing": True}))
    if not spec.diffusion.cache_latents:
        candidates.append(("cache the VAE's latents before training (the VAE not loaded)",
                           {"diffusion.cache_latents": True}))
    if not diffusion_shape(spec, pipeline).cache_text:
        candidates.append(("cache the text encoders' outputs before training (the encoders not loaded)",
                           {"diffusion.cache_text": True}))
    if spec.method == "full":
        candidates.append(("train LoRA adapters instead of every weight", {"method": "lora"}))
    if spec.optimizer in ("adamw", "adamw-foreach"):
        candidates.append(("use the 8-bit AdamW optimizer", {"optimizer": "adamw-8bit"}))
    if isinstance(spec.micro_batch, int) and spec.micro_batch > 1:
        candidates.append((f"micro-batch 1 with gradient accumulation {spec.micro_batch * spec.grad_accum}",
                           {"micro_batch": 1, "grad_accum": spec.micro_batch * spec.grad_accum}))
    found = []
    for change, settings in candidates:
        peak: float | None = None
        if trace:
            changed = spec.with_changes(settings)
            progress.progress(f"tracing the step with this change: {change}")
            peak = estimate_diffusion_memory(pipeline, diffusion_settings(changed), diffusion_shape(changed, pipeline),
                                             device="cuda", gpu=gpu, overheads=overheads).device_total_gib
        found.append(Suggestion(change, settings, peak, None if peak is None else peak <= gpu.usable_memory_gib))
    return tuple(found)


def answer_diffusion_memory(spec: RunSpec, pipeline: Pipeline, gpu: Gpu | None, overheads: tuple[Overhead, ...], *,
                            device: str, trace_suggestions: bool = False) -> DiffusionAnswer:
    """The run's per-GPU memory (traced: announced first, with about how long it takes), its fit on `gpu`, and where
    it does not fit, the changes that would save memory (each estimated with `trace_suggestions`)."""
    from tunecast.errors import TunecastError
    from tunecast.estimate import progress

    if spec.micro_batch == "auto":
        raise TunecastError("micro_batch: auto is the largest that fits a run's device, which `memory` does not run on",
                            field="micro_batch", hint="give a number of images per step (--micro-batch 1); with "
                            "--gpu, max_micro_batch says the largest that fits")
    shape = diffusion_shape(spec, pipeline)
    settings = diffusion_settings(spec)
    # with a GPU the limits need the profiles of a batch of one and of more; without, the asked shape's
    needed = [replace(shape, batch=batch) for batch in (1, 2)] if gpu is not None else [shape]
    if any(grid_profile(pipeline, settings, each) is None for each in needed):
        traces = 11 if settings.method == "lora" else 9
        progress.progress(f"tracing {pipeline.name}'s training step at {shape.batch} × {shape.width}×{shape.height} "
                          "px on fake tensors (no profile shipped or cached for these settings): about 10-30 s on a "
                          "laptop CPU"
                          + (f", then its profiles for any batch, resolution and rank ({traces} traces, 2-6 min; kept "
                             "in the cache, so the next question about this run is a replay)"
                             if gpu is not None and fits_grid(shape.width, shape.height) else ""))
    if gpu is not None:  # the limits will need the profiles: fitted first, the estimate is then a replay
        fit_profiles(pipeline, settings, shape)
    estimate = estimate_diffusion_memory(pipeline, diffusion_settings(spec), shape, device=device,
                                         gpu=gpu, overheads=overheads)
    fits = gpu is None or estimate.device_total_gib <= gpu.usable_memory_gib
    suggestions = () if fits or gpu is None else _suggestions(spec, pipeline, gpu, overheads, trace_suggestions)
    limits = None
    if gpu is not None:
        limits = diffusion_limits(spec, pipeline, gpu, overheads)
    return DiffusionAnswer(pipeline, shape, estimate, gpu, suggestions, limits)
