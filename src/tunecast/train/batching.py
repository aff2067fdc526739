"""The plan drives the run: micro-batch, gradient accumulation and checkpointing from the memory estimate.

For the device the run is on (a CUDA GPU: the free memory the driver reports; the CPU: the memory the kernel
says is available), with `plan.memory_margin` left free:

* `micro_batch: auto` — the largest micro-batch that divides the step's sequences and fits;
* `grad_checkpointing: auto` — off, unless nothing fits without it;
* gradient accumulation — to reach `global_batch` (or micro_batch × grad_accum when that is unset).

A micro-batch the user fixed is checked the same way before the first step: a run that will not fit stops
with what would make it fit, instead of running into an out-of-memory error minutes later.

On the CPU the process's whole growth counts, not only the step's live memory (host_memory.py): with freed
memory kept for speed, the heap's high-water mark above the live peak; and the weights' loading, when they are
converted from the dtype of their files. A shape that fits only with freed memory returned to the system runs
that way (`keep_freed_memory` false).
"""

from __future__ import annotations

from dataclasses import dataclass

from tunecast.catalog.diffusion import Pipeline
from tunecast.catalog.gpus import Gpu
from tunecast.catalog.store import Catalog
from tunecast.config.spec import DEFAULT_MICRO_BATCH, TORCH_ADAMW, RunSpec
from tunecast.errors import TunecastError
from tunecast.estimate.memory import MemoryEstimate, estimate_memory
from tunecast.train.host_memory import kept_heap_gib


@dataclass(frozen=True)
class Device:
    """Where the run trains, and how much memory it may use."""

    kind: str  # "cuda" or "cpu"
    name: str
    free_gib: float
    gpu: Gpu | None  # the catalog row of a CUDA device, when its name matches one


@dataclass(frozen=True)
class BatchChoice:
    micro_batch: int
    grad_accum: int
    grad_checkpointing: bool
    estimate_gib: float | None  # predicted device memory of the chosen shape; None when not estimated
    capacity_gib: float
    reasons: tuple[str, ...]
    keep_freed_memory: bool = False  # on the CPU: keep freed memory for reuse (host_memory.py); it fits so


def sequences_per_step(spec: RunSpec) -> int:
    """Sequences per optimizer step on this one process."""
    if spec.global_batch is not None:
        return spec.global_batch
    return (spec.micro_batch if spec.micro_batch != "auto" else DEFAULT_MICRO_BATCH) * spec.grad_accum


def _micro_batches(spec: RunSpec, per_step: int, unit: str) -> list[int]:
    """The micro-batches to try, largest first: with `micro_batch: auto` every divisor of the step's `per_step`
    `unit`s, else the one the run sets, which must divide them."""
    if spec.micro_batch == "auto":
        return [d for d in range(per_step, 0, -1) if per_step % d == 0]
    size = int(spec.micro_batch)
    if per_step % size:
        raise TunecastError(f"micro_batch {size} does not divide the {per_step} {unit} per optimizer step",
                            field="micro_batch", hint="choose a divisor of global_batch, or micro_batch: auto")
    return [size]


def choose_batch(spec: RunSpec, config_data: dict[str, object], device: Device, catalog: Catalog, *,
                 check_memory: bool = True, keep_freed: bool = False, loading_gib: float = 0.0) -> BatchChoice:
    """`keep_freed`: on the CPU, the runner may keep freed memory (the user did not tune glibc's allocator);
    `loading_gib`: what loading the weights holds besides the model (host_memory.loading_bytes), on the CPU."""
    per_step = sequences_per_step(spec)
    capacity = device.free_gib * (1 - spec.plan.memory_margin)
    auto_batch = spec.micro_batch == "auto"
    sizes = _micro_batches(spec, per_step, "sequences")
    checkpointing = [False, True] if spec.grad_checkpointing == "auto" else [bool(spec.grad_checkpointing)]
    if not check_memory:
        chosen = sizes[-1] if auto_batch else sizes[0]
        return BatchChoice(chosen, per_step // chosen, checkpointing[0], None, capacity,
                           ("memory not checked",), keep_freed)

    def estimate(micro_batch: int, recompute: bool) -> MemoryEstimate:
        return estimate_memory(spec, config_data, device=device.kind, gpu=device.gpu, overheads=catalog.overheads,
                               grad_checkpointing=recompute, micro_batch=micro_batch)

    smallest: MemoryEstimate | None = None
    for recompute in checkpointing:
        for micro_batch in sizes:  # largest first
            memory = estimate(micro_batch, recompute)
            if smallest is None or memory.device_total_gib < smallest.device_total_gib:
                smallest = memory
            needed, kept, terms = _process_growth(memory, device, keep_freed, loading_gib, capacity)
            if needed <= capacity:
                reasons = [f"{needed:.2f} GiB predicted{terms} of the {capacity:.2f} GiB usable on "
                           f"{device.name} ({device.free_gib:.2f} GiB free, {spec.plan.memory_margin:.0%} margin)"]
                if auto_batch:
                    larger = [s for s in sizes if s > micro_batch]
                    reasons.append(f"micro_batch {micro_batch}: the largest divisor of {per_step} sequences per step "
                                   "that fits" if larger else f"micro_batch {micro_batch}: all {per_step} sequences "
                                   "of a step fit at once")
                if spec.grad_checkpointing == "auto":
                    reasons.append("gradient checkpointing on: nothing fits without it" if recompute
                                   else "gradient checkpointing off: not needed to fit")
                return BatchChoice(micro_batch, per_step // micro_batch, recompute, needed, capacity, tuple(reasons),
                                   kept)
    assert smallest is not None
    raise TunecastError(
        f"the run does not fit {device.name}: at least {smallest.device_total_gib:.2f} GiB predicted "
        f"(micro-batch {smallest.micro_batch}, {smallest.seq_len} tokens), {capacity:.2f} GiB usable",
        field="micro_batch" if not auto_batch else "seq_len",
        hint=_suggestions(spec, auto_batch),
    )


def choose_diffusion_batch(spec: RunSpec, pipeline: Pipeline, device: Device, catalog: Catalog, *,
                           check_memory: bool = True) -> BatchChoice:
    """`choose_batch` for a diffusion pipeline: the images of an optimizer step (`global_batch`, else micro_batch ×
    grad_accum) in the largest micro-batch that divides them and fits (`micro_batch: auto`), or the one the run
    fixed, checked; checkpointing only where nothing fits without it (`grad_checkpointing: auto`). Each candidate is
    the traced step (estimate/diffusion.py), screened along the line of its allocations (`largest_fitting`)."""
    from tunecast.estimate.diffusion import (
        diffusion_settings,
        diffusion_shape,
        estimate_diffusion_memory,
        largest_fitting,
    )
    from tunecast.step.diffusion import supports_checkpointing

    per_step = spec.sequences_per_step  # images: a pipeline trains in one process
    capacity = device.free_gib * (1 - spec.plan.memory_margin)
    auto_batch = spec.micro_batch == "auto"
    sizes = _micro_batches(spec, per_step, "images")
    checkpointing = [False, True] if spec.grad_checkpointing == "auto" else [bool(spec.grad_checkpointing)]
    if not supports_checkpointing(pipeline):
        checkpointing = [False]
    if not check_memory:
        return BatchChoice(sizes[-1], per_step // sizes[-1], checkpointing[0], None, capacity, ("memory not checked",))
    least = float("inf")
    for recompute in checkpointing:
        def estimate(micro_batch: int, recompute: bool = recompute) -> MemoryEstimate:
            changed = spec.with_changes({"micro_batch": micro_batch, "grad_checkpointing": recompute})
            return estimate_diffusion_memory(pipeline, diffusion_settings(changed), diffusion_shape(changed, pipeline),
                                             device=device.kind, gpu=device.gpu, overheads=catalog.overheads)

        found, total = largest_fitting(estimate, sizes, capacity)
        least = min(least, total)
        if found is None:
            continue
        chosen = found
        reasons = [f"{total:.2f} GiB predicted of the {capacity:.2f} GiB usable on {device.name} "
                   f"({device.free_gib:.2f} GiB free, {spec.plan.memory_margin:.0%} margin)"]
        if auto_batch:
            reasons.append(f"micro_batch {chosen}: the largest divisor of {per_step} images per step that fits"
                           if chosen < per_step else f"micro_batch {chosen}: all {per_step} images of a step fit")
        if spec.grad_checkpointing == "auto":
            reasons.append("gradient checkpointing on: nothing fits without it" if recompute
                           else "gradient checkpointing off: not needed to fit")
        return BatchChoice(chosen, per_step // chosen, recompute, total, capacity, tuple(reasons))
    raise TunecastError(
        f"the run does not fit {device.name}: at least {least:.2f} GiB predicted, {capacity:.2f} GiB usable",
        field="micro_batch", hint="try " + ", ".join(
            [*(["micro_batch: auto"] if not auto_batch else []),
             *(["grad_checkpointing: auto"] if spec.grad_checkpointing is False else []),
             *(["diffusion.cache_latents: true"] if not spec.diffusion.cache_latents else []),
             *(["method: lora"] if spec.method == "full" else []), "a smaller diffusion.resolution"])
        + "; `tunecast memory --gpu` shows what fits")


def _process_growth(memory: MemoryEstimate, device: Device, keep_freed: bool, loading_gib: float,
                    capacity: float) -> tuple[float, bool, str]:
    """What the process grows by for this estimate (its live peak; on the CPU also the loading and, when freed
    memory is kept, the heap's high-water mark), whether freed memory is kept, and the terms said."""
    if device.kind != "cpu":
        return memory.device_total_gib, False, ""
    breakdown = memory.breakdown_gib
    loading = breakdown["weights"] + breakdown["trainable_weights"] + breakdown["overhead"] + loading_gib
    loaded = f", loading {loading:.2f} GiB" if loading_gib > 0 else ""
    live = max(memory.device_total_gib, loading)
    if keep_freed:
        state = sum(breakdown[key] for key in ("weights", "trainable_weights", "optimizer", "quantization"))
        kept = memory.device_total_gib + kept_heap_gib(max(0.0, memory.device_total_gib - state))
        if max(kept, loading) <= capacity or live > capacity:
            return max(kept, loading), True, (f" ({memory.device_total_gib:.2f} GiB live, "
                                              f"{kept - memory.device_total_gib:.2f} GiB of freed memory kept for "
                                              f"speed{loaded})")
    returned = " with freed memory returned to the system (slower steps)" if keep_freed else ""
    return live, False, (f"{returned}{f' ({loaded[2:]})' if loaded else ''}")


def _suggestions(spec: RunSpec, auto_batch: bool) -> str:
    options = []
    if not auto_batch:
        options.append("micro_batch: auto (the largest that fits, with gradient accumulation)")
    if spec.grad_checkpointing is False:
        options.append("grad_checkpointing: auto")
    several = spec.gpus.count > 1  # the chunked loss runs on one process; QLoRA under DDP only
    if spec.loss == "standard" and not several:
        options.append("loss: chunked")
    if spec.method == "full":
        options.append("method: lora")
    elif spec.method == "lora" and not (several and spec.gpus.strategy != "ddp"):
        options.append("method: qlora")
    if spec.optimizer in TORCH_ADAMW:
        options.append("optimizer: adamw-8bit")
    options.append("a shorter seq_len")
    return "try " + ", ".join(options) + "; `tunecast memory` with --gpu shows what each change gives"
