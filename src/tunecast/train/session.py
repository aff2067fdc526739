"""Set up everything one process's run needs (run.py decides whether it is fresh or resumed)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec
from tunecast.errors import Problem, TunecastError
from tunecast.estimate.settings import TraceSettings
from tunecast.train.batches import load_train_data
from tunecast.train.batching import BatchChoice, Device, choose_batch
from tunecast.train.host_memory import keep_freed_memory
from tunecast.train.loop import CheckpointPolicy, Session
from tunecast.train.metrics import MetricsLog
from tunecast.train.model import (
    BASE_SAVED,
    enable_float8,
    load_base,
    load_run_tokenizer,
    pad_id,
    quantize_for_qlora,
    save_base,
)
from tunecast.train.optim import TrainOptimizer, warmup_steps
from tunecast.train.run import (
    RESOLVED,
    TrainRequest,
    TrainResult,
    config_hash,
    free_memory_gib,
    total_steps,
    write_config,
)
from tunecast.train.setup import prepare_for_training
from tunecast.train.signals import PreemptionFlag
from tunecast.train.state import Progress, restore
from tunecast.train.store import MANIFEST, CheckpointStore, Loaded, RunLock, Storage


def resident_gib() -> float:
    """This process's resident memory now (the CPU memory estimate counts growth above it)."""
    import os

    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def local_device(catalog: Catalog) -> Device:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        short = name.removeprefix("NVIDIA ").removeprefix("GeForce ").strip()
        gpu = catalog.gpus.find(short) or catalog.gpus.find(short.replace(" ", "-"))
        return Device("cuda", name, free_memory_gib("cuda"), gpu)
    return Device("cpu", "the CPU", free_memory_gib("cpu"), None)


def _price(spec: Any, device: Device, catalog: Catalog) -> tuple[float, str]:
    if spec.pricing.usd_per_hour is not None:
        return spec.pricing.usd_per_hour, f"${spec.pricing.usd_per_hour:g}/h (pricing.usd_per_hour)"
    if device.gpu is not None:
        offers = [o for o in catalog.offers if o.gpu == device.gpu.slug and o.gpu_count == 1]
        if offers:
            cheapest = min(offers, key=lambda o: o.usd_per_hour)
            return cheapest.usd_per_hour, (f"${cheapest.usd_per_hour:g}/h: the cheapest on-demand {device.gpu.slug} "
                                           f"offer ({cheapest.provider}); set pricing.usd_per_hour for your own")
    return 0.0, f"no price for {device.name}: costs show $0 (set pricing.usd_per_hour or --usd-per-hour)"


def build_session(loaded: LoadedSpec, catalog: Catalog, request: TrainRequest, flag: PreemptionFlag, reporter: Any,
                  *, storage: Storage, store: CheckpointStore, lock: RunLock, found: Loaded | None,
                  resolved_then: dict[str, Any] | None, result: TrainResult) -> Session:
    spec, resolved_model = loaded.spec, loaded.model
    flag.check()
    if spec.dataset.path is None:
        raise TunecastError("training needs a dataset file", field="dataset.path",
                            hint="set dataset.path (or --dataset) to a JSONL, JSON, CSV or Parquet file")
    counter = load_run_tokenizer(spec, resolved_model)
    data = load_train_data(spec.dataset.path, counter, layout=spec.dataset.format, train_on=spec.dataset.train_on,
                           seq_len=spec.seq_len, packing=spec.packing, eval_examples=spec.eval.examples, seed=spec.seed,
                           skip_invalid=spec.dataset.skip_invalid, pad_id=pad_id(counter), check=flag.check,
                           limit=request.data_limit)
    if data.skipped_rows:
        result.warnings.append(Problem("dataset.skip_invalid", f"{data.skipped_rows} invalid row(s) skipped",
                                       "`tunecast data` lists them", severity="warning"))
    if data.untrained_examples:
        result.warnings.append(Problem("seq_len", f"{data.untrained_examples} example(s) have no trained token within "
                                       f"seq_len {spec.seq_len} and are left out",
                                       "raise seq_len if their responses matter", severity="warning"))
    flag.check()

    from accelerate import Accelerator

    device = local_device(catalog)
    keeps_freed_memory = device.kind == "cpu" and keep_freed_memory()
    accelerator = Accelerator(cpu=device.kind == "cpu", mixed_precision="no")
    fixed = spec
    if resolved_then:
        fixed = spec.with_changes({key: resolved_then[key] for key in RESOLVED if key in resolved_then}
                                  | {"global_batch": None})
    choice: BatchChoice = choose_batch(fixed, resolved_model.data, device, catalog, check_memory=request.check_memory)
    checkpointing = "on" if choice.grad_checkpointing else "off"
    reporter.event("start", f"micro_batch {choice.micro_batch} × grad_accum {choice.grad_accum}, gradient "
                            f"checkpointing {checkpointing}: " + "; ".join(choice.reasons))
    if spec.gpus.count > 1:
        result.warnings.append(Problem("gpus.count", f"is {spec.gpus.count}, but this process trains on one device",
                                       "the global batch is kept by gradient accumulation", severity="warning"))
    per_step = choice.micro_batch * choice.grad_accum
    steps, per_epoch = total_steps(spec, len(data.units), per_step)
    warmup = warmup_steps(spec, steps)

    seed_everything(spec.seed)
    flag.check()
    rss_before_model = resident_gib()
    base = load_base(spec, resolved_model, allow_download=request.allow_download)
    if base.random and not request.measuring and not storage.exists(BASE_SAVED, MANIFEST):
        save_base(base.model, counter, storage)
    flag.check()
    model = base.model
    if spec.method == "qlora":
        model = quantize_for_qlora(model, spec, accelerator.device)
    if spec.precision == "fp8":
        model = enable_float8(model.to(accelerator.device), accelerator.device)
    settings = TraceSettings.from_spec(spec, grad_checkpointing=choice.grad_checkpointing)
    model = prepare_for_training(model, settings)
    model = accelerator.prepare_model(model, device_placement=spec.method != "qlora")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = TrainOptimizer(spec, trainable)
    if spec.optimizer_in_backward and spec.max_grad_norm > 0:
        result.warnings.append(Problem("max_grad_norm", "does not apply with optimizer_in_backward: each parameter "
                                       "steps before the others' gradients exist", "set max_grad_norm: 0 to say so",
                                       severity="warning"))
    scaler = torch.amp.GradScaler(accelerator.device.type) if spec.precision == "fp16-mixed" else None

    progress = Progress()
    if found is not None:
        try:
            progress = restore(found.files, model=model, optimizer=optimizer, scaler=scaler)
        except (ValueError, KeyError, RuntimeError) as error:
            raise TunecastError(f"checkpoint step {found.step} does not fit this run: {error}", field="output",
                                hint="pass --fresh to start over (the old run is moved aside)") from None
        result.resumed_from = found.step
    metrics = MetricsLog(storage, keep_bytes=progress.metrics_bytes if found is not None else None)

    usd_per_hour, price_note = _price(spec, device, catalog)
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    policy = CheckpointPolicy.for_spec(
        spec, interruptions_per_hour=catalog.throughput.get("spot_interruptions_per_hour"),
        rate_source="the catalog's default spot preemption rate",
        # weights and two optimizer states, at the catalog's object-storage write speed, until one is measured
        estimated_write_s=3 * trainable_bytes / (catalog.throughput.get("checkpoint_write_mib_per_s") * 2**20))

    requested = spec.model_dump(mode="json")
    resolved = {"micro_batch": choice.micro_batch, "grad_accum": choice.grad_accum,
                "grad_checkpointing": choice.grad_checkpointing}
    document = {**requested, **resolved, "global_batch": None}
    config_yaml = write_config(storage, document)
    meta = {"requested": requested, "resolved": resolved, "config_sha256": config_hash(document),
            "total_steps": steps}
    reporter.event("start", f"model: {base.origin}; {sum(p.numel() for p in trainable):,} trainable parameters")
    reporter.event("start", f"data: {data.examples:,} training examples ({len(data.units):,} "
                            f"{'packed sequences' if spec.packing else 'sequences'}), {len(data.eval_units)} held out; "
                            f"{steps} steps ({per_epoch} per epoch)")
    if request.measuring:
        reporter.event("start", f"measuring only: no checkpoints; price {price_note}")
    else:
        reporter.event("start", f"checkpoints {policy.describe()}, keep {spec.checkpoint.keep}; price {price_note}")
    event = {"kind": "event", "event": "resume" if found is not None else "start", "step": progress.step,
             "total_steps": steps, "micro_batch": choice.micro_batch, "grad_accum": choice.grad_accum,
             "grad_checkpointing": choice.grad_checkpointing, "device": device.name, "usd_per_hour": usd_per_hour,
             "checkpoint_policy": policy.describe(), "rss_before_model_gib": rss_before_model,
             "keeps_freed_memory": keeps_freed_memory}
    metrics.write(event)
    if found is not None:
        reporter.event("resume", f"resumed from checkpoint step {found.step} of {steps}")
    return Session(spec=spec, model=model, optimizer=optimizer, scaler=scaler, accelerator=accelerator, data=data,
                   micro_batch=choice.micro_batch, grad_accum=choice.grad_accum, total_steps=steps,
                   warmup_steps=warmup, store=store, lock=lock, metrics=metrics, progress=progress, policy=policy,
                   usd_per_hour=usd_per_hour, config_yaml=config_yaml, manifest_meta=meta, flag=flag,
                   reporter=reporter, started=request.started, elapsed_before_s=progress.elapsed_s,
                   device=accelerator.device, trainable=trainable, tokenizer=counter)
