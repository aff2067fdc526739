"""The plan report's charts and flags without a browser (tests/integration/test_reports.py renders the pages): log
ticks that say their value, an old price marked, and a plan or a run that costs nothing drawn as no cost."""

from __future__ import annotations

import html
import json
from typing import Any

from tunecast.catalog.store import load_catalog
from tunecast.report.html import hours_tick, log_ticks, usd_tick
from tunecast.report.plan import plan_report
from tunecast.report.run import RunRecords, run_report


def test_log_ticks_say_their_value_whole() -> None:
    hours = log_ticks([0.28, 0.6, 2.4], hours_tick)
    assert hours["ticktext"] == ["0.2 h", "0.3 h", "0.5 h", "1 h", "2 h", "3 h"]
    assert hours["tickvals"] == [0.2, 0.3, 0.5, 1.0, 2.0, 3.0]
    usd = log_ticks([0.5, 40.0, 900.0], usd_tick)  # three decades: 1, 2 and 5 of each
    assert usd["ticktext"] == ["$0.5", "$1", "$2", "$5", "$10", "$20", "$50", "$100", "$200", "$500", "$1,000"]
    wide = log_ticks([0.01, 500.0], hours_tick)  # past four decades: the powers of ten
    assert wide["ticktext"] == ["0.01 h", "0.1 h", "1 h", "10 h", "100 h"]


def _option(gpu: str, usd_per_hour: float, hours: float, *, stale: bool = False) -> dict[str, Any]:
    return {"gpu": gpu, "gpu_count": 1, "provider": "somecloud", "spot": False, "usd_per_hour_total": usd_per_hour,
            "fits": True, "micro_batch": 4, "grad_accum": 2, "grad_checkpointing": False, "strategy": "ddp",
            "device_total_gib": 20.0, "capacity_gib": 22.8, "tokens_per_second": 5000.0, "hours": hours,
            "total_usd": round(usd_per_hour * hours, 2), "pareto": True, "launcher": "tunecast train",
            "memory_breakdown_gib": {"weights": 15.0, "activations": 5.0},
            "price_stale": stale, "price_as_of": "2026-06-17" if stale else "2026-11-20",
            "price_age_days": 165 if stale else 10}


def _document(options: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": {"name": "me/tiny", "params": 1000}, "optimize": "cost", "global_batch": 8,
            "spec": {"method": "lora", "precision": "bf16", "seq_len": 1024},
            "dataset": {"processed_tokens": 1000, "trained_tokens": 1000, "epochs": 1.0, "length": "1 epoch"},
            "recommendations": ["Cheapest: …"], "options": options, "warnings": []}


def _chart(page: str, name: str) -> dict[str, Any]:
    payload = page.split(f'data-chart="{name}"', 1)[1].split("var c = ", 1)[1].split("; Plotly.newPlot", 1)[0]
    return json.loads(payload.replace("<\\/", "</"))  # type: ignore[no-any-return]


def test_an_old_price_is_marked_in_the_ranked_options() -> None:
    page = plan_report(_document([_option("rtx-3090", 0.18, 2.0, stale=True), _option("h100-sxm", 2.5, 0.4)]),
                       load_catalog(None))
    table = page.split('data-table="options"', 1)[1].split("</table>", 1)[0]
    assert "$0.18*" in table and "$2.50*" not in table and "$2.50" in table
    assert "1 of these prices are old (a marketplace's after 1 day, a list price's after 30 days; the oldest from " \
           "2026-06-17)" in html.unescape(page)
    layout = _chart(page, "cost-vs-time")["layout"]
    assert layout["xaxis"]["type"] == "log" and "0.5 h" in layout["xaxis"]["ticktext"]
    assert layout["yaxis"]["type"] == "log" and all(text.startswith("$") for text in layout["yaxis"]["ticktext"])


def test_a_plan_that_costs_nothing_draws_no_cost_axis_from_minus_one() -> None:
    catalog = load_catalog(None)
    free = plan_report(_document([_option("rtx-3090", 0.0, 2.0), _option("rtx-4090", 0.0, 1.5)]), catalog)
    assert 'data-chart="cost-vs-time"' not in free and "No cost to chart" in free
    mixed = _chart(plan_report(_document([_option("rtx-3090", 0.0, 2.0), _option("h100-sxm", 2.5, 0.4)]), catalog),
                   "cost-vs-time")["layout"]
    assert mixed["yaxis"].get("type") != "log" and mixed["yaxis"]["rangemode"] == "tozero"


def test_a_run_without_a_price_says_so_instead_of_a_flat_line() -> None:
    start = {"kind": "event", "event": "start", "step": 0, "total_steps": 2, "usd_per_hour": 0.0, "elapsed_s": 0.0}
    steps = [{"kind": "train", "step": step, "loss": 2.0, "learning_rate": 1e-4, "tokens": 100, "step_seconds": 0.1,
              "tokens_per_second": 1000.0, "elapsed_s": 0.1 * step, "cost_usd": 0.0, "projected_cost_usd": 0.0}
             for step in (1, 2)]
    text = "".join(json.dumps(record) + "\n" for record in (start, *steps))
    page = run_report("/runs/x", RunRecords.parse(text), None)
    cost = page.split('data-chart="cost"', 1)[1].split("</figure>", 1)[0]
    assert "No cost to chart" in cost and "pricing.usd_per_hour" in cost and "Plotly.newPlot" not in cost
    priced = "".join(json.dumps(record) + "\n" for record in
                     (start, *({**s, "cost_usd": 0.01 * s["step"]} for s in steps)))
    drawn = _chart(run_report("/runs/x", RunRecords.parse(priced), None), "cost")
    assert drawn["layout"]["yaxis"]["rangemode"] == "tozero"
