"""Today's prices (`tunecast offers --refresh`): gpuhunt's and SkyPilot's sources served from recorded responses
(tests/data/prices/README.md), snapshots in the user's catalog, and how plans use them."""

from __future__ import annotations

import json
import zipfile
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from tunecast.catalog.offers import Offer
from tunecast.catalog.refresh import refresh, unreachable
from tunecast.catalog.snapshots import latest_snapshots
from tunecast.catalog.store import load_catalog

DATA = Path(__file__).resolve().parents[2] / "data" / "prices"
VERSIONS = {"20261204-1": "v1", "20261205-1": "v2"}
NOW = datetime(2026, 12, 5, 9, 30, tzinfo=timezone.utc)


class Sources:
    """The price sources as recorded: a `file://` copy of gpuhunt's bucket (one catalog version published at a
    time), Vast.ai's offers API answered from its recorded JSON, SkyPilot's catalogs from their recorded files."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import gpuhunt.providers.vastai as vastai

        self.bucket = root / "bucket" / "v3"
        self.vast_calls = 0
        monkeypatch.setenv("GPUHUNT_CATALOG_URL", self.bucket.as_uri())
        monkeypatch.setenv("TUNECAST_SKYPILOT_CATALOG_URL", (DATA / "skypilot").as_uri())
        monkeypatch.delenv("GPUHUNT_CATALOG_DIR", raising=False)
        recorded = json.loads((DATA / "gpuhunt" / "vastai-bundles.json").read_text())

        class Answer:
            def raise_for_status(self) -> None:
                return None

            def json(self) -> dict[str, Any]:
                return recorded

        def post(url: str, **_: Any) -> Answer:
            self.vast_calls += 1
            return Answer()

        monkeypatch.setattr(vastai.requests, "post", post)

    def publish(self, version: str, provider: str = "lambdalabs") -> None:
        folder = self.bucket / provider / version
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(folder / "catalog.zip", "w") as archive:
            archive.write(DATA / "gpuhunt" / VERSIONS[version] / f"{provider}.csv", f"{provider}.csv")
        (self.bucket / provider / "version").write_text(version + "\n")


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sources:
    return Sources(tmp_path, monkeypatch)


def lambda_offers(catalog_dir: Path) -> dict[tuple[str, int, str], Offer]:
    load_catalog.cache_clear()
    return {(o.gpu, o.gpu_count, o.instance_type): o for o in load_catalog(catalog_dir).offers if o.provider == "lambda"}


def test_a_refresh_adds_updates_and_drops_offers(sources: Sources, tmp_path: Path) -> None:
    catalog_dir = tmp_path / "catalog"
    sources.publish("20261204-1")
    [first] = refresh(catalog_dir, ["lambda"], ["gpuhunt"], now=NOW - timedelta(days=1))
    assert first.error is None and first.version == "20261204-1" and first.read == 6
    assert (first.added, first.updated, first.dropped) == (4, 0, 0)
    assert first.skipped == {"no GPU": 1}
    offers = lambda_offers(catalog_dir)
    a100 = offers[("a100-40gb", 1, "gpu_1x_a100_sxm4")]
    assert (a100.usd_per_hour, a100.region, a100.as_of) == (1.29, "us-east-1", date(2026, 12, 4))  # cheapest region
    assert a100.source.startswith("gpuhunt 20261204-1 ; file://")
    assert offers[("h100-sxm", 8, "gpu_8x_h100_sxm5")].usd_per_hour == pytest.approx(2.99)  # per GPU-hour
    assert offers[("h100-pcie", 1, "gpu_1x_h100_pcie")].usd_per_hour == 2.49  # "pcie" in the instance type
    # the bundled rows of the same offers are replaced; offers no source listed keep their bundled rows
    assert ("h100-pcie", 1, "gpu_1x_h100_pcie") in offers and ("b200", 1, "gpu_1x_b200_sxm6") in offers
    assert offers[("b200", 1, "gpu_1x_b200_sxm6")].as_of < date(2026, 12, 4)

    sources.publish("20261205-1")
    [second] = refresh(catalog_dir, ["lambda"], ["gpuhunt"], now=NOW)
    assert (second.added, second.updated, second.dropped) == (1, 1, 1)  # GH200 new, H100 PCIe cheaper, 8×H100 gone
    assert second.skipped == {"GPU not in the catalog: Z9000 12.0": 1}
    offers = lambda_offers(catalog_dir)
    assert offers[("h100-pcie", 1, "gpu_1x_h100_pcie")].usd_per_hour == 2.19
    assert offers[("gh200", 1, "gpu_1x_gh200")].as_of == date(2026, 12, 5)
    # 8×H100 SXM: gone, the bundled row as well (the source stopped listing the offer)
    assert not any(gpu == "h100-sxm" and count == 8 for gpu, count, _ in offers)
    assert ("h100-sxm", 1, "gpu_1x_h100_sxm5") in offers  # never listed by the source: the bundled row stays
    assert len(list((catalog_dir / "prices" / "gpuhunt" / "lambda").glob("*.csv"))) == 2  # both snapshots kept
    details = json.loads(second.written_to.with_suffix(".json").read_text())  # type: ignore[union-attr]
    assert details["version"] == "20261205-1" and details["taken_at"].startswith("2026-12-05T09:30")


def test_a_live_marketplace_is_one_offer_per_node_size_with_what_was_listed(sources: Sources,
                                                                            tmp_path: Path) -> None:
    [fetched] = refresh(tmp_path / "catalog", ["vast"], ["gpuhunt"], now=NOW)
    assert fetched.error is None and sources.vast_calls == 1
    offers = {(o.gpu, o.gpu_count): o for o in fetched.offers or []}
    one = offers[("rtx-4090", 1)]
    # the median of the three machines, each priced with 1 GB of disk (gpuhunt adds the disk's storage to the price)
    assert one.usd_per_hour == pytest.approx(0.35 + 0.1 / 720, abs=1e-4)
    assert one.spot_usd_per_hour == pytest.approx(0.20 + 0.1 / 720, abs=1e-4)
    assert one.available == 3 and one.price_kind == "marketplace" and "3 machine(s) listed" in one.notes
    assert offers[("rtx-4090", 2)].usd_per_hour == pytest.approx((0.62 + 0.1 / 720) / 2, abs=1e-4)


def test_runpods_community_and_secure_clouds_are_offers_of_their_own(sources: Sources, tmp_path: Path) -> None:
    """gpuhunt names RunPod's offers by the GPU's id in both clouds: a community offer's location is a country, a
    secure one's a data centre. They stay apart, as the bundled catalog has them, and a community price is a
    marketplace's; the PCIe and SXM A100s are told apart by the id."""
    sources.publish("20261205-1", "runpod")
    [fetched] = refresh(tmp_path / "catalog", ["runpod"], ["gpuhunt"], now=NOW)
    offers = {o.instance_type: o for o in fetched.offers or []}
    community = offers["NVIDIA GeForce RTX 4090 / community cloud"]
    secure = offers["NVIDIA GeForce RTX 4090 / secure cloud"]
    assert (community.usd_per_hour, community.region, community.price_kind) == (0.34, "US", "marketplace")
    assert (secure.usd_per_hour, secure.price_kind) == (0.59, "list")
    assert offers["NVIDIA A100 80GB PCIe / secure cloud"].gpu == "a100-80gb-pcie"
    assert offers["NVIDIA A100-SXM4-80GB / secure cloud"].gpu == "a100-80gb"
    assert community.billing_increment_s == 1  # RunPod bills per second (skypilot.py BILLING)


def test_staleness_is_judged_by_the_kind_of_price(sources: Sources, tmp_path: Path) -> None:
    catalog_dir = tmp_path / "catalog"
    sources.publish("20261205-1")
    refresh(catalog_dir, ["vast", "lambda"], ["gpuhunt"], now=NOW)
    catalog = load_catalog(catalog_dir)
    vast = next(o for o in catalog.offers if o.provider == "vast" and o.available)
    lam = next(o for o in catalog.offers if o.provider == "lambda" and o.as_of == NOW.date())
    assert not vast.is_stale(NOW.date()) and not lam.is_stale(NOW.date())
    two_days = NOW.date() + timedelta(days=2)
    assert vast.is_stale(two_days) and not lam.is_stale(two_days)  # a marketplace's after a day, a list's after 30
    assert lam.is_stale(NOW.date() + timedelta(days=31))


def test_a_source_that_fails_is_one_line_and_its_last_snapshot_stays(sources: Sources, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    catalog_dir = tmp_path / "catalog"
    sources.publish("20261204-1")
    refresh(catalog_dir, ["lambda"], ["gpuhunt"], now=NOW - timedelta(days=1))
    before = lambda_offers(catalog_dir)
    monkeypatch.setenv("GPUHUNT_CATALOG_URL", (tmp_path / "nowhere").as_uri())
    results = refresh(catalog_dir, ["lambda", "aws"], ["gpuhunt", "skypilot"], now=NOW)
    failed = [r for r in results if r.error]
    assert {(r.source, r.provider) for r in failed} == {("gpuhunt", "lambda"), ("gpuhunt", "aws"),
                                                        ("skypilot", "aws")}  # no recorded SkyPilot file for aws
    assert all("\n" not in r.error for r in failed)  # type: ignore[operator]
    lines = unreachable(results)
    assert len(lines) == 2 and lines[0].startswith("gpuhunt: could not refresh lambda, aws (URLError")
    assert [s.taken_at for s in latest_snapshots(catalog_dir) if s.source == "gpuhunt"] == [NOW - timedelta(days=1)]
    after = lambda_offers(catalog_dir)
    kept, was = after[("a100-40gb", 1, "gpu_1x_a100_sxm4")], before[("a100-40gb", 1, "gpu_1x_a100_sxm4")]
    # gpuhunt's price of yesterday stays; SkyPilot's, which answered today, disagrees and is said beside it
    assert (kept.usd_per_hour, kept.as_of) == (was.usd_per_hour, was.as_of) == (1.29, date(2026, 12, 4))
    assert kept.price_disagreement.startswith("gpuhunt $1.29, skypilot $1.49")


def test_two_sources_that_disagree_show_both_and_the_plan_uses_the_primary(sources: Sources, tmp_path: Path) -> None:
    catalog_dir = tmp_path / "catalog"
    sources.publish("20261205-1")
    refresh(catalog_dir, ["lambda"], now=NOW)
    offers = lambda_offers(catalog_dir)
    a100 = offers[("a100-40gb", 1, "gpu_1x_a100_sxm4")]
    assert a100.usd_per_hour == 1.29 and a100.source.startswith("gpuhunt")
    assert a100.price_disagreement.startswith("gpuhunt $1.29, skypilot $1.49 per GPU-hour on 2026-12-05; gpuhunt's")
    assert not offers[("rtx-a6000", 1, "gpu_1x_a6000")].price_disagreement  # the same price in both
    from tunecast.plan.cost import RunShape, price_run

    shape = RunShape(gpu_count=1, train_hours=10.0, startup_hours=0.1, boot_hours=0.05, restart_hours=0.1,
                     checkpoint_write_hours=0.01, storage_gb=50.0, fixed_interval_hours=None)
    cost = price_run(shape, a100, spot=False, default_interruptions_per_hour=0.05, today=NOW.date())
    assert cost is not None and any(n.startswith("price sources disagree: gpuhunt $1.29") for n in cost.notes)
    assert cost.as_dict()["price_source"].startswith("gpuhunt 20261205-1")


def test_a_plan_ranks_differently_after_a_refresh(sources: Sources, tmp_path: Path) -> None:
    from tunecast.config.load import Override, load_spec_text
    from tunecast.plan.report import PlanRequest, make_plan

    catalog_dir = tmp_path / "catalog"
    catalog_dir.mkdir()
    text = ("model: Qwen/Qwen2.5-0.5B\nmethod: lora\nseq_len: 1024\nglobal_batch: 16\n"
            "dataset: {examples: 20000, mean_tokens: 600}\npricing: {providers: [vast, lambda], spot: false}\n")

    def plan(**request: Any) -> list[dict[str, Any]]:
        load_catalog.cache_clear()
        catalog = load_catalog(catalog_dir)
        loaded = load_spec_text(text, [Override("gpus.count", 1, "--gpus")], catalog)
        document = make_plan(loaded, catalog, PlanRequest(**request), today=NOW.date(), cache=False)
        return [o for o in document["options"] if o["total_usd"] is not None]

    before = plan()
    assert before[0]["provider"] != "vast" or before[0]["gpu"] != "rtx-4090"
    sources.publish("20261205-1")
    refresh(catalog_dir, ["vast", "lambda"], now=NOW)
    after = plan()
    assert (after[0]["provider"], after[0]["gpu"]) == ("vast", "rtx-4090")
    assert after[0]["price_as_of"] == "2026-12-05" and after[0]["price_source"].startswith("gpuhunt live")
    assert after[0]["available"] == 3 and not after[0]["price_stale"]
    only = plan(available_only=True)
    assert only and {o["provider"] for o in only} == {"vast"}  # only offers a live snapshot listed


def test_a_catalog_that_cannot_be_written_is_said_like_a_source_that_failed(sources: Sources, tmp_path: Path) -> None:
    blocked = tmp_path / "catalog"
    blocked.write_text("a file where the catalog directory would be")
    [fetched] = refresh(blocked, ["vast"], ["gpuhunt"], now=NOW)
    assert fetched.offers is None and fetched.error is not None
    assert fetched.error.startswith(f"could not save the snapshot in {blocked}")
    assert unreachable([fetched])[0].startswith("gpuhunt: could not refresh vast (could not save the snapshot")
