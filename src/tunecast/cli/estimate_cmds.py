"""`tunecast memory`: peak GPU (or CPU) memory of a training step, and whether it fits."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from tunecast.cli.app import state
from tunecast.cli.config_cmds import load_run_from_cli, print_imported
from tunecast.cli.render import DOES_NOT_FIT, err, out, print_json, print_problems, working
from tunecast.cli.spec_flags import SpecArgs, SpecCommand, spec_command
from tunecast.errors import TunecastError
from tunecast.units import format_params

if TYPE_CHECKING:
    from tunecast.config.load import LoadedPipeline, LoadedSpec
    from tunecast.estimate.answer import MemoryAnswer
    from tunecast.estimate.fit import Suggestion
    from tunecast.estimate.memory import MemoryEstimate

LABELS = {"weights": "frozen weights", "trainable_weights": "trainable weights", "gradients": "gradients",
          "optimizer": "optimizer states", "activations": "activations", "temporaries": "temporaries",
          "quantization": "quantization constants", "overhead": "overhead"}


@spec_command
def memory_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    device: Annotated[str, typer.Option("--device", help="cuda (default) or cpu.")] = "cuda",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    trace_suggestions: Annotated[bool, typer.Option(
        "--trace-suggestions",
        help="With --gpu, estimate every suggested change, tracing those no shipped template or cached estimate "
             "covers (about a minute each for a large model on a laptop CPU). Without it they are listed with "
             "no figure.")] = False,
    check: Annotated[bool, typer.Option(
        "--check", help="A pre-flight gate: exit 0 when the run fits the GPU (--gpu, or gpus.gpu in the config), also "
                        "at the edge (only once the allocator releases its cache; said on stderr), and "
                        f"{DOES_NOT_FIT} when it does not, with the reason on stderr.")] = False,
    *,
    spec_args: SpecArgs,
) -> int:
    """Peak memory of one training step per GPU: allocated, reserved, what the device gives up, by category.
    With --gpu: whether it fits, the largest micro-batch and sequence, and what to change when it does not."""
    from tunecast.config.load import LoadedPipeline, imported_part
    from tunecast.estimate.answer import answer_memory, start_prewarm
    from tunecast.estimate.templates import building_beside

    found = load_run_from_cli(ctx, config, spec_args)
    if check and found.gpu is None:
        raise TunecastError("--check needs a GPU to check the run against", field="--check",
                            hint="name it with --gpu (for example --gpu a100-80gb, or --gpu local), or gpus.gpu in the "
                                 "config")
    if isinstance(found, LoadedPipeline):
        return _diffusion_memory(ctx, found, device=device, json_output=json_output, check=check,
                                 trace_suggestions=trace_suggestions)
    loaded = found
    warming = start_prewarm(loaded, state(ctx).catalog(), device=device)  # before the progress display's thread
    with working(f"Estimating the memory of {escape(loaded.model.name)}…"), building_beside():
        answer = answer_memory(loaded, state(ctx).catalog(), device=device, trace_suggestions=trace_suggestions,
                               warming=warming)
    if json_output:
        print_json({**answer.as_dict(loaded), **imported_part(loaded)})
    else:
        _render(loaded, answer)
        print_problems(list(loaded.warnings))
        print_imported(loaded)
    if check and answer.fit is not None and answer.fit.at_edge:
        err.print(f"fits at the edge: {answer.estimate.least_device_total_gib:.2f} GiB per GPU at least, of the "
                  f"{answer.fit.capacity_gib:.2f} GiB usable on {answer.fit.gpu} (the allocator releases its cache "
                  "and retries before it fails)")
    if check and answer.fit is not None and not answer.fit.fits and not answer.fit.at_edge:
        fit = answer.fit
        err.print(f"does not fit: {answer.estimate.device_total_gib:.2f} GiB per GPU, {-fit.headroom_gib:.2f} GiB over "
                  f"the {fit.capacity_gib:.2f} GiB usable on {fit.gpu}")
        return DOES_NOT_FIT
    return 0


def _diffusion_memory(ctx: typer.Context, loaded: LoadedPipeline, *, device: str, json_output: bool,
                      check: bool, trace_suggestions: bool) -> int:
    """`tunecast memory` of a diffusion pipeline (docs/diffusion.md): its traced step, and on a GPU whether it fits."""
    from tunecast.config.load import imported_part
    from tunecast.estimate.diffusion import answer_diffusion_memory

    spec = loaded.spec
    with working(f"Estimating the memory of {escape(loaded.pipeline.name)}…"):
        answer = answer_diffusion_memory(spec, loaded.pipeline, loaded.gpu, state(ctx).catalog().overheads,
                                         device=device, trace_suggestions=trace_suggestions)
    estimate = answer.estimate
    if json_output:
        runner = {"runner": spec.runner, "runner_notes": list(loaded.runner_notes)} if loaded.runner_notes else {}
        print_json({**answer.as_dict(spec), **runner, **imported_part(loaded)})
    else:
        method = spec.method if spec.method == "full" else f"{spec.method} r{spec.lora.rank}"
        shape = answer.shape
        frames = f" × {shape.frames} frames" if loaded.pipeline.video else ""
        out.print(f"[bold]{escape(loaded.pipeline.name)}[/] ({loaded.pipeline.classes[loaded.pipeline.denoiser]}) · "
                  f"{method} · {spec.precision} · {spec.optimizer} · {shape.batch} × {shape.width}×{shape.height} px"
                  f"{frames} · {'checkpointing' if spec.grad_checkpointing is True else 'no checkpointing'}"
                  f"{'' if spec.runner == 'tunecast' else f' · as {spec.runner} runs it'}")
        _memory_table(estimate)
        for note in loaded.runner_notes:
            out.print(f"[dim]· {escape(note)}[/]")
        if answer.gpu is not None:
            capacity = answer.gpu.usable_memory_gib
            headroom = capacity - estimate.device_total_gib
            verdict = (f"[green]fits[/] with {headroom:.1f} GiB to spare" if answer.fits
                       else f"[yellow]fits at the edge[/]: {estimate.least_device_total_gib:.1f} GiB at least"
                       if answer.at_edge else f"[red]does not fit[/]: {-headroom:.1f} GiB over")
            out.print(f"\nOn [bold]{answer.gpu.slug}[/] ({capacity:.2f} GiB usable): {verdict}")
            if answer.limits is not None:
                limits = answer.limits
                out.print(f"  largest micro-batch at {shape.width}×{shape.height} px: {limits.max_micro_batch} "
                          f"{'clips' if loaded.pipeline.video else 'images'}")
                out.print(f"  largest resolution at micro-batch {shape.batch}: "
                          + (f"{limits.max_resolution}×{limits.max_resolution} px" if limits.max_resolution else
                             f"none (not even {limits.step} px)"))
            _suggestion_table(answer.suggestions, "tracing each takes 10-30 s (--trace-suggestions)")
        print_problems(list(loaded.warnings))
        print_imported(loaded)
    if check and answer.fits is False and not answer.at_edge:
        slug = answer.gpu.slug if answer.gpu is not None else ""
        err.print(f"does not fit: {estimate.device_total_gib:.2f} GiB per GPU on {slug}")
        return DOES_NOT_FIT
    return 0


def _render(loaded: LoadedSpec, answer: MemoryAnswer) -> None:
    spec, estimate = loaded.spec, answer.estimate
    method = spec.method if spec.method == "full" else (
        f"{spec.method} r{spec.lora.rank} "
        f"{spec.lora.targets if isinstance(spec.lora.targets, str) else ','.join(spec.lora.targets)}")
    params = f" ({format_params(loaded.model.params)})" if loaded.model.params else ""
    checkpointing = "checkpointing" if answer.grad_checkpointing else "no checkpointing"
    gpus = f"{spec.gpus.count} GPUs {spec.gpus.strategy}" if spec.gpus.count > 1 else "1 GPU"
    runner = "" if spec.runner == "tunecast" else f" · as {spec.runner} runs it"
    out.print(f"[bold]{escape(loaded.model.name)}[/]{params} · {method} · {spec.precision} · {spec.optimizer} · "
              f"micro-batch {estimate.micro_batch} × {estimate.seq_len} tokens · {checkpointing} · {gpus}{runner}")
    _memory_table(estimate)
    if answer.fit is None:
        return
    _render_fit(answer)


def _memory_table(estimate: MemoryEstimate) -> None:
    """The peak's figures by category, and the estimate's notes."""
    where = "per GPU" if estimate.device == "cuda" else "on the CPU"
    table = Table(box=box.SIMPLE_HEAD, title=f"Peak memory {where}", title_justify="left")
    table.add_column("")
    table.add_column("GiB", justify="right")
    table.add_column("")
    if estimate.device == "cuda":
        table.add_row("allocated", f"{estimate.peak_allocated_gib:.2f}", "torch.cuda.max_memory_allocated")
        table.add_row("reserved", f"{estimate.peak_reserved_gib:.2f}", "torch.cuda.max_memory_reserved")
        table.add_row("[bold]device total[/]", f"[bold]{estimate.device_total_gib:.2f}[/]",
                      "what nvidia-smi shows: reserved + CUDA context")
    else:
        table.add_row("live tensors", f"{estimate.peak_allocated_gib:.2f}", "peak of tensor bytes")
        table.add_row("[bold]resident growth[/]", f"[bold]{estimate.device_total_gib:.2f}[/]",
                      "process RSS above its start: tensors + framework")
    table.add_row("peak in", estimate.peak_phase, "")
    if estimate.host_ram_gib:
        table.add_row("host RAM", f"{estimate.host_ram_gib:.2f}", "offloaded to CPU memory")
    if estimate.managed_gib:
        table.add_row("managed", f"{estimate.managed_gib:.2f}", "paged optimizer states (CUDA managed memory)")
    table.add_section()
    for key, value in estimate.breakdown_gib.items():
        if abs(value) >= 0.0005:
            table.add_row(f"  {LABELS[key]}", f"{value:.2f}", "")
    out.print(table)
    for note in estimate.notes:
        out.print(f"[dim]· {escape(note)}[/]")


def _render_fit(answer: MemoryAnswer) -> None:
    """Whether the run fits the GPU, its limits, and what would make it fit."""
    estimate = answer.estimate
    assert answer.fit is not None
    fit = answer.fit
    verdict = (f"[green]fits[/] with {fit.headroom_gib:.1f} GiB to spare" if fit.fits
               else f"[yellow]fits at the edge[/]: {estimate.least_device_total_gib:.1f} GiB at least, "
                    f"{-fit.headroom_gib:.1f} GiB over with the cache as it grows, so the cache fills the card "
                    f"({fit.device_total_gib:.1f} GiB shown) and is released there" if fit.at_edge
               else f"[red]does not fit[/]: {-fit.headroom_gib:.1f} GiB over")
    out.print(f"\nOn [bold]{fit.gpu}[/] ({fit.capacity_gib:.2f} GiB usable): {verdict}")
    longest = f"{fit.max_seq_len:,} tokens" + (" (the model's context length)" if fit.max_seq_len_capped else "")
    out.print(f"  largest micro-batch at {estimate.seq_len} tokens: {fit.max_micro_batch}; "
              f"longest sequence at micro-batch {estimate.micro_batch}: {longest}")
    for warning in fit.warnings:
        out.print(f"  [yellow]! {escape(warning)}[/]")
    _suggestion_table(fit.suggestions, "no shipped template covers it, and tracing it takes about a minute "
                                       "(--trace-suggestions)")


def _suggestion_table(suggestions: tuple[Suggestion, ...], why_unestimated: str) -> None:
    """The changes that would make a run fit, each with its figure and its `--set` form."""
    if not suggestions:
        return
    changes = Table(box=box.SIMPLE_HEAD, title="What would make it fit", title_justify="left")
    changes.add_column("")
    changes.add_column("change")
    changes.add_column("device GiB", justify="right")
    changes.add_column("as --set")
    for suggestion in suggestions:
        mark = {True: "[green]✓[/]", False: "[red]✗[/]", None: "[yellow]?[/]"}[suggestion.fits]
        sets = " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in suggestion.settings.items())
        gib = "—" if suggestion.device_total_gib is None else f"{suggestion.device_total_gib:.1f}"
        changes.add_row(mark, escape(suggestion.change), gib, escape(sets))
    out.print(changes)
    if any(suggestion.device_total_gib is None for suggestion in suggestions):
        out.print(f"  [yellow]?[/] not estimated: {why_unestimated}")


def register(app: typer.Typer) -> None:
    app.command("memory", cls=SpecCommand)(memory_command)
