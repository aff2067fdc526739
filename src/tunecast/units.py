"""Units and their conversions. Names carry their unit: GiB is 2**30 bytes, GB is 10**9 bytes."""

from __future__ import annotations

BYTES_PER_GIB = 2**30
BYTES_PER_GB = 10**9
SECONDS_PER_HOUR = 3600.0
HOURS_PER_MONTH = 730.0  # 365 × 24 / 12, the convention cloud price lists use


def bytes_to_gib(n_bytes: float) -> float:
    return n_bytes / BYTES_PER_GIB


def gib_to_bytes(gib: float) -> float:
    return gib * BYTES_PER_GIB


def format_params(count: int) -> str:
    """8030261248 → '8.03 B'; 596049920 → '596 M'."""
    if count >= 10**9:
        return f"{count / 1e9:.2f} B"
    if count >= 10**6:
        return f"{count / 1e6:.0f} M"
    return f"{count:,}"


def format_usd(amount: float) -> str:
    """Dollars with cents, and a tenth of a cent more below one dollar where it has one: 0.435 → '$0.435',
    0.7 → '$0.70'."""
    if not amount:
        return "$0"
    if abs(amount) < 1 and round(amount, 3) != round(amount, 2):
        return f"${amount:.3f}"
    return f"${amount:,.2f}"


def format_gib(gib: float) -> str:
    return f"{gib:,.1f} GiB"
