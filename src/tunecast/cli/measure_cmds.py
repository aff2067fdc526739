"""`tunecast probe` (measure the device at hand; its figures become a catalog row, `--gpu local`) and
`tunecast calibrate` (a short measured run of the real loop, next to the plan's prediction)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from tunecast.cli.app import state
from tunecast.cli.config_cmds import load_from_cli
from tunecast.cli.render import err, out, print_json, print_problems
from tunecast.cli.spec_flags import SpecArgs, SpecCommand, spec_command
from tunecast.errors import Problem, TunecastError
from tunecast.units import format_usd

EXIT_INTERRUPTED = 130


def probe_command(
    ctx: typer.Context,
    device: Annotated[str | None, typer.Option("--device", help="cuda or cpu (default: the GPU when there is one).")]
    = None,
    collectives: Annotated[bool, typer.Option("--collectives", help="Measure all-reduce, all-gather and "
                                              "reduce-scatter between this machine's GPUs instead (torch.distributed, "
                                              "NCCL; gloo between processes with --device cpu): their bus bandwidth "
                                              "and latency become the plan's link for --gpu local.")] = False,
    gpus: Annotated[int | None, typer.Option("--gpus", help="With --collectives: how many GPUs (default: every "
                                             "visible one), or processes with --device cpu (default 2).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Measure this machine's device in under a minute — matmul rates at small and large shapes, memory
    bandwidth, attention, the host's cost per eager operation, the optimizer step, bitsandbytes' 4-bit layer —
    and save them in the user catalog. `plan --gpu local` and `memory --gpu local` then use them. With
    --collectives, the collectives between its GPUs instead, for the plan's communication."""
    from tunecast.catalog.devices import DEVICES_FILE, merge_device
    from tunecast.catalog.store import load_catalog
    from tunecast.catalog.user import user_catalog_dir

    if device not in (None, "cpu", "cuda"):
        raise TunecastError(f"unknown device {device!r}", field="--device", hint="use --device cuda or --device cpu")
    if gpus is not None and not collectives:
        raise TunecastError("--gpus counts the devices of --collectives; the device probe measures one",
                            field="--gpus", hint="add --collectives, or leave --gpus out")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TunecastError("no CUDA device is available to PyTorch", field="--device",
                                hint="probe the CPU (--device cpu), or install a CUDA build of torch")
    if collectives:
        probe_collectives(ctx, device, gpus, json_output)
        return
    from tunecast.plan.probe import run_probe

    catalog = state(ctx).catalog()
    with err.status("Probing…") as status:
        result = run_probe(catalog.gpus, device=device, progress=lambda what: status.update(f"Probing: {what}"))
    directory = user_catalog_dir(state(ctx).catalog_dir)
    merge_device(directory, result.device, result.measurements)
    load_catalog.cache_clear()
    if json_output:
        print_json({"device": result.device.document(), "seconds": round(result.seconds, 1),
                    "saved_to": str(directory / DEVICES_FILE),
                    "measurements": [row.document() for row in result.measurements]})
        return
    row = result.device
    out.print(f"[bold]{escape(row.name)}[/] · {row.kind} · {row.count} device(s) · {row.memory_gib:.1f} GiB "
              f"({row.usable_memory_gib:.1f} usable) · {row.threads} threads · torch {row.torch_version}")
    table = Table(box=box.SIMPLE_HEAD)
    for heading, justify in (("quantity", "left"), ("dtype", "left"), ("shape", "left"), ("value", "right"),
                             ("unit", "left")):
        table.add_column(heading, justify=justify)  # type: ignore[arg-type]
    for measurement in result.measurements:
        table.add_row(measurement.quantity, measurement.dtype, measurement.shape, f"{measurement.value:,.4g}",
                      measurement.unit)
    out.print(table)
    out.print(f"Measured in {result.seconds:.0f} s; saved as device [bold]{row.slug}[/] in "
              f"{escape(str(directory / DEVICES_FILE))}. Plan on it with [bold]--gpu local[/].")


def probe_collectives(ctx: typer.Context, device: str | None, gpus: int | None, json_output: bool) -> None:
    """`tunecast probe --collectives`: time the collectives, save them on the device's row, show them."""
    from tunecast.catalog.devices import MEASUREMENTS_FILE, merge_collectives, read_devices
    from tunecast.catalog.store import load_catalog
    from tunecast.catalog.user import user_catalog_dir
    from tunecast.plan.collectives import bus_factor, run_collective_probe

    catalog = state(ctx).catalog()
    with err.status("Probing collectives…") as status:
        result = run_collective_probe(catalog.gpus, device=device, processes=gpus,
                                      progress=lambda what: status.update(f"Probing collectives: {what}"))
    directory = user_catalog_dir(state(ctx).catalog_dir)
    devices, _ = read_devices(directory)
    merge_collectives(directory, result.device, result.processes, result.measurements)
    load_catalog.cache_clear()
    row, link = result.device, result.link
    probed = any(d.slug == row.slug and d.host == row.host for d in devices)
    unit = "GPUs" if row.kind == "cuda" else "processes"
    if json_output:
        print_json({"device": row.document(), "processes": result.processes, "backend": result.backend,
                    "dtype": "fp32", "seconds": round(result.seconds, 1),
                    "saved_to": str(directory / MEASUREMENTS_FILE),
                    "timings": [t.document() for t in result.timings], "fits": [f.document() for f in result.fits],
                    "link": {"processes": link.processes, "bus_gb_per_s": round(link.bus_gb_per_s, 4),
                             "latency_us": round(link.latency_us, 2)},
                    "measurements": [m.document() for m in result.measurements]})
        return
    out.print(f"[bold]{escape(row.name)}[/] · {result.processes} {unit} · {result.backend} · fp32 · "
              f"torch {row.torch_version}")
    table = Table(box=box.SIMPLE_HEAD)
    for heading in ("collective", "size", "time µs", "algbw GB/s", "busbw GB/s"):
        table.add_column(heading, justify="left" if heading == "collective" else "right")
    for t in result.timings:
        table.add_row(t.collective, _bytes(t.size_bytes), f"{t.seconds * 1e6:,.1f}", f"{t.algbw_gb_per_s:,.4g}",
                      f"{t.busbw_gb_per_s:,.4g}")
    out.print(table)
    out.print("Fitted: time = latency + size × bus factor ÷ bus bandwidth")
    fits = Table(box=box.SIMPLE_HEAD)
    for heading in ("collective", "bus factor", "latency µs", "bus GB/s"):
        fits.add_column(heading, justify="left" if heading == "collective" else "right")
    for f in result.fits:
        fits.add_row(f.collective, f"{bus_factor(f.collective, result.processes):g}", f"{f.latency_s * 1e6:,.1f}",
                     f"{f.bus_bytes_per_s / 1e9:,.4g}")
    out.print(fits)
    out.print(f"Measured in {result.seconds:.0f} s; saved on device [bold]{row.slug}[/] in "
              f"{escape(str(directory / MEASUREMENTS_FILE))}.")
    out.print(f"A plan on [bold]--gpu local[/] with up to {result.processes} {unit} goes over the slowest of the "
              f"three: {link.bus_gb_per_s:,.4g} GB/s of bus bandwidth, {link.latency_us:,.1f} µs a collective.")
    if not probed and row.kind == "cpu":
        err.print("[yellow]![/] no device probe of this CPU yet: run `tunecast probe` too, so that "
                  "`--gpu local` can plan on it")


def _bytes(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


@spec_command(without=("output",))
def calibrate_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    seconds: Annotated[float | None, typer.Option("--seconds", help="Time budget of the measured steps: measuring "
                                                  "stops when the speed is steady or this runs out. Default 120.")]
    = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Measured steps at most (warm-up steps are added and "
                                              "left out); measuring stops sooner once the speed is steady. "
                                              "Default 300.")] = None,
    minutes: Annotated[float | None, typer.Option("--minutes", hidden=True, help="The time budget in minutes "
                                                  "(--seconds).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Where calibration.json goes (a path or a "
                                               "storage URL). Default: the run's output directory (set it with "
                                               "--set output=DIR).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the calibration document on stdout.")] = False,
    *,
    spec_args: SpecArgs,
) -> int:
    """Train briefly on a slice of the data with the real loop, on this device, until its speed is steady (the
    95% interval of the median tokens/s within ±5%) or the time budget runs out; measure tokens/s, an evaluation,
    a checkpoint write and memory; write calibration.json with the plan's prediction next to it and the whole run
    projected. Use it with `tunecast plan CONFIG --calibration calibration.json`. Nothing else is left behind."""
    from tunecast.train.signals import PROCESS_FLAG, Preempted

    if minutes is not None and seconds is not None:
        raise TunecastError("--seconds and --minutes both set", field="--minutes",
                            hint="give the time budget once, in seconds: --seconds")
    loaded = load_from_cli(ctx, config, spec_args)
    print_problems(list(loaded.warnings))
    installed_here = not PROCESS_FLAG.installed
    flag = PROCESS_FLAG.install() if installed_here else PROCESS_FLAG
    from tunecast.cli.train_cmds import ConsoleReporter, _quiet_libraries

    reporter = ConsoleReporter()
    try:
        _quiet_libraries()
        from tunecast.catalog.user import user_catalog_dir
        from tunecast.plan.calibrate import CALIBRATION_FILE, CalibrationRequest, run_calibration, write_calibration
        from tunecast.train.run import output_url

        budget = minutes * 60 if minutes is not None else seconds
        request = CalibrationRequest(steps=steps, seconds=budget, offline=spec_args.offline)
        status = err.status("Probing the device…")

        def progress(what: str) -> None:
            status.update(f"Probing the device: {what}")

        try:
            document = run_calibration(loaded, state(ctx).catalog(), request, flag, reporter,
                                       user_dir=user_catalog_dir(state(ctx).catalog_dir), progress=progress,
                                       before_probe=status.start, on_probed=status.stop)
        finally:
            status.stop()
    except Preempted as stop:
        reporter.close()
        err.print(f"[yellow]interrupted ({stop.signal_name}): nothing written.[/]")
        return EXIT_INTERRUPTED
    finally:
        reporter.close()
        if installed_here:
            flag.uninstall()
    target = output or f"{output_url(loaded.spec).rstrip('/')}/{CALIBRATION_FILE}"
    written = write_calibration(document, target)
    print_problems([Problem(**w) for w in document["warnings"]])
    if json_output:
        print_json({**document, "written_to": written})
        return 0
    for line in describe_calibration(document):
        out.print(line)
    out.print(f"[dim]Written to {escape(written)}; plan with it: tunecast plan CONFIG --calibration "
              f"{escape(written)}[/]")
    return 0


def describe_calibration(document: dict[str, Any]) -> list[str]:
    """The calibration in plain words: what was measured and how sure it is, the whole run, the plan's error."""
    measured, predicted, whole = document["measured"], document["predicted"], document["whole_run"]
    device = document["device"]
    examples = measured["examples_per_second"] * measured["seconds"]
    error = document["error"]["tokens_per_second"]
    sure = (f"[green]steady[/]: the {measured['confidence']:.0%} interval of the median is "
            f"{measured['ci_low']:,.0f}–{measured['ci_high']:,.0f} tokens/s (±{measured['relative_ci']:.1%})"
            if measured["stable"] else
            f"[yellow]not steady[/] ({escape(measured['why_not_stable'])}): the {measured['confidence']:.0%} "
            f"interval of the median is {measured['ci_low']:,.0f}–{measured['ci_high']:,.0f} tokens/s "
            f"(±{measured['relative_ci']:.1%}); measure longer (--seconds) on a quieter machine to be surer")
    lines = [
        f"On {escape(device['name'])}: {measured['steps_measured']} steps measured "
        f"({measured['warmup_steps_excluded']} warm-up steps left out; stopped at {escape(measured['stop_reason'])}) "
        f"— about {examples:,.0f} examples ({measured['tokens']:,} tokens) in {_hours(measured['seconds'] / 3600)}: "
        f"median [bold]{measured['tokens_per_second']:,.0f} tokens/s[/] ({measured['examples_per_second']:,.2f} "
        f"examples/s; {measured['padded_tokens_per_second']:,.0f} tokens/s with padding; half the steps between "
        f"{measured['iqr_low']:,.0f} and {measured['iqr_high']:,.0f}).",
        sure[0].upper() + sure[1:] + ".",
        f"The whole run ({whole['steps']:,} steps, {whole['tokens']:,.0f} tokens, {whole['evaluations']} "
        f"evaluation(s), {whole['checkpoints']} checkpoint(s)) would take [bold]{_hours(whole['hours'])}[/] on this "
        f"device at {whole['tokens_per_second']:,.0f} tokens/s, warm-up included"
        + (f", and cost [bold]{format_usd(whole['cost_usd'])}[/] at {format_usd(whole['usd_per_hour'])}/h."
           if whole["usd_per_hour"] else " (no price set: pricing.usd_per_hour or --usd-per-hour)."),
        f"The plan predicted {predicted['tokens_per_second']:,.0f} tokens/s: {abs(error):.0%} "
        f"{'too fast' if error > 0 else 'too slow'} ({_hours(whole['predicted_hours'])} predicted).",
    ]
    memory_error = document["error"]["memory"]
    if memory_error is not None:
        key = "peak_reserved_gib" if device["kind"] == "cuda" else "growth_gib"
        what = "reserved at the peak" if device["kind"] == "cuda" else "resident memory grown"
        lines.append(f"Memory: {measured[key]:.2f} GiB {what}; the estimate is {abs(memory_error):.0%} "
                     f"{'high' if memory_error > 0 else 'low'}.")
    return lines


def _hours(hours: float) -> str:
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h"


def register(app: typer.Typer) -> None:
    app.command("probe")(probe_command)
    app.command("calibrate", cls=SpecCommand)(calibrate_command)
