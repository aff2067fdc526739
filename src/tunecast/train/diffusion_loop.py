"""A diffusion pipeline's run: its set-up and its loop, on the language models' run (run.py: output, lock, resume and
config policy) and their loop's parts (loop.py: checkpoints, the step's metrics line, the preemption save).

Set-up, in order (each stage checking the preemption flag):

1. the images and captions (data/images.py), made the training size; the run's length in optimizer steps of
   micro_batch × grad_accum images (run.RunLength: an epoch is every image once);
2. the pipeline's parts (diffusion_parts.py), random weights kept under `base/`; the denoiser made trainable as the
   memory estimate traces it (step/diffusion.py: LoRA adapters in fp32, or every weight);
3. `diffusion.cache_latents`: every image encoded once by the VAE (its latent distribution kept in memory, sampled
   at each step as diffusers' examples sample cached latents), then the VAE unloaded; `diffusion.cache_text`: every
   caption encoded once, then the text encoders unloaded. A resumed run encodes them again, to the same values;
4. the optimizer and the learning-rate schedule of the language models' runs, then the checkpoint's state.

Each optimizer step draws its noise, timesteps and latent samples from a torch.Generator seeded from (seed, step)
alone, and its images in the epoch's order, a permutation of (seed, epoch): a step redone after a preemption draws
exactly what it drew the first time, and a resumed run reaches the same weights bit for bit. The loss of each
micro-batch is the step's (step/diffusion.training_loss, shared with the memory tracer), divided by the
accumulation steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tunecast.catalog.diffusion import Pipeline
from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedPipeline
from tunecast.config.spec import RunSpec
from tunecast.data.images import (
    Captioned,
    epoch_micro_batches,
    load_pixels,
    micro_batches_per_epoch,
    size_conditioning,
    training_sizes,
)
from tunecast.estimate.diffusion import diffusion_settings, diffusion_shape
from tunecast.step.diffusion import (
    Conditioning,
    NoiseSource,
    adapt_denoiser,
    autocast_dtype,
    encode_captions,
    is_sdxl,
    training_loss,
    weight_dtype,
)
from tunecast.storage.store import MANIFEST, CheckpointStore, Loaded, Storage
from tunecast.train.batches import epoch_order
from tunecast.train.batching import choose_diffusion_batch
from tunecast.train.diffusion_parts import load_parts, save_base
from tunecast.train.diffusion_parts import write_final as write_final_files
from tunecast.train.distributed import Engine
from tunecast.train.loop import (
    Outcome,
    Session,
    checkpoint_if_due,
    clip_and_step,
    finished,
    log_step,
    saved_on_preemption,
)
from tunecast.train.metrics import MetricsLog
from tunecast.train.model import BASE_SAVED
from tunecast.train.optim import TrainOptimizer, lr_factor, warmup_steps
from tunecast.train.preflight import check_pipeline_run, local_pipeline
from tunecast.train.run import RunLength, TrainRequest, TrainResult, config_hash, run_length, write_config
from tunecast.train.session import (
    check_schedule,
    checkpoint_policy,
    grad_scaler,
    local_device,
    resumed_progress,
    resumed_shape,
    run_price,
    seed_everything,
)
from tunecast.train.signals import Preempted, PreemptionFlag
from tunecast.train.state import capture_rng
from tunecast.units import SECONDS_PER_HOUR


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of optimizer step `step`'s noise, timesteps and latent samples: a function of (seed, step)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_003 + 1)


class Latents:
    """The training images' latents, scaled as the denoiser sees them: each image's latent distribution cached once
    (`diffusion.cache_latents`), or the VAE encoding the batch's images at every step; sampled from the step's
    generator either way (diffusers' DiagonalGaussianDistribution.sample)."""

    def __init__(self, vae: Any, images: list[Captioned], sizes: list[tuple[int, int]], dtype: torch.dtype,
                 *, cache: bool, check: Any) -> None:
        self.images, self.sizes, self.dtype = images, sizes, dtype  # sizes: each image's training (width, height)
        self.scaling = float(vae.config.scaling_factor)
        self.shift = float(vae.config.get("shift_factor") or 0.0)  # SD3's and FLUX's VAEs shift, SD's do not
        self.vae: Any = vae
        self.cached: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if cache:
            self.cached = []
            for index in range(len(images)):
                check()
                mean, std = self._distribution([index])
                self.cached.append((mean[0], std[0]))
            self.vae = None  # unloaded: nothing encodes while training

    def _distribution(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = torch.stack([torch.from_numpy(load_pixels(self.images[i].image, *self.sizes[i]))
                              for i in indices])  # (batch, 3, height, width) in [-1, 1]: a micro-batch has one size
        with torch.no_grad():
            encoded = self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist
        return encoded.mean, encoded.std

    def batch(self, indices: list[int], generator: torch.Generator) -> torch.Tensor:
        """(batch, channels, height / scale, width / scale) in the weight dtype."""
        if self.cached is not None:
            mean = torch.stack([self.cached[i][0] for i in indices])
            std = torch.stack([self.cached[i][1] for i in indices])
        else:
            mean, std = self._distribution(indices)
        drawn = torch.randn(mean.shape, generator=generator, dtype=mean.dtype).to(mean.device)  # on the CPU
        sample = mean + std * drawn
        return ((sample - self.shift) * self.scaling).to(self.dtype)


class Captions:
    """The captions as the denoiser attends to them: encoded once (`diffusion.cache_text`), or by the resident text
    encoders for each batch. For SDXL, with each image's size conditioning (`sizes`: data/images.size_conditioning)."""

    def __init__(self, pipeline: Pipeline, tokenizers: list[Any], encoders: list[Any], captions: list[str],
                 sizes: list[tuple[int, ...]] | None, *, cache: bool, check: Any) -> None:
        self.pipeline, self.tokenizers, self.encoders = pipeline, tokenizers, encoders
        self.captions, self.sizes = captions, sizes
        self.cached: list[Conditioning] | None = None
        if cache:
            self.cached = []
            for caption in captions:
                check()
                self.cached.append(encode_captions(pipeline, tokenizers, encoders, [caption]))
            self.encoders = []  # unloaded

    def batch(self, indices: list[int], dtype: torch.dtype, device: torch.device) -> Conditioning:
        if self.cached is not None:
            chosen = [self.cached[i] for i in indices]
            pooled = [one.pooled for one in chosen if one.pooled is not None]
            encoded = Conditioning(torch.cat([one.states for one in chosen]), torch.cat(pooled) if pooled else None)
        else:
            encoded = encode_captions(self.pipeline, self.tokenizers, self.encoders,
                                      [self.captions[i] for i in indices])
        if self.sizes is None:
            return encoded
        time_ids = torch.tensor([self.sizes[i] for i in indices], dtype=dtype, device=device)  # (batch, 6)
        return Conditioning(encoded.states, encoded.pooled, time_ids)


@dataclass(frozen=True)
class DiffusionData:
    """What a diffusion run trains on and with, besides the language models' parts of a Session."""

    pipeline: Pipeline
    images: list[Captioned]
    sizes: list[tuple[int, int]]  # each image's training (width, height): the resolution, or its aspect bucket
    latents: Latents
    captions: Captions
    noise_scheduler: Any  # the UNet models' DDPMScheduler, SD3's and FLUX's FlowMatchEulerDiscreteScheduler
    base: str  # the base final/ loads into: the run's base/, the pipeline folder or its Hub id


DiffusionSession = Session[DiffusionData]


def build_session(loaded: LoadedPipeline, catalog: Catalog, request: TrainRequest, flag: PreemptionFlag,
                  reporter: Any, *, storage: Storage, store: CheckpointStore, lock: Any, found: Loaded | None,
                  resolved_then: dict[str, Any] | None, result: TrainResult, engine: Engine) -> DiffusionSession:
    pipeline = loaded.pipeline
    spec = resumed_shape(loaded.spec, resolved_then, 1) if resolved_then else loaded.spec
    flag.check()
    images = check_pipeline_run(spec, pipeline)
    device = local_device(catalog)
    # the batch shape from the traced step's memory on this device (train/batching.py), as a language model's run
    choice = choose_diffusion_batch(spec, pipeline, device, catalog, check_memory=request.check_memory)
    micro_batch, grad_accum = choice.micro_batch, choice.grad_accum
    spec = spec.with_changes({"micro_batch": micro_batch, "grad_accum": grad_accum, "global_batch": None,
                              "grad_checkpointing": choice.grad_checkpointing})
    shape = diffusion_shape(spec, pipeline)
    epochs = image_epochs(spec, pipeline, images, micro_batch, grad_accum, epochs_set=loaded.spec.fixed("epochs"))
    sizes, length = epochs.sizes, epochs.length
    if found is not None:
        check_schedule(found, length.schedule_steps)
    settings = diffusion_settings(spec)

    seed_everything(spec.seed)
    flag.check()
    parts = load_parts(spec, pipeline, settings, offline=request.offline)
    folder = local_pipeline(spec)
    if parts.random and folder is not None and not storage.exists(BASE_SAVED, MANIFEST):
        save_base(parts, pipeline, folder, storage)
    flag.check()
    model = adapt_denoiser(parts.denoiser, pipeline, settings).to(engine.device)
    latents = Latents(parts.vae.to(engine.device), images, sizes, weight_dtype(settings), cache=shape.cache_latents,
                      check=flag.check)
    conditioning: list[tuple[int, ...]] | None = [size_conditioning(one.image, *size) for one, size in
                                                  zip(images, sizes, strict=True)] if is_sdxl(pipeline) else None
    captions = Captions(pipeline, parts.tokenizers, [encoder.to(engine.device) for encoder in parts.text_encoders],
                        [one.caption for one in images], conditioning, cache=shape.cache_text, check=flag.check)
    noise_scheduler, origin = parts.scheduler, parts.origin
    del parts  # the VAE and text encoders stay only where they are used (not when cached)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = TrainOptimizer(spec, trainable)
    scaler = grad_scaler(spec, engine)
    progress = resumed_progress(found, store, engine, spec, model=model, optimizer=optimizer, scaler=scaler,
                                result=result, reporter=reporter)
    metrics = MetricsLog(storage, keep_bytes=progress.metrics_bytes if found is not None else None)
    usd_per_hour, price_note = run_price(spec, device, catalog)
    policy = checkpoint_policy(spec, catalog, trainable)

    requested = loaded.spec.model_dump(mode="json")
    resolved = {"micro_batch": micro_batch, "grad_accum": grad_accum,
                "grad_checkpointing": spec.grad_checkpointing is True, "world_size": 1}
    document = {**requested, **{k: v for k, v in resolved.items() if k != "world_size"}, "global_batch": None}
    config_yaml = write_config(storage, document)
    meta = {"requested": requested, "resolved": resolved, "config_sha256": config_hash(document),
            "total_steps": length.steps, "schedule_steps": length.schedule_steps,
            "schedule_by": "epochs" if length.by_epochs else "max_steps"}
    base = storage.url_of(BASE_SAVED) if storage.exists(BASE_SAVED) else str(folder or pipeline.name)
    cached = [what for what, on in (("latents", shape.cache_latents), ("text", shape.cache_text)) if on]
    reporter.event("start", f"micro_batch {micro_batch} × grad_accum {grad_accum}, gradient checkpointing "
                            f"{'on' if spec.grad_checkpointing is True else 'off'}, {shape.width}×{shape.height} px, "
                            f"{pipeline.objective} objective; cached: {', '.join(cached) or 'nothing'}")
    reporter.event("start", "batch shape: " + "; ".join(choice.reasons))
    reporter.event("start", f"model: {origin}; {sum(p.numel() for p in trainable):,} trainable parameters")
    reporter.event("start", f"data: {epochs.about}; {length.steps} steps ({length.per_epoch} per epoch)")
    reporter.event("start", f"checkpoints {policy.describe()}, keep {spec.checkpoint.keep}; price {price_note}")
    metrics.write({"kind": "event", "event": "resume" if found is not None else "start", "step": progress.step,
                   "total_steps": length.steps, "micro_batch": micro_batch, "grad_accum": grad_accum,
                   "grad_checkpointing": spec.grad_checkpointing is True, "device": device.name,
                   "usd_per_hour": usd_per_hour, "checkpoint_policy": policy.describe(),
                   "elapsed_s": round(progress.elapsed_s, 3), "memory_kind": device.kind,
                   "gpu": device.gpu.slug if device.gpu is not None else None, "processes": 1,
                   "width": shape.width, "height": shape.height, "images": len(images)})
    if found is not None:
        reporter.event("resume", f"resumed from checkpoint step {found.step} of {length.steps}")
    data = DiffusionData(pipeline, images, sizes, latents, captions, noise_scheduler, base)
    return Session(spec=spec, model=model, optimizer=optimizer, scaler=scaler, engine=engine, data=data,
                   micro_batch=micro_batch, grad_accum=grad_accum, total_steps=length.steps,
                   schedule_steps=length.schedule_steps, warmup_steps=warmup_steps(spec, length.schedule_steps),
                   store=store, lock=lock, metrics=metrics, progress=progress, policy=policy,
                   usd_per_hour=usd_per_hour, config_yaml=config_yaml, manifest_meta=meta, flag=flag,
                   reporter=reporter, started=request.started, elapsed_before_s=progress.elapsed_s,
                   device=engine.device, trainable=trainable)


def _optimizer_step(session: DiffusionSession, micro: list[list[int]], generator: torch.Generator
                    ) -> tuple[float, float, float]:
    """Forward and backward over the step's micro-batches of images, then clip and step: (mean loss, grad norm,
    the time the passes ended)."""
    spec, pipeline = session.spec, session.data.pipeline
    dtype = weight_dtype(diffusion_settings(spec))
    cast = autocast_dtype(diffusion_settings(spec))
    source = NoiseSource(generator, session.data.noise_scheduler)
    total = 0.0
    for indices in micro:
        session.flag.check()
        latents = session.data.latents.batch(indices, generator).to(session.device)  # (batch, channels, h, w)
        conditioning = session.data.captions.batch(indices, dtype, session.device)
        with torch.autocast(session.device.type, dtype=cast, enabled=cast is not None):
            loss = training_loss(session.model, pipeline, latents, dtype, conditioning, source)
        scaled = loss / len(micro)
        (session.scaler.scale(scaled) if session.scaler is not None else scaled).backward()
        total += float(loss.detach()) / len(micro)
    passes_done = time.monotonic()
    grad_norm = clip_and_step(session)
    return total, grad_norm, passes_done


@dataclass(frozen=True)
class ImageEpochs:
    """What a run's epochs are made of: each image's training size, the run's length in optimizer steps, and the
    images in words (with their repeats and buckets)."""

    sizes: list[tuple[int, int]]
    length: RunLength
    about: str


def image_epochs(spec: RunSpec, pipeline: Pipeline, images: list[Captioned], micro_batch: int, grad_accum: int, *,
                 epochs_set: bool) -> ImageEpochs:
    """An epoch sees each image `diffusion.repeats` times (kohya's folder repeats), in micro-batches of one training
    size each (one size without buckets): the steps the run trains, `--dry-run` says and the plan counts."""
    shape = diffusion_shape(spec.with_changes({"micro_batch": 1}), pipeline)  # its sides (micro_batch auto too)
    sizes = training_sizes([one.image for one in images], shape.width, shape.height, pipeline.grid,
                           spec.diffusion.buckets)
    per_epoch = micro_batches_per_epoch(sizes, spec.diffusion.repeats, micro_batch)
    length = run_length(spec, per_epoch * micro_batch, micro_batch * grad_accum, epochs_set=epochs_set)
    repeats = f" × {spec.diffusion.repeats} repeats" if spec.diffusion.repeats > 1 else ""
    buckets = f" in {len(set(sizes))} aspect buckets" if spec.diffusion.buckets else ""
    return ImageEpochs(sizes, length, f"{len(images)} images with captions{repeats}{buckets}")


def epoch_batches(session: DiffusionSession, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s micro-batches of image indices: its order (each image `diffusion.repeats` times, shuffled from
    (seed, epoch) only) in micro-batches of one training size (data/images.epoch_micro_batches)."""
    images = len(session.data.images)
    order = epoch_order(images * session.spec.diffusion.repeats, session.spec.seed, epoch)
    groups = [session.data.sizes[unit % images] for unit in range(images * session.spec.diffusion.repeats)]
    return [[unit % images for unit in batch]
            for batch in epoch_micro_batches(order, groups, session.micro_batch)]


def _batch_at(batches: list[list[int]], offset: int) -> int:
    """The index of the micro-batch that starts after `offset` images of the epoch (a checkpoint's data position)."""
    seen = 0
    for index, batch in enumerate(batches):
        if seen == offset:
            return index
        seen += len(batch)
    raise RuntimeError(f"no micro-batch of the epoch starts after {offset} images (of {seen})")


def train(session: DiffusionSession) -> Outcome:
    """Optimizer steps until `total_steps`, or until a preemption signal (loop.train's order of work)."""
    spec, progress = session.spec, session.progress
    orders: dict[int, list[list[int]]] = {}
    try:
        while True:
            # 1. what is due between steps
            session.store.storage.check()
            if progress.step >= session.total_steps:
                break
            checkpoint_if_due(session)
            session.flag.check()

            # 2. this step's images, from the data position; its generator
            if progress.epoch not in orders:
                orders[progress.epoch] = epoch_batches(session, progress.epoch)
            order = orders[progress.epoch]
            at = _batch_at(order, progress.offset)
            micro = order[at:at + session.grad_accum]
            chosen = [image for batch in micro for image in batch]
            generator = step_generator(spec.seed, progress.step)
            started = time.monotonic()

            # 3. learning rate of this step, passes, clipping, optimizer
            lr = spec.learning_rate * lr_factor(spec.schedule, progress.step, warmup=session.warmup_steps,
                                                total=session.schedule_steps)
            session.optimizer.set_lr(lr)
            loss, grad_norm, passes_done = _optimizer_step(session, micro, generator)
            if session.device.type == "cuda":
                torch.cuda.synchronize(session.device)
            ended = time.monotonic()
            seconds = ended - started

            # 4. the position moves on; metrics; generators captured for the next step
            progress.step += 1
            progress.offset += len(chosen)
            if at + len(micro) >= len(order):
                progress.epoch += 1
                progress.offset = 0
                orders.pop(progress.epoch - 1, None)
            session.rng_at_boundary = capture_rng()
            session.trained_images += len(chosen)
            seen = len(session.data.images) * spec.diffusion.repeats
            log_step(session, {"epoch": progress.epoch + progress.offset / seen, "loss": loss,
                               "learning_rate": lr, "grad_norm": grad_norm, "images": len(chosen),
                               "images_per_second": len(chosen) / seconds if seconds else 0.0},
                     seconds=seconds, optimizer_seconds=ended - passes_done)
    except Preempted as stop:
        return saved_on_preemption(session, stop)
    return finished(session)


def write_final(session: DiffusionSession, storage: Storage, loaded: LoadedPipeline) -> None:
    write_final_files(session.model, session.data.pipeline, session.spec, storage, model_card(session, loaded),
                      {"kind": "final", "step": session.progress.step, "schedule_steps": session.schedule_steps})


def model_card(session: DiffusionSession, loaded: LoadedPipeline) -> str:
    spec, progress, pipeline = session.spec, session.progress, session.data.pipeline
    denoiser = pipeline.classes[pipeline.denoiser]
    if spec.method == "lora":
        what = (f"LoRA adapters (rank {spec.lora.rank}, alpha {spec.lora.alpha}) of the {denoiser} of "
                f"`{pipeline.name}`, in diffusers' LoRA format")
        load = (f"```python\nfrom diffusers import {pipeline.pipeline_class}\n"
                f"pipe = {pipeline.pipeline_class}.from_pretrained({session.data.base!r})\n"
                "pipe.load_lora_weights('FINAL_DIR')\n```")
    else:
        what = f"The fully fine-tuned {denoiser} of `{pipeline.name}`"
        load = (f"```python\nfrom diffusers import {pipeline.pipeline_class}, {denoiser}\n"
                f"{pipeline.denoiser} = {denoiser}.from_pretrained('FINAL_DIR')\n"
                f"pipe = {pipeline.pipeline_class}.from_pretrained({session.data.base!r}, {pipeline.denoiser}="
                f"{pipeline.denoiser})\n```")
    shape = diffusion_shape(spec, pipeline)
    lines = [
        f"# {pipeline.name}: {spec.method} fine-tune by tunecast", "",
        f"{what} (base: `{session.data.base}`).", "",
        "| | |", "|---|---|",
        f"| objective | {pipeline.objective} |",
        f"| precision, optimizer | {spec.precision}, {spec.optimizer} (learning rate {spec.learning_rate:g}, "
        f"{spec.schedule}, {session.warmup_steps} warm-up steps) |",
        f"| batch | micro-batch {session.micro_batch} × accumulation {session.grad_accum} images of "
        f"{shape.width}×{shape.height} px |",
        f"| data | `{spec.dataset.path}`: {len(session.data.images)} images with captions |",
        f"| trained | {progress.step:,} optimizer steps |",
        f"| time, cost | {progress.elapsed_s / SECONDS_PER_HOUR:.3f} hours, ${progress.cost_usd:,.2f} at "
        f"${session.usd_per_hour:g}/h |",
        f"| seed | {spec.seed} |", "",
        "Load it (FINAL_DIR is this folder):", "", load, "",
        "The run's `config.yaml` and `metrics.jsonl` sit beside this folder.", ""]
    return "\n".join(lines)
