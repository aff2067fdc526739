"""Price offers: what a provider charges per GPU-hour for a GPU, and how it bills; and the persistent-volume
price assumed for an offer that publishes none.

Storage is part of every whole-run cost. An offer's own `volume_usd_per_gb_month` is used as published. An offer
without one takes the default for its kind of provider (catalog/data/volume_defaults.csv: one row per kind, with
the providers of that kind, each row sourced and dated); a provider that no row names takes the dearest kind's
default. Each kind's default is the dearest general-purpose volume price read among its providers, so an assumed
storage cost errs high, never low. The catalog resolves the default when it loads (`with_volume_default`) and the
offer keeps it apart from its published price, so the plan can say that the figure is assumed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date

from pydantic import Field, field_validator, model_validator

from tunecast.catalog.rows import CatalogRow
from tunecast.errors import ConfigError, Problem

# A price older than this many days is flagged, by kind of price: a marketplace's (hosts set their own prices and
# machines come and go, Vast.ai, TensorDock, Akash, RunPod's community cloud) moves within a day; a provider's list
# price within weeks. `tunecast offers --refresh` fetches today's (catalog/refresh.py).
STALE_AFTER_DAYS = {"marketplace": 1, "list": 30}
MARKETPLACE_PROVIDERS = frozenset({"vast", "tensordock", "akash"})


class VolumeDefault(CatalogRow):
    """The persistent-volume price assumed for an offer of this kind of provider that publishes none."""

    kind: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    volume_usd_per_gb_month: float = Field(gt=0)
    """USD per GB-month, decimal GB (the unit of a run's storage); prices published per GiB are divided by
    1.073741824."""
    providers: tuple[str, ...] = ()
    """The providers of this kind, `;`-separated in the file."""

    @field_validator("providers", mode="before")
    @classmethod
    def _split_providers(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(";") if part.strip())
        return value


VOLUME_DEFAULT_COLUMNS = VolumeDefault.columns()


@dataclass(frozen=True)
class VolumeDefaults:
    """The defaults by kind of provider; build with `volume_defaults`, which checks them."""

    rows: tuple[VolumeDefault, ...]

    @property
    def fallback(self) -> VolumeDefault:
        """The dearest kind: what a provider that no row names is assumed to charge."""
        return max(self.rows, key=lambda row: (row.volume_usd_per_gb_month, row.kind))

    def for_provider(self, provider: str) -> VolumeDefault:
        """The row that names `provider`, else the fallback."""
        return next((row for row in self.rows if provider in row.providers), self.fallback)


def volume_defaults(rows: Iterable[VolumeDefault], source_name: str) -> VolumeDefaults:
    """Check the defaults (at least one kind; each kind and each provider once) and index them."""
    table = tuple(rows)
    problems: list[Problem] = []
    if not table:
        problems.append(Problem(source_name, "no kind of provider is listed",
                                "list at least one kind, with its volume price and source"))
    kinds: set[str] = set()
    kind_of: dict[str, str] = {}
    for row in table:
        if row.kind in kinds:
            problems.append(Problem(f"{source_name}: {row.kind}", f"kind {row.kind!r} is listed twice",
                                    "keep one row per kind"))
        kinds.add(row.kind)
        for provider in row.providers:
            if provider in kind_of and kind_of[provider] != row.kind:
                problems.append(Problem(f"{source_name}: {row.kind}",
                                        f"provider {provider!r} is also listed under {kind_of[provider]!r}",
                                        "list each provider under one kind"))
            kind_of[provider] = row.kind
    if problems:
        raise ConfigError(source_name, problems)
    return VolumeDefaults(table)


class Offer(CatalogRow):
    """One provider's price for one GPU model in one node size. Prices are per GPU-hour."""

    provider: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    gpu: str
    gpu_count: int = Field(1, ge=1)
    """GPUs per node of this offer; N GPUs cost N × usd_per_hour."""
    instance_type: str = ""
    region: str = ""
    usd_per_hour: float = Field(gt=0)
    """On-demand USD per GPU-hour."""
    spot_usd_per_hour: float | None = Field(None, gt=0)
    """Spot (interruptible) USD per GPU-hour; empty where the provider has no spot tier."""
    billing_increment_s: int = Field(1, ge=1)
    """Billing granularity in seconds: 1 per second, 60 per minute, 3600 per hour."""
    minimum_charge_s: int = Field(0, ge=0)
    """Minimum billed duration of an instance, in seconds."""
    boot_billed: bool = True
    """Whether the time an instance spends booting is billed."""
    volume_usd_per_gb_month: float | None = Field(None, ge=0)
    """Published persistent volume price, USD per GB-month; empty where the offer publishes none."""
    spot_interruptions_per_hour: float | None = Field(None, ge=0)
    """Published mean spot interruptions per instance-hour; empty when unknown."""
    available: int | None = Field(None, ge=0)
    """Machines of this configuration a live source listed as rentable when its snapshot was taken
    (`tunecast offers --refresh`); empty where the source does not say."""
    price_disagreement: str = ""
    """Where two price sources list this offer at different prices: both, and which the plan uses (snapshots.py)."""
    internode_gb_per_s: float | None = Field(None, gt=0)
    """Network bandwidth between nodes of this offer, per node and direction, decimal GB/s (AWS EFA, InfiniBand,
    RoCE); empty where the provider publishes none. Only offers with it are planned across several nodes."""
    volume_default: VolumeDefault | None = Field(None, exclude=True)
    """The default for its kind of provider, filled in by the catalog when the offer publishes no volume price;
    None when it publishes one. Not a CSV column."""

    @classmethod
    def columns(cls) -> list[str]:
        return [name for name in super().columns() if name != "volume_default"]

    def document(self) -> dict[str, object]:
        """The row as JSON-ready data, with the volume default the catalog assumed for it (or null)."""
        assumed = self.volume_default.document() if self.volume_default is not None else None
        return {**super().document(), "volume_default": assumed}

    @model_validator(mode="after")
    def _spot_not_dearer(self) -> Offer:
        if self.spot_usd_per_hour is not None and self.spot_usd_per_hour > self.usd_per_hour * 1.5:
            raise ValueError(
                f"spot_usd_per_hour {self.spot_usd_per_hour} is far above usd_per_hour {self.usd_per_hour};"
                " both are per GPU-hour"
            )
        return self

    @model_validator(mode="after")
    def _published_or_default(self) -> Offer:
        if self.volume_default is not None and self.volume_usd_per_gb_month is not None:
            raise ValueError("an offer with a published volume price takes no default volume price")
        return self

    @property
    def key(self) -> tuple[str, str, int, str, str]:
        """Rows with the same key are the same offer; a user catalog row replaces a bundled one."""
        return (self.provider, self.gpu, self.gpu_count, self.instance_type, self.region)

    @property
    def storage_usd_per_gb_month(self) -> float | None:
        """The volume price a run is charged: the published one, else the assumed default; None only for an
        offer that did not come through the catalog."""
        if self.volume_usd_per_gb_month is not None:
            return self.volume_usd_per_gb_month
        return self.volume_default.volume_usd_per_gb_month if self.volume_default is not None else None

    def age_days(self, today: date) -> int:
        return (today - self.as_of).days

    @property
    def price_kind(self) -> str:
        """`marketplace` (MARKETPLACE_PROVIDERS, and RunPod's community cloud) or `list`: what its staleness is
        judged by (STALE_AFTER_DAYS)."""
        community = self.provider == "runpod" and "community" in self.instance_type.lower()
        return "marketplace" if self.provider in MARKETPLACE_PROVIDERS or community else "list"

    @property
    def stale_after_days(self) -> int:
        return STALE_AFTER_DAYS[self.price_kind]

    def is_stale(self, today: date) -> bool:
        return self.age_days(today) > self.stale_after_days


def with_volume_default(offer: Offer, defaults: VolumeDefaults) -> Offer:
    """`offer` as published when it lists a volume price, else with the default for its kind of provider."""
    if offer.volume_usd_per_gb_month is not None:
        return offer
    return offer.model_copy(update={"volume_default": defaults.for_provider(offer.provider)})


OFFER_COLUMNS = Offer.columns()
