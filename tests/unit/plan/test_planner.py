"""The planner on tiny catalogs made here: what it chooses, what it honours, how it ranks and filters."""

from __future__ import annotations

import dataclasses
import json
from datetime import date
from pathlib import Path
from typing import Any

import pytest
from tests.models import shallow_llama

from tunecast.catalog.gpus import GpuIndex
from tunecast.catalog.offers import Offer
from tunecast.catalog.store import Catalog, load_catalog
from tunecast.config.load import Override, load_spec
from tunecast.errors import ConfigError, TunecastError
from tunecast.plan import report
from tunecast.plan.cost import OfferCost
from tunecast.plan.planner import Option, Planner, mark_pareto, rank
from tunecast.plan.report import PlanRequest, make_plan
from tunecast.plan.workload import workload_for

TODAY = date(2026, 11, 29)
BASE = {"method": "lora", "seq_len": 256, "global_batch": 8,
        "dataset": {"examples": 20_000_000, "mean_tokens": 200, "mean_trained_tokens": 120}}


# Traces are shared between tests; a plan's key holds the test's own model path, so plans are not.
pytestmark = pytest.mark.usefixtures("profile_cache")


def offer(gpu: str, usd: float, spot: float | None = None, **changes: Any) -> Offer:
    values = {"provider": f"cloud-{gpu}", "gpu": gpu, "gpu_count": 1, "usd_per_hour": usd,
              "spot_usd_per_hour": spot, "billing_increment_s": 1, "minimum_charge_s": 0, "boot_billed": False,
              "volume_usd_per_gb_month": 0.1, "as_of": date(2026, 11, 1), "source": "test"}
    values.update(changes)
    return Offer.model_validate(values)


def tiny_catalog(offers: list[Offer], memory: dict[str, float] | None = None,
                 slugs: tuple[str, ...] = ("rtx-3090", "h100-sxm")) -> Catalog:
    """Two cards of the bundled catalog (one slow, one fast), with the test's own prices and, where given,
    a usable memory small enough to make the tiny model's options differ."""
    bundled = load_catalog(None)
    gpus = []
    for slug in slugs:
        gpu = bundled.gpus.get(slug)
        if memory and slug in memory:
            gpu = gpu.model_copy(update={"usable_memory_gib": memory[slug]})
        gpus.append(gpu)
    return dataclasses.replace(bundled, gpus=GpuIndex(gpus), offers=tuple(offers))


WIDER = shallow_llama(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4)
WIDE = shallow_llama(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)


def loaded_spec(tmp_path: Path, catalog: Catalog, model_config: dict[str, Any] | None = None,
                **changes: Any):  # type: ignore[no-untyped-def]
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(model_config or shallow_llama()))
    spec = {"model": str(model), **BASE}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}  # type: ignore[dict-item]
        else:
            spec[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return load_spec(path, [], catalog)


def plan(tmp_path: Path, catalog: Catalog, request: PlanRequest | None = None,
         model_config: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    loaded = loaded_spec(tmp_path, catalog, model_config, **changes)
    return make_plan(loaded, catalog, request or PlanRequest(), today=TODAY)


def test_the_whole_run_not_the_hour_decides(tmp_path) -> None:
    """A card dearer per hour that finishes soon enough is the cheaper run, and is ranked first."""
    # a model wide enough, and sequences long enough, that the cards' speed shows (not kernel dispatch)
    wide = {"model_config": WIDE, "seq_len": 2048, "packing": True, "gpus": {"count": 1}}
    even = plan(tmp_path, tiny_catalog([offer("rtx-3090", 1.0), offer("h100-sxm", 1.0)]), **wide)
    speed = {o["gpu"]: o["tokens_per_second"] for o in even["options"]}
    ratio = speed["h100-sxm"] / speed["rtx-3090"]
    assert ratio > 1.5  # the H100's roofline is several times the 3090's
    dear_per_hour = ratio * 0.8  # the H100 costs more per hour, less per run
    document = plan(tmp_path, tiny_catalog([offer("rtx-3090", 1.0), offer("h100-sxm", dear_per_hour)]), **wide)
    first, second = document["options"][:2]
    assert first["gpu"] == "h100-sxm" and first["usd_per_hour_total"] > second["usd_per_hour_total"]
    assert first["total_usd"] < second["total_usd"]
    assert first["pareto"] and not second["pareto"]  # slower and dearer: dominated
    timed = plan(tmp_path, tiny_catalog([offer("rtx-3090", 0.1), offer("h100-sxm", 10.0)]),
                 PlanRequest(optimize="time"), **wide)
    assert [o["gpu"] for o in timed["options"]] == ["h100-sxm", "rtx-3090"]
    assert all(o["pareto"] for o in timed["options"])  # one cheaper, one faster


def test_options_follow_the_json_contract_and_add_up(tmp_path) -> None:
    document = plan(tmp_path, tiny_catalog([offer("rtx-3090", 0.5, 0.2), offer("h100-sxm", 2.0, 1.0)]))
    assert {"schema_version", "spec", "dataset", "options"} <= set(document)
    data = document["dataset"]  # over all epochs (3 by default), one epoch beside them
    assert data["epochs"] == 3 and data["tokens_per_epoch"] == 20_000_000 * 200
    assert data["processed_tokens"] == 3 * 20_000_000 * 200 and data["trained_tokens"] == 3 * 20_000_000 * 120
    keys = {"gpu", "gpu_count", "provider", "spot", "usd_per_hour_total", "fits", "micro_batch", "grad_accum",
            "grad_checkpointing", "peak_reserved_gib", "tokens_per_second", "tokens_per_second_per_gpu", "hours",
            "compute_usd", "storage_usd", "preemption_usd", "total_usd", "pareto", "notes"}
    options = document["options"]
    # 2 cards × counts 1, 2, 4, 8 × on-demand and spot
    assert len(options) == 16 and all(keys <= set(o) for o in options)
    totals = [o["total_usd"] for o in options]
    assert totals == sorted(totals)
    for o in options:
        assert o["total_usd"] == pytest.approx(o["compute_usd"] + o["storage_usd"] + o["preemption_usd"], abs=0.02)
        assert o["micro_batch"] * o["grad_accum"] * o["gpu_count"] == 8  # the global batch is kept
        assert o["tokens_per_second_per_gpu"] == pytest.approx(o["tokens_per_second"] / o["gpu_count"], rel=1e-3)
        assert o["preemption_usd"] > 0 if o["spot"] else o["preemption_usd"] == 0
        per_gpu = 0.2 if o["gpu"] == "rtx-3090" else 1.0
        if not o["spot"]:
            per_gpu = 0.5 if o["gpu"] == "rtx-3090" else 2.0
        assert o["usd_per_hour_total"] == pytest.approx(per_gpu * o["gpu_count"])
    # the largest micro-batch is chosen when it fits: all 8 sequences at once on one GPU
    single = next(o for o in options if o["gpu_count"] == 1)
    assert (single["micro_batch"], single["grad_accum"], single["grad_checkpointing"]) == (8, 1, False)


def test_what_the_user_fixed_is_honoured(tmp_path) -> None:
    catalog = tiny_catalog([offer("h100-sxm", 2.0)])
    document = plan(tmp_path, catalog, micro_batch=2, grad_checkpointing=True)
    fitting = [o for o in document["options"] if o["fits"]]
    assert fitting and all(o["micro_batch"] == 2 and o["grad_checkpointing"] for o in fitting)
    assert {o["grad_accum"] * o["gpu_count"] for o in fitting} == {4}
    # 8 GPUs cannot split 8 sequences into micro-batches of 2: listed with the reason
    eight = [o for o in document["options"] if o["gpu_count"] == 8 and o["gpu"] == "h100-sxm"]
    assert eight and not eight[0]["fits"] and "micro_batch 2" in eight[0]["notes"][0]
    counted = plan(tmp_path, catalog, gpus={"count": 2})
    assert {o["gpu_count"] for o in counted["options"]} == {2}


def test_optimizer_in_backward_takes_the_whole_share_in_one_micro_batch(tmp_path) -> None:
    catalog = tiny_catalog([offer("h100-sxm", 2.0)])
    document = plan(tmp_path, catalog, optimizer_in_backward=True)
    fitting = [o for o in document["options"] if o["fits"]]
    assert {o["gpu_count"] for o in fitting} == {1, 2, 4, 8}
    assert all(o["grad_accum"] == 1 and o["micro_batch"] == 8 // o["gpu_count"] for o in fitting)
    # a fixed micro-batch that cannot hold the share is refused with the reason
    fixed = plan(tmp_path, catalog, optimizer_in_backward=True, micro_batch=2)
    single = next(o for o in fixed["options"] if o["gpu_count"] == 1)
    assert not single["fits"] and "optimizer_in_backward" in single["notes"][0]
    assert next(o for o in fixed["options"] if o["gpu_count"] == 4)["fits"]


def _device_gib(tmp_path: Path, catalog: Catalog, gpu: str, micro_batch: int, checkpointing: bool,
                **changes: Any) -> float:
    loaded = loaded_spec(tmp_path, catalog, WIDER, **changes)
    planner = Planner(loaded, catalog, workload_for(loaded, catalog))
    return planner._estimate(loaded.spec, catalog.gpus.get(gpu), micro_batch, checkpointing).device_total_gib


def test_checkpointing_and_smaller_micro_batches_only_when_needed(tmp_path) -> None:
    probe = tiny_catalog([])
    full_batch = _device_gib(tmp_path, probe, "h100-sxm", 8, False)
    two = _device_gib(tmp_path, probe, "h100-sxm", 2, False)
    assert two < full_batch
    # room for micro-batches up to 4 but not 8: the planner stays without checkpointing
    usable = (two + (full_batch - two) * 0.5) / 0.95
    catalog = tiny_catalog([offer("h100-sxm", 2.0)], memory={"h100-sxm": usable}, slugs=("h100-sxm",))
    document = plan(tmp_path, catalog, model_config=WIDER, gpus={"count": 1})
    [single] = [o for o in document["options"] if o["total_usd"] is not None]
    assert single["fits"] and single["micro_batch"] <= 4 and single["grad_accum"] == 8 // single["micro_batch"]
    assert not single["grad_checkpointing"] and single["peak_reserved_gib"] <= usable
    # of the micro-batches that fit, it takes the one with the most real tokens per second (unpacked, a larger
    # one pads more)
    loaded = loaded_spec(tmp_path, catalog, WIDER, gpus={"count": 1})
    planner = Planner(loaded, catalog, workload_for(loaded, catalog))
    gpu = catalog.gpus.get("h100-sxm")
    chosen = planner.configure(gpu, 1)
    assert not isinstance(chosen, str) and chosen.micro_batch == single["micro_batch"]
    spec = chosen.spec
    for micro_batch in (1, 2, 4):
        memory = planner._estimate(spec, gpu, micro_batch, False)
        other = planner._configuration(gpu, 1, spec, micro_batch, 8 // micro_batch, False, memory, ())
        assert chosen.tokens_per_second >= other.tokens_per_second


def test_a_card_too_small_is_listed_with_the_reason_and_plan_allow_changes_the_method(tmp_path) -> None:
    # (a wider model than the others: the tiny one's states vanish in the allocator's rounding; a global
    # batch of 1 leaves the planner one micro-batch to try)
    probe = tiny_catalog([])
    full = _device_gib(tmp_path, probe, "h100-sxm", 1, True, method="full")  # the least full fine-tuning needs
    lora = _device_gib(tmp_path, probe, "h100-sxm", 1, False, method="lora")  # LoRA without checkpointing
    assert lora < full
    usable = (lora + full) / 2 / 0.95
    catalog = tiny_catalog([offer("h100-sxm", 2.0)], memory={"h100-sxm": usable}, slugs=("h100-sxm",))
    refused = plan(tmp_path, catalog, model_config=WIDER, method="full", global_batch=1, gpus={"count": 1})
    [h100] = refused["options"]
    assert not h100["fits"] and h100["total_usd"] is None
    assert h100["notes"][0].startswith("does not fit: at best") and "GiB over" in h100["notes"][0]
    assert refused["recommendations"][0].startswith("Nothing fits")
    allowed = plan(tmp_path, catalog, model_config=WIDER, method="full", global_batch=1, gpus={"count": 1},
                   plan={"allow": ["lora"]})
    h100 = allowed["options"][0]
    assert h100["fits"] and h100["changes"] == ["lora"] and not h100["grad_checkpointing"]


def test_budget_and_deadline_filter(tmp_path) -> None:
    catalog = tiny_catalog([offer("rtx-3090", 0.5), offer("h100-sxm", 2.0)])
    everything = plan(tmp_path, catalog, gpus={"count": 1})
    cheap, dear = sorted(everything["options"], key=lambda o: o["total_usd"])
    within = plan(tmp_path, catalog, PlanRequest(budget_usd=(cheap["total_usd"] + dear["total_usd"]) / 2),
                  gpus={"count": 1})
    assert [o["gpu"] for o in within["options"]] == [cheap["gpu"]] and within["filtered_out"] == 1
    fast = min(everything["options"], key=lambda o: o["hours"])
    slow = max(everything["options"], key=lambda o: o["hours"])
    soon = plan(tmp_path, catalog, PlanRequest(deadline_hours=(fast["hours"] + slow["hours"]) / 2),
                gpus={"count": 1})
    assert [o["gpu"] for o in soon["options"]] == [fast["gpu"]]
    nothing = plan(tmp_path, catalog, PlanRequest(budget_usd=cheap["total_usd"] / 2), gpus={"count": 1})
    assert nothing["filtered_out"] == 2 and nothing["recommendations"][0].startswith("No run meets the budget")
    assert f"${cheap['total_usd']:,.2f}" in nothing["recommendations"][0]


def test_node_offers_bill_the_whole_node_and_stale_prices_are_flagged(tmp_path) -> None:
    catalog = tiny_catalog([offer("h100-sxm", 2.0, gpu_count=8, as_of=date(2026, 5, 1))])
    document = plan(tmp_path, catalog)
    priced = [o for o in document["options"] if o["total_usd"] is not None]
    assert {o["gpu_count"] for o in priced} == {1, 2, 4, 8}
    assert all(o["usd_per_hour_total"] == pytest.approx(16.0) for o in priced)
    assert all(any("a list price older than 30 days" in n for n in o["notes"]) for o in priced)
    assert any(any("whole nodes of 8" in n for n in o["notes"]) for o in priced if o["gpu_count"] < 8)


def test_a_fitting_card_without_offers_is_listed_unpriced(tmp_path) -> None:
    document = plan(tmp_path, tiny_catalog([offer("h100-sxm", 2.0)]), gpus={"count": 1})
    unpriced = [o for o in document["options"] if o["gpu"] == "rtx-3090"]
    assert unpriced and unpriced[0]["fits"] and unpriced[0]["total_usd"] is None and unpriced[0]["hours"] > 0
    assert document["options"][0]["gpu"] == "h100-sxm"  # priced options first


def test_a_plan_without_a_dataset_names_the_missing_field(tmp_path) -> None:
    catalog = tiny_catalog([offer("h100-sxm", 2.0)])
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(shallow_llama()))
    loaded = load_spec(None, [Override("model", str(model), "--model")], catalog)
    with pytest.raises(TunecastError) as error:
        make_plan(loaded, catalog, PlanRequest(), today=TODAY)
    assert error.value.field is not None and "dataset" in error.value.field
    with pytest.raises(ConfigError):
        load_spec(None, [Override("model", str(model), "--model"), Override("dataset.examples", -1, "--set")],
                  catalog)


def test_the_plan_is_cached_until_an_input_changes(tmp_path, monkeypatch) -> None:
    catalog = tiny_catalog([offer("h100-sxm", 2.0)])
    loaded = loaded_spec(tmp_path, catalog, gpus={"count": 1})
    first = make_plan(loaded, catalog, PlanRequest(), today=TODAY)
    calls = []
    monkeypatch.setattr(report, "_compute", lambda *a, **k: calls.append(1) or {"recomputed": True})
    assert make_plan(loaded, catalog, PlanRequest(), today=TODAY) == first and not calls
    dearer = tiny_catalog([offer("h100-sxm", 3.0)])
    assert make_plan(loaded, dearer, PlanRequest(), today=TODAY) == {"recomputed": True}
    assert make_plan(loaded, catalog, PlanRequest(budget_usd=1.0), today=TODAY) == {"recomputed": True}


def _priced(total: float, hours: float) -> Option:
    cost = OfferCost("p", False, 1.0, hours, total, 0.0, 0.0, 0.5, 0.0, ())
    return Option(None, "g", 1, cost)


def test_pareto_front_and_ranking() -> None:
    options = [_priced(10, 5), _priced(8, 9), _priced(12, 4), _priced(11, 6), _priced(8, 10)]
    mark_pareto(options)
    assert [o.pareto for o in options] == [True, True, True, False, False]
    by_cost = rank(options, optimize="cost")
    assert [(o.cost.total_usd, o.cost.hours) for o in by_cost][:2] == [(8, 9), (8, 10)]  # type: ignore[union-attr]
    by_time = rank(options, optimize="time")
    assert [o.cost.hours for o in by_time] == [4, 5, 6, 9, 10]  # type: ignore[union-attr]
    unfit = Option(None, "g", 2, None, "does not fit")
    assert rank([unfit, *options], optimize="cost")[-1] is unfit


def test_an_unknown_ranking_is_a_user_error(tmp_path) -> None:
    catalog = tiny_catalog([])
    with pytest.raises(TunecastError) as error:
        make_plan(loaded_spec(tmp_path, catalog), catalog, PlanRequest(optimize="price"), today=TODAY)
    assert error.value.field == "--optimize"


def test_evaluation_adds_forward_passes_to_the_run(tmp_path) -> None:
    catalog = tiny_catalog([offer("h100-sxm", 2.0)], slugs=("h100-sxm",))
    plain = plan(tmp_path, catalog, gpus={"count": 1})["options"][0]
    assert plain["eval_hours"] == 0
    per_epoch = plan(tmp_path, catalog, gpus={"count": 1}, eval={"examples": 2_000_000})["options"][0]
    # three epochs: three evaluations of a tenth of the training examples, forward passes only
    assert per_epoch["eval_hours"] > 0 and per_epoch["hours"] > plain["hours"]
    train_hours = plain["hours"]
    assert per_epoch["eval_hours"] < 3 * 0.1 * train_hours * 0.6
    often = plan(tmp_path, catalog, gpus={"count": 1},
                 eval={"examples": 2_000_000, "every_steps": 1_000_000})["options"][0]
    steps = 3 * 20_000_000 // 8  # 7,500,000: seven evaluations at each millionth step and one after the last
    assert often["eval_hours"] == pytest.approx(per_epoch["eval_hours"] * (steps // 1_000_000 + 1) / 3, rel=0.01)


def test_a_profile_traced_at_one_shape_is_not_used_at_another(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fitted profiles fall back to the longest sequence's exact shape (operations differed between
    shapes), the step's work is traced again at the padded length the micro-batches really have: work at
    the full seq_len would be charged for every padded micro-batch."""
    from tunecast.estimate import profiles
    from tunecast.plan import planner as planner_module

    catalog = tiny_catalog([offer("h100-sxm", 2.0)], slugs=("h100-sxm",))
    loaded = loaded_spec(tmp_path, catalog, gpus={"count": 1})
    planner = Planner(loaded, catalog, workload_for(loaded, catalog))
    spec = loaded.spec
    gpu = catalog.gpus.get("h100-sxm")
    memory = planner._estimate(spec, gpu, 2, False)
    asked: list[tuple[int, int, bool]] = []

    def exact_only(config: Any, settings: Any, batch: int, seq: int, *, exact: bool = False) -> Any:
        asked.append((batch, seq, exact))
        pair = profiles.get_profiles(config, settings, batch, seq, exact=True)
        return dataclasses.replace(pair, exact_shape=(batch, seq))

    monkeypatch.setattr(planner_module, "get_profiles", exact_only)
    configured = planner._configuration(gpu, 1, spec, 2, 4, False, memory, ())
    padded = round(planner.workload.tokens_per_sequence(2))
    assert padded < spec.seq_len
    assert asked == [(2, spec.seq_len, False), (2, padded, True)]
    assert configured.step.tokens_per_step == 2 * padded * 4


def test_several_nodes_are_planned_where_the_network_between_them_is_published(tmp_path) -> None:
    """16 and 32 GPUs are nodes of 8, planned on the offers that publish their inter-node network and slower over
    a slower one; each option names its engine, launcher and nodes."""
    node = {"gpu_count": 8, "spot_usd_per_hour": 1.0}
    catalog = tiny_catalog([offer("h100-sxm", 2.0, **node, provider="fast-net", internode_gb_per_s=400.0),
                            offer("h100-sxm", 1.9, **node, provider="slow-net", internode_gb_per_s=12.5),
                            offer("h100-sxm", 1.5, **node, provider="no-net")], slugs=("h100-sxm",))
    document = plan(tmp_path, catalog, model_config=WIDE, method="full", global_batch=32)
    many = [o for o in document["options"] if o["gpu_count"] > 8]
    assert {o["gpu_count"] for o in many} == {16, 32}
    assert {o["provider"] for o in many} == {"fast-net", "slow-net"}
    for option in many:
        assert option["nodes"] == option["gpu_count"] // 8 and option["engine"] == "DDP"
        assert option["launcher"].startswith(f"tunecast export skypilot --gpus {option['gpu_count']} --nodes")
        if option["spot"]:
            assert any(f"{option['nodes']} nodes: preempted" in note for note in option["notes"])

    def speed(provider: str, count: int) -> float:
        return next(o["tokens_per_second"] for o in many if o["provider"] == provider and o["gpu_count"] == count)

    assert speed("slow-net", 16) < speed("fast-net", 16)
    one_node = [o for o in document["options"] if o["gpu_count"] <= 8]
    assert {o["provider"] for o in one_node} == {"fast-net", "slow-net", "no-net"}
    eight = next(o for o in one_node if o["gpu_count"] == 8)
    assert eight["launcher"].startswith("tunecast train --gpus 8") and eight["nodes"] == 1
    single = plan(tmp_path, catalog, model_config=WIDE, method="full", global_batch=32, gpus={"count": 1})
    assert {o["launcher"] for o in single["options"]} == {"tunecast train"}


def test_the_planner_tries_on_several_gpus_only_changes_that_train_there() -> None:
    from tunecast.config.spec import RunSpec
    from tunecast.plan.planner import _applicable

    allowing = RunSpec.model_validate({"model": "x", "plan": {"allow": ["chunked_loss", "optimizer_in_backward",
                                                                         "qlora"]}})
    assert all(_applicable(name, allowing, 1) for name in ("chunked_loss", "optimizer_in_backward", "qlora"))
    assert not _applicable("chunked_loss", allowing, 2) and not _applicable("optimizer_in_backward", allowing, 2)
    assert _applicable("qlora", allowing, 2)  # under DDP
    sharding = allowing.with_changes({"plan.allow": ["qlora", "fsdp"]})
    assert not _applicable("qlora", sharding, 2) and _applicable("qlora", sharding, 1)
