"""`tunecast plan` (which GPU, how long, what the whole run costs) and `tunecast breakeven` (rent or buy)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from tunecast.cli.app import state
from tunecast.cli.config_cmds import load_from_cli, load_run_from_cli, print_imported
from tunecast.cli.render import DOES_NOT_FIT, err, out, print_json, print_problems, working
from tunecast.cli.spec_flags import SpecArgs, SpecCommand, spec_command
from tunecast.errors import Problem, TunecastError
from tunecast.units import format_usd

if TYPE_CHECKING:
    from tunecast.config.load import LoadedPipeline

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


@spec_command
def plan_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    optimize: Annotated[str | None, typer.Option("--optimize", help="Rank by total `cost` or by `time` (hours within "
                                                 "5% count as equal). Default: plan.optimize, else cost.")] = None,
    budget: Annotated[float | None, typer.Option("--budget", metavar="USD", help="Only runs costing at most this. "
                                                 "Default: plan.budget_usd, else none.")] = None,
    deadline: Annotated[float | None, typer.Option("--deadline", metavar="HOURS", help="Only runs done within this. "
                                                   "Default: plan.deadline_hours, else none.")] = None,
    preemptions: Annotated[float | None, typer.Option(
        "--preemptions-per-hour", help="Spot preemption rate to assume for every offer.")] = None,
    top: Annotated[int, typer.Option("--top", help="Options shown in the table (the JSON has all).")] = 15,
    calibration: Annotated[Path | None, typer.Option(
        "--calibration", metavar="FILE", help="A calibration.json from `tunecast calibrate`: the calibrated device "
        "runs at its measured speed, the others' predictions are corrected by it.")] = None,
    report: Annotated[Path | None, typer.Option("--report", metavar="FILE", help="Also write the plan as a "
                                                "self-contained HTML page with charts (works offline).")] = None,
    refresh: Annotated[bool, typer.Option(
        "--refresh", help="First fetch today's offers (`tunecast offers --refresh`); a source that cannot be reached "
        "is said in one line and the last prices are used.")] = False,
    available: Annotated[bool, typer.Option(
        "--available", help="Rank only offers a live marketplace listed as rentable in its last refreshed snapshot "
        "(Vast.ai).")] = False,
    json_output: JsonFlag = False,
    check: Annotated[bool, typer.Option(
        "--check", help="A pre-flight gate: exit 0 when at least one option fits within the budget and deadline, and "
                        f"{DOES_NOT_FIT} when none does, with the reason on stderr.")] = False,
    *,
    spec_args: SpecArgs,
) -> int:
    """Every GPU and count: the fastest configuration that fits, tokens/s, hours, and the whole run's cost per
    offer (compute as billed, storage, spot preemptions), ranked; the Pareto front of cost and time marked."""
    from tunecast.catalog.store import today
    from tunecast.config.load import LoadedPipeline, imported_part
    from tunecast.estimate.templates import building_beside
    from tunecast.plan.calibration import read_calibration
    from tunecast.plan.report import PlanRequest, check_failure, make_plan

    found = load_run_from_cli(ctx, config, spec_args)
    if isinstance(found, LoadedPipeline):
        if report is not None or calibration is not None or available:
            flag = "--report" if report is not None else "--calibration" if calibration is not None else "--available"
            raise TunecastError(f"{flag} is not available for a diffusion pipeline yet", field=flag,
                                hint=f"leave {flag} out (docs/diffusion.md)")
        refreshed = _refresh(ctx, found.spec.pricing.providers, json_output) if refresh else None
        return _diffusion_plan(ctx, found, PlanRequest(optimize, budget, deadline, preemptions), top=top,
                               json_output=json_output, check=check, refreshed=refreshed)
    loaded = found
    refreshed = _refresh(ctx, loaded.spec.pricing.providers, json_output) if refresh else None
    request = PlanRequest(optimize, budget, deadline, preemptions,
                          read_calibration(calibration) if calibration is not None else None, available)
    with working("Planning…") as status, building_beside():
        document = make_plan(loaded, state(ctx).catalog(), request, today=today(),
                             progress=lambda gpu: status.update(f"Planning… {gpu}"))
    if report is not None:
        from tunecast.atomic import write_user_file
        from tunecast.report.plan import plan_report

        write_user_file(report, plan_report(document, state(ctx).catalog()), field="--report")
        err.print(f"wrote {escape(str(report))}")
    if json_output:
        print_json({**document, **imported_part(loaded), **({"refreshed": refreshed} if refresh else {})})
    else:
        _render_plan(document, top)
        print_problems(list(loaded.warnings) + [Problem(**w) for w in document.get("warnings", [])])
        print_imported(loaded)
    failure = check_failure(document) if check else None
    if failure is not None:
        err.print(f"check failed: {escape(failure)}")
        return DOES_NOT_FIT
    return 0


def _diffusion_plan(ctx: typer.Context, loaded: LoadedPipeline, request: Any, *, top: int, json_output: bool,
                    check: bool, refreshed: list[dict[str, Any]] | None) -> int:
    """`tunecast plan` of a diffusion pipeline (docs/diffusion.md): every GPU's fastest batch shape that fits, images
    per second, hours and the whole run's cost per offer."""
    from tunecast.catalog.store import today
    from tunecast.plan.diffusion import plan_diffusion
    from tunecast.plan.report import _check

    request = request.over(loaded.spec)
    _check(request)
    with working("Planning…") as status:
        status.update("Planning… tracing the step (each shape a trace of its own: about 5-30 s)")
        document = plan_diffusion(loaded.spec, loaded.pipeline, loaded.gpu, state(ctx).catalog(),
                                  optimize=request.optimize, budget_usd=request.budget_usd,
                                  deadline_hours=request.deadline_hours,
                                  interruptions_per_hour=request.interruptions_per_hour, today=today(),
                                  progress=lambda gpu: status.update(f"Planning… {gpu}"))
    if json_output:
        print_json({**document, **({"refreshed": refreshed} if refreshed is not None else {})})
    else:
        _render_diffusion_plan(document, top)
        print_problems(list(loaded.warnings))
    fitting = [o for o in document["options"] if o["fits"] and o["total_usd"] is not None]
    if check and not fitting:
        err.print("check failed: no option fits within the budget and deadline" if document["filtered_out"] else
                  "check failed: no option fits")
        return DOES_NOT_FIT
    return 0


def _render_diffusion_plan(document: dict[str, Any], top: int) -> None:
    data = document["dataset"]
    frames = f" × {document['frames']} frames" if document["frames"] else ""
    repeats = f" × {data['repeats']} repeats" if data["repeats"] > 1 else ""
    images = f"{data['images']:,} images{repeats} × {data['epochs']:g} epochs" \
        if data["max_steps"] is None else f"{data['max_steps']:,} steps"
    out.print(f"[bold]{escape(document['model'])}[/] ({document['denoiser']}) · {document['method']} · "
              f"{document['precision']} · {document['width']}×{document['height']} px{frames} · {images} · global "
              f"batch {document['global_batch']} · {document['steps']:,} steps")
    options = document["options"]
    priced = [o for o in options if o["total_usd"] is not None]
    unpriced = [o for o in options if o["fits"] and o["total_usd"] is None]
    ranking = "total cost" if document["optimize"] == "cost" else "hours"
    table = Table(box=box.SIMPLE_HEAD, title=f"Runs ranked by {ranking} ({len(priced)} priced)", title_justify="left")
    for heading, justify in (("gpu", "left"), ("provider", "left"), ("", "left"), ("$/h", "right"),
                             ("mb×acc", "right"), ("ckpt", "left"), ("GiB", "right"), ("img/s", "right"),
                             ("hours", "right"), ("total", "right")):
        table.add_column(heading, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for option in priced[:top] + unpriced[:UNPRICED_SHOWN]:
        cost = option["total_usd"] is not None
        table.add_row(option["gpu"], escape(option["provider"]) if cost else "—", "spot" if option["spot"] else "",
                      format_usd(option["usd_per_hour_total"]) if cost else "—",
                      f"{option['micro_batch']}×{option['grad_accum']}", "yes" if option["grad_checkpointing"] else "",
                      f"{option['device_total_gib']:.1f}", f"{option['images_per_second']:.2f}",
                      f"{option['hours']:.2f}" if option["hours"] >= 0.05 else f"{option['hours'] * 60:.1f} min",
                      f"${option['total_usd']:,.2f}" if cost else "no price")
    out.print(table)
    unfit = {o["gpu"]: o["notes"][0] for o in options if not o["fits"]}
    if unfit:
        out.print(f"Does not fit ({len(unfit)}):")
        for gpu, reason in list(unfit.items())[:UNFIT_SHOWN]:
            out.print(f"[dim]  {gpu}: {escape(reason)}[/]")
    if document["filtered_out"]:
        out.print(f"[dim]{document['filtered_out']} option(s) over the budget or the deadline left out.[/]")


def _refresh(ctx: typer.Context, providers: list[str], json_output: bool) -> list[dict[str, Any]]:
    """`plan --refresh`: today's offers of the providers the run considers (`pricing.providers`; all by default) that
    a price source serves; never fails the plan."""
    from tunecast.catalog.refresh import REFRESHABLE
    from tunecast.cli.catalog_cmds import refresh_offers

    served = [p for p in providers if p in REFRESHABLE]
    if providers and not served:
        err.print(f"[yellow]no price source refreshes {', '.join(providers)} (pricing.providers): their catalog prices "
                  "are used[/]")
        return []
    return refresh_offers(ctx, served or None, None, json_output=json_output)


UNFIT_SHOWN = 8  # configurations that do not fit, listed with their reason under the table
UNPRICED_SHOWN = 4  # configurations that fit but no offer prices, listed after the priced ones


def _render_plan(document: dict[str, Any], top: int) -> None:
    from tunecast.catalog.offers import STALE_AFTER_DAYS
    from tunecast.plan.planner import SAME_TIME_WITHIN, gpus_text

    data = document["dataset"]
    spec = document["spec"]
    out.print(f"[bold]{escape(document['model']['name'])}[/] · {spec['method']} · {spec['precision']} · "
              f"{data['processed_tokens']:,} tokens processed ({data['trained_tokens']:,} trained) over "
              f"{data['length']} · global batch {document['global_batch']} × {spec['seq_len']}"
              + ("" if spec.get("runner", "tunecast") == "tunecast" else f" · as {spec['runner']} runs it"))
    out.print(f"[dim]dataset: {escape(data['tokenizer'])}[/]")
    if data.get("padding_assumption"):
        out.print(f"[dim]padding: {escape(data['padding_assumption'])}[/]")
    options = document["options"]
    priced = [o for o in options if o["total_usd"] is not None]
    # fitting options no offer prices — a measured device, or the one GPU asked for — shown with their speed
    single = len({o["gpu"] for o in options}) == 1
    unpriced = [o for o in options if o["fits"] and o["total_usd"] is None
                and (single or o["basis"] == "measured")]
    calibrated = document.get("calibration") is not None
    ranking = ("total cost" if document["optimize"] == "cost" else
               f"hours (within {SAME_TIME_WITHIN:.0%} as fast: the cheaper first)")
    table = Table(box=box.SIMPLE_HEAD, title=f"Runs ranked by {ranking} ({len(priced)} priced; ★ = Pareto front of "
                  "cost and time)", title_justify="left")
    columns = [("", "left"), ("gpus", "left"), ("provider", "left"), ("", "left"), ("$/h", "right"),
               ("price of", "left"), ("mb×acc", "right"), ("ckpt", "left"), ("GiB", "right"), ("tok/s", "right"),
               ("comm", "right"), ("hours", "right"), ("total", "right")] + ([("basis", "left")] if calibrated else [])
    for heading, justify in columns:
        table.add_column(heading, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    shown = priced[:top] + unpriced[:UNPRICED_SHOWN]
    for option in shown:
        cost = option["total_usd"] is not None
        rate = format_usd(option["usd_per_hour_total"]) if cost else "—"
        dated = option.get("price_as_of") or "—"
        if option.get("price_stale"):
            dated = f"[yellow]{dated}*[/]"
        table.add_row("★" if option["pareto"] else "", gpus_text(option),
                      escape(option["provider"]) if cost else "—", "spot" if option["spot"] else "", rate, dated,
                      f"{option['micro_batch']}×{option['grad_accum']}",
                      "yes" if option["grad_checkpointing"] else "", f"{option['device_total_gib']:.1f}",
                      f"{option['tokens_per_second']:,.0f}", _comm_text(option),
                      f"{option['hours']:.1f}" if option["hours"] >= 0.05
                      else f"{option['hours'] * 60:.1f} min",
                      f"${option['total_usd']:,.2f}" if cost else "no price",
                      *([option["basis"]] if calibrated else []))
    out.print(table)
    stale = [o["price_as_of"] for o in shown if o.get("price_stale")]
    if stale:
        out.print(f"[yellow]* an old price (a marketplace's after {STALE_AFTER_DAYS['marketplace']} day, a list "
                  f"price's after {STALE_AFTER_DAYS['list']} days; the oldest shown is from {min(stale)}): it may have "
                  "moved; "
                  "`tunecast plan --refresh` fetches today's, `tunecast offers` lists every price's date and "
                  "source.[/]")
    unfit = {(o["gpu"], o["gpu_count"]): o["notes"][0] for o in options if not o["fits"]}
    if unfit:
        out.print(f"Does not fit ({len(unfit)}):")
        for (gpu, count), reason in list(unfit.items())[:UNFIT_SHOWN]:
            out.print(f"[dim]  {count}×{gpu}: {escape(reason.removeprefix('does not fit: '))}[/]")
        if len(unfit) > UNFIT_SHOWN:
            out.print(f"[dim]  … and {len(unfit) - UNFIT_SHOWN} more (--json lists them all)[/]")
    if calibrated:
        c = document["calibration"]
        out.print(f"[dim]Calibrated on {escape(c['device'])}: {c['measured_tokens_per_second']:,.0f} tokens/s "
                  f"measured; other options corrected (forward/backward ×{c['passes_factor']:.2f}, optimizer "
                  f"×{c['optimizer_factor']:.2f}).[/]")
    for line in document["recommendations"]:
        out.print(f"• {escape(line)}")
    if document["filtered_out"]:
        out.print(f"[dim]{document['filtered_out']} option(s) over the budget or the deadline left out.[/]")


def _comm_text(option: dict[str, Any]) -> str:
    """The share of an option's step that its GPUs' communication adds (what computation does not hide); blank on
    one GPU."""
    if option.get("comm_link") is None or not option.get("step_s"):
        return ""
    share = option["exposed_comm_s"] / option["step_s"]
    return f"{share:.1%}" if share < 0.095 else f"{share:.0%}"


def breakeven_command(
    ctx: typer.Context,
    gpu: Annotated[str | None, typer.Option("--gpu", help="The card you would buy (its catalog price and power).")]
    = None,
    purchase_usd: Annotated[float | None, typer.Option("--purchase-usd", help="Purchase price.")] = None,
    rent_usd_per_hour: Annotated[float | None, typer.Option("--rent-usd-per-hour", help="Rental price per hour.")]
    = None,
    rent_gpu: Annotated[str | None, typer.Option("--rent-gpu", help="Rent this card instead: its cheapest "
                                                 "on-demand offer.")] = None,
    hours_per_month: Annotated[float, typer.Option("--hours-per-month", help="Hours of use per month.")] = 200.0,
    power_w: Annotated[float | None, typer.Option("--power-w", help="Power draw while training (watts).")] = None,
    usd_per_kwh: Annotated[float | None, typer.Option("--usd-per-kwh", help="Electricity price.")] = None,
    resale_usd: Annotated[float, typer.Option("--resale-usd", help="What the card sells for later.")] = 0.0,
    run: Annotated[Path | None, typer.Option("--run", metavar="CONFIG", help="Compare in units of this run's work "
                                             "(the planner's hours on each card).")] = None,
    json_output: JsonFlag = False,
) -> None:
    """Rent versus buy: break-even hours and months; with --run, in runs of a workload."""
    from tunecast.catalog.store import today
    from tunecast.plan.breakeven import BreakEvenOptions, answer_break_even

    options = BreakEvenOptions(gpu=gpu, purchase_usd=purchase_usd, rent_usd_per_hour=rent_usd_per_hour,
                               rent_gpu=rent_gpu, hours_per_month=hours_per_month, power_w=power_w,
                               usd_per_kwh=usd_per_kwh, resale_usd=resale_usd)
    loader = None if run is None else (
        lambda overrides: load_from_cli(ctx, run, SpecArgs(overrides)))
    answer = answer_break_even(state(ctx).catalog(), options, run=loader, today=today())
    if json_output:
        print_json(answer.as_dict())
        return
    result = answer.result
    power = f" and {format_usd(result.power_usd_per_hour)}/h of power" if result.power_usd_per_hour else ""
    out.print(f"Buying at {format_usd(result.purchase_usd)} (resale {format_usd(result.resale_usd)}) against renting "
              f"at {format_usd(result.rent_usd_per_hour)}/h{power}:")
    if result.breakeven_hours is None:
        out.print("  renting stays cheaper: the power costs as much as the rent")
    else:
        out.print(f"  break-even after {result.breakeven_hours:,.0f} hours of use = "
                  f"{result.breakeven_months:.1f} months at {hours_per_month:g} h/month")
    if answer.work is not None:
        work = answer.work.as_dict()
        out.print(f"  per run: {work['owned_hours_per_run']:.2f} h on the owned card, "
                  f"{work['rented_hours_per_run']:.2f} h and ${work['rented_usd_per_run']:,.2f} rented")
        if work["breakeven_runs"] is not None:
            out.print(f"  break-even after {work['breakeven_runs']:.1f} runs = {work['breakeven_months']:.1f} months")


def register(app: typer.Typer) -> None:
    app.command("plan", cls=SpecCommand)(plan_command)
    app.command("breakeven")(breakeven_command)
