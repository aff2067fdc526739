"""Import a SkyPilot catalog file (`catalogs/v8/<cloud>/vms.csv`) as price offers.

SkyPilot's files list one row per instance type and region (or zone); `Price` and `SpotPrice` are USD
per instance-hour, and column order differs between clouds and catalog versions, so columns are read
by name. Each instance type becomes one offer at its cheapest region. Every row that is not imported is
counted with its reason. GCP lists accelerators apart from their host VMs; such a GPU row is priced
together with the host VM that carries that many GPUs in the same zone.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from tunecast.catalog.offers import Offer
from tunecast.catalog.store import Catalog
from tunecast.catalog.user import merge_offers
from tunecast.errors import TunecastError

REQUIRED_COLUMNS = ("AcceleratorName", "AcceleratorCount", "Price")

# Names that mean a different card on one cloud than the generic alias does (skypilot-catalog v8
# rows and GpuInfo: RunPod's A100-80GB and H100 are PCIe cards; its SXM parts carry -SXM).
PROVIDER_NAMES: dict[str, dict[str, str]] = {
    "runpod": {"A100-80GB": "a100-80gb-pcie", "A100-80GB-SXM": "a100-80gb", "H100": "h100-pcie",
               "H100-SXM": "h100-sxm", "H200-SXM": "h200"},
}

# The PCIe card of an SXM one, where an instance type says PCIe of a GPU whose name does not.
PCIE_VARIANTS = {"h100-sxm": "h100-pcie", "a100-80gb": "a100-80gb-pcie"}

# GCP's host VM for N GPUs of an accelerator (cloud.google.com/compute/docs/gpus).
GCP_HOSTS: dict[str, str] = {
    "A100": "a2-highgpu-{n}g", "A100-80GB": "a2-ultragpu-{n}g", "H100": "a3-highgpu-{n}g",
    "H100-MEGA": "a3-megagpu-{n}g", "H200": "a3-ultragpu-{n}g",
}
GCP_L4_HOSTS = {1: "g2-standard-4", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"}
GCP_NOT_OFFERED_USD = 700.0  # the catalog's placeholder price for "not offered in this zone"

# How the big clouds bill GPU instances, with sources. Other providers: per hour, stated in the notes.
BILLING: dict[str, tuple[int, int, str]] = {
    "aws": (1, 60, "per-second billing with a 60 s minimum (AWS EC2 on-demand pricing)"),
    "gcp": (1, 60, "per-second billing with a 1 min minimum (GCP VM instance pricing)"),
    "azure": (60, 60, "per-minute billing (Azure virtual machines pricing)"),
    "lambda": (60, 60, "per-minute billing (lambda.ai pricing)"),
    "runpod": (1, 0, "per-second billing (docs.runpod.io billing information)"),
}


def billing_of(provider: str) -> tuple[int, int, str]:
    """(billing increment s, minimum charge s, note) of `provider`'s GPU instances: BILLING's, else per hour."""
    return BILLING.get(provider, (3600, 0, "billing granularity unknown: per hour assumed"))


@dataclass
class ImportResult:
    provider: str
    offers: list[Offer]
    skipped: Counter[str] = field(default_factory=Counter)
    written_to: Path | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "imported": len(self.offers),
            "written_to": str(self.written_to) if self.written_to else None,
            "skipped": dict(self.skipped),
            "offers": [offer.model_dump(mode="json") for offer in self.offers],
        }


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return value


def _gpu_slug(name: str, instance_type: str, provider: str, catalog: Catalog) -> str | None:
    """The catalog GPU a price source names for `provider`: its own names first (PROVIDER_NAMES), then the catalog's
    aliases, a PCIe instance type taking the PCIe card."""
    special = PROVIDER_NAMES.get(provider, {}).get(name)
    if special:
        return special
    gpu = catalog.gpus.find(name)
    if gpu is None:
        return None
    return PCIE_VARIANTS.get(gpu.slug, gpu.slug) if "pcie" in instance_type.lower() else gpu.slug


def parse_skypilot(text: str, catalog: Catalog, *, provider: str, as_of: date, source: str) -> ImportResult:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise TunecastError(f"{source} lacks the column(s) {', '.join(missing)}, so it is not a SkyPilot "
                            "vms.csv", field="file",
                            hint="use a catalogs/v8/<cloud>/vms.csv file from skypilot-org/skypilot-catalog")
    rows = list(reader)
    host_prices = _host_prices(rows)
    result = ImportResult(provider=provider, offers=[])
    best: dict[tuple[str, int, str], dict[str, Any]] = {}
    for row in rows:
        name = (row.get("AcceleratorName") or "").strip()
        instance = (row.get("InstanceType") or "").strip()
        if not name:
            result.skipped["no GPU (CPU-only instance or host VM)"] += 1
            continue
        count = int(_number(row.get("AcceleratorCount")) or 0)
        price = _number(row.get("Price"))
        if count < 1 or price is None or price <= 0 or price >= GCP_NOT_OFFERED_USD:
            result.skipped["no usable price or GPU count"] += 1
            continue
        spot = _number(row.get("SpotPrice"))
        region = (row.get("Region") or "").strip()
        zone = (row.get("AvailabilityZone") or "").strip()
        if not instance:
            host = _gcp_host(name, count)
            vm = host_prices.get(zone or region, {}).get(host or "")
            if vm is None:
                result.skipped["GPU listed without a host VM to price it with"] += 1
                continue
            instance = host or ""
            price += vm[0]
            spot = spot + vm[1] if spot is not None and vm[1] is not None else None
        slug = _gpu_slug(name, instance, provider, catalog)
        if slug is None:
            result.skipped[f"GPU {name} is not in the GPU catalog"] += 1
            continue
        if spot is not None and (spot <= 0 or spot >= price or spot >= GCP_NOT_OFFERED_USD):
            spot = None  # equal to on-demand (or a placeholder): no real spot tier
        entry = best.get((slug, count, instance))
        if entry is None:
            best[(slug, count, instance)] = {"price": price, "region": region, "spot": spot, "regions": 1}
            continue
        entry["regions"] += 1
        if price < entry["price"]:
            entry["price"], entry["region"] = price, region
        if spot is not None and (entry["spot"] is None or spot < entry["spot"]):
            entry["spot"] = spot
    increment, minimum, billing_note = billing_of(provider)
    for (slug, count, instance), entry in sorted(best.items()):
        result.offers.append(Offer(
            provider=provider, gpu=slug, gpu_count=count, instance_type=instance, region=entry["region"],
            usd_per_hour=round(entry["price"] / count, 6),
            spot_usd_per_hour=round(entry["spot"] / count, 6) if entry["spot"] is not None else None,
            billing_increment_s=increment, minimum_charge_s=minimum, boot_billed=True,
            as_of=as_of, source=source,
            notes=f"imported from SkyPilot catalog; node price /{count}; cheapest of {entry['regions']} "
                  f"region/zone rows; {billing_note}",
        ))
    return result


def _gcp_host(accelerator: str, count: int) -> str | None:
    if accelerator == "L4":
        return GCP_L4_HOSTS.get(count)
    template = GCP_HOSTS.get(accelerator)
    return template.format(n=count) if template else None


def _host_prices(rows: list[dict[str, str]]) -> dict[str, dict[str, tuple[float, float | None]]]:
    """GCP host VM prices by zone (or region) and instance type: rows with an instance type but no GPU."""
    prices: dict[str, dict[str, tuple[float, float | None]]] = {}
    for row in rows:
        instance = (row.get("InstanceType") or "").strip()
        if not instance or (row.get("AcceleratorName") or "").strip():
            continue
        price = _number(row.get("Price"))
        if price is None:
            continue
        where = (row.get("AvailabilityZone") or row.get("Region") or "").strip()
        prices.setdefault(where, {})[instance] = (price, _number(row.get("SpotPrice")))
    return prices


def import_skypilot(path: Path, catalog: Catalog, *, provider: str | None, as_of: str | None,
                    user_dir: Path | None) -> ImportResult:
    """Parse `path` and merge its offers into the user's catalog (replacing offers with the same key)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise TunecastError(f"cannot read {path}: {error.strerror}", field="file",
                            hint="check the path to the vms.csv file") from None
    name = (provider or path.resolve().parent.name).lower()
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name):
        raise TunecastError(f"{name!r} is not a usable provider name", field="--provider",
                            hint="pass --provider aws (lower-case letters, digits, dots and dashes)")
    try:
        published = date.fromisoformat(as_of) if as_of else date.today()
    except ValueError:
        raise TunecastError(f"--as-of {as_of!r} is not a date", field="--as-of",
                            hint="write it as YYYY-MM-DD, for example 2026-11-01") from None
    result = parse_skypilot(text, catalog, provider=name, as_of=published, source=str(path.resolve()))
    if not result.offers:
        raise TunecastError(f"{path} has no GPU offers tunecast knows ({sum(result.skipped.values())} rows "
                            "skipped)", field="file", hint="; ".join(f"{n} × {r}" for r, n in result.skipped.items()))
    result.written_to = merge_offers(result.offers, user_dir)
    return result
