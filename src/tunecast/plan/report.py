"""The whole plan for a run: workload, options ranked, the Pareto front, and recommendations in words."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

from tunecast.atomic import write_text_atomic
from tunecast.catalog.devices import from_probe
from tunecast.catalog.offers import STALE_AFTER_DAYS
from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec
from tunecast.config.spec import RunSpec
from tunecast.errors import Problem, TunecastError
from tunecast.estimate import replays
from tunecast.estimate.memory import unquantized_experts_note
from tunecast.estimate.profiles import PROFILE_FORMAT
from tunecast.paths import cache_dir
from tunecast.plan.calibration import Calibration, calibrated_device, check_against
from tunecast.plan.planner import Estimates, Option, Planner, mark_pareto, rank
from tunecast.plan.workload import SIZE_HINT, workload_for
from tunecast.version import SCHEMA_VERSION, __version__

PLAN_FORMAT = 11


@dataclass(frozen=True)
class PlanRequest:
    """`tunecast plan`'s flags beside the run. Ranking, budget and deadline left None are the run's own
    (`plan.optimize`, `plan.budget_usd`, `plan.deadline_hours`); a value given here wins, as a flag does."""

    optimize: str | None = None  # "cost" or "time"
    budget_usd: float | None = None
    deadline_hours: float | None = None
    interruptions_per_hour: float | None = None
    calibration: dict[str, Any] | None = None  # a `tunecast calibrate` document
    available_only: bool = False  # rank only offers a live marketplace's snapshot listed as rentable (`--available`)

    def over(self, spec: RunSpec) -> PlanRequest:
        """This request with what it leaves open taken from the run's `plan:` section."""
        return replace(self, optimize=self.optimize if self.optimize is not None else spec.plan.optimize,
                       budget_usd=self.budget_usd if self.budget_usd is not None else spec.plan.budget_usd,
                       deadline_hours=(self.deadline_hours if self.deadline_hours is not None
                                       else spec.plan.deadline_hours))


def _fingerprint(loaded: LoadedSpec, catalog: Catalog, request: PlanRequest, today: date) -> str:
    path = loaded.spec.dataset.path
    stamp = None
    if path and Path(path).exists():
        stat = Path(path).stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
    catalog_rows = ([o.document() for o in catalog.offers] + [g.document() for g in catalog.gpus]
                    + [r.document() for r in catalog.throughput.rows] + [r.document() for r in catalog.overheads])
    # what the user set as well as every value: a value set equal to its default fixes it (gpus.count: 1 plans one
    # GPU, the default plans every count)
    payload = json.dumps({"spec": loaded.spec.model_dump(mode="json"),
                          "set": loaded.spec.model_dump(mode="json", exclude_unset=True), "model": loaded.model.data,
                          "request": request.__dict__, "dataset": stamp, "catalog": catalog_rows,
                          "today": today.isoformat(), "version": __version__,
                          "format": [PLAN_FORMAT, PROFILE_FORMAT]},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def make_plan(loaded: LoadedSpec, catalog: Catalog, request: PlanRequest, *, today: date,
              progress: Callable[[str], None] | None = None, estimates: Estimates | None = None,
              cache: bool = True, check: Callable[[], None] | None = None) -> dict[str, Any]:
    """The plan document (`tunecast plan --json`), from the cache when nothing it depends on changed (`cache`: look
    there, and keep the plan there; a server keeps its answers itself). `estimates`: memory estimates of this model
    (its config as `loaded` holds it) and catalog that earlier plans made, used and added to (a server keeps them
    across the plans of a model; the CLI plans once). `check` is called before every estimate (a server's job
    stops there when its client left)."""
    request = request.over(loaded.spec)
    _check(request)
    if request.available_only:  # offers whose snapshot listed machines to rent; the others are not ranked
        catalog = replace(catalog, offers=tuple(o for o in catalog.offers if o.available))
    cache = cache and os.environ.get("TUNECAST_NO_CACHE") != "1"
    path = cache_dir() / "plans" / f"{_fingerprint(loaded, catalog, request, today)}.json" if cache else None
    if path is not None and path.is_file():
        cached: dict[str, Any] = json.loads(path.read_text())
        return cached
    with replays.deferred():  # the replays of the plan's estimates, written once
        document = _compute(loaded, catalog, request, today=today, progress=progress,
                            estimates={} if estimates is None else estimates, check=check)
    if path is not None:
        write_text_atomic(path, json.dumps(document))
    return document


def _check(request: PlanRequest) -> None:
    if request.optimize not in ("cost", "time"):
        raise TunecastError(f"--optimize {request.optimize!r} is not cost or time", field="--optimize",
                            hint="use --optimize cost (the default) or --optimize time")
    for flag, value, floor in (("--budget", request.budget_usd, "a positive number of USD"),
                               ("--deadline", request.deadline_hours, "a positive number of hours")):
        if value is not None and not value > 0:
            raise TunecastError(f"{flag} {value:g} leaves no run", field=flag, hint=f"give {floor}, or leave it out")
    if request.interruptions_per_hour is not None and not request.interruptions_per_hour >= 0:
        raise TunecastError(f"--preemptions-per-hour {request.interruptions_per_hour:g} is negative",
                            field="--preemptions-per-hour", hint="give a rate of 0 or more per hour")


def _compute(loaded: LoadedSpec, catalog: Catalog, request: PlanRequest, *, today: date,
             progress: Callable[[str], None] | None, estimates: Estimates,
             check: Callable[[], None] | None = None) -> dict[str, Any]:
    workload = workload_for(loaded, catalog)
    warnings: list[Problem] = []
    if workload.unsized is not None:
        warnings.append(Problem("dataset", workload.unsized, "hours and costs are for those tokens, not the whole run: "
                                + SIZE_HINT, severity="warning"))
    experts = unquantized_experts_note(loaded.spec, loaded.model.data)
    if experts is not None:  # most of a mixture of experts' weights: every option is sized with them so
        warnings.append(Problem("method", experts, "the options are sized with the experts unquantized; see "
                                "docs/memory.md, QLoRA and mixtures of experts", severity="warning"))
    calibration = None
    gpus = [loaded.gpu] if loaded.gpu is not None else sorted((g for g in catalog.gpus if not from_probe(g)),
                                                              key=lambda g: g.slug)
    if request.calibration is not None:
        warnings += check_against(request.calibration, loaded.spec, loaded.model.data)
        calibration = Calibration.from_document(request.calibration)
        calibrated = calibrated_device(request.calibration, catalog)
        # the calibrated device is always among the options, with its measured figures
        gpus = [g for g in gpus if g.slug != calibrated.slug] + [calibrated]
    planner = Planner(loaded, catalog, workload, calibration, estimates, check=check)
    options = list(planner.options(gpus, interruptions_override=request.interruptions_per_hour, today=today,
                                   progress=progress))
    kept: list[Option] = []
    dropped: list[Option] = []
    for option in options:
        cost = option.cost
        if cost is not None and ((request.budget_usd is not None and cost.total_usd > request.budget_usd)
                                 or (request.deadline_hours is not None and cost.hours > request.deadline_hours)):
            dropped.append(option)
            continue
        kept.append(option)
    mark_pareto(kept)
    ranked = rank(kept, optimize=request.optimize or "cost")
    return {
        "schema_version": SCHEMA_VERSION,
        "spec": loaded.spec.model_dump(mode="json"),
        "model": {"name": loaded.model.name, "params": loaded.model.params},
        "dataset": workload.as_dict(),
        "global_batch": planner.global_batch(),
        "optimize": request.optimize,
        "budget_usd": request.budget_usd,
        "deadline_hours": request.deadline_hours,
        "filtered_out": len(dropped),
        "price_stale_after_days": STALE_AFTER_DAYS,  # an option's `price_stale`: its price older than this
        "calibration": None if calibration is None else {
            "device": calibration.device_slug, "measured_tokens_per_second": calibration.tokens_per_second,
            "passes_factor": calibration.passes_factor, "optimizer_factor": calibration.optimizer_factor,
            "memory_factor": calibration.memory_factor},
        "warnings": [w.as_dict() for w in warnings],
        "recommendations": recommendations(ranked, dropped, optimize=request.optimize or "cost"),
        "options": [option.as_dict() for option in ranked],
    }


def check_failure(document: dict[str, Any]) -> str | None:
    """Why a plan fails its pre-flight gate (`tunecast plan --check`), or None when it passes: at least one option
    fits and, with a budget or a deadline, is known to meet them (a price for the budget, hours for the deadline)."""
    budget, deadline = document["budget_usd"], document["deadline_hours"]
    passing = [o for o in document["options"] if o["fits"]
               and (budget is None or (o["total_usd"] is not None and o["total_usd"] <= budget))
               and (deadline is None or (o["hours"] is not None and o["hours"] <= deadline))]
    if passing:
        return None
    if not any(o["fits"] for o in document["options"]) and not document["filtered_out"]:
        unfit = next((o for o in document["options"] if o["notes"]), None)
        reason = "" if unfit is None else \
            f" ({unfit['gpu_count']}×{unfit['gpu']}: {unfit['notes'][0].removeprefix('does not fit: ')})"
        return f"no option fits{reason}"
    limits = " and ".join(part for part in (f"a budget of ${budget:,.2f}" if budget is not None else "",
                                            f"a deadline of {deadline:g} h" if deadline is not None else "") if part)
    return f"no option that fits meets {limits or 'the limits'}"


def recommendations(ranked: list[Option], dropped: list[Option], *, optimize: str = "cost") -> list[str]:
    """Plain-word advice: the cheapest and fastest runs, spot against on-demand, small micro-batches, and a price
    that is old enough to have moved."""
    priced = [o for o in ranked if o.cost is not None]
    if not priced and dropped:
        cheapest = min(dropped, key=lambda o: o.cost.total_usd)  # type: ignore[union-attr]
        return [f"No run meets the budget and deadline. Cheapest: {_describe(cheapest)}. "
                f"Fastest: {_describe(_fastest(dropped))}."]
    if not priced:
        fitting = [o for o in ranked if o.fits]
        if fitting:
            return ["No offer in the catalog prices the GPUs this run fits on; add your own prices with a "
                    "catalog directory (--catalog DIR, offers.csv)."]
        return ["Nothing fits: see each option's reason; allow memory-saving changes with plan.allow "
                "(for example --set plan.allow=qlora,adamw-8bit,fsdp)."]
    advice = []
    cheapest = min(priced, key=lambda o: (o.cost.total_usd, o.cost.hours))  # type: ignore[union-attr]
    fastest = _fastest(priced)
    named = [cheapest, fastest] if optimize == "cost" else [fastest, cheapest]
    if fastest is cheapest:
        named = [cheapest]
    for option in named:
        if option is cheapest:
            advice.append("Cheapest: " + _describe(cheapest) + ".")
        else:
            extra = fastest.cost.total_usd - cheapest.cost.total_usd  # type: ignore[union-attr]
            saved = cheapest.cost.hours - fastest.cost.hours  # type: ignore[union-attr]
            advice.append(f"Fastest: {_describe(fastest)} — {_hours(saved)} sooner for ${extra:,.2f} more.")
    stale = [f"{o.gpu_count} × {o.gpu} on {o.cost.provider} is from {o.cost.price_as_of}, {o.cost.price_age_days} "
             "days ago" for o in named if o.cost is not None and o.cost.price_stale]
    if stale:
        advice.append(f"Old price{'s' if len(stale) > 1 else ''}: {'; '.join(stale)}. `tunecast plan --refresh` "
                      "fetches today's, or check the provider's page before you rent (`tunecast offers` marks with * "
                      f"a marketplace's price older than {STALE_AFTER_DAYS['marketplace']} day and a list price older "
                      f"than {STALE_AFTER_DAYS['list']} days).")
    if cheapest.cost is not None and cheapest.cost.spot:
        advice.append(f"The cheapest run is on spot capacity: it expects {cheapest.cost.expected_preemptions:.1f} "
                      f"preemptions and checkpoints every {cheapest.cost.checkpoint_interval_hours * 60:.0f} min; "
                      "it resumes from the last checkpoint after each.")
    configuration = cheapest.configuration
    limited = configuration.memory_bound_micro_batch if configuration is not None else None
    if limited is not None:
        larger = [o for o in priced if o.configuration is not None and o.configuration.memory_bound_micro_batch is None
                  and o.configuration.micro_batch > limited
                  and o.cost is not None and o.cost.total_usd <= cheapest.cost.total_usd * 1.25]  # type: ignore[union-attr]
        if larger:
            best = min(larger, key=lambda o: o.cost.total_usd)  # type: ignore[union-attr]
            advice.append(f"The cheapest run fits only a micro-batch of {limited}; "
                          f"{_describe(best)} runs micro-batch {best.configuration.micro_batch} "  # type: ignore[union-attr]
                          "for at most 25% more, with steadier steps.")
        else:
            advice.append(f"The cheapest run fits only a micro-batch of {limited}: steps are slower "
                          "and noisier; a card with more memory may be worth its price.")
    return advice


def _fastest(priced: list[Option]) -> Option:
    """The fastest run worth naming: the first of the ranking by time, which is the cheapest of the runs within
    SAME_TIME_WITHIN of the shortest (four times the GPUs for the same hours, start-up bound, is no faster run)."""
    return rank(priced, optimize="time")[0]


def _hours(hours: float) -> str:
    return f"{hours:.1f} h" if hours >= 0.95 else f"{hours * 60:.0f} min"


def _describe(option: Option) -> str:
    assert option.cost is not None
    capacity = "spot" if option.cost.spot else "on-demand"
    return (f"{option.gpu_count} × {option.gpu} on {option.cost.provider} ({capacity}), "
            f"${option.cost.total_usd:,.2f} in {_hours(option.cost.hours)}")
