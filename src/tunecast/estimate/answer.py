"""The memory question for a validated run: the estimate, and with a GPU whether and how it fits."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tunecast.catalog.devices import is_cpu
from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec
from tunecast.errors import TunecastError
from tunecast.estimate import prewarm, replays
from tunecast.estimate.fit import FitReport, estimator_total, fit_report
from tunecast.estimate.memory import MemoryEstimate, estimate_memory

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class MemoryAnswer:
    estimate: MemoryEstimate
    fit: FitReport | None
    grad_checkpointing: bool

    def as_dict(self, loaded: LoadedSpec) -> dict[str, Any]:
        spec = loaded.spec
        document: dict[str, Any] = {
            "model": loaded.model.name,
            "params": loaded.model.params,
            "runner": spec.runner,
            "method": spec.method,
            "precision": spec.precision,
            "optimizer": spec.optimizer,
            "grad_checkpointing": self.grad_checkpointing,
            "gpus": spec.gpus.count,
            "strategy": spec.gpus.strategy,
            **self.estimate.as_dict(),
        }
        if self.fit is not None:
            document.update(self.fit.as_dict())
        return document


def answer_memory(loaded: LoadedSpec, catalog: Catalog, *, device: str, trace_suggestions: bool = False,
                  warming: prewarm.Prewarm | None = None) -> MemoryAnswer:
    """Estimate the run's per-GPU memory; with `gpus.gpu` set, also fit, limits and suggestions (those that
    would need a trace of their own only with `trace_suggestions`). `warming`: the second process `start_prewarm`
    started, whose replays the limits take.

    `grad_checkpointing: auto` is off unless the run does not fit the GPU without it.
    """
    with replays.deferred():  # the replays of every estimate made here, written once
        try:
            return _answer(loaded, catalog, device=device, trace_suggestions=trace_suggestions, warming=warming)
        finally:
            prewarm.abandon(warming)


def start_prewarm(loaded: LoadedSpec, catalog: Catalog, *, device: str) -> prewarm.Prewarm | None:
    """For a step whose loss is composed, estimated on a GPU: the second process that replays the stand-in's limits
    while this one traces (prewarm.py); None for any other. Call it before this process starts a thread (a progress
    display): a process with threads is not forked."""
    from tunecast.estimate.compose import composable
    from tunecast.step.settings import TraceSettings

    spec, gpu = loaded.spec, loaded.gpu
    if gpu is None or is_cpu(gpu) or device != "cuda":
        return None
    checkpointing = spec.grad_checkpointing is True  # `auto` is off until the estimate says otherwise
    if not composable(TraceSettings.from_spec(spec, grad_checkpointing=checkpointing, device=device)):
        return None
    total = estimator_total(loaded.model.data, gpu, catalog.overheads)
    run = spec.model_copy(update={"grad_checkpointing": checkpointing})

    def proxy(**shape: int) -> float:
        return total(run, trace=False, stand_in=True, **shape)

    return prewarm.start(proxy, gpu.usable_memory_gib, spec.micro_batch_size, spec.seq_len,
                         loaded.model.max_position_embeddings or 1 << 20)


def _answer(loaded: LoadedSpec, catalog: Catalog, *, device: str, trace_suggestions: bool,
            warming: prewarm.Prewarm | None) -> MemoryAnswer:
    if device not in DEVICES:
        raise TunecastError(f"unknown device {device!r}", field="--device", hint="use --device cuda or --device cpu")
    spec, gpu = loaded.spec, loaded.gpu
    on_cpu = gpu is not None and is_cpu(gpu)
    if device == "cpu" and gpu is not None and not on_cpu:
        raise TunecastError("--gpu needs --device cuda: a CPU estimate has no GPU to fit", field="--device",
                            hint="drop --gpu, or use --device cuda")
    if on_cpu:
        device = "cpu"  # `--gpu local` on a machine without a GPU: the CPU's memory is what must hold the run
    config = loaded.model.data
    estimated_on = None if on_cpu else gpu

    def run(checkpointing: bool) -> MemoryEstimate:
        return estimate_memory(spec, config, device=device, gpu=estimated_on, overheads=catalog.overheads,
                               grad_checkpointing=checkpointing)

    checkpointing = spec.grad_checkpointing is True
    estimate = run(checkpointing)
    if spec.grad_checkpointing == "auto" and gpu is not None and estimate.device_total_gib > gpu.usable_memory_gib:
        checkpointing = True
        estimate = run(True)
    fit = None
    if gpu is not None:
        prewarm.collect(warming)
        context = loaded.model.max_position_embeddings
        run_spec = spec if spec.grad_checkpointing != "auto" else spec.model_copy(
            update={"grad_checkpointing": checkpointing})
        fit = fit_report(run_spec, estimate, gpu, estimator_total(config, gpu, catalog.overheads), context_len=context,
                         trace_suggestions=trace_suggestions, parallel=warming is not None)
        if spec.micro_batch == "auto" and fit.max_micro_batch >= 1:
            # `auto` is left open: the answer is the largest micro-batch that fits, as `tunecast train` takes it
            # (there, also dividing the sequences of a step)
            chosen = fit.max_micro_batch
            estimate = estimate_memory(spec, config, device=device, gpu=estimated_on, overheads=catalog.overheads,
                                       grad_checkpointing=checkpointing, micro_batch=chosen)
            estimate = replace(estimate, notes=(*estimate.notes, f"micro_batch auto: {chosen}, the largest that fits"))
            fit = fit_report(run_spec.model_copy(update={"micro_batch": chosen}), estimate, gpu,
                             estimator_total(config, gpu, catalog.overheads), context_len=context,
                             trace_suggestions=trace_suggestions)
    return MemoryAnswer(estimate, fit, checkpointing)
