"""A training run from its config to `final/`: where it writes, whether it resumes, and the set-up of every
part the loop needs. The output directory (or storage URL) is the run's identity: the same command resumes.

Order of work, each step checking the preemption flag so a signal during set-up also stops cleanly:

1. the output: `--fresh` moves an old run aside first; a lock makes this process its only writer (storage/lock.py),
   from before anything loads to after `final/`;
2. the newest checkpoint that verifies (newer broken ones are named and skipped) and the config policy:
   a change that alters shapes, numerics or the data order is refused, a harmless one is allowed with a
   warning (HARMLESS below). These decisions are announced at once, before anything loads. When checkpoints
   are there but every one of them is damaged, the run refuses to start over them unless `--fresh`;
3. the data, tokenized; the batch shape, from the memory estimate (batching.py); the run's length (RunLength);
4. the model, adapters, optimizer; then the checkpoint's state, restored;
5. the loop (loop.py); at its end `final/`: the adapter (or full model), the tokenizer and a model card.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedPipeline, LoadedSpec, flatten
from tunecast.config.spec import RunSpec
from tunecast.errors import Problem, SharedError, TunecastError
from tunecast.storage.store import (
    CHECKPOINTS,
    LOCK,
    WRITE_HINT,
    CheckpointStore,
    Loaded,
    Skipped,
    Storage,
    WriteFailed,
    locked,
    read_set,
    step_name,
)
from tunecast.train.signals import PreemptionFlag

if TYPE_CHECKING:
    from tunecast.train.loop import RunView  # loop.py imports torch: imported when the run starts

FINAL = "final"
BASE = "base"
CONFIG_FILE = "config.yaml"
# Keys whose change leaves every step's computation as it was: allowed on resume, with a warning. `max_steps` too
# when the epochs set the schedule before and after (it only moves where the run ends: `schedule_by` below).
HARMLESS = ("output", "checkpoint.", "eval.every_steps", "log_every_steps", "pricing.", "plan.", "gpus.gpu",
            "gpus.count", "gpus.strategy", "gpus.offload", "grad_checkpointing", "activation_offload",
            "dataset.skip_invalid", "micro_batch", "grad_accum", "random_weights")
# The batch shape resolved at the first start; a resumed run keeps it whatever `auto` would choose now.
RESOLVED = ("micro_batch", "grad_accum", "grad_checkpointing")


@dataclass(frozen=True)
class TrainRequest:
    fresh: bool = False
    offline: bool = False  # `--offline`: weights only from disk or the local Hugging Face cache, never the Hub
    check_memory: bool = True
    started: float = field(default_factory=time.monotonic)
    # a measuring run (`tunecast calibrate`): random-weight bases are not saved, only the first `data_limit`
    # examples of the dataset are read
    measuring: bool = False
    data_limit: int | None = None
    view: RunView | None = None  # shows the run as it goes (loop.RunView; `train --report`)


@dataclass
class TrainResult:
    output: str
    finished: bool
    already_complete: bool = False
    steps: int = 0
    total_steps: int = 0
    signal: str | None = None
    resumed_from: int | None = None
    final: str | None = None
    elapsed_s: float = 0.0
    cost_usd: float = 0.0
    tokens_per_second: float = 0.0  # real tokens over the seconds of the steps this process ran
    images_per_second: float | None = None  # a diffusion run's images over those seconds (None: a language model's)
    warnings: list[Problem] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    lost: str | None = None  # another rank was lost: what the failed collective said (nothing new saved)

    def as_dict(self) -> dict[str, Any]:
        return {"output": self.output, "finished": self.finished, "already_complete": self.already_complete,
                "steps": self.steps, "total_steps": self.total_steps, "preempted_by": self.signal,
                "resumed_from_step": self.resumed_from, "final": self.final, "elapsed_s": round(self.elapsed_s, 3),
                "cost_usd": round(self.cost_usd, 4), "tokens_per_second": round(self.tokens_per_second, 2),
                **({} if self.images_per_second is None else {"images_per_second": round(self.images_per_second, 3)}),
                "processes": self.world_size, "lost_rank": self.lost,
                "warnings": [w.as_dict() for w in self.warnings]}


@dataclass(frozen=True)
class RunLength:
    """How many optimizer steps a run trains, and over how many its learning-rate schedule runs.

    `max_steps` alone: both are max_steps. `epochs` alone: both are ⌈epochs × steps per epoch⌉. Both set (the
    Trainer's, axolotl's and torchtune's convention): the epochs set the schedule (warm-up ratio, decay over the
    epochs' steps) and max_steps ends the run early, so a short run is the first steps of the long one."""

    steps: int
    schedule_steps: int
    per_epoch: int
    by_epochs: bool  # the schedule follows the epochs (False: max_steps alone)

    @property
    def capped(self) -> bool:
        """max_steps ends the run before its epochs do."""
        return self.steps < self.schedule_steps


def run_length(spec: RunSpec, units: int, per_step: int, *, epochs_set: bool) -> RunLength:
    """The run's length over `units` training sequences, `per_step` of them per optimizer step. `epochs_set`: the
    user set `epochs` (RunSpec.fixed), so that with max_steps the epochs still set the schedule."""
    per_epoch = math.ceil(units / per_step)
    by_epochs = max(1, math.ceil(spec.epochs * per_epoch))
    if spec.max_steps is None:
        return RunLength(by_epochs, by_epochs, per_epoch, True)
    if not epochs_set:
        return RunLength(spec.max_steps, spec.max_steps, per_epoch, False)
    return RunLength(min(spec.max_steps, by_epochs), by_epochs, per_epoch, True)


def schedule_by_epochs(spec: RunSpec, *, epochs_set: bool) -> bool:
    """Whether the epochs set the learning-rate schedule (run_length's rule, before the data is read)."""
    return spec.max_steps is None or epochs_set


def output_url(spec: RunSpec) -> str:
    return spec.output if spec.output is not None else str((Path.cwd() / spec.default_output).resolve())


def config_changes(then: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, allowed): the dotted keys whose value differs between the checkpoint's config and now."""
    old, new = flatten(then), flatten(now)
    changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
    allowed = [key for key in changed if key.startswith(HARMLESS) or key in HARMLESS]
    return [key for key in changed if key not in allowed], allowed


def config_hash(document: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def move_aside(storage: Storage) -> str | None:
    """Move an existing run out of the way (`--fresh`); returns where it went."""
    if not storage.exists() or not [name for name in storage.listdir() if name != LOCK]:
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    target = f"{storage.url}.old-{stamp}"
    storage.fs.mv(storage.root, Storage(target).root, recursive=True)
    return target


def final_complete(storage: Storage) -> bool:
    from tunecast.storage.store import InvalidSet

    try:
        read_set(storage, FINAL, keep=False)
    except InvalidSet:
        return False
    return True


class _NoLock:
    """The run's lock as ranks other than 0 hold it: rank 0 holds the real one."""

    took_over: str | None = None


def warn(result: TrainResult, reporter: Any, problem: Problem) -> None:
    """A warning of the run: said at once (a run that fails later has said it), and kept for the JSON summary."""
    result.warnings.append(problem)
    reporter.event("warning", f"{problem.field}: {problem.message}" + (f" → {problem.hint}" if problem.hint else ""))


@dataclass(frozen=True)
class Trainer:
    """What differs between a language model's run and a diffusion pipeline's (train/diffusion_loop.py): how the
    session is set up, the loop over its steps, and `final/`. The rest (the output, lock, resume and config policy,
    checkpoints, metrics, signals) is the same run."""

    build_session: Callable[..., Any]
    train: Callable[[Any], Any]  # session → loop.Outcome
    write_final: Callable[[Any, Storage, Any], None]
    counts_images: bool = False  # the session counts `trained_images` (a diffusion run)


def trainer_of(loaded: LoadedSpec | LoadedPipeline) -> Trainer:
    if isinstance(loaded, LoadedPipeline):
        from tunecast.train import diffusion_loop

        return Trainer(diffusion_loop.build_session, diffusion_loop.train, diffusion_loop.write_final, True)
    from tunecast.train import final, loop, session

    return Trainer(session.build_session, loop.train, final.write_final)


def run_training(loaded: LoadedSpec | LoadedPipeline, catalog: Catalog, request: TrainRequest,
                 flag: PreemptionFlag, reporter: Any) -> TrainResult:
    """Train `loaded` to the end or to a preemption, on this process or as one rank of several (started by
    torchrun, accelerate launch or `tunecast train --gpus N`). Raises TunecastError for what the user must fix."""
    from tunecast.train.distributed import Engine, PeerLost
    from tunecast.train.world import world_from_env

    world = world_from_env()
    result = TrainResult(output=output_url(loaded.spec), finished=False, rank=world.rank, world_size=world.size)
    engine = Engine.start(world)
    try:
        return _run(loaded, catalog, request, flag, reporter, engine, result)
    except PeerLost as lost:  # another rank stopped during set-up
        result.lost = str(lost)
        return result
    except WriteFailed as failed:  # a full or read-only output: say where the same command would start again
        raise failed.with_hint(f"{WRITE_HINT}; {CheckpointStore(Storage(result.output)).recovery()}") from None
    finally:
        engine.close()


def _open_run(spec: RunSpec, storage: Storage, request: TrainRequest, reporter: Any, stack: contextlib.ExitStack,
              result: TrainResult, epochs_set: bool) -> dict[str, Any]:
    """Rank 0's part before training: --fresh, the lock, leftovers, the newest valid checkpoint, the config policy,
    each decision said as it is taken. What it found, for every rank."""
    if request.fresh and storage.exists():
        with locked(storage):  # a run still writing there stops --fresh, as it would stop a resume
            pass
        moved = move_aside(storage)
        if moved:
            reporter.event("start", f"--fresh: the earlier run moved to {moved}")
    lock = stack.enter_context(locked(storage))
    if lock.took_over:
        reporter.event("start", f"took over the lock left by {lock.took_over} (a run that was killed or lost)")
    leftovers = storage.remove_temporaries()
    if leftovers:
        reporter.event("start", f"removed {len(leftovers)} half-written file(s) a killed run left")
    found, skipped = CheckpointStore(storage).newest_valid(keep=False)
    if found is None and any(bad.written for bad in skipped):
        _refuse_damaged(storage, skipped)
    instead = (f"checkpoint step {found.step} is used instead" if found is not None
               else "no complete checkpoint is left: the run starts from step 0")
    for bad in skipped:
        warn(result, reporter, Problem(f"checkpoints/{bad.name}", f"skipped: {bad.reason}",
                                       f"it was left by an interrupted or damaged write; {instead}",
                                       severity="warning"))
    opened: dict[str, Any] = {"lock": lock, "found": None, "resolved_then": None, "complete": False}
    if found is not None:
        # final/ is written only after the last step's checkpoint: complete, it means the run is done, unless a
        # larger max_steps (or none) now takes it further along the same schedule
        opened["complete"] = final_complete(storage) and not _goes_further(found.manifest, spec, epochs_set)
        if not opened["complete"]:
            reporter.event("resume", f"resuming from checkpoint step {found.step} "
                                     f"({CHECKPOINTS}/{step_name(found.step)}, the newest that verifies)")
        opened["found"] = (found.step, found.manifest)
        opened["resolved_then"] = _check_config(found.manifest, spec, result, reporter, epochs_set)
    return opened


def _refuse_damaged(storage: Storage, skipped: list[Skipped]) -> None:
    listed = "; ".join(f"{bad.name}: {bad.reason}" for bad in skipped[:4])
    more = f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""
    raise TunecastError(f"no checkpoint in {storage.url} verifies ({listed}{more}): starting from step 0 would "
                        "overwrite them", field="output",
                        hint="pass --fresh to start over (the damaged run is moved aside to OUTPUT.old-TIMESTAMP, "
                             "not deleted), or give this run another --output")


def _goes_further(manifest: dict[str, Any], spec: RunSpec, epochs_set: bool) -> bool:
    """Whether a finished run (its last checkpoint's `manifest`) has steps left now: it ended early at max_steps
    on a schedule of the epochs, and max_steps is now larger or unset."""
    schedule = manifest.get("schedule_steps")
    if manifest.get("schedule_by") != "epochs" or not isinstance(schedule, int) \
            or not schedule_by_epochs(spec, epochs_set=epochs_set):
        return False
    planned = schedule if spec.max_steps is None else min(spec.max_steps, schedule)
    return int(manifest.get("step", 0)) < planned


def _run(loaded: LoadedSpec | LoadedPipeline, catalog: Catalog, request: TrainRequest, flag: PreemptionFlag,
         reporter: Any, engine: Any, result: TrainResult) -> TrainResult:
    spec = loaded.spec
    trainer = trainer_of(loaded)
    storage = Storage(result.output)
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] | None = None
        failure: tuple[str, str | None, str | None] | None = None
        if engine.world.main:
            try:
                opened = _open_run(spec, storage, request, reporter, stack, result, spec.fixed("epochs"))
            except TunecastError as error:
                if not engine.world.distributed:
                    raise
                engine.broadcast({"failure": (error.message, error.field, error.hint)})
                raise
        probe = None
        if engine.world.main and engine.world.distributed:  # every rank must reach the output: see it write
            probe = f".tunecast-ranks-{os.getpid()}-{int(time.time() * 1e6)}"
            storage.write(probe, b"")
        shared = engine.broadcast(None if opened is None else {k: v for k, v in opened.items() if k != "lock"}
                                  | {"failure": failure, "probe": probe})
        if shared.get("failure"):
            message, field_name, hint = shared["failure"]
            raise SharedError(message, field=field_name, hint=hint)
        if shared.get("probe"):
            _check_shared(storage, engine, shared["probe"])
        lock = opened["lock"] if opened is not None else _NoLock()
        found = Loaded(shared["found"][0], shared["found"][1], {}) if shared["found"] is not None else None
        if found is not None and shared["complete"]:
            result.finished = result.already_complete = True
            result.steps = result.total_steps = found.step
            result.final = storage.url_of(FINAL)
            return result
        from tunecast.train.signals import Preempted

        store = CheckpointStore(storage)
        try:
            session = trainer.build_session(loaded, catalog, request, flag, reporter, storage=storage, store=store,
                                            lock=lock, found=found, resolved_then=shared["resolved_then"],
                                            result=result, engine=engine)
        except Preempted as stop:  # before the first step: the checkpoint resumed from (if any) stays as it is
            result.signal = stop.signal_name
            result.steps = found.step if found is not None else 0
            return result
        found = None
        from tunecast.train.loop import refresh_view

        session.view = request.view
        outcome = trainer.train(session)
        result.steps = outcome.progress.step
        result.total_steps = session.total_steps
        result.elapsed_s = outcome.progress.elapsed_s
        result.cost_usd = outcome.progress.cost_usd
        if session.trained_seconds:
            result.tokens_per_second = session.trained_tokens / session.trained_seconds
            if trainer.counts_images:
                result.images_per_second = session.trained_images / session.trained_seconds
        if not outcome.finished:
            result.signal = outcome.signal
            result.lost = outcome.lost
            if outcome.lost is not None:
                result.steps = _newest(store, engine)
            session.metrics.close()
            return result
        # a run killed while final/ is written resumes at its last step and writes final/ again
        trainer.write_final(session, storage, loaded)
        session.metrics.write({"kind": "event", "event": "finished", "step": outcome.progress.step,
                               "elapsed_s": round(outcome.progress.elapsed_s, 3),
                               "cost_usd": round(outcome.progress.cost_usd, 4)})
        session.metrics.sync()
        refresh_view(session)
        session.metrics.close()
        result.finished = True
        result.final = storage.url_of(FINAL)
        return result


def _check_shared(storage: Storage, engine: Any, probe: str) -> None:
    """Every rank sees the file rank 0 just wrote in the output: each writes its own files of a checkpoint there
    and rank 0 the manifest naming them all, so an output local to each node would hold checkpoints that never
    verify."""
    import socket

    seen = engine.gather((storage.exists(probe), socket.gethostname()))
    if engine.world.main:
        storage.remove(probe)
    blind = [f"rank {rank} on {host}" for rank, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise (TunecastError if engine.world.main else SharedError)(
            f"the output {storage.url} is not shared by every process: {', '.join(blind[:4])} cannot see what rank 0 "
            "wrote there", field="output",
            hint="give output a storage every node reaches: a bucket URL (s3://…, gs://…) or a shared filesystem")


def _newest(store: CheckpointStore, engine: Any) -> int:
    """The step a run that lost a rank resumes from (read by rank 0 alone; the others say 0)."""
    if not engine.world.main:
        return 0
    found, _ = store.newest_valid(keep=False)
    return found.step if found is not None else 0


def _check_config(manifest: dict[str, Any], spec: RunSpec, result: TrainResult, reporter: Any,
                  epochs_set: bool) -> dict[str, Any]:
    """The config policy on resume; returns the resolved batch shape the run started with."""
    then = manifest.get("requested", {})
    requested = spec.model_dump(mode="json")
    refused, allowed = config_changes(then, requested)
    # max_steps only moves where a run ends when the epochs set its schedule, before (a checkpoint of an earlier
    # version says so when it had no max_steps) and now
    then_by_epochs = manifest.get("schedule_by", "epochs" if then.get("max_steps") is None else None) == "epochs"
    if "max_steps" in refused and then_by_epochs and schedule_by_epochs(spec, epochs_set=epochs_set):
        refused.remove("max_steps")
        allowed.append("max_steps")
    if refused:
        old, new = flatten(then), flatten(requested)
        listed = ", ".join(f"{key} ({old.get(key)!r} → {new.get(key)!r})" for key in refused[:6])
        more = f" and {len(refused) - 6} more" if len(refused) > 6 else ""
        raise TunecastError(f"the config changed since the checkpoint in a way that changes training: {listed}{more}",
                            field=refused[0],
                            hint="restore those values to resume, or pass --fresh to start over (the old run is "
                                 "moved aside, not deleted)")
    for key in allowed:
        if key in RESOLVED:
            continue
        old_value, new_value = flatten(then).get(key), flatten(requested).get(key)
        warn(result, reporter, Problem(key, f"changed since the checkpoint ({old_value!r} → {new_value!r}); it does "
                                            "not change training, so the run resumes with the new value",
                                       severity="warning"))
    resolved = manifest.get("resolved", {})
    assert isinstance(resolved, dict)
    return resolved


def write_config(storage: Storage, document: dict[str, Any]) -> str:
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    storage.write(CONFIG_FILE, text.encode())
    return text


def free_memory_gib(kind: str) -> float:
    """Memory the run may take: the CUDA device's free memory, or the host's available memory."""
    if kind == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free / 2**30
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30
