"""The training loop: one visible loop over optimizer steps, each made of micro-batches.

Per optimizer step, in order:

1. what is due between steps: an evaluation (`eval.every_steps`, else at the end of each epoch), a
   checkpoint (`checkpoint.every_steps`, `every_minutes`, or the automatic Young/Daly interval);
2. the step's micro-batches from the data position (epoch, units consumed), each a forward and backward
   pass of the traced step (step/forward.py), the loss of every micro-batch divided by the trained tokens of
   the whole step, so accumulation weighs every token alike;
3. gradient clipping (`max_grad_norm`), the learning rate of this step, the optimizer step;
4. the position moves on; a metrics line; the random generators' state is captured, for the next step.

The preemption flag is checked before every micro-batch and inside evaluation. When it is set the step in
progress is abandoned (its gradients are dropped; weights and optimizer are as the last step left them), a
checkpoint of that state — with the generators as they were when the step began — is written, and the loop
returns "preempted". The resumed run redoes that step identically.

With several processes (distributed.py) the loop is the same on every rank: a step's micro-batches are
those of the global batch (micro_batch × grad_accum × ranks), dealt to the ranks in turn (batches.rank_passes),
the loss of each divided by the trained tokens of the whole global step and multiplied by the number of ranks
(DDP and FSDP2 average gradients over ranks; this makes the average the sum a single process would take). The
flag is checked collectively, so a signal on any rank stops every rank at the same micro-batch, and they save
together: each rank writes its own files, rank 0 the manifest, last. Only rank 0 writes metrics and reports.
A rank lost mid-step (killed, its machine gone) fails the next collective on the others, which stop without a
new checkpoint (`Outcome.lost`).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from tunecast.config.spec import RunSpec
from tunecast.data.packing import IGNORE_INDEX
from tunecast.step.forward import forward_backward, forward_loss
from tunecast.storage.store import MANIFEST, CheckpointStore, Storage, write_files, write_manifest
from tunecast.train.batches import Batch, TrainData, Unit, collate, eval_batches, micro_batches, rank_passes
from tunecast.train.distributed import Engine, PeerLost
from tunecast.train.host_memory import peak_rss_gib
from tunecast.train.metrics import MetricsLog
from tunecast.train.optim import TrainOptimizer, lr_factor
from tunecast.train.policy import CheckpointPolicy, evaluation_due
from tunecast.train.signals import Preempted, PreemptionFlag
from tunecast.train.state import LAYOUT, Progress, capture_rng, checkpoint_files
from tunecast.units import BYTES_PER_GIB, SECONDS_PER_HOUR


class Reporter(Protocol):
    """Where the loop tells what happens (the CLI draws progress from it; tests collect it)."""

    def event(self, kind: str, message: str) -> None: ...

    def step(self, record: dict[str, Any], total_steps: int, eta_s: float, cost_at_end_usd: float) -> None: ...


class RunView(Protocol):
    """What a run shows of itself as it goes (`train --report`: report.html), drawn by the command layer: rank 0 calls
    it at every checkpoint and at the end with the output's storage, metrics.jsonl so far and config.yaml."""

    @property
    def name(self) -> str: ...  # what it writes, for the message when it could not

    def __call__(self, storage: Storage, metrics: str, config: str) -> None: ...


DataT = TypeVar("DataT")


@dataclass
class Session(Generic[DataT]):
    """Everything one process's run needs, set up by run.py: a language model's (`data` its TrainData,
    session.py) or a diffusion pipeline's (`data` its images, latents and captions, diffusion_loop.py)."""

    spec: RunSpec
    model: Any
    optimizer: TrainOptimizer
    scaler: Any  # torch GradScaler for fp16-mixed, else None
    engine: Engine
    data: DataT
    micro_batch: int
    grad_accum: int
    total_steps: int  # the step the run ends at
    schedule_steps: int  # the steps the learning-rate schedule spans (more than total_steps when max_steps cuts it)
    warmup_steps: int
    store: CheckpointStore
    lock: Any  # the RunLock on rank 0 (refreshed by its own thread, lock.py); a stand-in on the others
    metrics: MetricsLog
    progress: Progress
    policy: CheckpointPolicy
    usd_per_hour: float
    config_yaml: str
    manifest_meta: dict[str, Any]
    flag: PreemptionFlag
    reporter: Reporter
    started: float  # time.monotonic() when this process started
    elapsed_before_s: float  # training time of earlier sessions of the run
    device: torch.device
    rng_at_boundary: dict[str, Any] = field(default_factory=capture_rng)
    step_seconds: float = 0.0  # a running mean, for the ETA
    trained_tokens: int = 0  # real tokens of the steps this process ran, and their seconds
    trained_images: int = 0  # a diffusion run's images (0 for a language model's)
    trained_seconds: float = 0.0
    trainable: list[torch.nn.Parameter] = field(default_factory=list)
    tokenizer: Any = None  # the TokenizerCounter the data was tokenized with (saved with final/)
    # A measuring run (`tunecast calibrate`) writes no checkpoint and stops when `stop` says so; a signal then
    # propagates as Preempted, with nothing saved.
    checkpoints: bool = True
    view: RunView | None = None  # rank 0 calls it at every checkpoint and at the end (`train --report`)
    stop: Callable[[Progress], bool] | None = None


@dataclass(frozen=True)
class Outcome:
    finished: bool  # False: preempted
    progress: Progress
    signal: str | None = None
    checkpoint_step: int | None = None
    lost: str | None = None  # another rank was lost: what the failed collective said (nothing new saved)


def elapsed_s(session: Session[Any]) -> float:
    return session.elapsed_before_s + time.monotonic() - session.started


def _peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / BYTES_PER_GIB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / BYTES_PER_GIB}
    return {"peak_rss_gib": peak_rss_gib()}


def save_checkpoint(session: Session[Any], reason: str) -> float:
    """Write the checkpoint of the current step boundary (skipped when a valid one of this step exists);
    returns the seconds it took. Old checkpoints beyond `checkpoint.keep` are pruned after it. Every rank
    calls it: each writes its own files, then rank 0 the manifest."""
    progress, store, engine = session.progress, session.store, session.engine
    main = engine.world.main
    if engine.broadcast(main and progress.step in store.steps() and store.is_valid(progress.step)):
        return 0.0
    started = time.monotonic()
    progress.elapsed_s = elapsed_s(session)
    progress.cost_usd = progress.elapsed_s / SECONDS_PER_HOUR * session.usd_per_hour
    folder = store.folder(progress.step)
    if main:
        session.metrics.write({"kind": "event", "event": "checkpoint", "step": progress.step, "reason": reason,
                               "elapsed_s": round(progress.elapsed_s, 3)})
        progress.metrics_bytes = session.metrics.sync()
        store.storage.remove(folder, MANIFEST)  # a set being rewritten stops being one before any file changes
    engine.barrier()
    with tempfile.TemporaryDirectory(prefix="tunecast-checkpoint-") as scratch:
        files = checkpoint_files(Path(scratch), rank=engine.world.rank, model=session.model,
                                 optimizer=session.optimizer,
                                 schedule={"name": session.spec.schedule, "step": progress.step,
                                           "warmup_steps": session.warmup_steps, "total_steps": session.total_steps,
                                           "schedule_steps": session.schedule_steps},
                                 scaler=session.scaler, rng=session.rng_at_boundary, progress=progress,
                                 config_yaml=session.config_yaml)
        listed = write_files(store.storage, folder, files)
    listings = engine.gather(listed)
    size = sum(entry["bytes"] for one in listings for entry in one.values())
    if main:
        merged = {name: entry for one in listings for name, entry in one.items()}
        write_manifest(store.storage, folder, merged,
                       {"step": progress.step, **session.manifest_meta, "layout": LAYOUT,
                        "world_size": engine.world.size, "optimizer_state": progress.step > 0})
        store.prune(session.spec.checkpoint.keep, newest=progress.step)
        refresh_view(session)
    engine.barrier()  # every rank leaves once the checkpoint exists
    seconds = time.monotonic() - started
    session.policy.saved(seconds)
    session.reporter.event("checkpoint", f"checkpoint at step {progress.step} ({reason}, "
                                         f"{size / 2**20:.1f} MiB in {seconds:.2f} s)")
    return seconds


def step_counts(micro: list[list[Unit]]) -> tuple[int, int, int]:
    """(real tokens, tokens computed with padding, tokens in the loss) of a step's micro-batches, from the units
    alone: every rank knows the whole global step."""
    tokens = sum(len(unit.input_ids) for chunk in micro for unit in chunk)
    padded = sum(len(chunk) * max(len(unit.input_ids) for unit in chunk) for chunk in micro)
    trained = sum(sum(1 for label in unit.labels[1:] if label != IGNORE_INDEX) for chunk in micro for unit in chunk)
    return tokens, padded, trained


def evaluate(session: Session[TrainData]) -> float:
    """Mean loss per trained token over the held-out examples (no gradients, no random draws), each rank
    evaluating its share."""
    model, spec, engine = session.model, session.spec, session.engine
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    one = torch.ones((), device=session.device)
    stand_in = session.data.eval_units[:1]
    try:
        for units in eval_batches(session.data, session.micro_batch, rank=engine.world.rank,
                                  world=engine.world.size):
            engine.check(session.flag)
            batch = collate(units or stand_in, session.data.pad_id).to(session.device)
            summed = forward_loss(model, batch.input_ids, batch.labels, precision=spec.precision,
                                  chunked_loss=spec.loss == "chunked", attention_mask=batch.attention_mask,
                                  position_ids=batch.position_ids, num_items=one)
            if units is not None:
                total += summed.double().cpu()
                tokens += batch.trained_tokens
    finally:
        model.train()
    summed_total, summed_tokens = engine.reduce_sum([float(total), float(tokens)])
    return summed_total / max(1.0, summed_tokens)


def _eval_due(session: Session[TrainData]) -> bool:
    spec, progress = session.spec, session.progress
    if spec.eval.examples == 0 or progress.last_eval_step == progress.step:
        return False
    # a step boundary at the start of an epoch ends the one before
    return evaluation_due(progress.step, session.total_steps, epoch_ended=progress.offset == 0,
                          every_steps=spec.eval.every_steps)


def _run_eval(session: Session[TrainData]) -> None:
    started = time.monotonic()
    loss = evaluate(session)
    session.progress.last_eval_step = session.progress.step
    session.metrics.write({"kind": "eval", "step": session.progress.step, "eval_loss": loss,
                           "examples": session.data.eval_examples, "seconds": round(time.monotonic() - started, 3),
                           "elapsed_s": round(elapsed_s(session), 3)})
    session.reporter.event("eval", f"step {session.progress.step}: eval loss {loss:.4f}")


def _optimizer_step(session: Session[TrainData], passes: list[Batch | None], stand_in: Batch, trained: int
                    ) -> tuple[float, float, float]:
    """Forward and backward over this rank's micro-batches of the step (None: a stand-in pass whose loss counts
    for nothing), then clip and step. `trained` is the trained tokens of the whole global step. Returns (loss of
    the step over every rank, grad norm, the time the passes ended: on CUDA each pass's loss value waits for its
    kernels, so what follows is the clipping and optimizer step)."""
    spec, model, engine = session.spec, session.model, session.engine
    num_items = torch.tensor(max(1, trained), device=session.device)
    ranks = engine.world.size

    def backward_of(weight: float) -> Callable[[torch.Tensor], None]:
        def run(loss: torch.Tensor) -> None:
            scaled = loss * weight if weight != 1 else loss
            (session.scaler.scale(scaled) if session.scaler is not None else scaled).backward()

        return run

    loss = 0.0
    for index, batch in enumerate(passes):
        engine.check(session.flag)
        on_device = (batch if batch is not None else stand_in).to(session.device)
        with engine.accumulating(model, last=index == len(passes) - 1):
            value = forward_backward(model, on_device.input_ids, on_device.labels, precision=spec.precision,
                                     chunked_loss=spec.loss == "chunked", attention_mask=on_device.attention_mask,
                                     position_ids=on_device.position_ids, num_items=num_items,
                                     backward=backward_of(ranks if batch is not None else 0.0),
                                     offload_activations=spec.activation_offload and session.device.type == "cuda")
        if batch is not None:
            loss += value or 0.0
    passes_done = time.monotonic()
    grad_norm = clip_and_step(session)
    if ranks > 1:
        (loss,) = engine.reduce_sum([loss])
    return loss, grad_norm, passes_done


def clip_and_step(session: Session[Any]) -> float:
    """After the step's backward passes: the gradients unscaled (fp16), clipped to `max_grad_norm`, the optimizer's
    step, the gradients dropped. Returns the norm before clipping (NaN when the optimizer stepped inside the
    backward pass, where there is nothing to clip)."""
    grad_norm = float("nan")
    if not session.optimizer.in_backward:
        if session.scaler is not None:
            session.scaler.unscale_(session.optimizer.optimizers[0])
        limit = session.spec.max_grad_norm if session.spec.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(session.trainable, limit)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    session.optimizer.step(session.scaler)
    session.optimizer.zero_grad()
    return grad_norm


def train(session: Session[TrainData]) -> Outcome:
    """Run optimizer steps until `total_steps`, or until a preemption signal."""
    spec, progress, data, engine = session.spec, session.progress, session.data, session.engine
    world = engine.world
    per_step = session.micro_batch * session.grad_accum * world.size
    orders: dict[int, list[int]] = {}
    try:
        while True:
            # 1. what is due between steps; a run that lost its output's lock (paused past its stale age, and taken
            # over) stops here rather than at its next write (no I/O unless the process was paused: storage/lock.py)
            session.store.storage.check()
            if _eval_due(session):
                _run_eval(session)
            if progress.step >= session.total_steps:
                break
            checkpoint_if_due(session)
            engine.check(session.flag)

            # 2. this step's micro-batches (of the global batch), from the data position; this rank's share
            order = orders.setdefault(progress.epoch, data.epoch_order(spec.seed, progress.epoch))
            units = micro_batches(data, order, progress.offset, micro_batch=session.micro_batch,
                                  grad_accum=session.grad_accum * world.size)
            mine = rank_passes(units, rank=world.rank, world=world.size)
            passes = [collate(chunk, data.pad_id) if chunk is not None else None for chunk in mine]
            stand_in = collate(units[0][:1], data.pad_id)
            tokens, padded, trained = step_counts(units)
            started = time.monotonic()

            # 3. learning rate of this step, passes, clipping, optimizer
            lr = spec.learning_rate * lr_factor(spec.schedule, progress.step, warmup=session.warmup_steps,
                                                total=session.schedule_steps)
            session.optimizer.set_lr(lr)
            loss, grad_norm, passes_done = _optimizer_step(session, passes, stand_in, trained)
            if session.device.type == "cuda":
                torch.cuda.synchronize(session.device)
            ended = time.monotonic()
            seconds = ended - started

            # 4. the position moves on; metrics; generators captured for the next step
            consumed = sum(len(chunk) for chunk in units)
            progress.step += 1
            progress.offset += consumed
            progress.tokens += tokens
            progress.trained_tokens += trained
            if progress.offset >= len(order):
                progress.epoch += 1
                progress.offset = 0
                orders.pop(progress.epoch - 1, None)
            session.rng_at_boundary = capture_rng()
            _log_step(session, loss=loss, lr=lr, grad_norm=grad_norm, tokens=tokens, padded=padded, seconds=seconds,
                      optimizer_seconds=ended - passes_done, per_step=per_step)
            if session.stop is not None and session.stop(progress):
                return Outcome(False, progress, None)
    except PeerLost as lost:
        return Outcome(False, progress, None, lost=str(lost))
    except RuntimeError as error:
        if not (world.distributed and lost_peer(error)):
            raise
        return Outcome(False, progress, None, lost=str(error).splitlines()[0])
    except Preempted as stop:
        return saved_on_preemption(session, stop)
    return finished(session)


def checkpoint_if_due(session: Session[Any]) -> None:
    """The checkpoint due at this step boundary, if one is (never before the first step)."""
    progress, engine = session.progress, session.engine
    due = session.checkpoints and progress.step > 0 and session.policy.due(progress.step)
    # a time-based interval is read on each rank's clock: the ranks save if any says so
    if engine.world.distributed and session.checkpoints and progress.step > 0:
        due = bool(engine.reduce_max([float(due)])[0])
    if due:
        save_checkpoint(session, "interval")


def saved_on_preemption(session: Session[Any], stop: Preempted) -> Outcome:
    """A signal stopped the step in progress: its gradients are dropped and the state at the step's start saved (a
    measuring run, which saves nothing, lets the signal go on up)."""
    progress, world = session.progress, session.engine.world
    session.optimizer.zero_grad()
    if not session.checkpoints:
        raise stop
    session.metrics.write({"kind": "event", "event": "preempted", "signal": stop.signal_name,
                           "step": progress.step, "elapsed_s": round(elapsed_s(session), 3)})
    session.reporter.event("preempted", f"{stop.signal_name}: saving step {progress.step} and stopping")
    try:
        save_checkpoint(session, f"preempted by {stop.signal_name}")
    except (PeerLost, RuntimeError) as lost:  # a rank died while the others saved: the newest complete
        if not (isinstance(lost, PeerLost) or (world.distributed and lost_peer(lost))):  # checkpoint stands
            raise
        return Outcome(False, progress, stop.signal_name, lost=str(lost).splitlines()[0])
    return Outcome(False, progress, stop.signal_name, progress.step)


def finished(session: Session[Any]) -> Outcome:
    """The run reached its last step: the checkpoint of that step (final/ is written from it)."""
    if session.checkpoints:
        save_checkpoint(session, "end of training")
    return Outcome(True, session.progress, None, session.progress.step)


def _log_step(session: Session[TrainData], *, loss: float, lr: float, grad_norm: float, tokens: int, padded: int,
              seconds: float, optimizer_seconds: float, per_step: int) -> None:
    progress = session.progress
    session.trained_tokens += tokens
    log_step(session, {"epoch": progress.epoch + progress.offset / max(1, len(session.data.units)),
                       "loss": loss, "learning_rate": lr, "grad_norm": grad_norm, "tokens": tokens,
                       "padded_tokens": padded, "tokens_per_second": tokens / seconds if seconds else 0.0,
                       "padded_tokens_per_second": padded / seconds if seconds else 0.0},
             seconds=seconds, optimizer_seconds=optimizer_seconds)


def log_step(session: Session[Any], measured: dict[str, Any], *, seconds: float, optimizer_seconds: float) -> None:
    """The step just done: its `train` line in metrics.jsonl (every `log_every_steps`, and the last) with what the
    run `measured` of it, the peak memory so far, time and cost; and the progress line, with the ETA (a running mean
    of the step time) and the cost at the end."""
    progress = session.progress
    weight = 0.1 if session.step_seconds else 1.0
    session.step_seconds = (1 - weight) * session.step_seconds + weight * seconds
    session.trained_seconds += seconds
    elapsed = elapsed_s(session)
    cost = elapsed / SECONDS_PER_HOUR * session.usd_per_hour
    eta = (session.total_steps - progress.step) * session.step_seconds
    peaks: dict[str, Any] = dict(_peak_memory(session.device))
    if session.engine.world.distributed:  # every rank's peak (each holds its own share)
        ranks = session.engine.gather(peaks)
        peaks.update({f"{key}_ranks": [one[key] for one in ranks] for key in peaks})
    record: dict[str, Any] = {
        "kind": "train", "step": progress.step, **measured, **peaks,
        "step_seconds": seconds, "optimizer_seconds": optimizer_seconds, "elapsed_s": elapsed, "cost_usd": cost,
        "projected_cost_usd": cost + eta / SECONDS_PER_HOUR * session.usd_per_hour,
    }
    if progress.step % session.spec.log_every_steps == 0 or progress.step == session.total_steps:
        session.metrics.write(record)
    session.reporter.step(record, session.total_steps, eta,
                          cost + eta / SECONDS_PER_HOUR * session.usd_per_hour)


def lost_peer(error: BaseException) -> bool:
    """Whether an error raised inside a collective of DDP, FSDP2 or the checkpoint says another rank is gone."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return any(mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL",
                                         "Broken pipe", "timed out", "Timed out"))


def refresh_view(session: Session[Any]) -> None:
    """Rank 0 hands the run so far to its view (`train --report` draws report.html from it). A view that fails is
    said and training goes on: it shows the run, it is not part of it."""
    if session.view is None or not session.engine.world.main:
        return
    try:
        session.view(session.store.storage, session.metrics.path.read_text(), session.config_yaml)
    except Exception as error:  # any failure of the view leaves the run as it is
        session.reporter.event("report", f"{session.view.name} not updated: {type(error).__name__}: {error}")
