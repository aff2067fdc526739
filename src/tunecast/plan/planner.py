"""The plan: for every GPU and GPU count, the fastest configuration that fits, how long the run takes, and
what it costs on every offer — ranked by the cost of the whole run.

What the user fixed (in the file or on the command line) is honoured; what is left open the planner chooses:
the micro-batch (the largest that fits among those that divide the global batch), gradient accumulation (to
keep the global batch), and checkpointing (only when nothing fits without it). Method, optimizer, loss,
offload and strategy change only when `plan.allow` lists the change.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import date
from typing import Any

from tunecast.catalog.devices import from_probe, is_cpu
from tunecast.catalog.gpus import Gpu
from tunecast.catalog.offers import Offer
from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec
from tunecast.config.spec import STRATEGY_ENGINES, TORCH_ADAMW, RunSpec
from tunecast.estimate.memory import MemoryEstimate, estimate_memory
from tunecast.estimate.profiles import ProfilePair, get_profiles
from tunecast.plan.calibration import Calibration
from tunecast.plan.cost import GPUS_PER_NODE, OfferCost, RunShape, price_run
from tunecast.plan.throughput import StepTime, forward_seconds, step_time
from tunecast.plan.workload import Workload, evaluations
from tunecast.step.settings import TraceSettings
from tunecast.units import BYTES_PER_GIB, SECONDS_PER_HOUR

GPU_COUNTS = (1, 2, 4, 8)
# Several nodes of 8, on offers that publish their inter-node network (Offer.internode_gb_per_s).
MULTI_NODE_COUNTS = (16, 32)
MIB = 2**20
SMALL_MICRO_BATCH = 2
MICRO_BATCH_CANDIDATES = 16  # fitting micro-batches whose speed is worked out per GPU and count (_speed_candidates)
# Two runs whose hours differ by less than this share are equally fast to a person reading the plan ("1.3 h" and
# "1.3 h"): the cheaper is the better, in the ranking by time, in the "Fastest" recommendation and in the Pareto front
# (`time_classes`). Start-up, loading and checkpoint writes weigh the same on any card, so a short run on 8 of the
# dearest GPUs often finishes within a minute of one on 4 cheaper ones at twenty times the price. 5%: the throughput
# model's median error against measured runs is three times that (docs/validation/throughput.md), so a smaller
# difference in predicted hours is no difference anyone can count on.
SAME_TIME_WITHIN = 0.05
# Changes `plan.allow` may permit, in the order tried: least effect on speed and on the result first.
ALLOWED_CHANGES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fsdp", {"gpus.strategy": "fsdp"}),
    ("adamw-8bit", {"optimizer": "adamw-8bit"}),
    ("chunked_loss", {"loss": "chunked"}),
    ("optimizer_in_backward", {"optimizer_in_backward": True, "grad_accum": 1}),
    ("paged-adamw-8bit", {"optimizer": "paged-adamw-8bit"}),
    ("paged-adamw", {"optimizer": "paged-adamw"}),
    ("lora", {"method": "lora"}),
    ("qlora", {"method": "qlora"}),
    ("activation_offload", {"activation_offload": True}),
    ("offload", {"gpus.offload": "optimizer"}),
)


@dataclass
class Configuration:
    """A way to run on one GPU model and count: what the planner chose, and what it gives."""

    gpu: Gpu
    gpu_count: int
    spec: RunSpec  # with the planner's choices applied
    micro_batch: int
    grad_accum: int
    grad_checkpointing: bool
    memory: MemoryEstimate
    step: StepTime
    tokens_per_second: float  # real (non-padding) tokens per second, all GPUs
    hours: float  # training steps and evaluations
    eval_hours: float
    changes: tuple[str, ...]
    notes: list[str] = field(default_factory=list)
    basis: str = "predicted"  # "measured" (the calibrated run itself), "calibrated" or "predicted"
    # the largest micro-batch that fits, where memory holds it at SMALL_MICRO_BATCH or below although the
    # global batch gives each GPU more sequences per step; None when memory does not hold it down
    memory_bound_micro_batch: int | None = None


@dataclass
class Option:
    configuration: Configuration | None
    gpu: str
    gpu_count: int
    cost: OfferCost | None
    reason: str | None = None  # why it does not fit (configuration None)
    pareto: bool = False
    capacity_gib: float | None = None  # what the plan may use of one GPU (usable memory less the margin)
    closest: MemoryEstimate | None = None  # an option that does not fit: its smallest estimate

    @property
    def fits(self) -> bool:
        return self.configuration is not None

    def as_dict(self) -> dict[str, Any]:
        c = self.configuration
        document: dict[str, Any] = {
            "gpu": self.gpu, "gpu_count": self.gpu_count,
            "provider": self.cost.provider if self.cost else None, "spot": self.cost.spot if self.cost else False,
            "usd_per_hour_total": round(self.cost.usd_per_hour_total, 4) if self.cost else None,
            "fits": self.fits,
            "micro_batch": c.micro_batch if c else None, "grad_accum": c.grad_accum if c else None,
            "grad_checkpointing": c.grad_checkpointing if c else None,
            "strategy": c.spec.gpus.strategy if c else None,
            **launch_of(self.gpu_count, c.spec if c else None),
            "changes": list(c.changes) if c else [],
            "peak_reserved_gib": round(c.memory.peak_reserved_gib, 2) if c else None,
            "device_total_gib": round(c.memory.device_total_gib, 2) if c else None,
            "least_device_total_gib": round(c.memory.least_device_total_gib, 2) if c else None,
            "step_s": round(c.step.total_s, 6) if c else None,
            "exposed_comm_s": round(c.step.communication_s, 6) if c else None,
            "comm_link": c.step.link.as_dict() if c and c.step.link is not None else None,
            "tokens_per_second": round(c.tokens_per_second, 1) if c else None,
            "tokens_per_second_per_gpu": round(c.tokens_per_second / self.gpu_count, 1) if c else None,
            "hours": round(self.cost.hours, 3) if self.cost else (round(c.hours, 3) if c else None),
            "eval_hours": round(c.eval_hours, 3) if c else None,
            "compute_usd": None, "storage_usd": None, "preemption_usd": None, "total_usd": None,
            "price_as_of": None, "price_age_days": None, "price_stale": False, "price_source": None,
            "price_kind": None, "available": None,
            "pareto": self.pareto,
            "capacity_gib": round(self.capacity_gib, 2) if self.capacity_gib is not None else None,
            "memory_breakdown_gib": _breakdown(c.memory if c else self.closest),
            "basis": c.basis if c else None,
            "notes": ([self.reason] if self.reason else []) + (list(c.notes) if c else [])
                     + (list(self.cost.notes) if self.cost else []),
        }
        if self.cost:
            cost = self.cost.as_dict()
            for key in ("compute_usd", "storage_usd", "preemption_usd", "total_usd", "checkpoint_interval_hours",
                        "expected_preemptions", "price_as_of", "price_age_days", "price_stale", "price_source",
                        "price_kind", "available"):
                document[key] = cost[key]
        return document


@functools.lru_cache(maxsize=256)
def _prime_factors(n: int) -> tuple[tuple[int, int], ...]:
    """(prime, power) of n by trial division: up to √ of what is left, so O(√n) at worst (a large prime) and a few
    steps for the batch sizes people use (powers of two times a few small primes)."""
    factors = []
    left = n
    divisor = 2
    while divisor * divisor <= left:
        power = 0
        while left % divisor == 0:
            left //= divisor
            power += 1
        if power:
            factors.append((divisor, power))
        divisor += 1 if divisor == 2 else 2
    if left > 1:
        factors.append((left, 1))
    return tuple(factors)


def divisors(n: int) -> list[int]:
    """Every divisor of n, largest first, made from its prime factors (a global batch of 32 billion has 150
    divisors, found in microseconds; counting down from n took hours)."""
    found = [1]
    for prime, power in _prime_factors(n):
        found = [d * prime**k for d in found for k in range(power + 1)]
    return sorted(found, reverse=True)


def _speed_candidates(sizes: list[int]) -> list[int]:
    """Of the micro-batches that fit (largest first), those whose speed the planner works out: all of them when they
    are few, else MICRO_BATCH_CANDIDATES spread evenly on a log scale, the largest and smallest among them. Speed
    changes smoothly with the micro-batch (more sequences per kernel, more padding when unpacked), so neighbours a
    few percent apart add nothing but time: a global batch of 720,720 has 240 divisors."""
    if len(sizes) <= MICRO_BATCH_CANDIDATES:
        return sizes
    chosen = {sizes[0], sizes[-1]}
    top, bottom = math.log(sizes[0]), math.log(sizes[-1])
    for step in range(1, MICRO_BATCH_CANDIDATES - 1):
        target = top + (bottom - top) * step / (MICRO_BATCH_CANDIDATES - 1)
        chosen.add(min(sizes, key=lambda size: abs(math.log(size) - target)))
    return [size for size in sizes if size in chosen]


# Keys of a RunSpec that change no training step's memory (the data, the schedule, checkpoints, evaluation, prices, the
# planner's own options): left out of the key of an estimate (`Planner._estimate`), so that plans that differ in them
# share their estimates. Every other key, present or future, is in it.
NOT_MEMORY_KEYS: frozenset[str] = frozenset({
    "dataset", "epochs", "max_steps", "learning_rate", "schedule", "warmup_steps", "warmup_ratio", "weight_decay",
    "max_grad_norm", "seed", "log_every_steps", "output", "checkpoint", "eval", "pricing", "plan", "global_batch",
    "grad_accum", "packing"})
# The estimates of one model and catalog, by what else they depend on (Planner._estimate's key).
Estimates = dict[tuple[Any, ...], MemoryEstimate]


@dataclass
class Planner:
    loaded: LoadedSpec
    catalog: Catalog
    workload: Workload
    calibration: Calibration | None = None
    # estimates of this model and catalog: the plan's own, or ones a server keeps across plans of the model
    _memory: Estimates = field(default_factory=dict)
    # the smallest estimate of each (GPU, count) that does not fit, for the memory chart of the report
    closest: dict[tuple[str, int], MemoryEstimate] = field(default_factory=dict)
    _pairs: dict[tuple[Any, ...], ProfilePair] = field(default_factory=dict)
    # called before every estimate: a server's job raises there when its client left or its time ran out, so that
    # a plan stops within one estimate (a trace under way finishes first)
    check: Callable[[], None] | None = None

    @property
    def spec(self) -> RunSpec:
        return self.loaded.spec

    def global_batch(self) -> int:
        spec = self.spec
        return spec.global_batch or spec.micro_batch_size * spec.grad_accum * spec.gpus.count

    def _estimate(self, spec: RunSpec, gpu: Gpu, micro_batch: int, checkpointing: bool) -> MemoryEstimate:
        if self.check is not None:
            self.check()
        # Memory depends on the GPU only through its architecture's cuBLAS workspace: cards of one
        # architecture share their estimates.
        key = (spec.model_dump_json(exclude={"gpus": {"gpu"}, **dict.fromkeys(NOT_MEMORY_KEYS, True)}),
               gpu.architecture, micro_batch, checkpointing)
        if key not in self._memory:
            on_cpu = is_cpu(gpu)
            self._memory[key] = estimate_memory(spec, self.loaded.model.data, device="cpu" if on_cpu else "cuda",
                                                gpu=None if on_cpu else gpu, overheads=self.catalog.overheads,
                                                grad_checkpointing=checkpointing, micro_batch=micro_batch)
        estimate = self._memory[key]
        calibration = self.calibration
        if calibration is not None and gpu.slug == calibration.device_slug and calibration.memory_factor != 1.0:
            factor = calibration.memory_factor
            estimate = replace(estimate, peak_allocated_gib=estimate.peak_allocated_gib * factor,
                               peak_reserved_gib=estimate.peak_reserved_gib * factor,
                               device_total_gib=estimate.device_total_gib * factor,
                               notes=(*estimate.notes, f"scaled ×{factor:.3f}: measured ÷ predicted peak in the "
                                                       "calibration"))
        return estimate

    def configure(self, gpu: Gpu, count: int, internode_gb_per_s: float | None = None) -> Configuration | str:
        """The fastest configuration of `count` × `gpu` that fits, or why none does; `internode_gb_per_s` is the
        network between nodes when `count` spans several."""
        spec = self.spec
        batch = self.global_batch()
        if batch % count:
            return f"the global batch of {batch} sequences does not divide over {count} GPUs"
        per_gpu = batch // count
        micro_batches = [spec.micro_batch_size] if spec.fixed("micro_batch") else divisors(per_gpu)
        if spec.fixed("micro_batch") and per_gpu % spec.micro_batch_size:
            return f"micro_batch {spec.micro_batch_size} does not divide the {per_gpu} sequences per GPU per step"
        if spec.grad_checkpointing == "auto" or not spec.fixed("grad_checkpointing"):
            checkpointing_options = [False, True]
        else:
            checkpointing_options = [bool(spec.grad_checkpointing)]
        base = spec.with_changes({"gpus.count": count, "gpus.gpu": gpu.slug})
        allowed = [(name, change) for name, change in ALLOWED_CHANGES if name in spec.plan.allow
                   and _applicable(name, base, count)]
        capacity = gpu.usable_memory_gib * (1 - spec.plan.memory_margin)
        applied: dict[str, Any] = {}
        names: list[str] = []
        smallest: MemoryEstimate | None = None
        for step in [None, *allowed]:
            if step is not None:
                applied.update(step[1])
                names.append(step[0])
            candidate = base.with_changes(applied) if applied else base
            sizes = micro_batches
            if candidate.optimizer_in_backward:
                # the optimizer steps inside the backward pass: no gradient accumulation, so one micro-batch
                # holds every sequence of the GPU's share of the step
                sizes = [size for size in micro_batches if size == per_gpu]
                if not sizes:
                    continue
            # memory grows with the micro-batch and without checkpointing: when the smallest form does not
            # fit, no other does
            least = self._estimate(candidate, gpu, min(sizes), max(checkpointing_options))
            if smallest is None or least.device_total_gib < smallest.device_total_gib:
                smallest = least
            if least.device_total_gib > capacity:
                continue
            for checkpointing in checkpointing_options:
                first = self._largest_fitting(candidate, gpu, sizes, checkpointing, capacity)
                if first is None:
                    continue
                fitting = [self._configuration(gpu, count, candidate, micro_batch, per_gpu // micro_batch,
                                               checkpointing, self._estimate(candidate, gpu, micro_batch,
                                                                             checkpointing),
                                               tuple(names), internode_gb_per_s)
                           for micro_batch in _speed_candidates(sizes[first:])]
                # the largest micro-batch is not always the fastest: unpacked, it pads every sequence to the
                # longest of more examples
                best = max(fitting, key=lambda c: c.tokens_per_second)
                largest = fitting[0].micro_batch
                if largest <= SMALL_MICRO_BATCH < per_gpu:
                    best.memory_bound_micro_batch = largest
                    best.notes.insert(0, f"only a micro-batch of {largest} fits: slower steps, noisier statistics")
                return best
        if smallest is None:
            return (f"optimizer_in_backward accumulates no gradients, so the micro-batch must be the {per_gpu} "
                    f"sequences per GPU per step, not {spec.micro_batch_size}")
        over = smallest.device_total_gib - capacity
        self.closest[(gpu.slug, count)] = smallest
        tried = f" (tried: {', '.join(names)})" if names else ""
        edge = ""
        if smallest.least_device_total_gib <= gpu.usable_memory_gib:
            edge = (f"; {smallest.least_device_total_gib:.1f} GiB at least once the allocator releases its cache, so "
                    f"it would run at the edge of the {gpu.usable_memory_gib:.1f} GiB usable")
        return (f"does not fit: at best {smallest.device_total_gib:.1f} GiB per GPU, {over:.1f} GiB over the "
                f"{capacity:.1f} GiB the plan may use{tried}{edge}")

    def _largest_fitting(self, spec: RunSpec, gpu: Gpu, sizes: list[int], checkpointing: bool,
                         capacity: float) -> int | None:
        """The index in `sizes` (largest first) of the largest micro-batch that fits, or None. Memory grows with the
        micro-batch, so once one fits every smaller one does: a binary search, a few estimates however many
        divisors the global batch has."""
        low, high = 0, len(sizes)  # sizes[high:] fit; sizes[:low] do not
        while low < high:
            middle = (low + high) // 2
            if self._estimate(spec, gpu, sizes[middle], checkpointing).device_total_gib <= capacity:
                high = middle
            else:
                low = middle + 1
        return low if low < len(sizes) else None

    def _configuration(self, gpu: Gpu, count: int, spec: RunSpec, micro_batch: int, grad_accum: int,
                       checkpointing: bool, memory: MemoryEstimate, changes: tuple[str, ...],
                       internode_gb_per_s: float | None = None) -> Configuration:
        settings = TraceSettings.from_spec(spec, grad_checkpointing=checkpointing, config_data=self.loaded.model.data)
        pair = self._profiles(settings, micro_batch, spec.seq_len)
        sequence = max(1, round(self.workload.tokens_per_sequence(micro_batch)))
        if not pair.covers(micro_batch, sequence):
            # traced at the longest sequence alone (its operations differed between shapes): the work of a step
            # is wanted at the length the micro-batches really have
            pair = self._profiles(settings, micro_batch, sequence, exact=True)
        offloaded = memory.host_ram_gib * BYTES_PER_GIB if spec.activation_offload else 0.0
        step = step_time(spec, pair, gpu, self.catalog.throughput, micro_batch=micro_batch, seq=sequence,
                         grad_accum=grad_accum, gpu_count=count, grad_checkpointing=checkpointing,
                         offloaded_activation_bytes=offloaded, internode_gb_per_s=internode_gb_per_s,
                         hidden_size=self.loaded.model.hidden_size)
        predicted_total = step.total_s
        real = self.workload.real_fraction(micro_batch)
        basis = "predicted"
        calibration = self.calibration
        if calibration is not None:
            if calibration.is_measured(gpu.slug, count, micro_batch, checkpointing):
                basis = "measured"
                # the measured speed, the parts in the model's proportions
                step = scale_step(step, step.tokens_per_step * real / calibration.tokens_per_second / step.total_s)
            else:
                basis = "calibrated"
                step = calibration.corrected(step)
        length = self.workload.length(self.global_batch(), spec.max_steps)
        steps = length.steps
        train_s = train_seconds(self.workload, step, micro_batch * count, grad_accum, steps)
        tokens = self.workload.processed_tokens * length.passes
        tokens_per_second = tokens / train_s if train_s > 0 else 0.0
        eval_s = self._eval_seconds(spec, pair, gpu, count, micro_batch, sequence, steps)
        notes = []
        if checkpointing and not self.spec.fixed("grad_checkpointing"):
            notes.append("gradient checkpointing needed to fit")
        if basis != "predicted":
            eval_s *= step.total_s / predicted_total
        hours = (train_s + eval_s) / SECONDS_PER_HOUR
        return Configuration(gpu, count, spec, micro_batch, grad_accum, checkpointing, memory, step,
                             tokens_per_second, hours, eval_s / SECONDS_PER_HOUR, changes, notes, basis)

    def _profiles(self, settings: TraceSettings, micro_batch: int, seq: int, *, exact: bool = False) -> ProfilePair:
        """The step profiles of these settings, looked up once in the plan (every GPU and count asks again)."""
        key = (settings, micro_batch, seq, exact)
        if key not in self._pairs:
            self._pairs[key] = get_profiles(self.loaded.model.data, settings, micro_batch, seq, exact=exact)
        return self._pairs[key]

    def _eval_seconds(self, spec: RunSpec, pair: ProfilePair, gpu: Gpu, count: int, micro_batch: int,
                      sequence: int, steps: int) -> float:
        """Every evaluation of the run: the held-out examples' forward passes, split over the GPUs."""
        workload = self.workload
        evaluations_run = evaluations(workload, steps, self.global_batch(), spec.eval.every_steps)
        if not evaluations_run:
            return 0.0
        sequences = workload.eval_examples
        if workload.packed:
            sequences = math.ceil(workload.eval_examples * workload.mean_tokens / workload.seq_len)
        batches = math.ceil(math.ceil(sequences / count) / micro_batch)
        forward = forward_seconds(spec, pair, gpu, self.catalog.throughput, micro_batch=micro_batch, seq=sequence)
        return evaluations_run * batches * forward

    def run_shape(self, config: Configuration) -> RunShape:
        constants = self.catalog.throughput
        spec = config.spec
        sharded = spec.gpus.strategy != "ddp"
        memory = config.memory.breakdown_gib
        state_gib = (memory["trainable_weights"] + memory["optimizer"]) * (config.gpu_count if sharded else 1)
        checkpoint_bytes = state_gib * BYTES_PER_GIB + config.memory.managed_gib * BYTES_PER_GIB
        write_hours = checkpoint_bytes / (constants.get("checkpoint_write_mib_per_s") * MIB) / SECONDS_PER_HOUR
        params = self.loaded.model.params or 0
        weights_bytes = params * 2
        load_hours = weights_bytes / (constants.get("weights_read_mib_per_s") * MIB) / SECONDS_PER_HOUR
        boot_hours = constants.get("boot_minutes") / 60
        storage_gb = (self.workload.dataset_bytes + checkpoint_bytes * (spec.checkpoint.keep + 1)) / 1e9
        interval = None
        if spec.checkpoint.every_minutes:
            interval = spec.checkpoint.every_minutes / 60
        elif spec.checkpoint.every_steps:
            interval = spec.checkpoint.every_steps * config.step.total_s / SECONDS_PER_HOUR
        return RunShape(config.gpu_count, config.hours, load_hours, write_hours,
                        boot_hours + load_hours + write_hours, boot_hours, storage_gb, interval)

    def options(self, gpus: list[Gpu], *, interruptions_override: float | None = None, today: date,
                progress: Callable[[str], None] | None = None) -> Iterator[Option]:
        spec = self.spec
        counts = [spec.gpus.count] if spec.fixed("gpus.count") else list(GPU_COUNTS + MULTI_NODE_COUNTS)
        offers = [o for o in self.catalog.offers if not spec.pricing.providers or o.provider in spec.pricing.providers]
        default_rate = self.catalog.throughput.get("spot_interruptions_per_hour")
        for gpu in gpus:
            if progress is not None:
                progress(gpu.slug)
            for count, internode in self._shapes(gpu, counts, offers):
                configured = self.configure(gpu, count, internode)
                capacity = gpu.usable_memory_gib * (1 - spec.plan.memory_margin)
                if isinstance(configured, str):
                    yield Option(None, gpu.slug, count, None, configured, capacity_gib=capacity,
                                 closest=self.closest.get((gpu.slug, count)))
                    continue
                if internode is not None:
                    configured.notes.append(f"{count // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}, "
                                            f"{internode:g} GB/s between nodes")
                if is_cpu(gpu) and count > 1:
                    configured.notes.append(f"{count} processes share one CPU: their collectives as measured, each "
                                            "one's computation at the rates probed for the whole CPU (too fast)")
                shape = self.run_shape(configured)
                priced = False
                for offer in (o for o in offers if o.gpu == gpu.slug
                              and (internode is None or o.internode_gb_per_s == internode)):
                    for spot in ((False, True) if spec.pricing.spot else (False,)):
                        cost = price_run(shape, offer, spot=spot, default_interruptions_per_hour=default_rate,
                                         today=today, interruptions_override=interruptions_override)
                        if cost is not None:
                            priced = True
                            yield Option(configured, gpu.slug, count, cost, capacity_gib=capacity)
                if not priced and internode is None:
                    yield Option(configured, gpu.slug, count, None, None, capacity_gib=capacity)

    def _shapes(self, gpu: Gpu, counts: list[int], offers: list[Offer]) -> Iterator[tuple[int, float | None]]:
        """(count, inter-node network) pairs to plan: one node as before; several nodes once per distinct network
        among the GPU's offers of whole 8-GPU nodes that publish one."""
        for count in device_counts(gpu, counts, fixed=self.spec.fixed("gpus.count")):
            if count <= GPUS_PER_NODE:
                yield count, None
                continue
            networks = sorted({o.internode_gb_per_s for o in offers if o.gpu == gpu.slug
                               and o.gpu_count == GPUS_PER_NODE and o.internode_gb_per_s is not None})
            for network in networks:
                yield count, network


def _breakdown(memory: MemoryEstimate | None) -> dict[str, float] | None:
    """Device memory by category, GiB: the estimate's breakdown at its peak phase and what the allocator reserves
    and the device adds above it."""
    if memory is None:
        return None
    parts = {name: round(value, 3) for name, value in memory.breakdown_gib.items() if value}
    allocated = sum(memory.breakdown_gib.values())
    parts["allocator reserve"] = round(max(0.0, memory.device_total_gib - allocated), 3)
    return parts


def gpus_text(option: dict[str, Any]) -> str:
    """An option's GPUs as the plan's table and report show them: `2×h100-sxm fsdp` (the strategy above one GPU)."""
    strategy = f" {option['strategy']}" if option["gpu_count"] > 1 and option["strategy"] else ""
    return f"{option['gpu_count']}×{option['gpu']}{strategy}"


def launch_of(count: int, spec: RunSpec | None) -> dict[str, Any]:
    """How an option of `count` GPUs is run: the engine, the launcher, the nodes it spans. What tunecast estimates
    but its own loop does not run (DeepSpeed, QLoRA sharded: config/checks.py `distributed_problems`) is launched by
    the tool that runs it."""
    nodes = max(1, -(-count // GPUS_PER_NODE))
    if spec is None:  # no configuration fits
        return {"engine": None, "launcher": None, "nodes": nodes}
    strategy = spec.gpus.strategy
    if count == 1:
        engine, launcher = "one process", "tunecast train"
    else:
        from tunecast.config.checks import distributed_problems

        engine = STRATEGY_ENGINES[strategy]
        refused = [p for p in distributed_problems(spec, count) if p.field == "gpus.strategy"]
        if refused or spec.runner != "tunecast":
            launcher = (f"accelerate launch, {count} processes{f' on {nodes} nodes' if nodes > 1 else ''}, with the "
                        "tool that runs it (tunecast train does not)")
        elif nodes == 1:
            launcher = f"tunecast train --gpus {count} (or torchrun / accelerate launch)"
        else:
            launcher = f"tunecast export skypilot --gpus {count} --nodes {nodes} (torchrun on each node)"
    return {"engine": engine, "launcher": launcher, "nodes": nodes}


def device_counts(gpu: Gpu, counts: list[int], *, fixed: bool = False) -> list[int]:
    """A measured device the catalog does not list (a CPU, an unlisted GPU) is planned at the count its machine
    has, or at the count the run fixes (`--gpus N`) where `tunecast probe --collectives` measured that many (on a
    CPU: N processes sharing it); a catalog GPU at every count."""
    if from_probe(gpu):
        if fixed and counts[0] in gpu.measured.collective_counts():
            return counts
        return [gpu.measured.device.count]
    return counts


def train_seconds(workload: Workload, step: StepTime, round_sequences: int, grad_accum: int, steps: int) -> float:
    """Seconds of the run's `steps` optimizer steps, an epoch's last step as short as the data leaves it.

    An epoch of S sequences (packed ones: a fraction, the last sequence short) at G = `round_sequences` ×
    `grad_accum` a step is ⌊S/G⌋ full steps and, when G does not divide S, one more with what is left: fewer
    micro-batch rounds, the last of them partly filled. Such a step pays the optimizer, the communication and
    each round's dispatch in full (a round costs the host the same operations whatever it holds) and the
    computation in proportion to the sequences it holds. A small dataset's epochs are few steps each (the
    demo's packed epoch: one full step and one of a tenth), and a plan that counted every step full
    overestimated the run's time and its speed alike. Steps past the last whole epoch are full ones."""
    full_s = step.total_s
    batch = round_sequences * grad_accum
    sequences = workload.sequences()
    whole_steps = math.floor(sequences / batch + 1e-9)
    left = sequences - whole_steps * batch
    if left <= 1e-9 * batch:
        return steps * full_s
    rounds = math.ceil(left / round_sequences - 1e-9)
    filled = rounds - 1 + (left - (rounds - 1) * round_sequences) / round_sequences  # in full rounds' work
    per_round_fixed = step.dispatch_s / grad_accum
    per_round_work = (step.compute_s + step.dequantize_s + step.offload_s) / grad_accum
    last_s = step.optimizer_s + step.communication_s + rounds * per_round_fixed + filled * per_round_work
    per_epoch = whole_steps + 1
    epochs, extra = divmod(steps, per_epoch)
    return epochs * (whole_steps * full_s + last_s) + extra * full_s


def scale_step(step: StepTime, factor: float) -> StepTime:
    return replace(step, compute_s=step.compute_s * factor, dequantize_s=step.dequantize_s * factor,
                   dispatch_s=step.dispatch_s * factor, optimizer_s=step.optimizer_s * factor,
                   communication_s=step.communication_s * factor, offload_s=step.offload_s * factor)


def _applicable(name: str, spec: RunSpec, count: int) -> bool:
    if name == "fsdp":
        return count > 1 and spec.gpus.strategy == "ddp"
    if name in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw"):
        return spec.optimizer in TORCH_ADAMW
    if name == "lora":
        return spec.method == "full"
    if name == "qlora":  # on several GPUs QLoRA trains under DDP only (train/session.py): no sharding tried with it
        return spec.method in ("lora", "full") and (count == 1 or (spec.gpus.strategy == "ddp"
                                                                   and "fsdp" not in spec.plan.allow))
    if name == "offload":
        return spec.gpus.strategy != "ddp" or "fsdp" in spec.plan.allow
    if name in ("optimizer_in_backward", "chunked_loss"):  # one process only (train/session.py)
        return count == 1 and (name == "chunked_loss" or not spec.optimizer_in_backward)
    return True


def time_classes(options: list[Option]) -> dict[int, int]:
    """The priced options' classes of equal time, by `id` of the option: 0 for the fastest and every option within
    SAME_TIME_WITHIN of it, 1 for the fastest of the rest and those within that of it, and so on."""
    priced = sorted((o for o in options if o.cost is not None), key=lambda o: o.cost.hours)  # type: ignore[union-attr]
    classes: dict[int, int] = {}
    number, start = -1, 0.0
    for option in priced:
        assert option.cost is not None
        if number < 0 or option.cost.hours > start * (1 + SAME_TIME_WITHIN):
            number, start = number + 1, option.cost.hours
        classes[id(option)] = number
    return classes


def mark_pareto(options: list[Option]) -> None:
    """Mark the priced options nothing beats on both total cost and hours, hours within SAME_TIME_WITHIN counting as
    equal: of each class of equal time (`time_classes`), the cheapest, when it costs less than the cheapest of every
    faster class."""
    classes = time_classes(options)
    cheapest: dict[int, Option] = {}
    by_cost = sorted((o for o in options if o.cost is not None),
                     key=lambda o: (o.cost.total_usd, o.cost.hours))  # type: ignore[union-attr]
    for option in by_cost:
        cheapest.setdefault(classes[id(option)], option)
    lowest = float("inf")
    for number in sorted(cheapest):
        option = cheapest[number]
        assert option.cost is not None
        if option.cost.total_usd < lowest:
            option.pareto = True
            lowest = option.cost.total_usd


def rank(options: list[Option], *, optimize: str) -> list[Option]:
    """Priced options best first, then unpriced ones that fit, then those that do not. By cost: total cost, then
    hours. By time: the class of equal time (`time_classes`: hours within SAME_TIME_WITHIN are as fast), then total
    cost, then hours."""
    classes = time_classes(options)

    def key(option: Option) -> tuple[float, ...]:
        if option.cost is not None:
            if optimize == "cost":
                return (0, option.cost.total_usd, option.cost.hours)
            return (0, classes[id(option)], option.cost.total_usd, option.cost.hours)
        if option.configuration is not None:
            return (1, option.configuration.hours)
        return (2,)

    return sorted(options, key=key)
