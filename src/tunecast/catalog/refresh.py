"""Today's offers, fetched from the providers' public price sources through maintained libraries
(`tunecast offers --refresh`, `tunecast plan --refresh`), saved as dated snapshots (snapshots.py).

Two sources (docs/catalog.md compares them, provider by provider):

* **gpuhunt**, dstack's GPU price catalog library. For aws, azure, gcp, oci, lambda, runpod, verda, nebius and
  cloudrift it downloads the catalog dstack rebuilds from each provider's own API (a zip of one CSV per provider,
  versioned); Vast.ai's marketplace it queries live (its public offers API, no key), which is where availability
  comes from. Prices are USD per instance-hour; a spot price is an item of its own.
* **skypilot**: the catalogs SkyPilot publishes for its clouds (skypilot-org/skypilot-catalog, `v8/<cloud>/vms.csv`,
  rebuilt every 7 hours), downloaded as SkyPilot itself does (GitHub, then its S3 mirror when GitHub answers 429)
  and read by skypilot.py, as `tunecast offers import-skypilot` reads such a file. SkyPilot's own package is not
  needed: its fetchers need each cloud's credentials and run in SkyPilot's CI.

Each (source, provider) is fetched on its own: one that cannot be reached is said in one line and its last
snapshot stays; a refresh never fails a plan. Mirrors: `GPUHUNT_CATALOG_URL` (gpuhunt's own setting),
`TUNECAST_SKYPILOT_CATALOG_URL`, `TUNECAST_VASTAI_URL`. Neither source publishes spot interruption rates; the plan
keeps its default (docs/catalog.md).
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

from tunecast.catalog.offers import Offer
from tunecast.catalog.skypilot import PCIE_VARIANTS, billing_of, parse_skypilot
from tunecast.catalog.snapshots import SOURCES, Snapshot, group_of, latest_snapshots, write_snapshot
from tunecast.catalog.store import Catalog, load_catalog

# tunecast's provider slugs, and each source's name for them.
GPUHUNT_NAMES = {"aws": "aws", "azure": "azure", "gcp": "gcp", "oci": "oci", "lambda": "lambdalabs",
                 "runpod": "runpod", "vast": "vastai", "verda": "verda", "nebius": "nebius", "cloudrift": "cloudrift"}
SKYPILOT_NAMES = {"aws": "aws", "azure": "azure", "gcp": "gcp", "oci": "oci", "lambda": "lambda", "runpod": "runpod",
                  "vast": "vast", "verda": "verda", "nebius": "nebius", "cudo": "cudo", "fluidstack": "fluidstack",
                  "paperspace": "paperspace"}
REFRESHABLE = tuple(sorted(set(GPUHUNT_NAMES) | set(SKYPILOT_NAMES)))
# gpuhunt's providers it queries live (each offer a machine listed now), not from its periodic catalog.
LIVE = frozenset({"vastai"})
SKYPILOT_URL = "https://raw.githubusercontent.com/skypilot-org/skypilot-catalog/master/catalogs"
SKYPILOT_MIRROR = "https://skypilot-catalog.s3.us-east-1.amazonaws.com/catalogs"
SKYPILOT_SCHEMA = "v8"
TIMEOUT_S = 20.0
# A GPU a source names is the catalog's only where their memory agrees within this (A100 40 GB against 80 GB).
MEMORY_AGREES = 0.12


@dataclass
class Fetched:
    """What one source served for one provider; `error` (one line) where it could not be fetched."""

    source: str
    provider: str
    offers: list[Offer] | None = None
    error: str | None = None
    url: str = ""
    version: str = ""
    read: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    added: int = 0
    updated: int = 0
    dropped: int = 0
    written_to: Path | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "provider": self.provider, "ok": self.error is None, "error": self.error,
                "url": self.url, "version": self.version, "read": self.read,
                "offers": None if self.offers is None else len(self.offers), "added": self.added,
                "updated": self.updated, "dropped": self.dropped, "skipped": dict(self.skipped),
                "written_to": str(self.written_to) if self.written_to else None}


def _one_line(error: BaseException) -> str:
    reason = getattr(error, "reason", None)
    text = str(reason if reason is not None else error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else 'no message'}"[:200]


def _slug(name: str | None, memory_gb: float | None, instance: str, catalog: Catalog) -> str | None:
    """The catalog GPU a gpuhunt item names (gpuhunt's own names, the same for every provider): by name with its
    memory first (`A100-80GB`), then by name, the PCIe card where the instance type says PCIe; None where the
    catalog has no such GPU or its memory disagrees with the item's."""
    if not name:
        return None
    gpu = (catalog.gpus.find(f"{name}-{round(memory_gb)}GB") if memory_gb else None) or catalog.gpus.find(name)
    if gpu is None:
        return None
    if memory_gb and abs(gpu.memory_gib - memory_gb) > MEMORY_AGREES * gpu.memory_gib:
        return None
    return PCIE_VARIANTS.get(gpu.slug, gpu.slug) if "pcie" in instance.lower() else gpu.slug


def _instance(provider: str, item: Any) -> str:
    """The instance type an item is offered as: RunPod's community and secure clouds apart (gpuhunt names both by the
    GPU's id; a community offer's location is a country code, a secure one's a data centre such as US-TX-3), as the
    bundled catalog has them, a community cloud's price judged as a marketplace's."""
    if provider == "runpod":
        cloud = "community" if re.fullmatch(r"[A-Z]{2}", item.location or "") else "secure"
        return f"{item.instance_name} / {cloud} cloud"
    return str(item.instance_name)


def offers_from_items(items: Iterable[Any], catalog: Catalog, *, provider: str, live: bool, as_of: date,
                      source: str) -> tuple[list[Offer], Counter[str]]:
    """gpuhunt's items (CatalogItem: instance_name, location, price per instance-hour, gpu_count, gpu_name,
    gpu_memory, spot) as offers per GPU-hour. From a catalog: each instance type at its cheapest location, with its
    cheapest spot price. Live (a marketplace): each GPU and node size, at the median of the machines listed, with how
    many were listed (`available`) and their range in the notes."""
    skipped: Counter[str] = Counter()
    groups: dict[tuple[str, int, str], list[Any]] = {}
    for item in items:
        count = int(item.gpu_count or 0)
        if count < 1:
            skipped["no GPU"] += 1
            continue
        if not item.price or item.price <= 0:
            skipped["no price"] += 1
            continue
        slug = _slug(item.gpu_name, item.gpu_memory, item.instance_name, catalog)
        if slug is None:
            skipped[f"GPU not in the catalog: {item.gpu_name} {item.gpu_memory or ''}".strip()] += 1
            continue
        groups.setdefault((slug, count, "" if live else _instance(provider, item)), []).append(item)
    increment, minimum, billing = billing_of(provider)
    offers = []
    for (slug, count, instance), members in sorted(groups.items()):
        on_demand = [m for m in members if not m.spot]
        spot = [m.price / count for m in members if m.spot]
        if not on_demand:
            skipped["spot price only"] += len(members)
            continue
        notes = [billing]
        if live:
            prices = sorted(m.price / count for m in on_demand)
            price = statistics.median(prices)
            spot_price = statistics.median(spot) if spot else None
            machines = len({m.instance_name for m in on_demand})
            notes.insert(0, f"{machines} machine(s) listed, ${prices[0]:.3f} to ${prices[-1]:.3f} per GPU-hour "
                            "(the median is used)")
            region, instance_type, available = "various", f"{count}x {slug} (marketplace)", machines
        else:
            cheapest = min(on_demand, key=lambda m: (m.price, m.location))
            price, region, instance_type, available = cheapest.price / count, cheapest.location, instance, None
            spot_price = min(spot) if spot else None
        if spot_price is not None and spot_price >= price:
            spot_price = None
        offers.append(Offer(provider=provider, gpu=slug, gpu_count=count, instance_type=instance_type,
                            region=region, usd_per_hour=round(price, 4),
                            spot_usd_per_hour=None if spot_price is None else round(spot_price, 4),
                            billing_increment_s=increment, minimum_charge_s=minimum, available=available,
                            as_of=as_of, source=source, notes="; ".join(notes)))
    return offers, skipped


def _gpuhunt(names: Sequence[str]) -> dict[str, tuple[list[Any] | None, str, str, str | None]]:
    """{gpuhunt provider: (items or None, url, version, error)}: each provider fetched on its own, so that one that
    fails leaves the others."""
    try:
        import gpuhunt
        from gpuhunt._internal import catalog as hunt
    except ImportError as error:
        return {name: (None, "", "", f"gpuhunt is not installed ({error}): pip install gpuhunt") for name in names}
    logging.getLogger("gpuhunt").setLevel(logging.CRITICAL)  # it logs each failure with a traceback
    found: dict[str, tuple[list[Any] | None, str, str, str | None]] = {}
    base = hunt._get_base_url()
    for name in names:
        hunted = gpuhunt.Catalog(balance_resources=False, auto_reload=False)
        url, version = base, ""
        try:
            if name in LIVE:
                from gpuhunt.providers import vastai

                vastai.bundles_url = os.environ.get("TUNECAST_VASTAI_URL", vastai.bundles_url)
                url = vastai.bundles_url
                hunted.add_provider(vastai.VastAIProvider())
                # the least disk, so that the price is the machine's, not its whole disk's (storage is priced apart)
                items = hunted.query(provider=name, min_disk_size=1)
            else:
                version = hunt._get_latest_version(base, name)
                url = f"{base}/{name}/{version}/catalog.zip"
                hunted.catalog[name] = hunted._load_provider(base, name, version)
                hunted.loaded_at = time.monotonic()
                items = hunted.query(provider=name)
            found[name] = (list(items), url, version, None)
        except Exception as error:  # every failure of a source is reported, never raised: a refresh never fails
            found[name] = (None, url, version, _one_line(error))
    return found


def _download(url: str) -> str:
    request = urllib.request.Request(url, headers={"User-Agent": "tunecast"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return str(response.read().decode("utf-8"))


def _skypilot(cloud: str) -> tuple[str, str]:
    """(the cloud's vms.csv, its URL): from GitHub, or SkyPilot's S3 mirror where GitHub limits the rate (HTTP 429),
    as SkyPilot's own catalog reader does."""
    base = os.environ.get("TUNECAST_SKYPILOT_CATALOG_URL", SKYPILOT_URL).rstrip("/")
    url = f"{base}/{SKYPILOT_SCHEMA}/{cloud}/vms.csv"
    try:
        return _download(url), url
    except urllib.error.HTTPError as error:
        if error.code != 429 or base != SKYPILOT_URL:
            raise
    mirror = f"{SKYPILOT_MIRROR}/{SKYPILOT_SCHEMA}/{cloud}/vms.csv"
    return _download(mirror), mirror


def _changes(fetched: Fetched, before: dict[tuple[str, str], Snapshot]) -> list[list[Any]]:
    """Count what is new, changed and gone against the source's last snapshot; return the offers (gpu, node size) it
    no longer lists, with those its earlier snapshots had stopped listing."""
    previous = before.get((fetched.source, fetched.provider))
    old = {offer.key: offer for offer in previous.offers} if previous is not None else {}
    new = {offer.key: offer for offer in fetched.offers or []}
    fetched.added = len(new.keys() - old.keys())
    fetched.dropped = len(old.keys() - new.keys())
    fetched.updated = sum(1 for key in new.keys() & old.keys()
                          if (new[key].usd_per_hour, new[key].spot_usd_per_hour, new[key].available)
                          != (old[key].usd_per_hour, old[key].spot_usd_per_hour, old[key].available))
    listed = {group_of(offer) for offer in new.values()}
    earlier = {group_of(offer) for offer in old.values()} | set(previous.gone if previous is not None else ())
    return [[gpu, count] for _, gpu, count in sorted(earlier - listed)]


def refresh(catalog_dir: Path, providers: Sequence[str] | None = None, sources: Sequence[str] = SOURCES, *,
            now: datetime | None = None) -> list[Fetched]:
    """Fetch today's offers of `providers` (all REFRESHABLE by default) from each of `sources` that serves them, and
    save each answer as a snapshot in `catalog_dir`. Never raises for a source: what failed is in its `error`."""
    taken_at = now or datetime.now(timezone.utc)
    as_of = taken_at.date()
    catalog = load_catalog(catalog_dir)  # the bundled catalog alone where the directory does not exist yet
    wanted = list(providers or REFRESHABLE)
    before = {(s.source, s.provider): s for s in latest_snapshots(catalog_dir)}
    results: list[Fetched] = []
    if "gpuhunt" in sources:
        names = {GPUHUNT_NAMES[p]: p for p in wanted if p in GPUHUNT_NAMES}
        for name, (items, url, version, error) in _gpuhunt(list(names)).items():
            provider = names[name]
            fetched = Fetched("gpuhunt", provider, url=url, version=version, error=error)
            if items is not None:
                fetched.read = len(items)
                label = f"gpuhunt {version or 'live'} ; {url}"
                fetched.offers, fetched.skipped = offers_from_items(items, catalog, provider=provider,
                                                                    live=name in LIVE, as_of=as_of, source=label)
            results.append(fetched)
    if "skypilot" in sources:
        for provider in (p for p in wanted if p in SKYPILOT_NAMES):
            fetched = Fetched("skypilot", provider)
            try:
                text, fetched.url = _skypilot(SKYPILOT_NAMES[provider])
                imported = parse_skypilot(text, catalog, provider=provider, as_of=as_of,
                                          source=f"skypilot {SKYPILOT_SCHEMA} ; {fetched.url}")
                fetched.offers, fetched.skipped = imported.offers, imported.skipped
                fetched.read = sum(imported.skipped.values()) + len(imported.offers)
            except Exception as error:  # as above: reported, never raised
                fetched.error = _one_line(error)
            results.append(fetched)
    for fetched in results:
        if fetched.offers is None:
            continue
        gone = _changes(fetched, before)
        details = {"url": fetched.url, "version": fetched.version, "read": fetched.read,
                   "skipped": dict(fetched.skipped), "gone": gone}
        try:
            fetched.written_to = write_snapshot(catalog_dir, fetched.source, fetched.provider, fetched.offers,
                                                taken_at, details)
        except OSError as error:  # a catalog directory that cannot be written: said like a source that failed
            fetched.error = f"could not save the snapshot in {catalog_dir}: {_one_line(error)}"
            fetched.offers = None
    load_catalog.cache_clear()
    return results


def unreachable(results: Iterable[Fetched]) -> list[str]:
    """One line per source that could not serve some provider: which, and the first reason."""
    failed: dict[str, list[Fetched]] = {}
    for fetched in results:
        if fetched.error is not None:
            failed.setdefault(fetched.source, []).append(fetched)
    return [f"{source}: could not refresh {', '.join(f.provider for f in items)} ({items[0].error}); the last "
            "snapshot of each stays" for source, items in failed.items()]
