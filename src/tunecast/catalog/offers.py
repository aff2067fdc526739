"""Price offers: what a provider charges per GPU-hour for a GPU, and how it bills."""

from __future__ import annotations

from datetime import date

from pydantic import Field, model_validator

from tunecast.catalog.rows import CatalogRow

# A price older than this is flagged: GPU rental prices move by tens of percent within months.
STALE_AFTER_DAYS = 90


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
    """Persistent volume price, USD per GB-month; empty where the provider sells none."""
    spot_interruptions_per_hour: float | None = Field(None, ge=0)
    """Published mean spot interruptions per instance-hour; empty when unknown."""

    @model_validator(mode="after")
    def _spot_not_dearer(self) -> Offer:
        if self.spot_usd_per_hour is not None and self.spot_usd_per_hour > self.usd_per_hour * 1.5:
            raise ValueError(
                f"spot_usd_per_hour {self.spot_usd_per_hour} is far above usd_per_hour {self.usd_per_hour};"
                " both are per GPU-hour"
            )
        return self

    @property
    def key(self) -> tuple[str, str, int, str, str]:
        """Rows with the same key are the same offer; a user catalog row replaces a bundled one."""
        return (self.provider, self.gpu, self.gpu_count, self.instance_type, self.region)

    def age_days(self, today: date) -> int:
        return (today - self.as_of).days

    def is_stale(self, today: date) -> bool:
        return self.age_days(today) > STALE_AFTER_DAYS


OFFER_COLUMNS = Offer.columns()
