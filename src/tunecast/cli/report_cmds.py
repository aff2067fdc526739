"""`tunecast report RUN_DIR_OR_URL`: a run's metrics as a self-contained HTML page with charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from tunecast.cli.render import err
from tunecast.errors import TunecastError


def _document(path: Path | None, flag: str) -> dict | None:  # type: ignore[type-arg]
    if path is None:
        return None
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise TunecastError(f"cannot read {path}: {error.strerror}", field=flag, hint="give an existing file") from None
    except ValueError:
        raise TunecastError(f"{path} is not JSON", field=flag,
                            hint="give what `tunecast plan --json` or `tunecast calibrate` wrote") from None
    if not isinstance(document, dict):
        raise TunecastError(f"{path} is not a JSON object", field=flag, hint="give a plan or calibration document")
    if flag == "--plan":
        check_plan(document, str(path), flag)
    return document


def check_plan(document: dict, where: str, flag: str) -> None:  # type: ignore[type-arg]
    """A plan document as `tunecast plan --json` writes it: options with what the report reads."""
    options = document.get("options")
    needed = ("gpu", "gpu_count", "fits", "tokens_per_second", "device_total_gib", "total_usd")
    if not isinstance(options, list) or not all(isinstance(o, dict) and all(k in o for k in needed)
                                                for o in options):
        raise TunecastError(f"{where} is not a plan: no options as `tunecast plan --json` writes them", field=flag,
                            hint="give the document `tunecast plan CONFIG --json` printed")


def report_command(
    run_dir: Annotated[str, typer.Argument(metavar="RUN_DIR_OR_URL", help="The run's output directory or storage "
                                           "URL.")],
    output: Annotated[str | None, typer.Option("--output", "-o", metavar="FILE", help="Where the page goes. "
                                               "Default: RUN_DIR/report.html.")] = None,
    plan: Annotated[Path | None, typer.Option("--plan", metavar="FILE", help="A `tunecast plan --json` document: "
                                              "its option for this device is drawn as the prediction (default: "
                                              "RUN_DIR/plan.json, when there is one).")] = None,
    calibration: Annotated[Path | None, typer.Option("--calibration", metavar="FILE",
                                                     help="A calibration.json to compare with.")] = None,
) -> None:
    """Loss and learning rate, tokens/s, peak memory against the prediction, cost against the plan, and the
    checkpoints, preemptions and resumptions of a run, in one HTML file that works offline."""
    from tunecast.report.run import REPORT_FILE, read_run, run_report

    records, config, in_run = read_run(run_dir)
    if in_run is not None:
        check_plan(in_run, f"{run_dir}/plan.json", "RUN_DIR")
    text = run_report(run_dir, records, config, plan=_document(plan, "--plan") or in_run,
                      calibration=_document(calibration, "--calibration"))
    if output is None:
        from tunecast.storage.store import Storage

        Storage(run_dir).write(REPORT_FILE, text.encode())
        where = f"{run_dir.rstrip('/')}/{REPORT_FILE}"
    else:
        from tunecast.atomic import write_user_file

        write_user_file(Path(output), text, field="--output")
        where = output
    err.print(f"wrote {escape(where)}")


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)
