"""Dated snapshots of refreshed offers in the user's catalog directory, and how plans use them.

`tunecast offers --refresh` (catalog/refresh.py) writes what each source served for each provider as
`prices/<source>/<provider>/<UTC time>.csv` (Offer rows, each with the fetch date as `as_of` and the source's URL
as `source`) beside a `.json` of the same name (when, from where, what was read and skipped). The newest snapshot
of each source and provider counts; the older ones (up to SNAPSHOTS_KEPT) stay for comparison.

How the catalog uses them (`apply_snapshots`, called by store.load_catalog): an offer is a provider's GPU in one
node size, (provider, gpu, gpu_count). Where a snapshot lists such an offer and is at least as recent as the rows
the catalog has for it (bundled or the user's offers.csv), the snapshot's rows replace those rows; an offer an
earlier snapshot of a source listed and its newest does not (`gone` in the snapshot's details) is dropped, older
rows and all; offers no snapshot ever listed keep their rows, with their own dates. A provider both sources serve is
priced from PRIMARY's; where the other source's price for the same offer differs, the offer says both
(`price_disagreement`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunecast.atomic import write_text_atomic
from tunecast.catalog.offers import OFFER_COLUMNS, Offer
from tunecast.catalog.rows import parse_rows, write_rows

PRICES_DIR = "prices"
SNAPSHOTS_KEPT = 7  # per source and provider
STAMP = "%Y%m%dT%H%M%SZ"
SOURCES = ("gpuhunt", "skypilot")
# Prices closer than this (relative) are taken as the same price, not a disagreement between sources.
AGREE_WITHIN = 0.01
# Where both sources serve a provider, the one whose prices the plan uses: gpuhunt wherever it serves one. It queries
# Vast.ai's own offers API live, and rebuilds its other catalogs daily from each provider's own API; SkyPilot's
# catalogs are rebuilt every 7 hours from the same APIs but only for the clouds SkyPilot supports, and its Vast.ai
# file lists no spot prices. docs/catalog.md says which serves which and why.
PRIMARY = {"aws": "gpuhunt", "azure": "gpuhunt", "gcp": "gpuhunt", "oci": "gpuhunt", "lambda": "gpuhunt",
           "runpod": "gpuhunt", "vast": "gpuhunt", "verda": "gpuhunt", "nebius": "gpuhunt", "cloudrift": "gpuhunt",
           "cudo": "skypilot", "fluidstack": "skypilot", "paperspace": "skypilot"}

OfferGroup = tuple[str, str, int]  # (provider, gpu, gpu_count): one offer, whatever its instance types and regions


@dataclass(frozen=True)
class Snapshot:
    source: str
    provider: str
    taken_at: datetime
    path: Path
    offers: tuple[Offer, ...]
    gone: tuple[OfferGroup, ...] = ()  # offers an earlier snapshot of this source listed and this one does not


def group_of(offer: Offer) -> OfferGroup:
    return offer.provider, offer.gpu, offer.gpu_count


def snapshot_dir(catalog_dir: Path, source: str, provider: str) -> Path:
    return catalog_dir / PRICES_DIR / source / provider


def write_snapshot(catalog_dir: Path, source: str, provider: str, offers: Iterable[Offer], taken_at: datetime,
                   details: dict[str, Any]) -> Path:
    """Save one source's offers for one provider as a new snapshot (CSV, and its details beside it as JSON), then
    drop all but the newest SNAPSHOTS_KEPT. Returns the CSV written."""
    directory = snapshot_dir(catalog_dir, source, provider)
    stamp = taken_at.astimezone(timezone.utc).strftime(STAMP)
    path = directory / f"{stamp}.csv"
    write_text_atomic(path, write_rows(list(offers), OFFER_COLUMNS))
    document = {"source": source, "provider": provider,
                "taken_at": taken_at.astimezone(timezone.utc).isoformat(), **details}
    write_text_atomic(path.with_suffix(".json"), json.dumps(document, indent=2) + "\n")
    for old in sorted(directory.glob("*.csv"))[:-SNAPSHOTS_KEPT]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
    return path


def latest_snapshots(catalog_dir: Path | None) -> list[Snapshot]:
    """The newest snapshot of every source and provider under `catalog_dir`; none without one."""
    if catalog_dir is None or not (catalog_dir / PRICES_DIR).is_dir():
        return []
    found = []
    for source in SOURCES:
        for directory in sorted(p for p in (catalog_dir / PRICES_DIR / source).glob("*") if p.is_dir()):
            files = sorted(directory.glob("*.csv"))
            if not files:
                continue
            newest = files[-1]
            taken_at = datetime.strptime(newest.stem, STAMP).replace(tzinfo=timezone.utc)
            offers = parse_rows(newest.read_text(encoding="utf-8"), Offer, str(newest))
            details = newest.with_suffix(".json")
            gone = json.loads(details.read_text(encoding="utf-8")).get("gone", []) if details.is_file() else []
            found.append(Snapshot(source, directory.name, taken_at, newest, tuple(offers),
                                  tuple((directory.name, gpu, int(count)) for gpu, count in gone)))
    return found


def _cheapest(offers: Iterable[Offer]) -> float:
    return min(offer.usd_per_hour for offer in offers)


def refreshed_offers(snapshots: Iterable[Snapshot]) -> dict[OfferGroup, list[Offer]]:
    """The offers the snapshots list, by offer: the primary source's rows where it lists the offer, else the other's;
    where both list it at prices more than AGREE_WITHIN apart, each row kept says both."""
    by_source: dict[str, dict[OfferGroup, list[Offer]]] = {}
    for snapshot in snapshots:
        groups = by_source.setdefault(snapshot.source, {})
        for offer in snapshot.offers:
            groups.setdefault(group_of(offer), []).append(offer)
    chosen: dict[OfferGroup, list[Offer]] = {}
    for group in {group for groups in by_source.values() for group in groups}:
        listed = {source: groups[group] for source, groups in by_source.items() if group in groups}
        primary = PRIMARY.get(group[0], "gpuhunt")
        used = primary if primary in listed else next(iter(sorted(listed)))
        rows = listed[used]
        prices = {source: _cheapest(offers) for source, offers in listed.items()}
        low, high = min(prices.values()), max(prices.values())
        if len(prices) > 1 and high > low * (1 + AGREE_WITHIN):
            said = ", ".join(f"{source} ${price:.2f}" for source, price in sorted(prices.items()))
            disagreement = (f"{said} per GPU-hour on {max(o.as_of for o in rows).isoformat()}; {used}'s is used"
                            + (f" (it serves {group[0]}'s prices most directly)" if used == primary else ""))
            rows = [offer.model_copy(update={"price_disagreement": disagreement}) for offer in rows]
        chosen[group] = rows
    return chosen


def apply_snapshots(offers: dict[tuple[str, str, int, str, str], Offer],
                    snapshots: Iterable[Snapshot]) -> dict[tuple[str, str, int, str, str], Offer]:
    """`offers` (by key) with every offer a snapshot lists at least as recently as these rows replaced by the
    snapshot's rows, and without the offers a source stopped listing (unless another snapshot lists them)."""
    snapshots = list(snapshots)
    existing: dict[OfferGroup, list[Offer]] = {}
    for offer in offers.values():
        existing.setdefault(group_of(offer), []).append(offer)
    merged = dict(offers)
    refreshed = refreshed_offers(snapshots)
    for group in {group for snapshot in snapshots for group in snapshot.gone} - refreshed.keys():
        for offer in existing.get(group, []):
            if offer.as_of <= max(s.taken_at.date() for s in snapshots if group in s.gone):
                merged.pop(offer.key, None)
    for group, rows in refreshed.items():
        kept = existing.get(group, [])
        if kept and max(o.as_of for o in kept) > max(o.as_of for o in rows):
            continue  # the catalog's own rows are newer than the snapshot: they stay
        for offer in kept:
            merged.pop(offer.key, None)
        merged.update({offer.key: offer for offer in rows})
    return merged
