"""The training loop: one visible loop over optimizer steps, each made of micro-batches.

Per optimizer step, in order:

1. what is due between steps: an evaluation (`eval.every_steps`, else at the end of each epoch), a
   checkpoint (`checkpoint.every_steps`, `every_minutes`, or the automatic Young/Daly interval);
2. the step's micro-batches from the data position (epoch, units consumed), each a forward and backward
   pass of the traced step (train/step.py), the loss of every micro-batch divided by the trained tokens of
   the whole step, so accumulation weighs every token alike;
3. gradient clipping (`max_grad_norm`), the learning rate of this step, the optimizer step;
4. the position moves on; a metrics line; the random generators' state is captured, for the next step.

The preemption flag is checked before every micro-batch and inside evaluation. When it is set the step in
progress is abandoned (its gradients are dropped; weights and optimizer are as the last step left them), a
checkpoint of that state — with the generators as they were when the step began — is written, and the loop
returns "preempted". The resumed run redoes that step identically.
"""

from __future__ import annotations

import contextlib
import math
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from tunecast.config.spec import RunSpec
from tunecast.plan.cost import young_daly_interval
from tunecast.train.batches import Batch, TrainData, collate, eval_batches, micro_batches
from tunecast.train.metrics import MetricsLog
from tunecast.train.optim import TrainOptimizer, lr_factor
from tunecast.train.signals import Preempted, PreemptionFlag
from tunecast.train.state import Progress, capture_rng, checkpoint_files
from tunecast.train.step import forward_backward, forward_loss
from tunecast.train.store import CheckpointStore, RunLock
from tunecast.units import BYTES_PER_GIB, SECONDS_PER_HOUR


class Reporter(Protocol):
    """Where the loop tells what happens (the CLI draws progress from it; tests collect it)."""

    def event(self, kind: str, message: str) -> None: ...

    def step(self, record: dict[str, Any], total_steps: int, eta_s: float, cost_at_end_usd: float) -> None: ...


@dataclass
class CheckpointPolicy:
    """When to checkpoint: every N steps, every N seconds, or automatically every √(2 C / λ) (Young/Daly),
    C being the last measured write time and λ the preemption rate assumed for the machine."""

    every_steps: int | None
    every_s: float | None
    automatic: bool
    interruptions_per_hour: float
    rate_source: str
    write_s: float  # the last measured write (estimated until the first one)
    last_at: float = field(default_factory=time.monotonic)

    @classmethod
    def for_spec(cls, spec: RunSpec, *, interruptions_per_hour: float, rate_source: str,
                 estimated_write_s: float) -> CheckpointPolicy:
        every_s = spec.checkpoint.every_minutes * 60 if spec.checkpoint.every_minutes else None
        automatic = spec.checkpoint.every_steps is None and every_s is None
        policy = cls(spec.checkpoint.every_steps, every_s, automatic, interruptions_per_hour, rate_source,
                     estimated_write_s)
        if automatic:
            policy._update_interval()
        return policy

    def _update_interval(self) -> None:
        self.every_s = young_daly_interval(self.write_s / SECONDS_PER_HOUR,
                                           self.interruptions_per_hour) * SECONDS_PER_HOUR

    def due(self, step: int) -> bool:
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_s is not None and time.monotonic() - self.last_at >= self.every_s

    def saved(self, write_s: float) -> None:
        self.last_at = time.monotonic()
        self.write_s = write_s
        if self.automatic:
            self._update_interval()

    def describe(self) -> str:
        if self.every_steps is not None:
            return f"every {self.every_steps} steps" + (f" and every {self.every_s / 60:g} min" if self.every_s else "")
        if not self.automatic:
            return f"every {self.every_s / 60:g} min"  # type: ignore[operator]
        return (f"every {self.every_s / 60:.1f} min (Young/Daly: √(2 × {self.write_s:.2f} s write ÷ "  # type: ignore[operator]
                f"{self.interruptions_per_hour:g} preemptions/h, {self.rate_source}), at least one minute")


@dataclass
class Session:
    """Everything one process's run needs, set up by run.py."""

    spec: RunSpec
    model: Any
    optimizer: TrainOptimizer
    scaler: Any  # torch GradScaler for fp16-mixed, else None
    accelerator: Any
    data: TrainData
    micro_batch: int
    grad_accum: int
    total_steps: int
    warmup_steps: int
    store: CheckpointStore
    lock: RunLock
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
    trained_seconds: float = 0.0
    trainable: list[torch.nn.Parameter] = field(default_factory=list)
    tokenizer: Any = None  # the TokenizerCounter the data was tokenized with (saved with final/)
    # A measuring run (`tunecast calibrate`) writes no checkpoint and stops when `stop` says so; a signal then
    # propagates as Preempted, with nothing saved.
    checkpoints: bool = True
    stop: Callable[[Progress], bool] | None = None


@dataclass(frozen=True)
class Outcome:
    finished: bool  # False: preempted
    progress: Progress
    signal: str | None = None
    checkpoint_step: int | None = None


def elapsed_s(session: Session) -> float:
    return session.elapsed_before_s + time.monotonic() - session.started


def _peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / BYTES_PER_GIB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / BYTES_PER_GIB}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / BYTES_PER_GIB}


def save_checkpoint(session: Session, reason: str) -> float:
    """Write the checkpoint of the current step boundary (skipped when a valid one of this step exists);
    returns the seconds it took. Old checkpoints beyond `checkpoint.keep` are pruned after it."""
    progress = session.progress
    store = session.store
    if progress.step in store.steps() and store.is_valid(progress.step):
        return 0.0
    started = time.monotonic()
    progress.elapsed_s = elapsed_s(session)
    progress.cost_usd = progress.elapsed_s / SECONDS_PER_HOUR * session.usd_per_hour
    session.metrics.write({"kind": "event", "event": "checkpoint", "step": progress.step, "reason": reason,
                           "elapsed_s": round(progress.elapsed_s, 3)})
    progress.metrics_bytes = session.metrics.sync()
    with tempfile.TemporaryDirectory(prefix="tunecast-checkpoint-") as scratch:
        files = checkpoint_files(Path(scratch), model=session.model, optimizer=session.optimizer,
                                 schedule={"name": session.spec.schedule, "step": progress.step,
                                           "warmup_steps": session.warmup_steps, "total_steps": session.total_steps},
                                 scaler=session.scaler, rng=session.rng_at_boundary, progress=progress,
                                 config_yaml=session.config_yaml)
        size = sum(v.stat().st_size if isinstance(v, Path) else len(v) for v in files.values())
        store.save(progress.step, files, session.manifest_meta)
    store.prune(session.spec.checkpoint.keep, newest=progress.step)
    session.lock.refresh()
    seconds = time.monotonic() - started
    session.policy.saved(seconds)
    session.reporter.event("checkpoint", f"checkpoint at step {progress.step} ({reason}, "
                                         f"{size / 2**20:.1f} MiB in {seconds:.2f} s)")
    return seconds


def evaluate(session: Session) -> float:
    """Mean loss per trained token over the held-out examples (no gradients, no random draws)."""
    model, spec = session.model, session.spec
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    one = torch.ones((), device=session.device)
    try:
        for units in eval_batches(session.data, session.micro_batch):
            session.flag.check()
            batch = collate(units, session.data.pad_id).to(session.device)
            summed = forward_loss(model, batch.input_ids, batch.labels, precision=spec.precision,
                                  chunked_loss=spec.loss == "chunked", attention_mask=batch.attention_mask,
                                  position_ids=batch.position_ids, num_items=one)
            total += summed.double().cpu()
            tokens += batch.trained_tokens
    finally:
        model.train()
    return float(total) / max(1, tokens)


def _eval_due(session: Session) -> bool:
    spec, progress = session.spec, session.progress
    epoch_ended = progress.offset == 0  # a step boundary at the start of an epoch ends the one before
    if spec.eval.examples == 0 or progress.last_eval_step == progress.step or progress.step == 0:
        return False
    if spec.eval.every_steps is not None:
        return progress.step % spec.eval.every_steps == 0 or progress.step == session.total_steps
    return epoch_ended or progress.step == session.total_steps


def _run_eval(session: Session) -> None:
    started = time.monotonic()
    loss = evaluate(session)
    session.progress.last_eval_step = session.progress.step
    session.metrics.write({"kind": "eval", "step": session.progress.step, "eval_loss": loss,
                           "examples": len(session.data.eval_units), "seconds": round(time.monotonic() - started, 3),
                           "elapsed_s": round(elapsed_s(session), 3)})
    session.reporter.event("eval", f"step {session.progress.step}: eval loss {loss:.4f}")


def _optimizer_step(session: Session, batches: list[Batch]) -> tuple[float, float, float]:
    """Forward and backward over the step's micro-batches, then clip and step. Returns (loss, grad norm, the
    time the passes ended: on CUDA each pass's loss value waits for its kernels, so what follows is the
    clipping and optimizer step)."""
    spec, model, accelerator = session.spec, session.model, session.accelerator
    num_items = torch.tensor(max(1, sum(batch.trained_tokens for batch in batches)), device=session.device)
    backward: Callable[[torch.Tensor], None] = (
        (lambda loss: session.scaler.scale(loss).backward()) if session.scaler is not None else accelerator.backward)
    loss = 0.0
    for index, batch in enumerate(batches):
        session.flag.check()
        on_device = batch.to(session.device)
        last = index == len(batches) - 1
        with accelerator.no_sync(model) if not last else contextlib.nullcontext():
            value = forward_backward(model, on_device.input_ids, on_device.labels, precision=spec.precision,
                                     chunked_loss=spec.loss == "chunked", attention_mask=on_device.attention_mask,
                                     position_ids=on_device.position_ids, num_items=num_items, backward=backward,
                                     offload_activations=spec.activation_offload and session.device.type == "cuda")
        loss += value or 0.0
    passes_done = time.monotonic()
    grad_norm = float("nan")
    if not session.optimizer.in_backward:
        if session.scaler is not None:
            session.scaler.unscale_(session.optimizer.optimizers[0])
        limit = spec.max_grad_norm if spec.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(session.trainable, limit))
    session.optimizer.step(session.scaler)
    session.optimizer.zero_grad()
    return loss, grad_norm, passes_done


def train(session: Session) -> Outcome:
    """Run optimizer steps until `total_steps`, or until a preemption signal."""
    spec, progress, data = session.spec, session.progress, session.data
    per_step = session.micro_batch * session.grad_accum
    orders: dict[int, list[int]] = {}
    try:
        while True:
            # 1. what is due between steps
            if _eval_due(session):
                _run_eval(session)
            if progress.step >= session.total_steps:
                break
            if session.checkpoints and progress.step > 0 and session.policy.due(progress.step):
                save_checkpoint(session, "interval")
            session.flag.check()

            # 2. this step's micro-batches, from the data position
            order = orders.setdefault(progress.epoch, data.epoch_order(spec.seed, progress.epoch))
            units = micro_batches(data, order, progress.offset, micro_batch=session.micro_batch,
                                  grad_accum=session.grad_accum)
            batches = [collate(chunk, data.pad_id) for chunk in units]
            started = time.monotonic()

            # 3. learning rate of this step, passes, clipping, optimizer
            lr = spec.learning_rate * lr_factor(spec.schedule, progress.step, warmup=session.warmup_steps,
                                                total=session.total_steps)
            session.optimizer.set_lr(lr)
            loss, grad_norm, passes_done = _optimizer_step(session, batches)
            if session.device.type == "cuda":
                torch.cuda.synchronize(session.device)
            ended = time.monotonic()
            seconds = ended - started

            # 4. the position moves on; metrics; generators captured for the next step
            consumed = sum(len(chunk) for chunk in units)
            tokens = sum(batch.tokens for batch in batches)
            padded = sum(batch.padded_tokens for batch in batches)
            progress.step += 1
            progress.offset += consumed
            progress.tokens += tokens
            progress.trained_tokens += sum(batch.trained_tokens for batch in batches)
            if progress.offset >= len(order):
                progress.epoch += 1
                progress.offset = 0
                orders.pop(progress.epoch - 1, None)
            session.rng_at_boundary = capture_rng()
            session.lock.refresh()
            _log_step(session, loss=loss, lr=lr, grad_norm=grad_norm, tokens=tokens, padded=padded, seconds=seconds,
                      optimizer_seconds=ended - passes_done, per_step=per_step)
            if session.stop is not None and session.stop(progress):
                return Outcome(False, progress, None)
    except Preempted as stop:
        session.optimizer.zero_grad()
        if not session.checkpoints:
            raise
        session.metrics.write({"kind": "event", "event": "preempted", "signal": stop.signal_name,
                               "step": progress.step, "elapsed_s": round(elapsed_s(session), 3)})
        session.reporter.event("preempted", f"{stop.signal_name}: saving step {progress.step} and stopping")
        save_checkpoint(session, f"preempted by {stop.signal_name}")
        return Outcome(False, progress, stop.signal_name, progress.step)
    if session.checkpoints:
        save_checkpoint(session, "end of training")
    return Outcome(True, progress, None, progress.step)


def _log_step(session: Session, *, loss: float, lr: float, grad_norm: float, tokens: int, padded: int,
              seconds: float, optimizer_seconds: float, per_step: int) -> None:
    progress = session.progress
    weight = 0.1 if session.step_seconds else 1.0
    session.step_seconds = (1 - weight) * session.step_seconds + weight * seconds
    session.trained_tokens += tokens
    session.trained_seconds += seconds
    elapsed = elapsed_s(session)
    cost = elapsed / SECONDS_PER_HOUR * session.usd_per_hour
    eta = (session.total_steps - progress.step) * session.step_seconds
    record: dict[str, Any] = {
        "kind": "train", "step": progress.step,
        "epoch": progress.epoch + progress.offset / max(1, len(session.data.units)),
        "loss": loss, "learning_rate": lr, "grad_norm": grad_norm, "tokens": tokens, "padded_tokens": padded,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "padded_tokens_per_second": padded / seconds if seconds else 0.0,
        **_peak_memory(session.device),
        "step_seconds": seconds, "optimizer_seconds": optimizer_seconds, "elapsed_s": elapsed, "cost_usd": cost,
    }
    if progress.step % session.spec.log_every_steps == 0 or progress.step == session.total_steps:
        session.metrics.write(record)
    session.reporter.step(record, session.total_steps, eta,
                          cost + eta / SECONDS_PER_HOUR * session.usd_per_hour)
