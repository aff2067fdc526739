"""Set up everything one process's run needs (run.py decides whether it is fresh or resumed).

With several processes every rank runs this: each reads and tokenizes the data (the order of an epoch is a
function of the seed, so every rank knows every step), builds the same model from the same seed, and wraps
it as `gpus.strategy` says (distributed.py). Rank 0 alone chooses the batch shape (the others receive it),
saves random base weights and writes the run's config and metrics.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from tunecast.catalog.store import Catalog
from tunecast.config.checks import distributed_problems
from tunecast.config.load import LoadedSpec
from tunecast.config.spec import STRATEGY_ENGINES
from tunecast.errors import Problem, SharedError, TunecastError
from tunecast.step.settings import TraceSettings
from tunecast.step.setup import decoder_layers, prepare_for_training
from tunecast.storage.store import MANIFEST, CheckpointStore, InvalidSet, Loaded, Storage, local_folder
from tunecast.train.batches import TrainData, run_data
from tunecast.train.batching import BatchChoice, Device, choose_batch
from tunecast.train.distributed import Engine, PeerLost
from tunecast.train.host_memory import can_keep_freed_memory, cpu_loading_gib, keep_freed_memory, reset_peak_rss
from tunecast.train.loop import Session
from tunecast.train.metrics import MetricsLog
from tunecast.train.model import (
    BASE_SAVED,
    enable_float8,
    load_base,
    load_run_tokenizer,
    quantize_for_qlora,
    save_base,
)
from tunecast.train.optim import TrainOptimizer, warmup_steps
from tunecast.train.policy import CheckpointPolicy
from tunecast.train.preflight import check_run
from tunecast.train.quantize import unquantized_weights
from tunecast.train.run import (
    RESOLVED,
    RunLength,
    TrainRequest,
    TrainResult,
    config_hash,
    free_memory_gib,
    run_length,
    warn,
    write_config,
)
from tunecast.train.signals import PreemptionFlag, stop_within_layers
from tunecast.train.state import LAYOUT, STATE, TRAINABLE, Progress, restore, restore_legacy, seed_ranks
from tunecast.train.world import world_from_env


def resident_gib() -> float:
    """This process's resident memory now (the CPU memory estimate counts growth above it)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def local_device(catalog: Catalog, ranks_here: int = 1) -> Device:
    """The device this rank trains on; on the CPU, ranks on one machine share its memory."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        short = name.removeprefix("NVIDIA ").removeprefix("GeForce ").strip()
        gpu = catalog.gpus.find(short) or catalog.gpus.find(short.replace(" ", "-"))
        return Device("cuda", name, free_memory_gib("cuda"), gpu)
    return Device("cpu", "the CPU", free_memory_gib("cpu") / ranks_here, None)


class QuietReporter:
    """What ranks other than 0 report: nothing (rank 0 speaks for the run)."""

    def event(self, kind: str, message: str) -> None:
        pass

    def step(self, record: dict[str, Any], total_steps: int, eta_s: float, cost_at_end_usd: float) -> None:
        pass


class NoMetrics:
    """metrics.jsonl as ranks other than 0 see it: rank 0 writes it."""

    size = 0

    def write(self, record: dict[str, Any]) -> None:
        pass

    def sync(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _check_distributed(spec: Any, engine: Engine) -> None:
    """What a run on several processes cannot do (yet), said before anything loads (by rank 0: every rank finds
    the same, the others only exit with its status). The rules are `validate`'s (config/checks.py), at the real
    number of processes."""
    if not engine.world.distributed:
        return
    found = distributed_problems(spec, engine.world.size)
    if found:
        first = found[0]
        raise (TunecastError if engine.world.main else SharedError)(first.message, field=first.field, hint=first.hint)


def _decided(engine: Engine, decide: Any) -> Any:
    """`decide()` on rank 0, its value (or its user error) on every rank."""
    if not engine.world.distributed:
        return decide()
    outcome: tuple[str, Any] | None = None
    failure: TunecastError | None = None
    if engine.world.main:
        try:
            outcome = ("value", decide())
        except TunecastError as error:
            failure = error
            outcome = ("error", (error.message, error.field, error.hint))
    outcome = engine.broadcast(outcome)
    assert outcome is not None
    if failure is not None:
        raise failure
    if outcome[0] == "error":
        message, field_name, hint = outcome[1]
        raise SharedError(message, field=field_name, hint=hint)
    return outcome[1]


def run_price(spec: Any, device: Device, catalog: Catalog, gpus: int = 1) -> tuple[float, str]:
    """The run's price per hour, all its GPUs together (`gpus` of them, one per process)."""
    if spec.pricing.usd_per_hour is not None:
        return spec.pricing.usd_per_hour, f"${spec.pricing.usd_per_hour:g}/h (pricing.usd_per_hour)"
    if device.gpu is not None:
        offers = [o for o in catalog.offers if o.gpu == device.gpu.slug and o.gpu_count == 1]
        if offers:
            cheapest = min(offers, key=lambda o: o.usd_per_hour)
            times = f" × {gpus} GPUs" if gpus > 1 else ""
            return cheapest.usd_per_hour * gpus, (f"${cheapest.usd_per_hour:g}/h{times}: the cheapest on-demand "
                                                  f"{device.gpu.slug} offer ({cheapest.provider}); set "
                                                  "pricing.usd_per_hour for your own")
    return 0.0, f"no price for {device.name}: costs show $0 (set pricing.usd_per_hour or --usd-per-hour)"


def build_session(loaded: LoadedSpec, catalog: Catalog, request: TrainRequest, flag: PreemptionFlag, reporter: Any,
                  *, storage: Storage, store: CheckpointStore, lock: Any, found: Loaded | None,
                  resolved_then: dict[str, Any] | None, result: TrainResult, engine: Engine | None = None
                  ) -> Session[TrainData]:
    spec, resolved_model = loaded.spec, loaded.model
    engine = engine or Engine.start(world_from_env())
    world = engine.world
    if world.distributed and spec.gpus.count != world.size:
        spec = spec.with_changes({"gpus.count": world.size})  # the estimate and the batch are per rank of this world
    _check_distributed(spec, engine)
    main = world.main
    if not main:
        reporter = QuietReporter()
    flag.check()
    cuda = engine.device.type == "cuda"
    check_run(spec, resolved_model, cuda=cuda, capability=torch.cuda.get_device_capability(engine.device)
              if cuda else None, device_name=torch.cuda.get_device_name(engine.device) if cuda else "the CPU",
              random_allowed=request.measuring)
    counter = load_run_tokenizer(spec, resolved_model)
    data = run_data(spec, counter, check=flag.check, limit=request.data_limit)
    if data.skipped_rows and main:
        warn(result, reporter, Problem("dataset.skip_invalid", f"{data.skipped_rows} invalid row(s) skipped",
                                       "`tunecast data` lists them", severity="warning"))
    if data.untrained_examples and main:
        warn(result, reporter, Problem("seq_len", f"{data.untrained_examples} example(s) have no trained token "
                                       f"within seq_len {spec.seq_len} and are left out",
                                       "raise seq_len if their responses matter", severity="warning"))
    flag.check()

    device = local_device(catalog, world.local_size)
    may_keep = device.kind == "cpu" and can_keep_freed_memory()
    loading_gib = cpu_loading_gib(spec, resolved_model) if device.kind == "cpu" else 0.0
    fixed = spec
    if world.distributed and spec.global_batch is not None:  # each process takes its share of the global batch
        fixed = spec.with_changes({"global_batch": spec.global_batch // world.size})
    if resolved_then:
        fixed = resumed_shape(spec, resolved_then, world.size)
    choice: BatchChoice = _decided(engine, lambda: choose_batch(fixed, resolved_model.data, device, catalog,
                                                                check_memory=request.check_memory,
                                                                keep_freed=may_keep, loading_gib=loading_gib))
    keeps_freed_memory = choice.keep_freed_memory and keep_freed_memory()
    checkpointing = "on" if choice.grad_checkpointing else "off"
    processes = "process" if world.size == 1 else "processes"
    across = f" × {world.size} {processes} ({STRATEGY_ENGINES[spec.gpus.strategy]})" if world.distributed else ""
    reporter.event("start", f"micro_batch {choice.micro_batch} × grad_accum {choice.grad_accum}{across}, gradient "
                            f"checkpointing {checkpointing}: " + "; ".join(choice.reasons))
    if world.distributed and spec.gpus.offload != "none" and device.kind != "cuda" and main:
        warn(result, reporter, Problem("gpus.offload", f"is {spec.gpus.offload}, but this run is on the CPU already",
                                       "nothing is offloaded; the setting applies on GPUs", severity="warning"))
    if spec.gpus.count > 1 and not world.distributed:
        warn(result, reporter, Problem("gpus.count", f"is {spec.gpus.count}, but this process trains on one device",
                                       "the global batch is kept by gradient accumulation; pass --gpus "
                                       f"{spec.gpus.count} to train on {spec.gpus.count} processes",
                                       severity="warning"))
    per_step = choice.micro_batch * choice.grad_accum * world.size
    # a measuring run (calibrate) trains exactly its max_steps
    length = run_length(spec, len(data.units), per_step,
                        epochs_set=loaded.spec.fixed("epochs") and not request.measuring)
    steps = length.steps
    if found is not None:
        check_schedule(found, length.schedule_steps)
    warmup = warmup_steps(spec, length.schedule_steps)

    seed_everything(spec.seed)
    flag.check()
    rss_before_model = resident_gib()
    base = load_base(spec, resolved_model, offline=request.offline, random_allowed=request.measuring)
    if main and base.random and not request.measuring and not storage.exists(BASE_SAVED, MANIFEST):
        save_base(base.model, counter, storage)
    flag.check()
    model = base.model
    if spec.method == "qlora":
        model = quantize_for_qlora(model, spec, engine.device)
        unquantized = unquantized_weights(model)  # a mixture of experts' fused experts: most of its weights
        if unquantized is not None and main:
            reporter.event("start", unquantized.describe())
    if spec.precision == "fp8":
        model = enable_float8(model.to(engine.device), engine.device)
    settings = TraceSettings.from_spec(spec, grad_checkpointing=choice.grad_checkpointing)
    model = prepare_for_training(model, settings)
    if spec.method != "qlora" and not (world.distributed and spec.gpus.strategy != "ddp"):
        model = model.to(engine.device)  # FSDP2 moves each shard to the device itself, layer by layer
    model = engine.wrap(model, strategy=spec.gpus.strategy, offload=spec.gpus.offload, layers=decoder_layers(model))
    engine.barrier()  # every rank wrapped (DDP's constructor broadcasts from rank 0)
    if not world.distributed and not spec.optimizer_in_backward:
        stop_within_layers(model, flag)
    if engine.sharded and device.kind == "cpu":
        reset_peak_rss()  # the whole model each rank built before sharding is not the training steps' peak
    if world.distributed:
        seed_ranks(spec.seed, world.rank, 0)  # dropout masks of their own on every rank
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = TrainOptimizer(spec, trainable)
    if spec.optimizer_in_backward and spec.max_grad_norm > 0 and main:
        warn(result, reporter, Problem("max_grad_norm", "does not apply with optimizer_in_backward: each parameter "
                                       "steps before the others' gradients exist", "set max_grad_norm: 0 to say so",
                                       severity="warning"))
    scaler = grad_scaler(spec, engine)

    progress = resumed_progress(found, store, engine, spec, model=model, optimizer=optimizer, scaler=scaler,
                                result=result, reporter=reporter)
    metrics: Any = MetricsLog(storage, keep_bytes=progress.metrics_bytes if found is not None else None) if main \
        else NoMetrics()

    usd_per_hour, price_note = run_price(spec, device, catalog, gpus=world.size if device.kind == "cuda" else 1)
    policy = checkpoint_policy(spec, catalog, trainable)

    requested = loaded.spec.model_dump(mode="json")
    resolved = {"micro_batch": choice.micro_batch, "grad_accum": choice.grad_accum,
                "grad_checkpointing": choice.grad_checkpointing, "world_size": world.size}
    document = {**requested, **{k: v for k, v in resolved.items() if k != "world_size"}, "global_batch": None}
    if world.distributed:
        document["gpus"] = {**document["gpus"], "count": world.size}
    config_yaml = write_config(storage, document) if main else ""
    meta = {"requested": requested, "resolved": resolved, "config_sha256": config_hash(document),
            "total_steps": steps, "schedule_steps": length.schedule_steps,
            "schedule_by": "epochs" if length.by_epochs else "max_steps"}
    reporter.event("start", f"model: {base.origin}; {sum(p.numel() for p in trainable):,} trainable parameters")
    reporter.event("start", f"data: {data.examples:,} training examples ({len(data.units):,} "
                            f"{'packed sequences' if spec.packing else 'sequences'}), {data.eval_examples} held out; "
                            f"{steps} steps ({length.per_epoch} per epoch)")
    if length.by_epochs and spec.max_steps is not None:
        reporter.event("start", _length_line(spec, length))
    if request.measuring:
        reporter.event("start", f"measuring only: no checkpoints; price {price_note}")
    else:
        reporter.event("start", f"checkpoints {policy.describe()}, keep {spec.checkpoint.keep}; price {price_note}")
    event = {"kind": "event", "event": "resume" if found is not None else "start", "step": progress.step,
             "total_steps": steps, "micro_batch": choice.micro_batch, "grad_accum": choice.grad_accum,
             "grad_checkpointing": choice.grad_checkpointing, "device": device.name, "usd_per_hour": usd_per_hour,
             "checkpoint_policy": policy.describe(), "rss_before_model_gib": rss_before_model,
             "elapsed_s": round(progress.elapsed_s, 3), "memory_kind": device.kind,
             "gpu": device.gpu.slug if device.gpu is not None else None, "processes": world.size,
             "predicted_memory_gib": choice.estimate_gib, "capacity_gib": round(choice.capacity_gib, 3),
             **({"rss_before_model_gib_ranks": engine.gather(rss_before_model)} if world.distributed else {}),
             "keeps_freed_memory": keeps_freed_memory}
    metrics.write(event)
    if found is not None:
        reporter.event("resume", f"resumed from checkpoint step {found.step} of {steps}")
    return Session(spec=spec, model=model, optimizer=optimizer, scaler=scaler, engine=engine, data=data,
                   micro_batch=choice.micro_batch, grad_accum=choice.grad_accum, total_steps=steps,
                   schedule_steps=length.schedule_steps, warmup_steps=warmup, store=store, lock=lock,
                   metrics=metrics, progress=progress, policy=policy, usd_per_hour=usd_per_hour,
                   config_yaml=config_yaml, manifest_meta=meta, flag=flag, reporter=reporter, started=request.started,
                   elapsed_before_s=progress.elapsed_s, device=engine.device, trainable=trainable, tokenizer=counter)


def checkpoint_policy(spec: Any, catalog: Catalog, trainable: list[torch.nn.Parameter]) -> CheckpointPolicy:
    """When the run saves: `checkpoint.*`, or the automatic interval from the catalog's spot preemption rate and the
    checkpoint's estimated write time."""
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    return CheckpointPolicy.for_spec(
        spec, interruptions_per_hour=catalog.throughput.get("spot_interruptions_per_hour"),
        rate_source="the catalog's default spot preemption rate",
        # weights and two optimizer states, at the catalog's object-storage write speed, until one is measured
        estimated_write_s=3 * trainable_bytes / (catalog.throughput.get("checkpoint_write_mib_per_s") * 2**20))


def _length_line(spec: Any, length: RunLength) -> str:
    """The one line said when both max_steps and epochs are set."""
    epochs = f"{spec.epochs:g} epoch{'' if spec.epochs == 1 else 's'}"
    if length.capped:
        return (f"max_steps {spec.max_steps} ends the run at step {length.steps} of the {length.schedule_steps} steps "
                f"of {epochs}; the learning-rate schedule follows the {epochs}, so these are the first steps of "
                "that run (the same command without max_steps continues it)")
    return f"max_steps {spec.max_steps} is beyond the {length.schedule_steps} steps of {epochs}: the epochs end the run"


def check_schedule(found: Loaded, schedule_steps: int) -> None:
    """A resumed run keeps the schedule its checkpoint was trained on (the config policy allows no change that
    would move it; a checkpoint of an earlier version does not record it)."""
    then = found.manifest.get("schedule_steps")
    if isinstance(then, int) and then != schedule_steps:
        raise TunecastError(f"the learning-rate schedule of checkpoint step {found.step} spans {then} steps, this "
                            f"run's {schedule_steps}", field="epochs",
                            hint="restore the settings the run started with, or pass --fresh to start over")


def grad_scaler(spec: Any, engine: Engine) -> Any:
    """fp16's loss scaler; sharded gradients need FSDP's own, which agrees on overflow over every rank."""
    if spec.precision != "fp16-mixed":
        return None
    if engine.sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(engine.device.type)
    return torch.amp.GradScaler(engine.device.type)


def resumed_shape(spec: Any, resolved_then: dict[str, Any], world_size: int) -> Any:
    """The spec with the batch shape the run started with. On another number of processes the global batch
    is kept: the micro-batch stays, gradient accumulation absorbs the change."""
    fixed = {key: resolved_then[key] for key in RESOLVED if key in resolved_then}
    then_world = int(resolved_then.get("world_size", 1))
    if then_world != world_size and "micro_batch" in fixed and "grad_accum" in fixed:
        global_batch = fixed["micro_batch"] * fixed["grad_accum"] * then_world
        if global_batch % (fixed["micro_batch"] * world_size):
            raise TunecastError(f"the run's global batch of {global_batch} sequences (micro-batch "
                                f"{fixed['micro_batch']} on {then_world} processes) does not divide over "
                                f"{world_size} processes at micro-batch {fixed['micro_batch']}", field="gpus.count",
                                hint=f"resume on {then_world} processes, or on a number that divides "
                                     f"{global_batch // fixed['micro_batch']}")
        fixed["grad_accum"] = global_batch // (fixed["micro_batch"] * world_size)
    return spec.with_changes(fixed | {"global_batch": None})


def resumed_progress(found: Loaded | None, store: CheckpointStore, engine: Engine, spec: Any, *, model: Any,
                     optimizer: Any, scaler: Any, result: TrainResult, reporter: Any) -> Progress:
    """Where the run starts: step 0, or the checkpoint `found` restored (said in `result`)."""
    if found is None:
        return Progress()
    result.resumed_from = found.step
    return _restore(found, store, engine, spec, model=model, optimizer=optimizer, scaler=scaler, result=result,
                    reporter=reporter)


def _restore(found: Loaded, store: CheckpointStore, engine: Engine, spec: Any, *, model: Any, optimizer: Any,
             scaler: Any, result: TrainResult, reporter: Any) -> Progress:
    """This rank's state from checkpoint `found` (verified by rank 0)."""
    storage, folder, manifest = store.storage, store.folder(found.step), found.manifest
    try:
        if manifest.get("layout") != LAYOUT:
            if engine.world.distributed or TRAINABLE not in manifest.get("files", {}):
                raise TunecastError(f"checkpoint step {found.step} is in the one-process layout of an earlier "
                                    "tunecast", field="gpus.count", hint="resume it on one process (--gpus 1)")
            _, files = store.load(found.step)
            return restore_legacy(files, model=model, optimizer=optimizer, scaler=scaler)
        with local_folder(storage, folder, manifest, STATE) as state_folder:
            restored = restore(lambda name: storage.read(folder, name), state_folder, manifest,
                               rank=engine.world.rank, world_size=engine.world.size, model=model,
                               optimizer=optimizer, scaler=scaler, seed=spec.seed)
    except (ValueError, KeyError, RuntimeError, InvalidSet) as error:
        from tunecast.train.loop import lost_peer

        if engine.world.distributed and isinstance(error, RuntimeError) and lost_peer(error):
            raise PeerLost(str(error).splitlines()[0]) from None  # another rank stopped, not a wrong checkpoint
        raise TunecastError(f"checkpoint step {found.step} does not fit this run: {str(error).splitlines()[0]}",
                            field="output", hint="pass --fresh to start over (the old run is moved aside)") from None
    if not restored.rng_restored and engine.world.main:
        warn(result, reporter, Problem("gpus.count", f"checkpoint step {found.step} was written by "
                                       f"{manifest.get('world_size', 1)} process(es), this run has {engine.world.size}",
                                       "it resumes with the same weights, optimizer and data position; random draws "
                                       "(dropout) differ from an uninterrupted run", severity="warning"))
    return restored.progress
