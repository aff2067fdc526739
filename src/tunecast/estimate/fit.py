"""Does a run fit a GPU, how far can micro-batch and sequence length go, and what would make it fit.

Micro-batch and length sweeps replay the cached step profiles (no new trace): allocation sizes are
polynomials in both. Changes that alter the traced step (checkpointing, chunked loss, optimizer in
backward) are estimated from their templates; one that no template or cache entry serves is listed without
a figure unless the caller lets it trace (`trace`: about a minute a change for a large model on a laptop
CPU), and is cached like any other estimate once traced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tunecast.catalog.gpus import Gpu
from tunecast.catalog.overheads import Overhead
from tunecast.config.spec import DEEPSPEED_STRATEGIES, TORCH_ADAMW, RunSpec
from tunecast.errors import TunecastError
from tunecast.estimate.memory import MemoryEstimate, estimate_memory
from tunecast.estimate.profiles import NeedsTrace

MAX_MICRO_BATCH = 4096
SMALL_MICRO_BATCH = 2  # at or below this, steps are slow and noisy: flag it
# A limit of a composed step (`_solved`): rounds of solving the stand-in's polynomials plus the loss's measured memory,
# before what is left open is closed with the composed step itself.
SOLVE_ROUNDS = 2
# ... then rounds of solving the composed step with its loss interpolated between the traces of the checks so far (the
# loss's sizes are linear in n between changes of its number of chunks: exact there, no trace per evaluation).
NEAR_ROUNDS = 2
# ... and how close to the exact limit such a limit is taken: the largest value verified to fit, at most this share
# below the first that does not (exact below 100: a micro-batch, a short length).
SOLVE_TOLERANCE = 0.01


@dataclass(frozen=True)
class Suggestion:
    """A change to the run, and the per-GPU memory it leads to: None (and `fits` None) when estimating it
    needs a trace the caller did not allow."""

    change: str
    settings: dict[str, Any]
    device_total_gib: float | None
    fits: bool | None

    def as_dict(self) -> dict[str, Any]:
        gib = None if self.device_total_gib is None else round(self.device_total_gib, 3)
        return {"change": self.change, "settings": self.settings, "device_total_gib": gib, "fits": self.fits,
                "estimated": self.device_total_gib is not None}


@dataclass(frozen=True)
class FitReport:
    gpu: str
    capacity_gib: float
    fits: bool
    headroom_gib: float
    max_micro_batch: int  # 0 when not even one sequence fits
    max_seq_len: int  # at the configured micro-batch; 0 when no length fits
    max_seq_len_capped: bool  # True when the model's context length, not memory, is the limit
    suggestions: tuple[Suggestion, ...]
    warnings: tuple[str, ...] = field(default=())
    at_edge: bool = False
    """Does not fit with the allocator's cache as it grows when memory is plentiful, but fits in what the process needs
    at least (`least_device_total_gib`): the allocator releases its free cached segments and retries before it fails,
    so the run goes on at the edge, slower where it releases."""
    reserved_gib: float = 0.0
    """What the process reserves at its peak on this GPU (`MemoryEstimate.on_device`): the estimate's where it fits;
    at the edge, the GPU's memory less the context, where the allocator releases its cache."""
    device_total_gib: float = 0.0
    """`reserved_gib` plus the CUDA context: what a GPU monitor shows at the peak on this GPU."""

    def as_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "capacity_gib": round(self.capacity_gib, 3), "fits": self.fits,
                "fits_at_edge": self.at_edge, "reserved_on_gpu_gib": round(self.reserved_gib, 3),
                "device_total_on_gpu_gib": round(self.device_total_gib, 3),
                "headroom_gib": round(self.headroom_gib, 3), "max_micro_batch": self.max_micro_batch,
                "max_seq_len": self.max_seq_len, "max_seq_len_is_context_limit": self.max_seq_len_capped,
                "suggestions": [s.as_dict() for s in self.suggestions], "warnings": list(self.warnings)}


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """Largest n in [low, high] with fits(n), given fits is monotone (the estimate never falls as micro-batch or
    length grow, so a larger value never fits where a smaller one did not); low - 1 when none. Doubles from
    `low` first: from 1 that visits the powers of two, the shapes whose allocator reserve is simulated."""
    if not fits(low):
        return low - 1
    while 2 * low <= high and fits(2 * low):
        low *= 2
    high = min(high, 2 * low - 1)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _largest_along(value: Callable[[int], float], capacity: float, low: int, high: int) -> int:
    """Largest n in [low, high] with value(n) <= capacity (low - 1 when none), for a value that never falls with n and
    is near linear (a step's memory in micro-batch or length): each guess where the line through the nearest
    measurements on either side reaches the capacity (ahead of the largest that fits while none fails), halved
    after two guesses running that each left more than half the interval; exact as a search, in a few evaluations
    where bisection takes twice as many."""
    seen = {low: value(low)}  # every probe lies strictly between the bracket's ends: none is measured twice
    if seen[low] > capacity:
        return low - 1
    fitting, failing = low, high + 1
    probe = min(high, max(low + 1, 2 * low))
    stalled = False  # the last guess between two measurements left more than half the interval
    while failing - fitting > 1:
        before = failing - fitting
        seen[probe] = value(probe)
        if seen[probe] <= capacity:
            fitting = probe
        else:
            failing = probe
        if failing - fitting <= 1:
            break
        below, above = seen[fitting], seen.get(failing)
        if above is None:  # none fails yet: along the line of the two largest that fit
            earlier = max((n for n in seen if n < fitting), default=None)
            slope = (below - seen[earlier]) / (fitting - earlier) if earlier is not None else 0.0
            ahead = fitting + int((capacity - below) / slope) if slope > 0 else 2 * fitting
            probe = min(max(ahead, fitting + 1), failing - 1)
            continue
        halved = failing - fitting <= before // 2
        if (stalled and not halved) or above <= below:
            probe, stalled = (fitting + failing) // 2, False  # the lines stall twice running: halve
            continue
        stalled = not halved
        line = fitting + int((capacity - below) * (failing - fitting) / (above - below))
        probe = min(max(line, fitting + 1), failing - 1)
    return fitting


Near = Callable[[int, Iterable[int]], float | None]
"""near(n, measured) → a composed step's memory at n with its loss interpolated between its traces at `measured`
(compose.from_near_traces); None where two such with the same events are not among them."""


def _solved(exact: Callable[[int], float], proxy: Callable[[int], float], known: tuple[int, float], capacity: float,
            low: int, high: int, near: Near | None = None) -> int:
    """Largest n in [low, high] with exact(n) <= capacity (low - 1 when none), where exact costs a trace of the loss at
    each n (a composed step) and proxy is the same step with the loss's stand-in (template polynomials: no trace); to
    within SOLVE_TOLERANCE of it: the n returned is verified to fit, and n + 1 + ⌊n × SOLVE_TOLERANCE⌋ not to.

    Solved, not searched: the gap exact − proxy (the loss's own memory) is measured where exact is known (`known`, the
    asked shape, first) and taken linear in n (`_gap_line`), and proxy plus that gap is solved over the polynomials;
    the solution is checked with the composed step on both sides (n fits, n + 1 does not), and a check that fails adds
    its measurement for the next solve. After SOLVE_ROUNDS, `near` (the composed step with the loss interpolated
    between the checks' traces: compose.from_near_traces; None where no two of them have the same events) is solved
    instead, for up to NEAR_ROUNDS: exact where the loss's sizes are linear in n, and each evaluation a composition
    and a replay, not a trace (about half a check's cost, so only where the line has not closed). Then what is left
    open (the allocator's rounding, or a peak that moved to another phase, which the line misses) is closed on the
    composed step's own measurements (`_closing`), each guess checked on both sides; bisected where that did not
    halve the interval; while no measurement fails, upward where the line of the largest two that fit reaches the
    capacity (`_above_fitting`), else in doubling steps."""
    fitting, failing = low - 1, high + 1  # the largest n known to fit, the smallest known not to
    gaps: list[tuple[int, float]] = []
    values: dict[int, float] = {}

    def fits(n: int, value: float | None = None) -> bool:
        nonlocal fitting, failing
        value = exact(n) if value is None else value
        gaps.append((n, value - proxy(n)))
        values[n] = value
        if value <= capacity:
            fitting = max(fitting, n)
            return True
        failing = min(failing, n)
        return False

    def margin(n: int) -> int:
        return int(max(n, 0) * SOLVE_TOLERANCE)

    def closed() -> bool:
        return failing - fitting <= 1 + margin(fitting)

    def checked(guess: int) -> None:
        """The guess, then the other side of the tolerance: below a guess that does not fit, above one that does."""
        other = guess - 1 - margin(guess) if guess > fitting and not fits(guess) else guess + 1 + margin(guess)
        if fitting < other < failing:
            fits(other)

    if low <= known[0] <= high:
        fits(*known)
    for _ in range(SOLVE_ROUNDS):
        if closed():
            return fitting
        checked(_largest_along(lambda n, gap=_gap_line(gaps): proxy(n) + gap(n),  # type: ignore[misc]
                               capacity, fitting + 1, failing - 1))
    for _ in range(NEAR_ROUNDS if near is not None else 0):
        if closed() or near(fitting + 1, set(values)) is None:
            break
        checked(_largest_along(lambda n, measured=set(values): value if (  # type: ignore[misc]
            value := near(n, measured)) is not None else float("inf"), capacity, fitting + 1, failing - 1))
    step = 1 + margin(fitting)
    halved = True
    while not closed():
        width = failing - fitting
        if failing not in values:  # nothing above fails yet: where the line of what fits leads, else doubling steps
            ahead = _above_fitting(values, fitting, capacity)
            if ahead is not None and fitting < ahead < failing:
                checked(ahead)
            else:
                fits(fitting + step if step < width else (fitting + failing) // 2)
            step *= 2
            continue
        guess = min(max(_closing(values, fitting, failing, capacity) if halved else (fitting + failing) // 2,
                        fitting + 1), failing - 1)
        if halved or width <= 4 * (1 + margin(fitting)):
            checked(guess)  # a guess from the measurements' lines is near the limit: both of its sides close it
        else:
            fits(guess)  # a bisection: the guess alone narrows the interval
        halved = failing - fitting <= width // 2
    return fitting


def _closing(values: dict[int, float], fitting: int, failing: int, capacity: float) -> int:
    """The next guess at the limit from the measurements around it: the larger of `_below_failing`'s point (the limit
    at most, where memory is convex there; the limit itself where it is linear) and `_between`'s (the limit at least,
    where convex; the larger where the allocator's reserve bends the lines instead); bisected without either."""
    guesses = [found for found in (_below_failing(values, capacity), _between(values, fitting, failing, capacity))
               if found is not None]
    return max(guesses, default=(fitting + failing) // 2)


def _below_failing(values: dict[int, float], capacity: float) -> int | None:
    """Where the line through the two smallest measurements that do not fit reaches the capacity; None without two
    such on a rising line. Memory is convex in n (each phase's is linear, or quadratic in the length, and
    the peak is their largest), so the line stays under it below them: the limit is at or below that point, and at it
    where both measurements are in the limit's phase. A line through measurements that fit can follow another phase
    (the optimizer step's, constant in n) and miss by far."""
    over = sorted(n for n, value in values.items() if value > capacity)[:2]
    if len(over) < 2 or values[over[1]] <= values[over[0]]:
        return None
    first, second = over
    return first - int((values[first] - capacity) * (second - first) / (values[second] - values[first]))


def _above_fitting(values: dict[int, float], fitting: int, capacity: float) -> int | None:
    """Where the line through the two largest measurements that fit (up to `fitting`) reaches the capacity; None
    without two such on a rising line. Where memory is convex the limit is at or below it; at it where linear."""
    under = sorted(n for n, value in values.items() if value <= capacity and n <= fitting)[-2:]
    if len(under) < 2 or values[under[1]] <= values[under[0]]:
        return None
    first, second = under
    return second + int((capacity - values[second]) * (second - first) / (values[second] - values[first]))


def _between(values: dict[int, float], fitting: int, failing: int, capacity: float) -> int | None:
    """Where the line between the largest measurement that fits and the smallest that does not reaches the capacity;
    None without both. Where memory is convex the limit is at or above it."""
    if fitting not in values or failing not in values or values[failing] <= values[fitting]:
        return None
    return fitting + int((capacity - values[fitting]) * (failing - fitting) / (values[failing] - values[fitting]))


def _gap_line(gaps: list[tuple[int, float]]) -> Callable[[int], float]:
    """The gap at n: through the last measurement, with the slope of the two measurements farthest apart (near ones
    would turn the allocator's rounding into a slope); constant with one measurement."""
    if not gaps:
        return lambda n: 0.0
    last, at_last = gaps[-1]
    first = min(gaps, key=lambda item: item[0])
    final = max(gaps, key=lambda item: item[0])
    slope = 0.0 if final[0] == first[0] else (final[1] - first[1]) / (final[0] - first[0])
    return lambda n: at_last + slope * (n - last)


Total = Callable[..., float]
"""total(run_spec, micro_batch=…, seq_len=…, exact=…, trace=…, stand_in=…) → per-GPU device memory in GiB of that
run. `exact` says the answer is wanted at this one shape (no sweep will follow); `trace=False` raises NeedsTrace
where the answer would need a trace; `stand_in` takes a composed step with its loss's stand-in (estimate_memory)."""


def estimator_total(config_data: dict[str, Any], gpu: Gpu, overheads: tuple[Overhead, ...]) -> Total:
    """The `Total` the memory estimator gives for one model on one GPU (or a probed CPU)."""
    from tunecast.catalog.devices import is_cpu

    on_cpu = is_cpu(gpu)

    def total(run: RunSpec, *, exact: bool = False, trace: bool = True, stand_in: bool = False, **shape: int) -> float:
        return estimate_memory(run, config_data, device="cpu" if on_cpu else "cuda", gpu=None if on_cpu else gpu,
                               overheads=overheads, exact_shape=exact, trace=trace, stand_in=stand_in,
                               **shape).device_total_gib

    return total


def fit_report(spec: RunSpec, estimate: MemoryEstimate, gpu: Gpu, total: Total, *,
               context_len: int | None, trace_suggestions: bool = False, parallel: bool = False) -> FitReport:
    """Whether `spec` fits `gpu`, its largest micro-batch and length, and changes that would make it fit
    (each with its figure where a template or the cache serves it, or `trace_suggestions` lets it trace). With
    `parallel`, a composed step's two limits are solved at once, the length's in a forked process (prewarm.py)."""
    capacity = gpu.usable_memory_gib
    seq_cap = context_len or 1 << 20
    if estimate.composed:  # each shape would trace the loss: the limits are solved (see _solved)
        from tunecast.estimate.compose import repeats_once
        from tunecast.estimate.prewarm import both

        known = estimate.device_total_gib

        def near(axis: str) -> Near:
            from tunecast.estimate.compose import NoNearTraces, from_near_traces

            def value(n: int, measured: Iterable[int]) -> float | None:
                shapes = [(m, spec.seq_len) if axis == "micro_batch" else (spec.micro_batch_size, m) for m in measured]
                try:
                    with from_near_traces(shapes):
                        return total(spec, **{axis: n})
                except NoNearTraces:
                    return None
            return value

        def batch_limit() -> int:
            return _solved(lambda b: total(spec, micro_batch=b), lambda b: total(spec, micro_batch=b, stand_in=True),
                           (estimate.micro_batch, known), capacity, 1, MAX_MICRO_BATCH, near("micro_batch"))

        def seq_limit() -> int:
            return _solved(lambda s: total(spec, seq_len=s), lambda s: total(spec, seq_len=s, stand_in=True),
                           (estimate.seq_len, known), capacity, 1, seq_cap, near("seq_len"))

        with repeats_once():  # the checks read memory only
            max_batch, max_seq = both(batch_limit, seq_limit) if parallel else (batch_limit(), seq_limit())
    else:
        max_batch = _largest(lambda b: total(spec, micro_batch=b) <= capacity, 1, MAX_MICRO_BATCH)
        max_seq = _largest(lambda s: total(spec, seq_len=s) <= capacity, 1, seq_cap)
    fits = estimate.device_total_gib <= capacity
    warnings: list[str] = []
    if 1 <= max_batch <= SMALL_MICRO_BATCH and spec.micro_batch_size > max_batch:
        warnings.append(
            f"only a micro-batch of {max_batch} fits: training gets slower and noisier (make up the batch with "
            "gradient accumulation), and a card with more memory may be the better buy")
    at_edge = not fits and estimate.least_device_total_gib <= capacity
    if at_edge:
        warnings.append(
            f"fits only at the edge: {estimate.device_total_gib:.1f} GiB with the allocator's cache as it grows, "
            f"{estimate.least_device_total_gib:.1f} GiB at least once it releases its free cached segments and "
            "retries (PyTorch does so before it fails); a change below leaves room")
    suggestions = () if fits else tuple(_suggestions(spec, total, capacity, max_batch, trace_suggestions))
    reserved, device_total = estimate.on_device(capacity)
    return FitReport(gpu.slug, capacity, fits, capacity - estimate.device_total_gib, max(max_batch, 0),
                     max(max_seq, 0), max_seq == seq_cap, suggestions, tuple(warnings), at_edge, reserved,
                     device_total)


def _estimated(change: str, settings: dict[str, Any], spec: RunSpec, total: Total, capacity: float,
               trace: bool) -> Suggestion:
    """`change` (`settings` applied to `spec`) with its peak, or without one where that needs a trace not allowed, or
    where the changed run is one tunecast does not estimate (the Trainer's QLoRA of a mixture of experts: the error
    belongs to that run, not to the one asked about)."""
    try:
        peak: float | None = total(spec.with_changes(settings), exact=True, trace=trace)
    except (NeedsTrace, TunecastError):
        peak = None
    return Suggestion(change, settings, peak, None if peak is None else peak <= capacity)


def _suggestions(spec: RunSpec, total: Total, capacity: float, max_batch: int, trace: bool) -> list[Suggestion]:
    """Single changes first, each with its estimated peak; then changes combined until the run fits."""
    candidates: list[tuple[str, dict[str, Any]]] = []
    if spec.grad_checkpointing is not True:
        candidates.append(("turn on gradient checkpointing", {"grad_checkpointing": True}))
    several = spec.gpus.count > 1  # what tunecast trains on one process only is not suggested there (train/session.py)
    if spec.method == "lora" and not (several and spec.gpus.strategy != "ddp"):
        candidates.append(("use QLoRA (4-bit NF4 base weights)", {"method": "qlora"}))
    if spec.method == "full":
        candidates.append(("train LoRA adapters instead of every weight", {"method": "lora"}))
    if spec.optimizer in TORCH_ADAMW:
        candidates.append(("use the 8-bit AdamW optimizer", {"optimizer": "adamw-8bit"}))
        candidates.append(("use the paged 8-bit AdamW optimizer", {"optimizer": "paged-adamw-8bit"}))
    if not spec.optimizer_in_backward and not several:
        candidates.append(("step the optimizer in the backward pass (grad_accum 1)",
                           {"optimizer_in_backward": True, "grad_accum": 1}))
    if spec.loss != "chunked" and not several:
        candidates.append(("compute the loss in chunks", {"loss": "chunked"}))
    if not spec.activation_offload:
        candidates.append(("offload activations to CPU RAM", {"activation_offload": True}))
    if 1 <= max_batch < spec.micro_batch_size:
        # The largest micro-batch that fits and divides the sequences per step, so the batch stays the same.
        per_step = spec.micro_batch_size * spec.grad_accum
        smaller = max(d for d in range(1, max_batch + 1) if per_step % d == 0)
        candidates.append((f"micro-batch {smaller} with gradient accumulation {per_step // smaller}",
                           {"micro_batch": smaller, "grad_accum": per_step // smaller}))
    shard, engine = _sharding(spec)
    candidates.append((f"offload parameters and optimizer states to CPU RAM ({engine})",
                       {"gpus.strategy": shard, "gpus.offload": "params"}))
    found = [_estimated(change, settings, spec, total, capacity, trace) for change, settings in candidates]
    sharded = _fewest_gpus(spec, total, capacity, trace)
    if sharded is not None:
        found.append(sharded)
    if not any(s.fits for s in found):
        found.extend(_combined(spec, total, capacity, trace))
    return found


def _sharding(spec: RunSpec) -> tuple[str, str]:
    """The strategy that shards everything, and its name, for a run's suggestions: DeepSpeed's ZeRO-3 for a run
    already on DeepSpeed (its tool runs it), FSDP otherwise."""
    return ("zero3", "ZeRO-3") if spec.gpus.strategy in DEEPSPEED_STRATEGIES else ("fsdp", "FSDP")


def _fewest_gpus(spec: RunSpec, total: Total, capacity: float, trace: bool) -> Suggestion | None:
    """The fewest GPUs (2, 4 or 8) over which FSDP (ZeRO-3 for DeepSpeed) makes the run fit; 8 when none does."""
    last: Suggestion | None = None
    shard, engine = _sharding(spec)
    for count in (2, 4, 8):
        if count <= spec.gpus.count:
            continue
        settings = {"gpus.count": count, "gpus.strategy": shard}
        last = _estimated(f"shard over {count} GPUs with {engine}", settings, spec, total, capacity, trace)
        if last.fits is not False:
            break
    return last


def _combined(spec: RunSpec, total: Total, capacity: float, trace: bool) -> list[Suggestion]:
    """Add memory-saving changes one at a time, cheapest in speed first, until the run fits; without
    `trace`, a change whose figure would need a trace is left out of the combination."""
    steps: list[tuple[str, dict[str, Any]]] = [
        ("gradient checkpointing", {"grad_checkpointing": True}),
        ("chunked loss", {"loss": "chunked"}),
        ("8-bit AdamW", {"optimizer": "adamw-8bit"} if spec.optimizer in TORCH_ADAMW else {}),
        ("QLoRA", {"method": "qlora"} if spec.method == "lora" else {}),
        ("micro-batch 1", {"micro_batch": 1, "grad_accum": spec.micro_batch_size * spec.grad_accum}),
        ("activation offload", {"activation_offload": True}),
    ]
    applied: dict[str, Any] = {}
    names: list[str] = []
    peak: float | None = None
    for name, settings in steps:
        if not settings:
            continue
        try:
            tried = total(spec.with_changes({**applied, **settings}), exact=True, trace=trace)
        except (NeedsTrace, TunecastError):  # a change whose run tunecast does not estimate is left out too
            continue
        applied.update(settings)
        names.append(name)
        peak = tried
        if peak <= capacity:
            return [Suggestion("combine " + " + ".join(names), applied, peak, True)]
    if peak is None:
        return []
    return [Suggestion("combine " + " + ".join(names), applied, peak, False)]

