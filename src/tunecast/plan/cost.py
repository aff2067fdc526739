"""What a run costs on one offer: compute as the offer bills it, storage for the run's duration, and on spot
capacity the expected cost of preemptions with the checkpoint interval that minimises it.

* Billing: the run's seconds (plus boot when the offer bills it) rounded up to the billing increment, at least
  the minimum charge. An offer's price is per GPU-hour; N GPUs cost N × that price. An offer for a node of
  G > 1 GPUs is rented whole: N GPUs cost ⌈N / G⌉ × G GPUs, and no more than G GPUs run on one node.
* Storage: the dataset and the kept checkpoints on the offer's persistent volume for the run's duration, at the
  offer's published volume price, else at the default the catalog assumed for its kind of provider (named in the
  option's notes; see `tunecast.catalog.offers`). Storage is part of every whole-run cost, never a silent $0.
* Spot: preemptions arrive at rate λ (the offer's published rate, else the catalog's default). Each loses
  the work since the last checkpoint (half an interval on average) and a restart (boot, loading the weights
  and the checkpoint). Checkpointing every τ hours costs C (one write) each time. The expected cost is
  minimised near τ = √(2·C/λ) (Young, 1974; Daly, 2006), which is the interval used unless the run fixes one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date
from typing import Any

from tunecast.catalog.offers import Offer
from tunecast.train.policy import young_daly_interval
from tunecast.units import HOURS_PER_MONTH, SECONDS_PER_HOUR

ON_DEMAND_CHECKPOINT_HOURS = 0.5  # automatic interval on on-demand capacity


@dataclass(frozen=True)
class RunShape:
    """What the run needs, independent of who rents the GPUs."""

    gpu_count: int
    train_hours: float  # computing, all GPUs together
    startup_hours: float  # loading weights (boot is the offer's)
    checkpoint_write_hours: float  # one checkpoint write
    restart_hours: float  # after a preemption: boot, weights, checkpoint
    boot_hours: float
    storage_gb: float
    fixed_interval_hours: float | None  # the run's own checkpoint interval, when it sets one


def billed_hours(hours: float, offer: Offer) -> float:
    seconds = hours * SECONDS_PER_HOUR
    increments = math.ceil(seconds / offer.billing_increment_s - 1e-9)
    return max(increments * offer.billing_increment_s, offer.minimum_charge_s) / SECONDS_PER_HOUR


GPUS_PER_NODE = 8  # a multi-GPU box of single-GPU offers holds at most this many


def billed_gpus(gpu_count: int, offer: Offer) -> int | None:
    """GPUs paid for: whole nodes of a multi-GPU offer; None when the run does not fit the offer's nodes (more
    GPUs than a node, on an offer whose inter-node network is not published)."""
    if gpu_count > max(offer.gpu_count, GPUS_PER_NODE if offer.gpu_count == 1 else 0):
        if offer.internode_gb_per_s is None or gpu_count % offer.gpu_count:
            return None
        return gpu_count
    if offer.gpu_count == 1:
        return gpu_count
    return offer.gpu_count


@dataclass(frozen=True)
class OfferCost:
    provider: str
    spot: bool
    usd_per_hour_total: float
    hours: float  # wall-clock hours of the run on this offer (preemptions included on spot)
    compute_usd: float
    storage_usd: float
    preemption_usd: float
    checkpoint_interval_hours: float
    expected_preemptions: float
    notes: tuple[str, ...]
    price_as_of: date | None = None  # the date of the offer's price
    price_age_days: int | None = None  # how old that price is on the day of the plan
    price_stale: bool = False  # older than the catalog's STALE_AFTER_DAYS for its kind (`tunecast offers` marks `*`)
    price_source: str = ""  # where the price comes from (the offer's `source`: a URL, or a refresh's source and URL)
    price_kind: str = "list"  # `list` or `marketplace`: what its staleness is judged by
    available: int | None = None  # machines a live marketplace listed when its snapshot was taken

    @property
    def total_usd(self) -> float:
        return self.compute_usd + self.storage_usd + self.preemption_usd

    def as_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "spot": self.spot, "usd_per_hour_total": round(self.usd_per_hour_total, 4),
                "hours": round(self.hours, 3), "compute_usd": round(self.compute_usd, 2),
                # a run's storage often costs less than a cent: to the cent it would read as a false $0.00
                "storage_usd": round(self.storage_usd, 4), "preemption_usd": round(self.preemption_usd, 2),
                "total_usd": round(self.total_usd, 2),
                "checkpoint_interval_hours": round(self.checkpoint_interval_hours, 3),
                "expected_preemptions": round(self.expected_preemptions, 2),
                "price_as_of": self.price_as_of.isoformat() if self.price_as_of else None,
                "price_age_days": self.price_age_days, "price_stale": self.price_stale,
                "price_source": self.price_source, "price_kind": self.price_kind, "available": self.available}


def price_run(shape: RunShape, offer: Offer, *, spot: bool, default_interruptions_per_hour: float,
              today: date, interruptions_override: float | None = None) -> OfferCost | None:
    """The whole run on `offer` (on-demand, or spot when `spot`); None when the offer cannot host it."""
    gpus = billed_gpus(shape.gpu_count, offer)
    price = offer.spot_usd_per_hour if spot else offer.usd_per_hour
    if gpus is None or price is None:
        return None
    rate = gpus * price
    notes: list[str] = []
    if offer.gpu_count > 1 and gpus > shape.gpu_count:
        notes.append(f"the offer rents whole nodes of {offer.gpu_count} GPUs")
    stale = offer.is_stale(today)
    if stale:
        notes.append(f"price from {offer.as_of.isoformat()}, {offer.age_days(today)} days old (a {offer.price_kind} "
                     f"price older than {offer.stale_after_days} day{'s' if offer.stale_after_days > 1 else ''}: "
                     "`tunecast offers --refresh` fetches today's)")
    if offer.price_disagreement:
        notes.append(f"price sources disagree: {offer.price_disagreement}")
    if offer.available is not None:
        notes.append(f"{offer.available} machine(s) of this kind listed on {offer.as_of.isoformat()}")
    base_hours = shape.startup_hours + shape.train_hours
    preemption_hours = 0.0
    expected = 0.0
    if spot:
        published = offer.spot_interruptions_per_hour
        # an override of 0 (no preemptions) is a rate like any other
        lam = next(rate for rate in (interruptions_override, published, default_interruptions_per_hour)
                   if rate is not None)
        if interruptions_override is None and published is None:
            notes.append(f"no published preemption rate: {lam:g} per hour assumed")
        nodes = gpus // offer.gpu_count if offer.gpu_count > 1 else 1
        if nodes > 1:  # the rate is per instance: a preemption of any node stops every node
            lam *= nodes
            notes.append(f"{nodes} nodes: preempted {nodes}× as often as one")
        interval = shape.fixed_interval_hours or (young_daly_interval(shape.checkpoint_write_hours, lam) if lam
                                                  else ON_DEMAND_CHECKPOINT_HOURS)
        writes = shape.train_hours / interval * shape.checkpoint_write_hours
        # Expected preemptions over the run, each losing half an interval of work and a restart.
        expected = lam * (base_hours + writes)
        preemption_hours = expected * (interval / 2 + shape.restart_hours)
    else:
        interval = shape.fixed_interval_hours or ON_DEMAND_CHECKPOINT_HOURS
        writes = shape.train_hours / interval * shape.checkpoint_write_hours
    run_hours = base_hours + writes
    boot = shape.boot_hours if offer.boot_billed else 0.0
    compute_usd = billed_hours(run_hours + boot, offer) * rate
    preemption_usd = preemption_hours * rate
    wall_hours = run_hours + shape.boot_hours + preemption_hours
    storage_usd = 0.0
    volume_price = offer.storage_usd_per_gb_month
    if volume_price is not None:
        storage_usd = shape.storage_gb * volume_price * wall_hours / HOURS_PER_MONTH
    note = _volume_note(offer)
    if note:
        notes.append(note)
    return OfferCost(offer.provider, spot, rate, wall_hours, compute_usd, storage_usd, preemption_usd, interval,
                     expected, tuple(notes), offer.as_of, offer.age_days(today), stale, offer.source,
                     offer.price_kind, offer.available)


def _volume_note(offer: Offer) -> str | None:
    """Why storage costs what it does, where that is not simply the offer's published price."""
    default = offer.volume_default
    if default is not None:
        usd = default.volume_usd_per_gb_month
        price = f"${usd:.2f}" if round(usd, 2) == usd else f"${usd:g}"  # cents, or every digit the price has
        price += f"/GB-month of {default.kind} volumes"
        if offer.provider not in default.providers:
            return (f"storage at the assumed {price}, the dearest kind, as the catalog does not say what kind of "
                    f"provider {offer.provider} is (no published price for this offer)")
        return f"storage at the assumed {price} (no published price for this offer)"
    if offer.volume_usd_per_gb_month is None:
        return "no volume price, published or assumed: storage not counted"
    if offer.volume_usd_per_gb_month == 0:
        return "storage included in the offer's price (published volume price $0/GB-month)"
    return None
