"""Volume prices assumed by kind of provider: the table's rules on tiny tables, the bundled table, and how the
catalog hands every offer without a published volume price the default for its kind, user offers included."""

from datetime import date
from pathlib import Path

import pytest

from tunecast.catalog.offers import (
    OFFER_COLUMNS,
    Offer,
    VolumeDefault,
    VolumeDefaults,
    volume_defaults,
    with_volume_default,
)
from tunecast.catalog.rows import parse_rows
from tunecast.catalog.store import VOLUME_DEFAULTS_FILE, bundled_data_dir, load_catalog
from tunecast.errors import ConfigError

HEADER = "kind,volume_usd_per_gb_month,providers,as_of,source,notes\n"
TINY = HEADER + ("cloud,0.08,aws;gcp,2026-12-01,https://example.com/cloud,\n"
                 "neo,0.19,lambda,2026-12-01,https://example.com/neo,\n"
                 "market,0.10,vast,2026-12-01,https://example.com/market,\n")
OFFER_HEADER = ("provider,gpu,gpu_count,instance_type,region,usd_per_hour,spot_usd_per_hour,billing_increment_s,"
                "minimum_charge_s,boot_billed,volume_usd_per_gb_month,spot_interruptions_per_hour,as_of,source,notes\n")


def tiny() -> VolumeDefaults:
    return volume_defaults(parse_rows(TINY, VolumeDefault, "tiny.csv"), "tiny.csv")


def offer(provider: str, volume: float | None = None) -> Offer:
    return Offer(provider=provider, gpu="h100-sxm", usd_per_hour=2.0, volume_usd_per_gb_month=volume,
                 as_of=date(2026, 11, 1), source="test")


def test_a_provider_gets_its_kind_and_an_unnamed_one_the_dearest_kind() -> None:
    defaults = tiny()
    assert defaults.for_provider("gcp").kind == "cloud"
    assert defaults.for_provider("vast").kind == "market"
    assert defaults.fallback.kind == "neo"  # the dearest: an unknown provider is never charged less
    assert defaults.for_provider("homelab").kind == "neo"


def test_providers_are_split_on_semicolons() -> None:
    assert tiny().rows[0].providers == ("aws", "gcp")


def test_a_published_price_is_kept_and_a_missing_one_takes_the_default() -> None:
    published = with_volume_default(offer("aws", 0.05), tiny())
    assert published.volume_default is None and published.storage_usd_per_gb_month == 0.05
    assumed = with_volume_default(offer("aws"), tiny())
    assert assumed.volume_usd_per_gb_month is None  # the published price stays empty: the offer stays honest
    assert assumed.volume_default is not None and assumed.volume_default.kind == "cloud"
    assert assumed.storage_usd_per_gb_month == 0.08


def test_the_default_is_no_csv_column_but_is_in_the_document() -> None:
    assumed = with_volume_default(offer("vast"), tiny())
    assert "volume_default" not in OFFER_COLUMNS
    assert "volume_default" not in assumed.model_dump()
    assert assumed.document()["volume_default"]["kind"] == "market"  # type: ignore[index]
    assert offer("vast", 0.1).document()["volume_default"] is None


def test_an_offer_cannot_carry_both_a_published_price_and_a_default() -> None:
    with pytest.raises(ValueError, match="takes no default"):
        Offer(provider="aws", gpu="h100-sxm", usd_per_hour=2.0, volume_usd_per_gb_month=0.08,
              volume_default=tiny().rows[0], as_of=date(2026, 11, 1), source="test")


@pytest.mark.parametrize(("rows", "message"), [
    ("", "no kind of provider"),
    ("a,0.1,x,2026-12-01,s,\na,0.2,y,2026-12-01,s,\n", "listed twice"),
    ("a,0.1,x;y,2026-12-01,s,\nb,0.2,y,2026-12-01,s,\n", "'y' is also listed under 'a'"),
])
def test_a_bad_table_is_refused(rows: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        volume_defaults(parse_rows(HEADER + rows, VolumeDefault, "bad.csv"), "bad.csv")
    assert any(message in problem.message for problem in error.value.problems)


def test_bundled_defaults_are_sourced_and_name_every_bundled_provider() -> None:
    rows = parse_rows((bundled_data_dir() / VOLUME_DEFAULTS_FILE).read_text(), VolumeDefault, VOLUME_DEFAULTS_FILE)
    assert {row.kind for row in rows} == {"hyperscaler", "neocloud", "marketplace"}
    for row in rows:
        assert row.source.startswith("http") and row.as_of <= date.today() and row.notes
        assert 0.01 < row.volume_usd_per_gb_month < 1.0, row.kind
    named = {provider for row in rows for provider in row.providers}
    assert set(load_catalog(None).providers) <= named  # no bundled offer falls back for want of a kind


def test_every_bundled_offer_is_charged_for_storage() -> None:
    for item in load_catalog(None).offers:
        assert item.storage_usd_per_gb_month is not None and item.storage_usd_per_gb_month > 0, item.key
        assert (item.volume_default is None) == (item.volume_usd_per_gb_month is not None), item.key


def test_bundled_offers_of_each_kind() -> None:
    offers = {o.provider: o for o in load_catalog(None).offers}
    assert offers["runpod"].volume_default is None and offers["runpod"].storage_usd_per_gb_month == 0.07
    assert offers["aws"].volume_default is None and offers["aws"].storage_usd_per_gb_month == 0.08
    assert offers["azure"].volume_default is not None and offers["azure"].volume_default.kind == "hyperscaler"
    assert offers["tensordock"].volume_default is not None
    assert offers["tensordock"].volume_default.kind == "marketplace"


def test_the_catalog_keeps_its_defaults_for_offers_built_elsewhere() -> None:
    catalog = load_catalog(None)
    own = with_volume_default(offer("my-desk"), catalog.volume_defaults)
    assert own.volume_default is not None and own.volume_default == catalog.volume_defaults.fallback


def test_a_user_offer_for_an_unknown_provider_gets_the_fallback(tmp_path: Path) -> None:
    (tmp_path / "offers.csv").write_text(
        OFFER_HEADER + "homelab,4090,1,,,0.10,,3600,0,false,,,2026-11-01,electricity bill,\n"
        + "mycloud,4090,1,,,0.30,,1,0,true,0.02,,2026-11-01,my quote,\n")
    offers = {o.provider: o for o in load_catalog(tmp_path).offers}
    homelab = offers["homelab"].volume_default
    assert homelab is not None and homelab.kind == "neocloud" and "homelab" not in homelab.providers
    assert offers["mycloud"].volume_default is None and offers["mycloud"].storage_usd_per_gb_month == 0.02


def test_a_user_table_replaces_a_kind_and_can_classify_a_provider(tmp_path: Path) -> None:
    (tmp_path / "offers.csv").write_text(
        OFFER_HEADER + "homelab,4090,1,,,0.10,,3600,0,false,,,2026-11-01,electricity bill,\n")
    (tmp_path / VOLUME_DEFAULTS_FILE).write_text(
        HEADER + "marketplace,0.03,vast;runpod;tensordock;akash;openrelay;market-median;homelab,2026-12-01,mine,\n")
    offers = {o.provider: o for o in load_catalog(tmp_path).offers}
    for provider in ("homelab", "tensordock"):
        assert offers[provider].storage_usd_per_gb_month == 0.03, provider
    assert offers["lambda"].volume_default is not None and offers["lambda"].volume_default.kind == "neocloud"


def test_a_user_table_that_lists_a_provider_under_two_kinds_is_refused(tmp_path: Path) -> None:
    (tmp_path / VOLUME_DEFAULTS_FILE).write_text(HEADER + "mine,0.03,aws,2026-12-01,mine,\n")
    with pytest.raises(ConfigError) as error:
        load_catalog(tmp_path)
    assert error.value.source.endswith(VOLUME_DEFAULTS_FILE)
    assert "'aws' is also listed under 'hyperscaler'" in error.value.problems[0].message
