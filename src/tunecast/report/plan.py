"""The plan report (`tunecast plan … --report FILE`): the plan document of `tunecast plan --json`, drawn.

* the ranked options, a sortable table (every priced option);
* cost against time for every option, the Pareto front joined and marked, the recommendation starred;
* per GPU, the memory of its best option (or, where none fits, the smallest it came to) stacked by category
  against the memory the plan may use of it: what does not fit stands over the line;
* rent versus buy for the card of the cheapest one-GPU run the catalog gives a purchase price for: cumulative cost
  over months at `tunecast breakeven`'s default use (200 hours a month), the break-even point marked;
* what the numbers rest on: the dataset's figures, the catalog rows of the options shown (provider, price, date,
  source), the calibration, the plan's warnings.
"""

from __future__ import annotations

from typing import Any

from tunecast.catalog.offers import STALE_AFTER_DAYS
from tunecast.catalog.store import Catalog
from tunecast.plan.planner import SAME_TIME_WITHIN, gpus_text
from tunecast.report.html import chart, facts, hours_tick, link, log_ticks, page, paragraph, section, table, usd_tick

HOURS_PER_MONTH = 200.0  # `tunecast breakeven`'s default
MONTHS = 36
TABLE_ROWS = 200
SOURCE_ROWS = 30


def plan_report(document: dict[str, Any], catalog: Catalog) -> str:
    options = document["options"]
    priced = [o for o in options if o["total_usd"] is not None]
    spec, data = document["spec"], document["dataset"]
    title = f"Plan: {document['model']['name']} · {spec['method']} · {spec['precision']}"
    subtitle = (f"{data['processed_tokens']:,} tokens processed ({data['trained_tokens']:,} trained) over "
                f"{data['length']}, global batch {document['global_batch']} × {spec['seq_len']}; "
                f"{len(priced)} priced options, ranked by "
                + ("total cost" if document["optimize"] == "cost" else "hours"))
    sections = [
        section("Recommendation", *(paragraph(line) for line in document["recommendations"])),
        section("Cost against time", _cost_time(priced)),
        section("Memory per GPU", _memory(options)),
        section("Ranked options", _options_table(priced)),
        section("Rent or buy", _rent_or_buy(priced, catalog)),
        section("What the numbers rest on", _assumptions(document, priced, catalog)),
    ]
    return page(title, subtitle, sections)


def _label(option: dict[str, Any]) -> str:
    return f"{gpus_text(option)} · {option['provider']}{' spot' if option['spot'] else ''}"


def _cost_time(priced: list[dict[str, Any]]) -> str:
    import plotly.graph_objects as go

    if not priced:
        return paragraph("No option is priced: nothing to draw.", muted=True)
    free = [o for o in priced if not o["total_usd"] > 0]
    if len(free) == len(priced):
        return paragraph("No cost to chart: every priced option costs $0 (a price of $0 per hour); their hours are in "
                         "the table of ranked options.", muted=True)
    figure = go.Figure()
    for spot, symbol, name in ((False, "circle", "on-demand"), (True, "diamond", "spot")):
        chosen = [o for o in priced if o["spot"] == spot]
        if chosen:
            figure.add_trace(go.Scatter(
                x=[o["hours"] for o in chosen], y=[o["total_usd"] for o in chosen], mode="markers", name=name,
                marker={"symbol": symbol, "size": 8, "opacity": 0.55},
                text=[_label(o) for o in chosen], hovertemplate="%{text}<br>%{x:.2f} h · $%{y:,.2f}<extra></extra>"))
    front = sorted((o for o in priced if o["pareto"]), key=lambda o: o["hours"])
    figure.add_trace(go.Scatter(
        x=[o["hours"] for o in front], y=[o["total_usd"] for o in front], mode="lines+markers",
        name="Pareto front", line={"color": "#D55E00", "width": 2}, marker={"size": 10, "color": "#D55E00"},
        text=[_label(o) for o in front], hovertemplate="%{text}<br>%{x:.2f} h · $%{y:,.2f}<extra></extra>"))
    best = priced[0]
    figure.add_trace(go.Scatter(
        x=[best["hours"]], y=[best["total_usd"]], mode="markers+text", name="recommended",
        marker={"symbol": "star", "size": 18, "color": "#000000"}, text=["recommended"],
        textposition="top right", hovertemplate=f"{_label(best)}<br>%{{x:.2f}} h · $%{{y:,.2f}}<extra></extra>"))
    # a run that costs $0 has no place on a log scale: then the cost axis is linear, from $0
    cost_axis = ({"rangemode": "tozero", "tickprefix": "$"} if free else
                 {"type": "log", **log_ticks([o["total_usd"] for o in priced], usd_tick)})
    figure.update_layout(xaxis={"title": {"text": "hours (wall clock)"}, "type": "log",
                                **log_ticks([o["hours"] for o in priced], hours_tick)},
                         yaxis={"title": {"text": "whole run, USD"}, **cost_axis},
                         legend={"orientation": "h", "y": -0.2})
    scales = "a log scale of hours, cost from $0" if free else "log scales"
    return chart("cost-vs-time", figure, f"Every priced option: hours against the cost of the whole run ({scales}). "
                 f"The Pareto front joins the options nothing beats on both (hours within {SAME_TIME_WITHIN:.0%} "
                 "count as equal); the star is the first-ranked option.")


def _memory(options: list[dict[str, Any]]) -> str:
    import plotly.graph_objects as go

    per_gpu: dict[str, dict[str, Any]] = {}
    for option in options:  # ranked: of a GPU's fewest GPUs, the first option (its best; the closest if none fits)
        if option["memory_breakdown_gib"] is None:
            continue
        kept = per_gpu.get(option["gpu"])
        if kept is None or option["gpu_count"] < kept["gpu_count"]:
            per_gpu[option["gpu"]] = option
    if not per_gpu:
        return paragraph("No memory estimate to draw.", muted=True)
    gpus = sorted(per_gpu, key=lambda slug: per_gpu[slug]["capacity_gib"] or 0)
    categories: list[str] = []
    for slug in gpus:
        for name in per_gpu[slug]["memory_breakdown_gib"]:
            if name not in categories:
                categories.append(name)
    figure = go.Figure()
    labels = [f"{per_gpu[s]['gpu_count']}×{s}" + ("" if per_gpu[s]["fits"] else " (does not fit)") for s in gpus]
    for name in categories:
        figure.add_trace(go.Bar(x=labels, y=[per_gpu[s]["memory_breakdown_gib"].get(name, 0.0) for s in gpus],
                                name=name, hovertemplate=f"{name}: %{{y:.2f}} GiB<extra></extra>"))
    figure.add_trace(go.Scatter(
        x=labels, y=[per_gpu[s]["capacity_gib"] for s in gpus], mode="markers", name="usable memory",
        marker={"symbol": "line-ew-open", "size": 34, "line": {"width": 3, "color": "#000000"}},
        hovertemplate="usable: %{y:.1f} GiB<extra></extra>"))
    figure.update_layout(barmode="stack", yaxis_title="GiB per GPU", legend={"orientation": "h", "y": -0.35},
                         xaxis_tickangle=-40)
    return chart("memory-per-gpu", figure, "Per card at its fewest GPUs (one, unless the plan fixed a count): the "
                 "memory of its best option (or the least it came to, where nothing fits), by category, against what "
                 "the plan may use of the card (its usable memory less plan.memory_margin, the black bar): a stack "
                 "above the bar does not fit.")


def _options_table(priced: list[dict[str, Any]]) -> str:
    columns = [("rank", True), ("GPUs", False), ("provider", False), ("capacity", False), ("$/h", True),
               ("mb×acc", False), ("ckpt", False), ("GiB", True), ("tok/s", True), ("hours", True), ("total", True),
               ("Pareto", False), ("launcher", False)]
    rows = []
    for rank, o in enumerate(priced[:TABLE_ROWS], start=1):
        rows.append([str(rank), gpus_text(o), o["provider"],
                     "spot" if o["spot"] else "on-demand",
                     (f"${o['usd_per_hour_total']:,.2f}" + ("*" if o.get("price_stale") else ""),
                      o["usd_per_hour_total"]),
                     f"{o['micro_batch']}×{o['grad_accum']}", "yes" if o["grad_checkpointing"] else "",
                     (f"{o['device_total_gib']:.1f}", o["device_total_gib"]),
                     (f"{o['tokens_per_second']:,.0f}", o["tokens_per_second"]), (f"{o['hours']:.2f}", o["hours"]),
                     (f"${o['total_usd']:,.2f}", o["total_usd"]), "★" if o["pareto"] else "", o["launcher"] or ""])
    more = f" The first {TABLE_ROWS} of {len(priced)}; `tunecast plan --json` lists all." if len(priced) > TABLE_ROWS \
        else ""
    stale = sorted(o["price_as_of"] for o in priced[:TABLE_ROWS] if o.get("price_stale"))
    warning = paragraph(f"* {len(stale)} of these prices are old (a marketplace's after "
                        f"{STALE_AFTER_DAYS['marketplace']} day, a list price's after {STALE_AFTER_DAYS['list']} days; "
                        f"the oldest from {stale[0]}): they may have moved; `tunecast plan --refresh` fetches today's, "
                        "or check the provider before you rent. `tunecast offers` lists every price's date and "
                        "source.") if stale else ""
    return table(columns, rows, highlight=[0], name="options") + warning + paragraph(
        "Click a column head to sort." + more, muted=True)


def _rent_or_buy(priced: list[dict[str, Any]], catalog: Catalog) -> str:
    import plotly.graph_objects as go

    from tunecast.plan.breakeven import break_even

    # (a card rented for nothing, a local one without a price, is never worth buying instead)
    single = [o for o in priced if o["gpu_count"] == 1 and not o["spot"] and o["usd_per_hour_total"] > 0]
    buyable = [o for o in single if (gpu := catalog.gpus.find(o["gpu"])) is not None and gpu.purchase_usd]
    if not buyable:
        return paragraph("No one-GPU on-demand option is on a card the catalog has a purchase price for.", muted=True)
    option = buyable[0]
    gpu = catalog.gpus.get(option["gpu"])
    assert gpu.purchase_usd is not None
    rent = option["usd_per_hour_total"]
    result = break_even(purchase_usd=gpu.purchase_usd, rent_usd_per_hour=rent, hours_per_month=HOURS_PER_MONTH)
    months = list(range(MONTHS + 1))
    figure = go.Figure()
    figure.add_trace(go.Scatter(x=months, y=[rent * HOURS_PER_MONTH * m for m in months],
                                name=f"rent ({option['provider']})", mode="lines",
                                line={"color": "#0072B2", "width": 3}))
    figure.add_trace(go.Scatter(x=months, y=[gpu.purchase_usd for _ in months], name="buy (purchase price)",
                                mode="lines", line={"color": "#E69F00", "width": 3, "dash": "dash"}))
    text = "renting stays cheaper"
    if result.breakeven_months is not None:
        at = result.breakeven_months
        figure.add_trace(go.Scatter(x=[at], y=[gpu.purchase_usd], mode="markers+text", name="break-even",
                                    marker={"symbol": "x", "size": 14, "color": "#000000"},
                                    text=[f"break-even: {at:.1f} months"], textposition="bottom right"))
        text = f"buying pays for itself after {result.breakeven_hours:,.0f} hours, {at:.1f} months"
    figure.update_layout(xaxis_title=f"months at {HOURS_PER_MONTH:g} hours of use each", yaxis_title="cumulative USD",
                         legend={"orientation": "h", "y": -0.25})
    runs = HOURS_PER_MONTH / option["hours"] if option["hours"] else 0.0
    caption = (f"{gpu.name}: ${gpu.purchase_usd:,.0f} to buy (catalog, {gpu.as_of.isoformat()}) against "
               f"${rent:,.2f}/h to rent on {option['provider']} — {text}; at {HOURS_PER_MONTH:g} h a month that is "
               f"{runs:.1f} runs of this plan a month. Electricity and resale are not counted here: "
               "`tunecast breakeven --gpu … --usd-per-kwh … --resale-usd …` counts them.")
    return chart("rent-vs-buy", figure, caption)


def _assumptions(document: dict[str, Any], priced: list[dict[str, Any]], catalog: Catalog) -> str:
    from tunecast.catalog.store import today

    data = document["dataset"]
    on = today()
    def shown_value(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        return f"{value:,}" if isinstance(value, int) else str(value)

    dataset = facts([(key.replace("_", " "), shown_value(value)) for key, value in data.items()
                     if not isinstance(value, (dict, list)) and value is not None])
    shown: list[tuple[str, str]] = []
    for option in priced:
        key = (option["provider"], option["gpu"])
        if key not in shown:
            shown.append(key)
        if len(shown) >= SOURCE_ROWS:
            break
    rows = []
    for provider, slug in shown:
        for offer in catalog.offers:
            if offer.provider == provider and offer.gpu == slug:
                source = offer.source.split(" ; ")[0].strip()
                rows.append([provider, slug, offer.instance_type, str(offer.gpu_count),
                             (f"${offer.usd_per_hour:,.3f}", offer.usd_per_hour),
                             (f"${offer.spot_usd_per_hour:,.3f}" if offer.spot_usd_per_hour else "—",
                              offer.spot_usd_per_hour or 0),
                             offer.as_of.isoformat() + (f"* ({offer.age_days(on)} days)" if offer.is_stale(on) else ""),
                             link(source, source)])
    offers = table([("provider", False), ("GPU", False), ("instance", False), ("GPUs/node", True),
                    ("$/GPU-h", True), ("spot $/GPU-h", True), ("as of", False), ("source", False)], rows,
                   name="sources")
    calibration = document.get("calibration")
    calibrated = (paragraph(f"Calibrated on {calibration['device']}: {calibration['measured_tokens_per_second']:,.0f} "
                            f"tokens/s measured; other options corrected by forward/backward ×"
                            f"{calibration['passes_factor']:.2f}, optimizer ×{calibration['optimizer_factor']:.2f}.")
                  if calibration else paragraph("No calibration: every speed is the throughput model's prediction "
                                                "(`tunecast calibrate` measures one on your device).", muted=True))
    warnings = [paragraph(f"{w.get('field') or ''}: {w['message']}") for w in document.get("warnings", [])]
    return ("<h3>Dataset</h3>" + dataset + "<h3>Prices of the options shown</h3>" + offers
            + "<h3>Speed</h3>" + calibrated + "".join(warnings))
