"""The `tunecast` command: global options, command registration, and the error boundary."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from typer._click.exceptions import ClickException  # Typer bundles its own click

from tunecast.cli.render import err, report_error
from tunecast.errors import SharedError, TunecastError
from tunecast.paths import default_user_catalog_dir
from tunecast.version import __version__

if TYPE_CHECKING:
    from tunecast.catalog.store import Catalog

# What is imported here, and by each command module at its top, is what `tunecast --help` and every command pay
# for before they start: typer, rich and tunecast's light modules (errors, paths, units). The library (pydantic
# models, the catalog, the estimator) is imported inside the commands that use it.

app = typer.Typer(
    name="tunecast",
    help="Plan, price and run LLM fine-tuning: what fits, how long, what the whole run costs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@dataclass
class State:
    """Global options, shared by every command through the click context."""

    catalog_dir: Path | None = None
    debug: bool = False

    def catalog(self) -> Catalog:
        from tunecast.catalog.store import load_catalog

        directory = self.catalog_dir if self.catalog_dir is not None else default_user_catalog_dir()
        return load_catalog(directory.expanduser().resolve())


def _version(value: bool) -> None:
    if value:
        from tunecast.catalog.store import load_catalog

        catalog_version = load_catalog(None).version
        typer.echo(f"tunecast {__version__} (catalog {catalog_version})")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    catalog: Annotated[Path | None, typer.Option(
        "--catalog", metavar="DIR",
        help="User catalog directory whose gpus.csv, offers.csv and models add to and override the bundled "
             "ones. Default: $TUNECAST_CATALOG, else ~/.local/share/tunecast/catalog.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    ctx.obj = State(catalog_dir=catalog, debug=debug)


def state(ctx: typer.Context) -> State:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, State) else State()


# The module that registers each command. A command imports its own module only (a cold `tunecast memory` need
# not pay for the others' imports); no command, help or an unknown word imports them all.
# tests/integration/test_cli.py holds this table to what the modules register.
COMMAND_MODULES = {
    "gpus": "catalog_cmds", "offers": "catalog_cmds", "models": "catalog_cmds",
    "validate": "config_cmds", "init": "config_cmds",
    "memory": "estimate_cmds",
    "data": "data_cmds",
    "plan": "plan_cmds", "breakeven": "plan_cmds",
    "train": "train_cmds", "merge": "train_cmds",
    "probe": "measure_cmds", "calibrate": "measure_cmds",
    "export": "export_cmds",
    "report": "report_cmds",
    "serve": "serve_cmds",
}
_REGISTERED: list[str] = []


def register(modules: list[str] | None = None) -> None:
    """Add the commands of `modules` (default: every command module) to the app, each module once."""
    for name in modules if modules is not None else list(dict.fromkeys(COMMAND_MODULES.values())):
        if name not in _REGISTERED:
            importlib.import_module(f"tunecast.cli.{name}").register(app)
            _REGISTERED.append(name)


_VALUED_OPTIONS = ("--catalog",)  # global options followed by a value


def command_word(argv: list[str]) -> str | None:
    """The command `argv` runs (its first word that is not an option or an option's value), or None: no
    command, or help or the version asked before it."""
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help", "--version"):
            return None
        if word in _VALUED_OPTIONS:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _command_module(argv: list[str]) -> str | None:
    """The module of the command `argv` runs, or None (no command, or help asked before it)."""
    word = command_word(argv)
    return None if word is None else COMMAND_MODULES.get(word)


def _wants_json(argv: list[str]) -> bool:
    words = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in words


# The command line being run (after the program name): `tunecast train --gpus N` starts its workers with it.
ARGS: list[str] = []


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors → message and exit 2; bugs → a short note and exit 1 (traceback with --debug)."""
    args = sys.argv[1:] if argv is None else argv
    ARGS[:] = args
    debug = "--debug" in args or os.environ.get("TUNECAST_DEBUG") == "1"
    module = _command_module(args)
    register([module] if module is not None else None)
    try:
        # standalone_mode=False: click returns typer.Exit's code instead of exiting, and raises the rest here.
        result = app(args=args, prog_name="tunecast", standalone_mode=False)
    except TunecastError as error:
        if isinstance(error, SharedError):  # a worker of a run whose rank 0 reports this error
            sys.exit(2)
        if debug:
            import traceback

            traceback.print_exc()
        report_error(error, json_output=_wants_json(args))
        sys.exit(2)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:  # every cache entry is written whole or not at all: nothing to clean up
        err.print("interrupted")
        sys.exit(130)
    except ClickException as error:  # bad flags or arguments: click's own message, exit 2
        error.show()
        sys.exit(error.exit_code)
    except Exception as error:  # a bug in tunecast, not the user's fault
        if debug:
            import traceback

            traceback.print_exc()
        else:
            err.print(f"[red bold]internal error:[/] {type(error).__name__}: {escape(str(error))}\n"
                      "  This is a bug in tunecast. Run again with --debug for the traceback and report it.")
        sys.exit(1)
    code = result if isinstance(result, int) else 0
    if argv is None and module in QUICK_EXIT_MODULES:
        _quick_exit(code)
    sys.exit(code)


# Commands whose process ends as soon as their answer is out (run as the `tunecast` program, not through `main(argv)`):
# the interpreter's teardown of torch and transformers takes about 0.9 s on 2 cores, most of a warm estimate's time.
QUICK_EXIT_MODULES = ("estimate_cmds", "plan_cmds")


def _quick_exit(code: int) -> None:
    """Exit now with `code`, after the exit handlers and with the output flushed, skipping the teardown of modules
    (every file tunecast writes is written whole and closed before this: atomic.py). Returns where another thread
    still runs, whose work a normal exit waits for."""
    import atexit
    import threading

    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
