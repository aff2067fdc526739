"""`tunecast train --dry-run`: what a run would do, decided as the run decides it, without loading weights,
taking the run's lock or writing anything.

1. The device: `gpus.gpu` when the config names one (its usable memory from the catalog), else this machine's.
2. The batch shape: the micro-batch, accumulation and checkpointing `choose_batch` picks on that device for each of
   the `gpus.count` workers (each its share of a global batch, as the session takes it), from the memory estimate of
   the config's runner (`runner:`; another tool's step is estimated, tunecast's trains).
3. The steps: from the dataset file read with the run's tokenizer (as training reads it), else from the declared
   `dataset.examples`; none when neither is there.
4. The output: whether a checkpoint there would be resumed (the newest one that verifies).

A diffusion pipeline's run (`diffusion_dry_run`) is decided the same way: its checks before anything loads
(train/preflight.py: the images and captions read and each image opened), the batch shape `choose_diffusion_batch`
picks on the device, and the steps of its images × `diffusion.repeats` × epochs, as the run counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedPipeline, LoadedSpec
from tunecast.train.batching import BatchChoice, Device, choose_batch


@dataclass(frozen=True)
class DryRun:
    runner: str
    device: str
    choice: BatchChoice
    examples: int | None
    sequences: int | None  # training sequences (packed sequences with packing)
    steps: int | None
    steps_per_epoch: int | None
    data_source: str
    output: str
    resume_step: int | None  # the checkpoint a run would resume from

    def as_dict(self) -> dict[str, Any]:
        choice = self.choice
        return {"dry_run": True, "runner": self.runner, "device": self.device,
                "micro_batch": choice.micro_batch, "grad_accum": choice.grad_accum,
                "grad_checkpointing": choice.grad_checkpointing,
                "predicted_memory_gib": None if choice.estimate_gib is None else round(choice.estimate_gib, 3),
                "capacity_gib": round(choice.capacity_gib, 3), "reasons": list(choice.reasons),
                "examples": self.examples, "sequences": self.sequences, "steps": self.steps,
                "steps_per_epoch": self.steps_per_epoch, "data_source": self.data_source, "output": self.output,
                "resume_step": self.resume_step}


def planned_device(loaded: LoadedSpec | LoadedPipeline, catalog: Catalog) -> Device:
    """The GPU the config names (its usable memory), else the device of this machine."""
    if loaded.gpu is not None:
        return Device("cuda", loaded.gpu.slug, loaded.gpu.usable_memory_gib, loaded.gpu)
    from tunecast.train.session import local_device

    return local_device(catalog)


def dry_run(loaded: LoadedSpec, catalog: Catalog, *, check_memory: bool = True) -> DryRun:
    from tunecast.train.host_memory import can_keep_freed_memory, cpu_loading_gib
    from tunecast.train.run import output_url, run_length

    spec = loaded.spec
    device = planned_device(loaded, catalog)
    processes = spec.gpus.count  # `train --gpus N` starts N workers; each takes its share of a global batch
    fixed = spec.with_changes({"global_batch": spec.global_batch // processes}) \
        if spec.global_batch is not None and processes > 1 else spec
    cpu = device.kind == "cpu"  # as the run decides it there (batching.py)
    choice = choose_batch(fixed, loaded.model.data, device, catalog, check_memory=check_memory,
                          keep_freed=cpu and can_keep_freed_memory(),
                          loading_gib=cpu_loading_gib(spec, loaded.model) if cpu else 0.0)
    per_step = choice.micro_batch * choice.grad_accum * processes
    examples = sequences = steps = per_epoch = None
    if spec.dataset.path is not None:
        from tunecast.train.batches import run_data
        from tunecast.train.model import load_run_tokenizer

        data = run_data(spec, load_run_tokenizer(spec, loaded.model))
        examples, sequences = data.examples, len(data.units)
        source = f"{spec.dataset.path}, read with the run's tokenizer"
    elif spec.dataset.examples is not None and not spec.packing:
        examples = sequences = spec.dataset.examples
        source = "dataset.examples (declared; no file to read)"
    else:
        source = ("no dataset file: steps unknown" if spec.max_steps is None else
                  "max_steps (at most: no dataset file to count the epochs' steps)" if spec.fixed("epochs")
                  else "max_steps")
    if sequences is not None:
        length = run_length(spec, sequences, per_step, epochs_set=spec.fixed("epochs"))
        steps, per_epoch = length.steps, length.per_epoch
    elif spec.max_steps is not None:
        steps = spec.max_steps
    output = output_url(spec)
    return DryRun(spec.runner, device.name, choice, examples, sequences, steps, per_epoch, source, output,
                  _resume_step(output))


def _resume_step(output: str) -> int | None:
    """The step of the newest checkpoint at `output` that verifies, which a run there would resume from."""
    from tunecast.storage.store import CheckpointStore, Storage

    storage = Storage(output)
    if not storage.exists():
        return None
    found, _ = CheckpointStore(storage).newest_valid(keep=False)
    return found.step if found is not None else None


def diffusion_dry_run(loaded: LoadedPipeline, catalog: Catalog, *, check_memory: bool = True) -> DryRun:
    """`dry_run` of a diffusion pipeline's run: `examples` its images, `sequences` the images an epoch sees (times
    `diffusion.repeats`)."""
    from tunecast.train.batching import choose_diffusion_batch
    from tunecast.train.diffusion_loop import image_epochs
    from tunecast.train.preflight import check_pipeline_run
    from tunecast.train.run import output_url

    spec, pipeline = loaded.spec, loaded.pipeline
    images = check_pipeline_run(spec, pipeline)
    device = planned_device(loaded, catalog)
    choice = choose_diffusion_batch(spec, pipeline, device, catalog, check_memory=check_memory)
    epochs = image_epochs(spec, pipeline, images, choice.micro_batch, choice.grad_accum,
                          epochs_set=spec.fixed("epochs"))
    seen = len(images) * spec.diffusion.repeats
    output = output_url(spec)
    return DryRun(spec.runner, device.name, choice, len(images), seen, epochs.length.steps, epochs.length.per_epoch,
                  f"{spec.dataset.path}: {epochs.about}", output, _resume_step(output))
