"""`tunecast plan` of a diffusion pipeline: on every GPU of the catalog, the fastest batch shape that fits, images per
second, hours, and the whole run's cost per offer, ranked.

The model, term by term:

* the workload: the images of `dataset.path` (a folder, counted: docs/diffusion.md) or `diffusion.images`, each seen
  `diffusion.repeats` times per epoch, for `epochs` (or `max_steps` optimizer steps of the global batch,
  micro_batch × grad_accum);
* memory: the traced step (estimate/diffusion.py) at each candidate micro-batch (the global batch's divisors, unless
  the run sets `micro_batch`) with and without gradient checkpointing (unless the run sets it). Candidates are screened
  along the line of what is allocated per image (linear in the batch's pixels), and the one chosen is traced exactly;
  one that does not fit after all is dropped and the next is taken. The trace of a shape serves every GPU (memory
  depends on the card only through its cuBLAS workspace);
* time of a micro-batch: the same trace's work on the card's roofline (plan/throughput.py's rates: its matmul rate for
  the matmuls and convolutions FlopCounterMode counts, its attention rate, the bytes of the memory-bound kernels at its
  bandwidth), or the host's time issuing the step's operations where that is longer: a diffusers step at batch 1 is
  host-bound on a fast card (SD 1.5 and SDXL take as long on an H100 as on an L40S), at the catalog's
  `diffusion_op_dispatch_us` per operation; the optimizer's bytes once per optimizer step;
* the run's cost: plan/cost.py's, as for a language model (startup reading the pipeline's weights, checkpoints of the
  trained weights and their optimizer states, spot preemptions).

Not counted: the text encoders' forward pass each step where their outputs are not cached (CLIP's 77 tokens: well
under 1% of a UNet's step), and the caching passes before training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Any

from tunecast.catalog.devices import from_probe, is_cpu
from tunecast.catalog.diffusion import Pipeline
from tunecast.catalog.gpus import Gpu
from tunecast.catalog.store import Catalog
from tunecast.config.spec import RunSpec
from tunecast.data.images import list_image_folder, micro_batches_per_epoch, training_sizes
from tunecast.errors import TunecastError
from tunecast.estimate.diffusion import (
    DiffusionShape,
    checkpointing_options,
    diffusion_settings,
    diffusion_shape,
    estimate_diffusion_memory,
    largest_fitting,
    step_work,
)
from tunecast.estimate.memory import MemoryEstimate
from tunecast.plan.cost import OfferCost, RunShape, price_run
from tunecast.plan.planner import MIB, divisors
from tunecast.plan.throughput import _Rates
from tunecast.units import BYTES_PER_GIB, SECONDS_PER_HOUR

SIZE_HINT = "set dataset.path to the image folder, or diffusion.images to the number of images"


@dataclass(frozen=True)
class ImageWorkload:
    """What the run trains on: `images` seen `repeats` times an epoch, for `epochs`, or `max_steps` steps."""

    images: int
    repeats: int
    epochs: float
    max_steps: int | None
    dataset_bytes: int
    source: str  # the folder counted, or "declared"
    sizes: tuple[tuple[int, int], ...] = ()  # with aspect buckets, each image's (data/images.training_sizes)

    def steps(self, global_batch: int, micro_batch: int | None = None) -> int:
        """Optimizer steps of `global_batch` images, in micro-batches of `micro_batch` (default: one a step): with
        aspect buckets a micro-batch holds one bucket's images, so each bucket's last one may be partial (as the run
        makes them: data/images.epoch_micro_batches)."""
        if self.max_steps is not None:
            return self.max_steps
        micro = micro_batch or global_batch
        if self.sizes:
            batches = micro_batches_per_epoch(list(self.sizes), self.repeats, micro)
            per_epoch = math.ceil(batches / (global_batch // micro))
        else:
            per_epoch = math.ceil(self.images * self.repeats / global_batch)
        return math.ceil(per_epoch * self.epochs)

    def as_dict(self) -> dict[str, Any]:
        return {"images": self.images, "repeats": self.repeats, "epochs": self.epochs, "max_steps": self.max_steps,
                "dataset_bytes": self.dataset_bytes, "source": self.source}


def image_workload(spec: RunSpec, pipeline: Pipeline | None = None) -> ImageWorkload:
    """The run's images: those of the folder `dataset.path` that the run trains on (data/images.py: the top level's
    captioned images, or those metadata.jsonl names), with their aspect buckets where the run has them (and
    `pipeline` is given), or `diffusion.images` as declared."""
    epochs = spec.epochs if spec.epochs is not None else 1
    if spec.dataset.path is not None:
        files = [item.image for item in list_image_folder(spec.dataset.path)]
        sizes: tuple[tuple[int, int], ...] = ()
        if spec.diffusion.buckets and pipeline is not None:
            shape = diffusion_shape(spec.with_changes({"micro_batch": 1}), pipeline)
            sizes = tuple(training_sizes(files, shape.width, shape.height, pipeline.grid, True))
        return ImageWorkload(len(files), spec.diffusion.repeats, epochs, spec.max_steps,
                             sum(path.stat().st_size for path in files), str(Path(spec.dataset.path)), sizes)
    if spec.diffusion.images is not None:
        return ImageWorkload(spec.diffusion.images, spec.diffusion.repeats, epochs, spec.max_steps, 0, "declared")
    if spec.max_steps is not None:
        return ImageWorkload(0, spec.diffusion.repeats, epochs, spec.max_steps, 0, "max_steps")
    raise TunecastError("the run has no images to plan for", field="dataset.path", hint=SIZE_HINT)


@dataclass(frozen=True)
class DiffusionStepTime:
    """Seconds of one optimizer step on one GPU, by part."""

    compute_s: float  # matmuls, convolutions, attention and memory-bound kernels of every micro-batch
    dispatch_s: float  # the host's dispatch where it exceeds the GPU's work
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.dispatch_s + self.optimizer_s


def step_time(trace_flops: dict[str, float], spec: RunSpec, gpu: Gpu, catalog: Catalog,
              grad_accum: int) -> DiffusionStepTime:
    """One optimizer step of `grad_accum` micro-batches, each the traced step's work (`trace_flops`: the trace's
    counted FLOPs and bytes) on `gpu`'s roofline."""
    rates = _Rates.of(spec, gpu, catalog.throughput)
    if rates.figures is None:  # a probed device keeps its measured overhead; else a diffusers step's (catalog)
        rates = replace(rates, host_op_s=catalog.throughput.get("diffusion_op_dispatch_us") * 1e-6)
    device_s = (trace_flops.get("matmul", 0.0) / rates.matmul + rates.attention_seconds(
        trace_flops.get("attention", 0.0), 1) + rates.elementwise_seconds(trace_flops))
    host_s = rates.host_seconds(trace_flops.get("kernels", 0.0), device_s)
    return DiffusionStepTime(grad_accum * device_s, grad_accum * host_s,
                             trace_flops.get("optimizer_bytes", 0.0) / rates.bandwidth)


@dataclass(frozen=True)
class DiffusionConfiguration:
    """The batch shape chosen on one GPU, its memory and speed."""

    gpu: Gpu
    micro_batch: int
    grad_accum: int
    grad_checkpointing: bool
    memory: MemoryEstimate
    step: DiffusionStepTime
    hours: float  # training, all steps

    @property
    def images_per_second(self) -> float:
        return self.micro_batch * self.grad_accum / self.step.total_s


@dataclass(frozen=True)
class DiffusionOption:
    gpu: str
    configuration: DiffusionConfiguration | None
    cost: OfferCost | None
    reason: str | None = None  # why nothing fits (configuration None)

    def as_dict(self) -> dict[str, Any]:
        c = self.configuration
        document: dict[str, Any] = {
            "gpu": self.gpu, "gpu_count": 1, "fits": c is not None,
            "micro_batch": c.micro_batch if c else None, "grad_accum": c.grad_accum if c else None,
            "grad_checkpointing": c.grad_checkpointing if c else None,
            "device_total_gib": round(c.memory.device_total_gib, 2) if c else None,
            "step_s": round(c.step.total_s, 6) if c else None,
            "images_per_second": round(c.images_per_second, 3) if c else None,
            "images_per_second_per_gpu": round(c.images_per_second, 3) if c else None,
            "hours": round(self.cost.hours, 3) if self.cost else (round(c.hours, 3) if c else None),
            "provider": None, "spot": False, "usd_per_hour_total": None, "total_usd": None,
            "notes": [self.reason] if self.reason else []}
        if self.cost is not None:
            document.update({key: value for key, value in self.cost.as_dict().items() if key != "hours"})
            document["notes"] += list(self.cost.notes)
        return document


@dataclass
class DiffusionPlanner:
    """The plan's choices on each GPU; traces shared across GPUs and kept for the process (estimate/diffusion.py)."""

    spec: RunSpec
    pipeline: Pipeline
    catalog: Catalog
    workload: ImageWorkload
    _memory: dict[tuple[int, bool, str], MemoryEstimate] = field(default_factory=dict)  # by batch, checkpointing,
    # the GPU's architecture (its cuBLAS workspace and CUDA context): every card of one architecture replays alike

    def global_batch(self) -> int:
        return self.spec.sequences_per_step  # images here: a pipeline trains on one GPU (config/load.py)

    def _estimate(self, gpu: Gpu, batch: int, checkpointing: bool) -> MemoryEstimate:
        """The step's memory on `gpu`: a replay where the step's profiles are shipped or cached
        (estimate/diffusion_fit.py), else a trace, which counts the step's work too."""
        key = (batch, checkpointing, gpu.architecture)  # a GPU enters the estimate by its architecture alone
        if key not in self._memory:
            spec = self.spec.with_changes({"grad_checkpointing": checkpointing, "micro_batch": batch})
            shape = diffusion_shape(spec, self.pipeline)
            self._memory[key] = estimate_diffusion_memory(self.pipeline, diffusion_settings(spec), shape,
                                                          device="cuda", gpu=gpu, overheads=self.catalog.overheads)
        return self._memory[key]

    def configure(self, gpu: Gpu) -> DiffusionConfiguration | str:
        """The fastest batch shape on `gpu` that fits (the largest micro-batch, without checkpointing where one fits
        so), or why none does."""
        spec = self.spec
        batch = self.global_batch()
        capacity = gpu.usable_memory_gib * (1 - spec.plan.memory_margin)
        fixed = spec.fixed("micro_batch")
        if fixed and batch % int(spec.micro_batch):
            return f"micro_batch {spec.micro_batch} does not divide the global batch of {batch} images"
        candidates = [int(spec.micro_batch)] if fixed else divisors(batch)
        checkpointing = checkpointing_options(spec, self.pipeline)
        least = math.inf
        for check in checkpointing:
            micro, total = largest_fitting(lambda n, check=check: self._estimate(gpu, n, check),  # type: ignore[misc]
                                           candidates, capacity)
            least = min(least, total)
            if micro is None:
                continue
            memory = self._estimate(gpu, micro, check)
            chosen = spec.with_changes({"grad_checkpointing": check, "micro_batch": micro})
            settings, shape = diffusion_settings(chosen), diffusion_shape(chosen, self.pipeline)
            flops = step_work(self.pipeline, settings, shape)
            step = step_time(flops, spec, gpu, self.catalog, batch // micro)
            hours = self.workload.steps(batch, micro) * step.total_s / SECONDS_PER_HOUR
            return DiffusionConfiguration(gpu, micro, batch // micro, check, memory, step, hours)
        return f"does not fit in {capacity:.1f} GiB: {least:.1f} GiB at least"

    def run_shape(self, config: DiffusionConfiguration) -> RunShape:
        constants = self.catalog.throughput
        memory = config.memory.breakdown_gib
        checkpoint_bytes = (memory["trainable_weights"] + memory["optimizer"]) * BYTES_PER_GIB
        write_hours = checkpoint_bytes / (constants.get("checkpoint_write_mib_per_s") * MIB) / SECONDS_PER_HOUR
        weights_bytes = (memory["weights"] + memory["trainable_weights"]) * BYTES_PER_GIB
        load_hours = weights_bytes / (constants.get("weights_read_mib_per_s") * MIB) / SECONDS_PER_HOUR
        boot_hours = constants.get("boot_minutes") / 60
        storage_gb = (self.workload.dataset_bytes + checkpoint_bytes * (self.spec.checkpoint.keep + 1)) / 1e9
        interval = None
        if self.spec.checkpoint.every_minutes:
            interval = self.spec.checkpoint.every_minutes / 60
        elif self.spec.checkpoint.every_steps:
            interval = self.spec.checkpoint.every_steps * config.step.total_s / SECONDS_PER_HOUR
        return RunShape(1, config.hours, load_hours, write_hours, boot_hours + load_hours + write_hours,
                        boot_hours, storage_gb, interval)


def plan_diffusion(spec: RunSpec, pipeline: Pipeline, gpu: Gpu | None, catalog: Catalog, *, optimize: str,
                   budget_usd: float | None, deadline_hours: float | None, interruptions_per_hour: float | None,
                   today: date, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The plan document of a diffusion run (`tunecast plan --json` of a pipeline): every GPU's option per offer,
    ranked by the whole run's cost (or its hours with `optimize` "time"), those over the budget or the deadline left
    out and counted."""
    workload = image_workload(spec, pipeline)
    planner = DiffusionPlanner(spec, pipeline, catalog, workload)
    gpus = [gpu] if gpu is not None else sorted((g for g in catalog.gpus if not from_probe(g) and not is_cpu(g)),
                                                key=lambda g: g.slug)
    offers = [o for o in catalog.offers if not spec.pricing.providers or o.provider in spec.pricing.providers]
    default_rate = catalog.throughput.get("spot_interruptions_per_hour")
    options: list[DiffusionOption] = []
    for card in gpus:
        if progress is not None:
            progress(card.slug)
        configured = planner.configure(card)
        if isinstance(configured, str):
            options.append(DiffusionOption(card.slug, None, None, configured))
            continue
        shape = planner.run_shape(configured)
        priced = [cost for offer in offers if offer.gpu == card.slug
                  for spot in ((False, True) if spec.pricing.spot else (False,))
                  if (cost := price_run(shape, offer, spot=spot, default_interruptions_per_hour=default_rate,
                                        today=today, interruptions_override=interruptions_per_hour)) is not None]
        options += [DiffusionOption(card.slug, configured, cost) for cost in priced] or \
            [DiffusionOption(card.slug, configured, None)]
    kept = [o for o in options if o.cost is None or (
        (budget_usd is None or o.cost.total_usd <= budget_usd)
        and (deadline_hours is None or o.cost.hours <= deadline_hours))]

    def key(option: DiffusionOption) -> tuple[float, ...]:
        if option.cost is not None:
            by_cost = (option.cost.total_usd, option.cost.hours)
            return (0, *(by_cost if optimize == "cost" else by_cost[::-1]))
        if option.configuration is not None:
            return (1, option.configuration.hours)
        return (2,)

    ranked = sorted(kept, key=key)
    asked: DiffusionShape = diffusion_shape(spec.with_changes({"micro_batch": planner.global_batch()}), pipeline)
    return {"model": pipeline.name, "pipeline": pipeline.pipeline_class,
            "denoiser": pipeline.classes[pipeline.denoiser], "method": spec.method, "precision": spec.precision,
            "optimizer": spec.optimizer, "width": asked.width, "height": asked.height,
            "frames": asked.frames if pipeline.video else None, "dataset": workload.as_dict(),
            "global_batch": planner.global_batch(), "steps": workload.steps(planner.global_batch()),
            "optimize": optimize, "budget_usd": budget_usd, "deadline_hours": deadline_hours,
            "filtered_out": len(options) - len(kept), "options": [option.as_dict() for option in ranked]}
