"""A user catalog directory adds rows and replaces rows with the same key."""

import pytest

from tunecast.catalog.store import load_catalog
from tunecast.errors import ConfigError

OFFER_HEADER = ("provider,gpu,gpu_count,instance_type,region,usd_per_hour,spot_usd_per_hour,billing_increment_s,"
                "minimum_charge_s,boot_billed,volume_usd_per_gb_month,spot_interruptions_per_hour,as_of,source,notes\n")


def test_user_offers_add_and_override(tmp_path) -> None:
    (tmp_path / "offers.csv").write_text(
        OFFER_HEADER
        + "thunder-compute,a100-80gb,1,A100 80GB (prototyping tier),us,0.66,,60,0,true,0.05,,2026-11-01,my quote,\n"
        + "homelab,4090,2,,,0.10,,3600,0,false,,,2026-11-01,electricity bill,\n"
    )
    catalog = load_catalog(tmp_path)
    thunder = [o for o in catalog.offers if o.provider == "thunder-compute" and o.gpu == "a100-80gb"
               and o.instance_type.startswith("A100 80GB (prototyping")]
    assert [o.usd_per_hour for o in thunder] == [0.66]
    homelab = [o for o in catalog.offers if o.provider == "homelab"]
    assert homelab[0].gpu == "rtx-4090" and homelab[0].gpu_count == 2  # alias stored as its slug


def test_user_gpus_are_added(tmp_path) -> None:
    import csv

    from tunecast.catalog.store import bundled_data_dir

    rows = list(csv.DictReader((bundled_data_dir() / "gpus.csv").open()))
    header = list(rows[0])
    mine = dict(rows[0], slug="my-card", aliases="MYCARD", name="My card")
    with (tmp_path / "gpus.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerow(mine)
    assert load_catalog(tmp_path).gpus.get("mycard").slug == "my-card"


def test_bad_user_rows_name_file_line_and_column(tmp_path) -> None:
    (tmp_path / "offers.csv").write_text(OFFER_HEADER + "x,h100,1,,,-2,,1,0,true,,,2026-11-01,src,\n"
                                         + "y,h100,1,,,2,,1,0,true,,,not-a-date,src,\n")
    with pytest.raises(ConfigError) as error:
        load_catalog(tmp_path)
    fields = [p.field for p in error.value.problems]
    assert any(f and f.endswith("offers.csv:2 (usd_per_hour)") for f in fields)
    assert any(f and f.endswith("offers.csv:3 (as_of)") for f in fields)


def test_user_offer_for_an_unknown_gpu_is_refused_with_suggestions(tmp_path) -> None:
    (tmp_path / "offers.csv").write_text(OFFER_HEADER + "x,h1000,1,,,2,,1,0,true,,,2026-11-01,src,\n")
    with pytest.raises(ConfigError) as error:
        load_catalog(tmp_path)
    assert "h100" in (error.value.problems[0].hint or "")


def test_unknown_column_is_reported(tmp_path) -> None:
    (tmp_path / "offers.csv").write_text("provider,gpu,price\n")
    with pytest.raises(ConfigError) as error:
        load_catalog(tmp_path)
    assert any("column price" in (p.field or "") for p in error.value.problems)
