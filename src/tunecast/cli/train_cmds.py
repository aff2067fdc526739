"""`tunecast train` (run the fine-tune; exit 75 when preempted) and `tunecast merge` (adapter into the base)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from tunecast.cli.app import state
from tunecast.cli.config_cmds import load_run_from_cli, print_imported
from tunecast.cli.render import err, estimate_line, out, print_json, print_problems
from tunecast.cli.spec_flags import SpecArgs, SpecCommand, spec_command
from tunecast.errors import Problem
from tunecast.estimate.progress import listening
from tunecast.train.signals import EXIT_PREEMPTED, PROCESS_FLAG, Preempted, PreemptionFlag

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from tunecast.config.load import LoadedPipeline, LoadedSpec

PLAIN_EVERY_S = 10.0  # without a terminal, a progress line at most this often


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


LABEL = "training"
BAR_MIN, BAR_MAX = 10, 40  # the progress bar's width, when the terminal has room for one


def _cost(usd: float) -> str:
    return f"${usd:,.2f}"


def progress_forms(record: dict[str, Any], total: int, eta_s: float, cost_at_end: float) -> list[str]:
    """The progress line, from the fullest to the tightest; each keeps the step, loss, speed (tok/s, or a diffusion
    run's img/s), ETA and cost."""
    step, loss = record["step"], record["loss"]
    speed = f"{record['images_per_second']:,.2f} img/s" if "images_per_second" in record else \
        f"{record['tokens_per_second']:,.0f} tok/s"
    so_far, eta = record["cost_usd"], _duration(eta_s)
    return [f"step {step}/{total} · loss {loss:.4f} · {speed} · {_duration(record['elapsed_s'])} elapsed · "
            f"ETA {eta} · {_cost(so_far)} so far, {_cost(cost_at_end)} at the end",
            f"step {step}/{total} · loss {loss:.4f} · {speed} · ETA {eta} · {_cost(so_far)} → "
            f"{_cost(cost_at_end)} at the end",
            f"{step}/{total} · loss {loss:.3f} · {speed} · ETA {eta} · {_cost(so_far)}→{_cost(cost_at_end)}"]


def fit_progress(forms: list[str], width: int) -> tuple[str, int, bool]:
    """On a terminal `width` columns wide: the fullest form that leaves room for a bar at least BAR_MIN wide beside
    the label, else the tightest with a bar and no label, else the tightest alone; the bar's width (0: none), and
    whether the label shows."""
    for text in forms:
        room = width - len(LABEL) - len(text) - 3  # two gaps between columns, and a column to spare
        if room >= BAR_MIN:
            return text, min(BAR_MAX, room), True
    room = width - len(forms[-1]) - 2
    return forms[-1], min(BAR_MAX, room) if room >= BAR_MIN else 0, False


class ConsoleReporter:
    """Progress on stderr: a live bar on a terminal (the line narrows to the terminal's width: the bar and the
    elapsed time go first), a line every few seconds otherwise."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or err
        self.live = self.console.is_terminal
        self.progress: Progress | None = None
        self.task: Any = None
        self.last_line = 0.0

    def event(self, kind: str, message: str) -> None:
        colour = {"preempted": "yellow", "resume": "cyan", "checkpoint": "dim", "eval": "green"}.get(kind, "")
        text = f"[{colour}]{escape(message)}[/]" if colour else escape(message)
        if kind == "warning":  # as print_problems marks one
            text = f"  [yellow]![/] {escape(message)}"
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            self.console.print(text)

    def step(self, record: dict[str, Any], total_steps: int, eta_s: float, cost_at_end_usd: float) -> None:
        forms = progress_forms(record, total_steps, eta_s, cost_at_end_usd)
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn

            text, bar, label = fit_progress(forms, self.console.width)
            columns = ((TextColumn(f"[bold]{LABEL}"),) if label else ()) + \
                ((BarColumn(bar_width=bar),) if bar else ()) + (TextColumn("{task.description}"),)
            if self.progress is None:
                self.progress = Progress(*columns, console=self.console, transient=False)
                self.progress.start()
                self.task = self.progress.add_task(escape(text), total=total_steps)
            self.progress.columns = columns
            self.progress.update(self.task, completed=record["step"], description=escape(text))
            return
        now = time.monotonic()
        if now - self.last_line >= PLAIN_EVERY_S or record["step"] == total_steps or record["step"] == 1:
            self.last_line = now
            self.console.print(escape(forms[0]))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _quiet_libraries() -> None:
    """The libraries' own progress bars and deprecation notices are for their developers; the run's progress is
    ours (stderr), and their real warnings (logging at error level) still show. bitsandbytes warns as it is imported
    on a CPU with AVX512-BF16 that an optional inference kernel (`pip install kernels`) is missing, which training and
    merging never use (train/quantize.py turns that path off), so its logger is quieted before anything imports it."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()


@spec_command
def train_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start over: move the earlier run in the output aside "
                                        "(OUTPUT.old-TIMESTAMP) instead of resuming it (also when every checkpoint "
                                        "there is damaged).")] = False,
    skip_invalid: Annotated[bool, typer.Option("--skip-invalid", help="Skip rows that cannot be read, and count "
                                               "them, instead of stopping.")] = False,
    no_memory_check: Annotated[bool, typer.Option("--no-memory-check", help="Do not estimate memory before the "
                                                  "first step (micro_batch: auto then takes the smallest).")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout at the end.")]
    = False,
    report: Annotated[bool, typer.Option("--report", help="Keep OUTPUT/report.html (charts of the run, works "
                                         "offline) up to date: at every checkpoint and at the end.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what the run would do (device, batch shape and "
                                          "its predicted memory, steps, resume) without training or writing; with "
                                          "--runner, as that tool would run it.")] = False,
    *,
    spec_args: SpecArgs,
) -> int:
    """Fine-tune: checkpoints in OUTPUT/checkpoints, metrics in OUTPUT/metrics.jsonl, the result in OUTPUT/final.
    Preempted (SIGTERM, SIGINT, SIGUSR1): saves a checkpoint and exits 75; the same command resumes. With
    gpus.count (or --gpus) above 1 it starts that many workers (DDP or FSDP2, gpus.strategy); it also runs as
    the workers of torchrun or accelerate launch."""
    if dry_run:
        return _dry_run(ctx, config, spec_args, json_output, no_memory_check)
    started = time.monotonic()
    installed_here = not PROCESS_FLAG.installed  # run from code (tests), not from the console script
    flag = PROCESS_FLAG.install() if installed_here else PROCESS_FLAG
    try:
        status = _train(ctx, config, fresh, no_memory_check, json_output, spec_args, skip_invalid, flag, started,
                        report)
    finally:
        if installed_here:
            flag.uninstall()
    if not installed_here:
        _exit_at_once(status)
    return status


def _exit_at_once(status: int) -> None:
    """End the console script's process now: everything the run wrote is closed and durable, its lock released and
    its process group left, and the interpreter's own teardown of torch and the model (seconds on a loaded machine)
    is time a preempted machine does not have (benchmarks/sigterm_latency.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _launch(count: int, json_output: bool) -> int:
    """Start `count` workers of this same command and wait for them (launch/local.py)."""
    from tunecast.cli.app import ARGS
    from tunecast.launch.local import launch

    already = signal.Signals[PROCESS_FLAG.received].value if PROCESS_FLAG.received else None
    err.print(f"starting {count} worker processes (rank 0 reports)")
    status, ended = launch(ARGS, count, already=already)
    failed = [one for one in ended if one.code not in (0, EXIT_PREEMPTED, 2)]  # 2: rank 0 said what to fix
    if failed:
        first = failed[0]
        err.print(f"[red]{escape(first.describe())}; the other workers stopped. The newest complete checkpoint is "
                  "kept: run the same command again to resume from it.[/]")
    return status


# Set by _run_train when the run stopped on a preemption signal (this rank's or another's), not a lost rank.
_STOPPED_BY_SIGNAL: list[bool] = [False]


def _marked(status: int, flag: PreemptionFlag) -> int:
    """A worker's status, and under a launcher that cannot pass it on (torchrun exits 1 for any failure) a mark
    that it stopped on a preemption signal: the file TUNECAST_EXIT_FILE names (the exported SkyPilot script
    reads it and exits 75, which relaunches the job). A worker that stopped because another rank was lost leaves
    no mark: that rank's failure is the job's status, and a crash is not relaunched as if preempted."""
    marker = os.environ.get("TUNECAST_EXIT_FILE")
    if status == EXIT_PREEMPTED and marker and (flag.received is not None or _STOPPED_BY_SIGNAL[0]):
        with contextlib.suppress(OSError):
            Path(marker).write_text(f"{EXIT_PREEMPTED}\n")
    return status


def _train(ctx: typer.Context, config: Path | None, fresh: bool, no_memory_check: bool, json_output: bool,
           spec_args: SpecArgs, skip_invalid: bool, flag: PreemptionFlag, started: float, report: bool) -> int:
    return _marked(_run_train(ctx, config, fresh, no_memory_check, json_output, spec_args, skip_invalid, flag,
                              started, report), flag)


def _run_train(ctx: typer.Context, config: Path | None, fresh: bool, no_memory_check: bool, json_output: bool,
               spec_args: SpecArgs, skip_invalid: bool, flag: PreemptionFlag, started: float, report: bool) -> int:
    from tunecast.config.load import Override

    if skip_invalid:
        spec_args = SpecArgs([*spec_args.overrides, Override("dataset.skip_invalid", True, "--skip-invalid")],
                             spec_args.offline, spec_args.source)
    from tunecast.config.load import LoadedPipeline
    from tunecast.train.world import world_from_env

    loaded = load_run_from_cli(ctx, config, spec_args)  # a diffusion pipeline too (docs/diffusion.md)
    if isinstance(loaded, LoadedPipeline):
        return _train_pipeline(ctx, loaded, fresh, not no_memory_check, json_output, spec_args, flag, started,
                               report)
    if loaded.spec.runner != "tunecast":
        from tunecast.errors import TunecastError

        raise TunecastError(f"runner is {loaded.spec.runner}: tunecast train runs tunecast's own loop, and the runner "
                            "setting says whose step to estimate", field="runner",
                            hint="remove runner (or --runner) to train with tunecast; `tunecast train --dry-run "
                                 f"--runner {loaded.spec.runner}` shows what that tool's run would hold")
    world = world_from_env()
    if not world.distributed:  # under a launcher every rank checks its run (train/session.py), rank 0 reporting
        from tunecast.config.checks import distributed_problems
        from tunecast.errors import TunecastError

        # what `validate` lets `memory` and `plan` estimate (QLoRA sharded, DeepSpeed) but tunecast cannot run
        refused = [p for p in distributed_problems(loaded.spec, loaded.spec.gpus.count) if p.field != "global_batch"]
        if refused:
            raise TunecastError(refused[0].message, field=refused[0].field, hint=refused[0].hint)
    if world.distributed and loaded.spec.fixed("gpus.count") and loaded.spec.gpus.count != world.size:
        from tunecast.errors import TunecastError

        raise TunecastError(f"gpus.count is {loaded.spec.gpus.count} but the launcher started {world.size} processes",
                            field="gpus.count", hint=f"set gpus.count (or --gpus) to {world.size}, or leave it out")
    if world.main:  # no data, a busy output or a model without weights: refused now, not after the libraries load
        from tunecast.storage.lock import probe_lock
        from tunecast.storage.store import Storage
        from tunecast.train.preflight import check_dataset, check_weights
        from tunecast.train.run import output_url

        check_dataset(loaded.spec)
        probe_lock(Storage(output_url(loaded.spec)))
        check_weights(loaded.spec, loaded.model, random_allowed=False)
    if not world.distributed and loaded.spec.gpus.count > 1:
        print_problems(list(loaded.warnings))
        return _launch(loaded.spec.gpus.count, json_output)
    if world.main:
        from tunecast.launch.accelerate import contradiction

        said = contradiction(loaded.spec.gpus.strategy, dict(os.environ)) if world.distributed else None
        if said:
            print_problems([Problem("gpus.strategy", said, f"tunecast trains with gpus.strategy "
                                    f"({loaded.spec.gpus.strategy}); `tunecast export accelerate` writes a matching "
                                    "accelerate config", severity="warning")])
        print_problems(list(loaded.warnings))
    return _run_and_say(ctx, loaded, fresh, not no_memory_check, json_output, spec_args, flag, started, report,
                        world.rank)


def _train_pipeline(ctx: typer.Context, loaded: LoadedPipeline, fresh: bool, check_memory: bool, json_output: bool,
                    spec_args: SpecArgs, flag: PreemptionFlag, started: float, report: bool) -> int:
    """A diffusion pipeline's run (one process): its images, settings and weights checked before the libraries
    load."""
    from tunecast.errors import TunecastError
    from tunecast.storage.lock import probe_lock
    from tunecast.storage.store import Storage
    from tunecast.train.preflight import check_pipeline_run
    from tunecast.train.run import output_url
    from tunecast.train.world import world_from_env

    if world_from_env().distributed:
        raise TunecastError("a diffusion pipeline trains in one process for now, and a launcher started several",
                            field="gpus.count", hint="run tunecast train without torchrun or accelerate launch")
    check_pipeline_run(loaded.spec, loaded.pipeline)
    probe_lock(Storage(output_url(loaded.spec)))
    print_problems(list(loaded.warnings))
    return _run_and_say(ctx, loaded, fresh, check_memory, json_output, spec_args, flag, started, report, 0)


def _run_and_say(ctx: typer.Context, loaded: LoadedSpec | LoadedPipeline, fresh: bool, check_memory: bool,
                 json_output: bool, spec_args: SpecArgs, flag: PreemptionFlag, started: float, report: bool,
                 rank: int) -> int:
    """Run the training and say how it ended: its exit status (75 when preempted)."""
    reporter = ConsoleReporter()
    try:
        flag.check()
        _quiet_libraries()
        from tunecast.report.run import ReportView
        from tunecast.train.run import TrainRequest, run_training

        request = TrainRequest(fresh=fresh, offline=spec_args.offline,
                               check_memory=check_memory, started=started, view=ReportView() if report else None)
        with listening(estimate_line):  # the memory check before training may trace on first use
            result = run_training(loaded, state(ctx).catalog(), request, flag, reporter)
    except Preempted as stop:
        reporter.close()
        _STOPPED_BY_SIGNAL[0] = True
        if rank != 0:  # rank 0 says it for the run
            return EXIT_PREEMPTED
        err.print(f"[yellow]preempted ({stop.signal_name}) before training started: nothing to save. "
                  "Run the same command again.[/]")
        if json_output:
            print_json({"finished": False, "preempted_by": stop.signal_name, "steps": 0})
        return EXIT_PREEMPTED
    finally:
        reporter.close()
    _STOPPED_BY_SIGNAL[0] = result.signal is not None and result.lost is None
    if result.rank != 0:  # rank 0 speaks for the run
        return EXIT_PREEMPTED if not result.finished else 0
    if json_output:  # the warnings were said as they arose (ConsoleReporter); the document lists them too
        print_json(result.as_dict())
    if result.lost is not None:
        err.print(f"[yellow]Another worker was lost ({escape(result.lost)}): stopped without a new checkpoint; the "
                  f"newest complete one is step {result.steps}. Run the same command again to resume.[/]")
        return EXIT_PREEMPTED
    if result.already_complete:
        err.print(f"Already complete: {escape(result.output)} finished at step {result.steps}; final model in "
                  f"{escape(str(result.final))}. Pass --fresh to train again.")
        return 0
    if not result.finished:
        saved = (f"checkpoint at step {result.steps} of {result.total_steps} saved" if result.total_steps else
                 f"stopped before training started, nothing new to save (the run is at step {result.steps})")
        err.print(f"[yellow]Preempted ({result.signal}): {saved} in {escape(result.output)}. Run the same command "
                  "again to resume.[/]")
        return EXIT_PREEMPTED
    if not json_output:
        speed = f", {result.tokens_per_second:,.0f} tok/s" if result.tokens_per_second else ""
        if result.images_per_second is not None:
            speed = f", {result.images_per_second:,.2f} images/s"
        out.print(f"Trained {result.steps} steps in {_duration(result.elapsed_s)} (${result.cost_usd:.2f}{speed}). "
                  f"Final model: {escape(str(result.final))}")
    return 0


def _dry_run(ctx: typer.Context, config: Path | None, spec_args: SpecArgs, json_output: bool,
             no_memory_check: bool) -> int:
    from tunecast.config.load import LoadedPipeline, imported_part
    from tunecast.train.dryrun import diffusion_dry_run, dry_run

    loaded = load_run_from_cli(ctx, config, spec_args)
    with listening(estimate_line):
        result = diffusion_dry_run(loaded, state(ctx).catalog(), check_memory=not no_memory_check) \
            if isinstance(loaded, LoadedPipeline) else dry_run(loaded, state(ctx).catalog(),
                                                               check_memory=not no_memory_check)
    if json_output:
        print_json({**result.as_dict(), **imported_part(loaded)})
        return 0
    choice = result.choice
    runner = "" if result.runner == "tunecast" else f" as {result.runner} runs it"
    out.print(f"[bold]Dry run{escape(runner)}[/] on {escape(result.device)}: nothing is loaded, trained or written.")
    checkpointing = "on" if choice.grad_checkpointing else "off"
    out.print(f"  batch: micro_batch {choice.micro_batch} × grad_accum {choice.grad_accum}, gradient checkpointing "
              f"{checkpointing}; " + escape("; ".join(choice.reasons)))
    if result.steps is not None:
        epoch = f" ({result.steps_per_epoch} per epoch)" if result.steps_per_epoch else ""
        data = f"{result.examples:,} examples, {result.sequences:,} sequences; " if result.examples is not None else ""
        if isinstance(loaded, LoadedPipeline):  # the source says the images, their captions and repeats
            data = ""
        out.print(f"  data: {data}{result.steps:,} optimizer steps{epoch} — {escape(result.data_source)}")
    else:
        out.print(f"  data: {escape(result.data_source)}")
    resume = (f"would resume from its checkpoint at step {result.resume_step}" if result.resume_step is not None
              else "would start a new run")
    out.print(f"  output: {escape(result.output)} ({resume})")
    print_problems(list(loaded.warnings))
    print_imported(loaded)
    return 0


def merge_command(
    ctx: typer.Context,
    run_dir: Annotated[str, typer.Argument(help="The run's output directory or storage URL.")],
    output: Annotated[str | None, typer.Option("--output", "-o", help="Where the merged model goes. Default: "
                                               "RUN_DIR/merged.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Merge a finished run's adapter into its base weights (dequantized for QLoRA): a model that
    `from_pretrained` loads without peft."""
    from tunecast.train.merge import merge_run

    _quiet_libraries()
    with err.status("Merging…"):
        result = merge_run(run_dir, output, state(ctx).catalog())
    if json_output:
        print_json(result)
        return
    out.print(f"Merged model written to {escape(result['output'])} ({result['parameters']:,} parameters)")


def register(app: typer.Typer) -> None:
    app.command("train", cls=SpecCommand)(train_command)
    app.command("merge")(merge_command)
