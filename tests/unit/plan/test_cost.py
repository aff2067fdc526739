"""Cost of a whole run on an offer: billing rules, node sizes, storage, spot preemptions and Young/Daly."""

import math
from datetime import date, timedelta

import pytest

from tunecast.catalog.offers import Offer, VolumeDefault, VolumeDefaults, with_volume_default
from tunecast.plan.cost import RunShape, billed_gpus, billed_hours, price_run
from tunecast.train.policy import young_daly_interval

TODAY = date(2026, 11, 29)


def offer(**changes) -> Offer:  # type: ignore[no-untyped-def]
    values = {"provider": "p", "gpu": "h100-sxm", "gpu_count": 1, "usd_per_hour": 2.0, "spot_usd_per_hour": 1.0,
              "billing_increment_s": 1, "minimum_charge_s": 0, "boot_billed": False, "volume_usd_per_gb_month": 0.1,
              "as_of": date(2026, 11, 1), "source": "test"}
    values.update(changes)
    return Offer.model_validate(values)


def shape(**changes) -> RunShape:  # type: ignore[no-untyped-def]
    values = {"gpu_count": 1, "train_hours": 10.0, "startup_hours": 0.0, "checkpoint_write_hours": 0.0,
              "restart_hours": 0.0, "boot_hours": 0.0, "storage_gb": 0.0, "fixed_interval_hours": None}
    values.update(changes)
    return RunShape(**values)


def test_billing_increments_and_minimum_charge() -> None:
    assert billed_hours(1.0, offer()) == 1.0
    assert billed_hours(61 / 3600, offer(billing_increment_s=60)) == pytest.approx(120 / 3600)
    assert billed_hours(0.2, offer(billing_increment_s=3600)) == 1.0
    assert billed_hours(10 / 3600, offer(minimum_charge_s=60)) == pytest.approx(60 / 3600)


def test_gpus_billed_by_node() -> None:
    assert billed_gpus(4, offer()) == 4  # per-GPU offers scale
    assert billed_gpus(2, offer(gpu_count=8)) == 8  # a node of 8 is rented whole
    assert billed_gpus(8, offer(gpu_count=8)) == 8
    assert billed_gpus(16, offer(gpu_count=8)) is None  # no network between nodes published: no multi-node run
    assert billed_gpus(16, offer(gpu_count=8, internode_gb_per_s=400.0)) == 16  # two whole nodes
    assert billed_gpus(12, offer(gpu_count=8, internode_gb_per_s=400.0)) is None  # nodes are rented whole
    assert billed_gpus(16, offer()) is None  # single cards make a box of at most 8


def test_a_preemption_of_any_node_stops_a_multi_node_run() -> None:
    node = offer(gpu_count=8, internode_gb_per_s=400.0, spot_usd_per_hour=1.0)
    one = price_run(shape(gpu_count=8, checkpoint_write_hours=0.01), node, spot=True, default_interruptions_per_hour=0.5, today=TODAY)
    two = price_run(shape(gpu_count=16, checkpoint_write_hours=0.01), node, spot=True, default_interruptions_per_hour=0.5, today=TODAY)
    assert one is not None and two is not None
    # twice the rate, and checkpoints twice as often by Young/Daly (which add their writes to the hours at risk)
    assert 2 * one.expected_preemptions <= two.expected_preemptions < 2.1 * one.expected_preemptions
    assert two.usd_per_hour_total == pytest.approx(2 * one.usd_per_hour_total)
    assert any("2 nodes" in note for note in two.notes)


def test_on_demand_compute_and_storage() -> None:
    cost = price_run(shape(gpu_count=4, storage_gb=100.0), offer(), spot=False, default_interruptions_per_hour=0.5,
                     today=TODAY)
    assert cost is not None
    assert cost.usd_per_hour_total == 8.0 and cost.compute_usd == pytest.approx(80.0)
    assert cost.storage_usd == pytest.approx(100 * 0.1 * 10 / 730)
    assert cost.preemption_usd == 0 and cost.total_usd == pytest.approx(80.0 + cost.storage_usd)


def test_boot_time_is_billed_where_the_offer_bills_it() -> None:
    billed = price_run(shape(boot_hours=0.1), offer(boot_billed=True), spot=False, default_interruptions_per_hour=0,
                       today=TODAY)
    free = price_run(shape(boot_hours=0.1), offer(boot_billed=False), spot=False, default_interruptions_per_hour=0,
                     today=TODAY)
    assert billed is not None and free is not None
    assert billed.compute_usd - free.compute_usd == pytest.approx(0.1 * 2.0)


def test_checkpoint_writes_take_time() -> None:
    cost = price_run(shape(checkpoint_write_hours=0.05), offer(), spot=False, default_interruptions_per_hour=0,
                     today=TODAY)
    assert cost is not None and cost.checkpoint_interval_hours == 0.5
    assert cost.hours == pytest.approx(10 + 10 / 0.5 * 0.05)


def test_young_daly_interval() -> None:
    assert young_daly_interval(0.02, 0.5) == pytest.approx(math.sqrt(2 * 0.02 / 0.5))


def test_spot_expected_preemption_cost() -> None:
    s = shape(checkpoint_write_hours=0.02, restart_hours=0.2)
    cost = price_run(s, offer(), spot=True, default_interruptions_per_hour=0.5, today=TODAY)
    assert cost is not None and cost.spot and cost.usd_per_hour_total == 1.0
    interval = math.sqrt(2 * 0.02 / 0.5)
    run = 10 + 10 / interval * 0.02
    expected = 0.5 * run
    assert cost.checkpoint_interval_hours == pytest.approx(interval)
    assert cost.expected_preemptions == pytest.approx(expected)
    assert cost.preemption_usd == pytest.approx(expected * (interval / 2 + 0.2) * 1.0)
    assert any("no published preemption rate" in note for note in cost.notes)


def test_young_daly_minimises_the_expected_overhead() -> None:
    s = shape(checkpoint_write_hours=0.02, restart_hours=0.2)

    def overhead(interval: float) -> float:
        cost = price_run(RunShape(**{**s.__dict__, "fixed_interval_hours": interval}), offer(), spot=True,
                         default_interruptions_per_hour=0.5, today=TODAY)
        assert cost is not None
        return cost.hours

    best = young_daly_interval(0.02, 0.5)
    assert overhead(best) <= overhead(best / 2) and overhead(best) <= overhead(best * 2)


def test_published_rate_and_override() -> None:
    published = price_run(shape(), offer(spot_interruptions_per_hour=0.01), spot=True,
                          default_interruptions_per_hour=0.5, today=TODAY)
    overridden = price_run(shape(), offer(spot_interruptions_per_hour=0.01), spot=True,
                           default_interruptions_per_hour=0.5, today=TODAY, interruptions_override=1.0)
    assert published is not None and overridden is not None
    assert published.expected_preemptions == pytest.approx(0.1) and overridden.expected_preemptions == pytest.approx(10)
    # an override of 0 means no preemptions, not "use the published rate"
    calm = price_run(shape(checkpoint_write_hours=0.01), offer(spot_interruptions_per_hour=0.01), spot=True,
                     default_interruptions_per_hour=0.5, today=TODAY, interruptions_override=0.0)
    assert calm is not None and calm.expected_preemptions == 0 and calm.preemption_usd == 0
    assert calm.checkpoint_interval_hours == pytest.approx(0.5)  # the on-demand interval


def test_no_spot_price_no_spot_option_and_stale_prices_flagged() -> None:
    assert price_run(shape(), offer(spot_usd_per_hour=None), spot=True, default_interruptions_per_hour=0.5,
                     today=TODAY) is None
    old = price_run(shape(), offer(as_of=date(2026, 1, 1)), spot=False, default_interruptions_per_hour=0.5,
                    today=TODAY)
    assert old is not None and any("a list price older than 30 days" in note for note in old.notes)
    month = price_run(shape(), offer(as_of=TODAY - timedelta(days=30)), spot=False, default_interruptions_per_hour=0.5,
                      today=TODAY)
    assert month is not None and not month.price_stale and month.as_dict()["price_kind"] == "list"
    market = price_run(shape(), offer(provider="vast", as_of=TODAY - timedelta(days=2)), spot=False,
                       default_interruptions_per_hour=0.5, today=TODAY)
    assert market is not None and market.price_stale and market.as_dict()["price_kind"] == "marketplace"


def test_free_checkpoint_writes_keep_a_floor_interval() -> None:
    assert young_daly_interval(0.0, 0.5) == pytest.approx(1 / 60)
    cost = price_run(shape(), offer(), spot=True, default_interruptions_per_hour=0.5, today=TODAY)
    assert cost is not None and cost.checkpoint_interval_hours == pytest.approx(1 / 60)


# Storage: the offer's published volume price, else the default its catalog assumed for its kind of provider.
KINDS = VolumeDefault(kind="hyperscaler", volume_usd_per_gb_month=0.08, providers=("aws", "gcp"),
                      as_of=date(2026, 12, 1), source="test")


def test_a_published_volume_price_is_used_as_is_with_no_note() -> None:
    cost = price_run(shape(storage_gb=100.0), offer(volume_usd_per_gb_month=0.1), spot=False,
                     default_interruptions_per_hour=0, today=TODAY)
    assert cost is not None and cost.storage_usd == pytest.approx(100 * 0.1 * 10 / 730)
    assert not any("storage" in note for note in cost.notes)


def test_an_offer_without_a_volume_price_is_charged_the_default_of_its_kind_and_says_so() -> None:
    assumed = with_volume_default(offer(provider="aws", volume_usd_per_gb_month=None), VolumeDefaults((KINDS,)))
    cost = price_run(shape(storage_gb=100.0), assumed, spot=False, default_interruptions_per_hour=0, today=TODAY)
    assert cost is not None and cost.storage_usd == pytest.approx(100 * 0.08 * 10 / 730)
    assert "storage at the assumed $0.08/GB-month of hyperscaler volumes (no published price for this offer)" \
        in cost.notes


def test_an_unknown_provider_is_charged_the_fallback_kind_and_says_so() -> None:
    dear = VolumeDefault(kind="neocloud", volume_usd_per_gb_month=0.19, providers=("lambda",),
                         as_of=date(2026, 12, 1), source="test")
    assumed = with_volume_default(offer(provider="homelab", volume_usd_per_gb_month=None),
                                  VolumeDefaults((KINDS, dear)))
    cost = price_run(shape(storage_gb=10.0), assumed, spot=True, default_interruptions_per_hour=0, today=TODAY)
    assert cost is not None and cost.storage_usd == pytest.approx(10 * 0.19 * cost.hours / 730)
    note = next(note for note in cost.notes if note.startswith("storage"))
    assert "$0.19/GB-month of neocloud volumes, the dearest kind" in note and "homelab" in note


def test_storage_is_never_a_silent_zero() -> None:
    included = price_run(shape(storage_gb=10.0), offer(volume_usd_per_gb_month=0.0), spot=False,
                         default_interruptions_per_hour=0, today=TODAY)
    assert included is not None and included.storage_usd == 0
    assert any("included in the offer's price" in note for note in included.notes)
    # an offer that did not come through the catalog has no default to fall back on, and says so
    bare = price_run(shape(storage_gb=10.0), offer(volume_usd_per_gb_month=None), spot=False,
                     default_interruptions_per_hour=0, today=TODAY)
    assert bare is not None and any("storage not counted" in note for note in bare.notes)


def test_storage_under_a_cent_is_not_rounded_to_zero() -> None:
    # the demo's shape: 1.6 GB for 10.7 hours at $0.07/GB-month is $0.0017
    cost = price_run(shape(storage_gb=1.631, train_hours=10.693), offer(volume_usd_per_gb_month=0.07), spot=False,
                     default_interruptions_per_hour=0, today=TODAY)
    assert cost is not None and cost.as_dict()["storage_usd"] == pytest.approx(0.0017)


def test_bundled_offers_without_a_published_volume_price_are_charged_for_storage() -> None:
    from tunecast.catalog.store import load_catalog

    tensordock = next(o for o in load_catalog(None).offers if o.provider == "tensordock" and o.gpu == "rtx-4090")
    cost = price_run(shape(storage_gb=1.631), tensordock, spot=False, default_interruptions_per_hour=0, today=TODAY)
    assert cost is not None and cost.storage_usd > 0
    assert any(note.startswith("storage at the assumed $0.10/GB-month of marketplace volumes") for note in cost.notes)
