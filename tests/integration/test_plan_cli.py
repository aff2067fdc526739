"""`tunecast plan` and `tunecast breakeven` end to end through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.models import shallow_llama

OPTION_KEYS = {"gpu", "gpu_count", "provider", "spot", "usd_per_hour_total", "fits", "micro_batch", "grad_accum",
               "grad_checkpointing", "peak_reserved_gib", "tokens_per_second", "tokens_per_second_per_gpu", "hours",
               "compute_usd", "storage_usd", "preemption_usd", "total_usd", "pareto", "notes", "strategy", "engine",
               "launcher", "nodes", "least_device_total_gib", "exposed_comm_s", "comm_link"}


pytestmark = pytest.mark.usefixtures("profile_cache")


@pytest.fixture
def model(tmp_path: Path) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(shallow_llama()))
    return str(path)


def plan_args(model: str, *extra: str) -> list[str]:
    return ["plan", "--model", model, "--method", "lora", "--seq-len", "256", "--global-batch", "8",
            "--set", "dataset.examples=1000000", "--set", "dataset.mean_tokens=200", *extra]


def test_plan_json_follows_the_contract(cli, model) -> None:
    # the batch shape fixed: one memory estimate per GPU count (the planner's choices are tested elsewhere)
    result = cli(*plan_args(model, "--gpu", "H100", "--micro-batch", "1", "--no-grad-checkpointing", "--json"))
    # (--gpu is an alias: options name the canonical slug)
    assert result.code == 0, result.stderr
    document = result.json()
    assert {"schema_version", "spec", "dataset", "options"} <= set(document)
    assert document["dataset"]["processed_tokens"] == 3 * 1_000_000 * 200
    assert document["dataset"]["trained_tokens"] == document["dataset"]["processed_tokens"]  # no prompts declared
    options = document["options"]
    assert options and all(set(o) >= OPTION_KEYS for o in options)
    # one node of 1-8, and 2 or 4 nodes of 8 on the H100 offers that publish their network between nodes
    assert {o["gpu"] for o in options} == {"h100-sxm"} and {o["gpu_count"] for o in options} == {1, 2, 4, 8, 16, 32}
    assert all(o["nodes"] == max(1, o["gpu_count"] // 8) for o in options)
    # several GPUs: the communication a step cannot hide, and the link it assumed (the network past one node)
    for option in (o for o in options if o["fits"]):
        single = option["gpu_count"] == 1
        assert (option["comm_link"] is None) == single and (option["exposed_comm_s"] == 0) == single
        if option["gpu_count"] > 8:
            assert option["comm_link"]["name"].startswith("network between nodes")
        elif not single:
            assert option["comm_link"]["name"].startswith("nvlink")
    priced = [o["total_usd"] for o in options if o["total_usd"] is not None]
    assert priced == sorted(priced) and any(o["pareto"] for o in options)
    assert {o["spot"] for o in options} == {False, True}  # spot offers priced beside on-demand


def test_plan_table_and_recommendations(cli, model) -> None:
    result = cli(*plan_args(model, "--gpu", "h100-sxm", "--gpus", "1", "--optimize", "time"))
    assert result.code == 0, result.stderr
    assert "Runs ranked by hours" in result.stdout and "Cheapest:" in result.stdout
    assert "1×h100-sxm" in result.stdout
    assert " comm " in result.stdout  # the share of a step the GPUs' communication adds (blank on one GPU)


def test_a_plan_without_a_dataset_size_names_the_field(cli, model) -> None:
    result = cli("plan", "--model", model, "--gpu", "h100-sxm")
    assert result.code == 2 and "Traceback" not in result.stderr
    assert "dataset" in result.stderr and "mean_tokens" in result.stderr


@pytest.mark.parametrize(("args", "flag"), [(["--optimize", "price"], "--optimize"),
                                            (["--budget", "-5"], "--budget"), (["--deadline", "0"], "--deadline")])
def test_bad_plan_flags_exit_2(cli, model, args, flag) -> None:
    result = cli(*plan_args(model, "--gpu", "h100-sxm", *args))
    assert result.code == 2 and flag in result.stderr and "Traceback" not in result.stderr


def test_breakeven_quoted_example(cli) -> None:
    result = cli("breakeven", "--purchase-usd", "3800", "--rent-usd-per-hour", "0.78", "--hours-per-month", "350",
                 "--json")
    assert result.code == 0, result.stderr
    assert result.json()["breakeven_hours"] == 4871.8 and result.json()["breakeven_months"] == 13.9
    powered = cli("breakeven", "--purchase-usd", "3800", "--rent-usd-per-hour", "0.78", "--hours-per-month", "350",
                  "--power-w", "450", "--usd-per-kwh", "0.30", "--json").json()
    assert powered["breakeven_hours"] == pytest.approx(3800 / (0.78 - 0.135), abs=0.1)
    words = cli("breakeven", "--gpu", "rtx-4090", "--hours-per-month", "200")
    assert words.code == 0 and "break-even after" in words.stdout


def test_breakeven_in_units_of_work(cli, tmp_path) -> None:
    # wide enough that the GPUs' work, not dispatching kernels, sets the pace
    model = tmp_path / "wide.json"
    model.write_text(json.dumps(shallow_llama(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                           num_key_value_heads=4)))
    run = tmp_path / "run.yaml"
    # the batch shape fixed: one memory estimate per card
    run.write_text(f"model: {model}\nmethod: lora\nseq_len: 1024\nglobal_batch: 8\nmicro_batch: 8\n"
                   "grad_checkpointing: false\ndataset:\n  examples: 1000000\n  mean_tokens: 200\n")
    result = cli("breakeven", "--gpu", "rtx-4090", "--rent-gpu", "h100-sxm", "--run", str(run), "--json")
    assert result.code == 0, result.stderr
    work = result.json()["work"]
    assert 0 < work["rented_hours_per_run"] < work["owned_hours_per_run"]  # the H100 is faster
    assert work["rented_usd_per_run"] > 0 and work["breakeven_runs"] > 0
    # the run's own budget and deadline choose among plans; they hide no card from rent-or-buy
    bounded = tmp_path / "bounded.yaml"
    bounded.write_text(run.read_text() + "plan:\n  budget_usd: 0.01\n  deadline_hours: 0.001\n")
    tight = cli("breakeven", "--gpu", "rtx-4090", "--rent-gpu", "h100-sxm", "--run", str(bounded), "--json")
    assert tight.code == 0, tight.stderr
    assert tight.json()["work"] == work


def test_breakeven_without_a_price_names_the_flag(cli) -> None:
    result = cli("breakeven", "--rent-usd-per-hour", "1.0")
    assert result.code == 2 and "--purchase-usd" in result.stderr


def test_micro_batch_auto_is_left_open_by_plan(cli, model) -> None:
    fixed = cli(*plan_args(model, "--gpu", "H100", "--gpus", "1", "--micro-batch", "2", "--json"))
    auto = cli(*plan_args(model, "--gpu", "H100", "--gpus", "1", "--micro-batch", "auto", "--json"))
    assert fixed.code == 0 and auto.code == 0, auto.stderr
    assert {o["micro_batch"] for o in fixed.json()["options"] if o["fits"]} == {2}
    assert {o["micro_batch"] for o in auto.json()["options"] if o["fits"]} == {8}  # the whole step fits at once


@pytest.mark.parametrize("value", ["0", "abc", "-2"])
def test_micro_batch_must_be_a_number_or_auto(cli, model, value: str) -> None:
    result = cli("validate", "--model", model, "--micro-batch", value)
    assert result.code == 2
    assert "must be a whole number ≥ 1 or auto" in result.stderr
    assert result.stderr.count("✗") == 1


def test_the_runs_ranking_budget_and_deadline_are_read_and_flags_win(cli, model, tmp_path) -> None:
    flags = cli(*plan_args(model, "--gpu", "h100-sxm", "--json")).json()
    totals = sorted(o["total_usd"] for o in flags["options"] if o["total_usd"] is not None)
    budget = totals[len(totals) // 2]
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {model}\nmethod: lora\nseq_len: 256\nglobal_batch: 8\ngpus:\n  gpu: h100-sxm\n"
                   f"dataset:\n  examples: 1000000\n  mean_tokens: 200\nplan:\n  optimize: time\n  budget_usd: {budget}\n")
    own = cli("plan", str(run), "--json").json()
    flagged = cli(*plan_args(model, "--gpu", "h100-sxm", "--optimize", "time", "--budget", str(budget), "--json"))
    assert own["options"] == flagged.json()["options"] and own["filtered_out"] > 0
    assert own["optimize"] == "time" and own["budget_usd"] == budget
    wider = cli("plan", str(run), "--budget", str(totals[-1] * 2), "--optimize", "cost", "--json").json()
    assert wider["filtered_out"] == 0 and wider["optimize"] == "cost"
    refused = cli("validate", str(run), "--set", "plan.budget_usd=-1")
    assert refused.code == 2 and "plan.budget_usd" in refused.stderr


def test_an_old_price_is_marked_in_the_table_and_the_recommendation(cli, model) -> None:
    from tunecast.catalog.offers import OFFER_COLUMNS, Offer
    from tunecast.catalog.rows import write_rows
    from tunecast.paths import default_user_catalog_dir

    old = Offer.model_validate({"provider": "oldcloud", "gpu": "h100-sxm", "gpu_count": 1, "usd_per_hour": 0.01,
                                "billing_increment_s": 1, "minimum_charge_s": 0, "boot_billed": False,
                                "volume_usd_per_gb_month": 0.1, "as_of": "2020-01-01", "source": "a test"})
    catalog = default_user_catalog_dir()
    catalog.mkdir(parents=True, exist_ok=True)
    (catalog / "offers.csv").write_text(write_rows([old], OFFER_COLUMNS))
    args = plan_args(model, "--gpu", "h100-sxm", "--gpus", "1", "--set", "pricing.spot=false")
    document = cli(*args, "--json").json()
    first = document["options"][0]
    assert first["provider"] == "oldcloud" and first["price_stale"] and first["price_as_of"] == "2020-01-01"
    assert first["price_age_days"] > 2000
    assert any(line.startswith("Old price: 1 × h100-sxm on oldcloud is from 2020-01-01")
               for line in document["recommendations"])
    table = cli(*args)
    assert table.code == 0 and "2020-01-01*" in table.stdout  # the price's date, marked
    assert "after 30 days; the oldest shown is from 2020-01-01)" in " ".join(table.stdout.split())


def test_check_is_a_pre_flight_gate_over_the_budget_and_deadline(cli, model) -> None:
    fixed = ("--gpu", "H100", "--micro-batch", "1", "--no-grad-checkpointing")
    passes = cli(*plan_args(model, *fixed, "--check", "--json"))
    assert passes.code == 0, passes.stderr
    document = passes.json()
    cheapest = min(o["total_usd"] for o in document["options"] if o["fits"] and o["total_usd"] is not None)
    over_budget = cli(*plan_args(model, *fixed, "--check", "--budget", f"{cheapest / 2:.4f}"))
    assert over_budget.code == 3
    assert "check failed: no option that fits meets a budget of $" in over_budget.stderr
    assert cli(*plan_args(model, *fixed, "--budget", f"{cheapest / 2:.4f}")).code == 0  # no gate asked
    fastest = min(o["hours"] for o in document["options"] if o["fits"])
    late = cli(*plan_args(model, *fixed, "--check", "--deadline", f"{fastest / 2:.6f}"))
    assert late.code == 3 and "a deadline of" in late.stderr


def test_offline_a_refresh_says_each_unreachable_source_once_and_the_plan_is_unchanged(
        cli, model, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network (every source at a port that refuses): `offers --refresh` exits 0 with one line per source, and
    `plan --refresh` plans with the prices it had."""
    for variable in ("GPUHUNT_CATALOG_URL", "TUNECAST_SKYPILOT_CATALOG_URL", "TUNECAST_VASTAI_URL"):
        monkeypatch.setenv(variable, "http://127.0.0.1:9/unreachable")
    monkeypatch.delenv("GPUHUNT_CATALOG_DIR", raising=False)
    refreshed = cli("offers", "--refresh", "--gpu", "h100-sxm")
    assert refreshed.code == 0 and "h100-sxm" in refreshed.stdout
    lines = [line for line in refreshed.stderr.splitlines() if "could not refresh" in line]
    assert [line.split(":")[0] for line in lines] == ["gpuhunt", "skypilot"], refreshed.stderr
    assert "the last snapshot of each stays" in " ".join(refreshed.stderr.split())
    args = plan_args(model, "--gpu", "h100-sxm", "--gpus", "1")
    before = cli(*args, "--json").json()
    after = cli(*args, "--refresh", "--json")
    assert after.code == 0 and len([line for line in after.stderr.splitlines() if "could not refresh" in line]) == 2
    document = after.json()
    assert all(not item["ok"] for item in document.pop("refreshed"))
    assert document["options"] == before["options"]
    unknown = cli("offers", "--refresh", "--provider", "nowhere-cloud")
    assert unknown.code == 2 and "--provider" in unknown.stderr and "no price source refreshes" in unknown.stderr
