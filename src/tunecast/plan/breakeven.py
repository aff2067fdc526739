"""Rent versus buy: after how many hours (and months) owning a GPU costs less than renting one.

Owning costs the purchase price less what the card sells for later, plus electricity while it runs;
renting costs the hourly price. Break-even hours = (purchase − resale) ÷ (rent per hour − power per hour).
In units of work, an owned card and a rented one are compared on the same run: each run costs its hours
on each card, so a slower card owned is weighed against a faster one rented.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import TYPE_CHECKING, Any

from tunecast.errors import TunecastError

if TYPE_CHECKING:
    from tunecast.catalog.gpus import Gpu
    from tunecast.catalog.store import Catalog
    from tunecast.config.load import LoadedSpec, Override


@dataclass(frozen=True)
class BreakEven:
    purchase_usd: float
    resale_usd: float
    rent_usd_per_hour: float
    power_usd_per_hour: float
    hours_per_month: float
    breakeven_hours: float | None  # None: renting is never dearer
    breakeven_months: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "purchase_usd": self.purchase_usd, "resale_usd": self.resale_usd,
            "rent_usd_per_hour": self.rent_usd_per_hour, "power_usd_per_hour": round(self.power_usd_per_hour, 4),
            "hours_per_month": self.hours_per_month,
            "breakeven_hours": round(self.breakeven_hours, 1) if self.breakeven_hours is not None else None,
            "breakeven_months": round(self.breakeven_months, 1) if self.breakeven_months is not None else None,
        }


def power_usd_per_hour(power_w: float | None, usd_per_kwh: float | None) -> float:
    if power_w is None and usd_per_kwh is None:
        return 0.0
    if power_w is None or usd_per_kwh is None:
        raise TunecastError("power cost needs both --power-w and --usd-per-kwh", field="--power-w",
                            hint="give both, for example --power-w 450 --usd-per-kwh 0.15")
    return power_w / 1000 * usd_per_kwh


def break_even(*, purchase_usd: float, rent_usd_per_hour: float, hours_per_month: float,
               power_w: float | None = None, usd_per_kwh: float | None = None, resale_usd: float = 0.0) -> BreakEven:
    for name, value in (("--purchase-usd", purchase_usd), ("--rent-usd-per-hour", rent_usd_per_hour),
                        ("--hours-per-month", hours_per_month)):
        if value <= 0:
            raise TunecastError(f"{name} must be positive (got {value})", field=name, hint=f"give {name} a value > 0")
    if not 0 <= resale_usd < purchase_usd:
        raise TunecastError(f"--resale-usd must be at least 0 and below the purchase price (got {resale_usd})",
                            field="--resale-usd", hint="the price the card is expected to sell for later")
    if hours_per_month > 744:
        raise TunecastError(f"--hours-per-month {hours_per_month} is more than a month has", field="--hours-per-month",
                            hint="at most 744 (31 days × 24 h)")
    power = power_usd_per_hour(power_w, usd_per_kwh)
    saving = rent_usd_per_hour - power
    if saving <= 0:
        return BreakEven(purchase_usd, resale_usd, rent_usd_per_hour, power, hours_per_month, None, None)
    hours = (purchase_usd - resale_usd) / saving
    return BreakEven(purchase_usd, resale_usd, rent_usd_per_hour, power, hours_per_month, hours,
                     hours / hours_per_month)


@dataclass(frozen=True)
class WorkBreakEven:
    """Break-even counted in runs of one workload: owned card against a rented one."""

    owned_hours_per_run: float
    rented_hours_per_run: float
    rented_usd_per_run: float
    owned_power_usd_per_run: float
    breakeven_runs: float | None
    breakeven_months: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"owned_hours_per_run": round(self.owned_hours_per_run, 3),
                "rented_hours_per_run": round(self.rented_hours_per_run, 3),
                "rented_usd_per_run": round(self.rented_usd_per_run, 2),
                "owned_power_usd_per_run": round(self.owned_power_usd_per_run, 2),
                "breakeven_runs": round(self.breakeven_runs, 1) if self.breakeven_runs is not None else None,
                "breakeven_months": round(self.breakeven_months, 1) if self.breakeven_months is not None else None}


def work_break_even(*, purchase_usd: float, resale_usd: float, owned_hours_per_run: float,
                    rented_hours_per_run: float, rented_usd_per_run: float, power_usd_per_hour: float,
                    hours_per_month: float) -> WorkBreakEven:
    """Runs after which the owned card has paid for itself; months at `hours_per_month` of owned-card time."""
    power_per_run = owned_hours_per_run * power_usd_per_hour
    saving = rented_usd_per_run - power_per_run
    if saving <= 0:
        return WorkBreakEven(owned_hours_per_run, rented_hours_per_run, rented_usd_per_run, power_per_run, None, None)
    runs = (purchase_usd - resale_usd) / saving
    return WorkBreakEven(owned_hours_per_run, rented_hours_per_run, rented_usd_per_run, power_per_run, runs,
                         runs * owned_hours_per_run / hours_per_month)


@dataclass(frozen=True)
class BreakEvenOptions:
    """What `tunecast breakeven` is asked (its flags, by the same names)."""

    gpu: str | None = None  # the card to buy: its catalog price and power
    purchase_usd: float | None = None
    rent_usd_per_hour: float | None = None
    rent_gpu: str | None = None  # rent this card instead: its cheapest 1-GPU on-demand offer
    hours_per_month: float = 200.0
    power_w: float | None = None
    usd_per_kwh: float | None = None
    resale_usd: float = 0.0


@dataclass(frozen=True)
class BreakEvenAnswer:
    """The break-even of the options, and with a run, counted in runs of it."""

    result: BreakEven
    work: WorkBreakEven | None = None

    def as_dict(self) -> dict[str, Any]:
        document = self.result.as_dict()
        if self.work is not None:
            document["work"] = self.work.as_dict()
        return document


# Loads the run to weigh in units of work with these overrides (the GPU to plan it on, one of it).
RunLoader = Callable[[list["Override"]], "LoadedSpec"]


def answer_break_even(catalog: Catalog, options: BreakEvenOptions, *, run: RunLoader | None = None,
                      today: date | None = None) -> BreakEvenAnswer:
    """Rent versus buy for `options`, the prices the user left out taken from the catalog: the owned card's
    purchase price and power draw, the rented card's cheapest 1-GPU offer. With `run`, also in runs of that
    workload, each card's hours from the planner."""
    owned = catalog.gpus.get(options.gpu, field="--gpu") if options.gpu else None
    purchase_usd = options.purchase_usd
    if purchase_usd is None:
        if owned is None or owned.purchase_usd is None:
            raise TunecastError("no purchase price", field="--purchase-usd",
                                hint="give --purchase-usd, or --gpu a card whose catalog row has a price")
        purchase_usd = owned.purchase_usd
    power_w = options.power_w
    if power_w is None and options.usd_per_kwh is not None and owned is not None:
        power_w = owned.tdp_w
    rented = catalog.gpus.get(options.rent_gpu, field="--rent-gpu") if options.rent_gpu else owned
    rent_usd_per_hour = options.rent_usd_per_hour
    if rent_usd_per_hour is None:
        offers = [o for o in catalog.offers if rented is not None and o.gpu == rented.slug and o.gpu_count == 1]
        if not offers:
            raise TunecastError("no rental price", field="--rent-usd-per-hour",
                                hint="give --rent-usd-per-hour, or --rent-gpu / --gpu a card with a 1-GPU offer")
        rent_usd_per_hour = min(o.usd_per_hour for o in offers)
    result = break_even(purchase_usd=purchase_usd, rent_usd_per_hour=rent_usd_per_hour,
                        hours_per_month=options.hours_per_month, power_w=power_w, usd_per_kwh=options.usd_per_kwh,
                        resale_usd=options.resale_usd)
    work = None
    if run is not None:
        work = _work_break_even(catalog, run, owned, rented, result, today=today)
    return BreakEvenAnswer(result, work)


def _work_break_even(catalog: Catalog, run: RunLoader, owned: Gpu | None, rented: Gpu | None, result: BreakEven, *,
                     today: date | None) -> WorkBreakEven:
    from tunecast.catalog.store import today as catalog_today
    from tunecast.config.load import Override
    from tunecast.plan.report import PlanRequest, make_plan

    if owned is None or rented is None:
        raise TunecastError("--run needs --gpu (the card to buy) and --rent-gpu or --gpu", field="--run",
                            hint="for example --gpu rtx-4090 --rent-gpu h100-sxm --run run.yaml")
    on = today if today is not None else catalog_today()

    def best(slug: str) -> dict[str, Any]:
        # the run on one card, whatever its plan's budget and deadline (they would hide the card's one option)
        loaded = run([Override("gpus.gpu", slug, "--gpu"), Override("gpus.count", 1, "--gpus"),
                      Override("plan.budget_usd", None, "--run"), Override("plan.deadline_hours", None, "--run")])
        plan = make_plan(loaded, catalog, PlanRequest(), today=on)
        fitting = [o for o in plan["options"] if o["fits"]]
        if not fitting:
            raise TunecastError(f"the run does not fit one {slug}", field="--run",
                                hint=plan["options"][0]["notes"][0] if plan["options"] else "see tunecast plan")
        priced = [o for o in fitting if o["total_usd"] is not None and not o["spot"]]
        return min(priced, key=lambda o: o["total_usd"]) if priced else fitting[0]

    mine, theirs = best(owned.slug), best(rented.slug)
    if theirs["total_usd"] is None:
        raise TunecastError(f"no on-demand offer prices {rented.slug}", field="--rent-gpu",
                            hint="choose a card with offers (tunecast offers)")
    return work_break_even(purchase_usd=result.purchase_usd, resale_usd=result.resale_usd,
                           owned_hours_per_run=mine["hours"], rented_hours_per_run=theirs["hours"],
                           rented_usd_per_run=theirs["total_usd"], power_usd_per_hour=result.power_usd_per_hour,
                           hours_per_month=result.hours_per_month)
