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
from tunecast.cli.spec_flags import SpecArgs, spec_command
from tunecast.errors import Problem, TunecastError
from tunecast.units import format_usd

EXIT_INTERRUPTED = 130


def probe_command(
    ctx: typer.Context,
    device: Annotated[str | None, typer.Option("--device", help="cuda or cpu (default: the GPU when there is one).")]
    = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Measure this machine's device in under a minute — matmul rates at small and large shapes, memory
    bandwidth, attention, the host's cost per eager operation, the optimizer step, bitsandbytes' 4-bit layer —
    and save them in the user catalog. `plan --gpu local` and `memory --gpu local` then use them."""
    from tunecast.catalog.devices import DEVICES_FILE, merge_device
    from tunecast.catalog.store import load_catalog
    from tunecast.catalog.user import user_catalog_dir
    from tunecast.train.probe import run_probe

    if device not in (None, "cpu", "cuda"):
        raise TunecastError(f"unknown device {device!r}", field="--device", hint="use --device cuda or --device cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TunecastError("no CUDA device is available to PyTorch", field="--device",
                                hint="probe the CPU (--device cpu), or install a CUDA build of torch")
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


@spec_command(without=("output",))
def calibrate_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Measured steps (warm-up steps are added and left "
                                              "out). Default 20.")] = None,
    minutes: Annotated[float | None, typer.Option("--minutes", help="Measure for this long instead of --steps.")]
    = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Where calibration.json goes (a path or a "
                                               "storage URL). Default: the run's output directory (set it with "
                                               "--set output=DIR).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the calibration document on stdout.")] = False,
    *,
    spec_args: SpecArgs,
) -> int:
    """Train briefly on a slice of the data with the real loop, on this device; measure tokens/s and memory;
    write calibration.json with the plan's prediction next to it and the whole run extrapolated. Use it with
    `tunecast plan CONFIG --calibration calibration.json`. Nothing else is left behind."""
    from tunecast.train.signals import PROCESS_FLAG, Preempted

    loaded = load_from_cli(ctx, config, spec_args)
    print_problems(list(loaded.warnings))
    installed_here = not PROCESS_FLAG.installed
    flag = PROCESS_FLAG.install() if installed_here else PROCESS_FLAG
    from tunecast.cli.train_cmds import ConsoleReporter, _quiet_libraries

    reporter = ConsoleReporter()
    try:
        _quiet_libraries()
        from tunecast.catalog.user import user_catalog_dir
        from tunecast.train.calibrate import CALIBRATION_FILE, CalibrationRequest, run_calibration, write_calibration
        from tunecast.train.run import output_url

        request = CalibrationRequest(steps=steps, minutes=minutes, allow_download=spec_args.allow_download)
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
    """The calibration in plain words."""
    measured, predicted, whole = document["measured"], document["predicted"], document["whole_run"]
    device = document["device"]
    examples = measured["examples_per_second"] * measured["seconds"]
    error = document["error"]["tokens_per_second"]
    lines = [
        f"On {escape(device['name'])}: {measured['steps']} steps measured ({measured['warmup_steps_excluded']} "
        f"warm-up steps left out) — about {examples:,.0f} examples ({measured['tokens']:,} tokens) in "
        f"{_hours(measured['seconds'] / 3600)}: [bold]{measured['tokens_per_second']:,.0f} tokens/s[/] "
        f"({measured['examples_per_second']:,.2f} examples/s; {measured['padded_tokens_per_second']:,.0f} tokens/s "
        "with padding).",
        f"The whole run ({whole['tokens']:,.0f} tokens) would take [bold]{_hours(whole['hours'])}[/] on this device"
        + (f" and cost [bold]{format_usd(whole['cost_usd'])}[/] at {format_usd(whole['usd_per_hour'])}/h."
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
    app.command("calibrate")(calibrate_command)
