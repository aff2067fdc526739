"""Rent versus buy: after how many hours (and months) owning a GPU costs less than renting one.

Owning costs the purchase price less what the card sells for later, plus electricity while it runs;
renting costs the hourly price. Break-even hours = (purchase − resale) ÷ (rent per hour − power per hour).
In units of work, an owned card and a rented one are compared on the same run: each run costs its hours
on each card, so a slower card owned is weighed against a faster one rented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunecast.errors import TunecastError


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
