"""`tunecast data`: what a dataset holds in tokens, as the planner and the trainer will count them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from tunecast.cli.app import state
from tunecast.cli.config_cmds import hub_access
from tunecast.cli.render import err, out, print_json
from tunecast.errors import TunecastError

if TYPE_CHECKING:
    from tunecast.catalog.store import Catalog
    from tunecast.data.stats import DatasetStats
    from tunecast.data.tokens import TokenCounter

CONFIG_SUFFIXES = (".yaml", ".yml")


def data_command(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(help="JSONL, JSON, CSV or Parquet file, a datasets folder, or an fsspec URL; "
                                        "or a run config (YAML), whose dataset, tokenizer and batch shape are used.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model whose tokenizer counts the tokens "
                                              "(a local model folder, or a catalog name).")] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="A tokenizer folder or tokenizer.json file.")]
    = None,
    layout: Annotated[str | None, typer.Option("--format", help="auto, text, prompt-completion, alpaca, sharegpt or "
                                               "messages. Default: auto, or the config's dataset.format.")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Sequence length: longer examples are truncated. "
                                                "Default: 2048, or the config's seq_len.")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="Sequences per micro-batch (for padding). "
                                                    "Default: 1, or the config's micro_batch.")] = None,
    train_on: Annotated[str | None, typer.Option("--train-on", help="completion (responses only; plain text: all) "
                                                 "or all. Default: auto, or the config's dataset.train_on.")] = None,
    skip_invalid: Annotated[bool, typer.Option("--skip-invalid", help="Skip invalid rows, and report them.")] = False,
    seed: Annotated[int | None, typer.Option("--seed", help="Order of micro-batches for the padding figure. Default: "
                                             "42, or the config's seed.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Examples, tokens (processed and trained), lengths, truncation, padding and packing efficiency: of a data file,
    or of the dataset a run config names, read with its settings and tokenizer."""
    from tunecast.data.counters import choose_counter
    from tunecast.data.settings import validate_data_options
    from tunecast.data.stats import measure

    catalog = state(ctx).catalog()
    defaults: dict[str, Any] = {"layout": "auto", "seq_len": 2048, "micro_batch": 1, "train_on": "auto", "seed": 42}
    counter: TokenCounter | None = None
    if _is_config(path):
        path, defaults, counter = _from_config(Path(path), catalog, model=model, tokenizer=tokenizer)
    given = {"layout": layout, "seq_len": seq_len, "micro_batch": micro_batch, "train_on": train_on, "seed": seed}
    options = {key: defaults[key] if value is None else value for key, value in given.items()}
    skip_invalid = skip_invalid or bool(defaults.get("skip_invalid"))
    validate_data_options(layout=options["layout"], seq_len=options["seq_len"], micro_batch=options["micro_batch"],
                          train_on=options["train_on"])
    if counter is None:
        counter = choose_counter(model=model, tokenizer=tokenizer, catalog=catalog, base_dir=Path.cwd(),
                                 hub=hub_access(offline=False))
    if not counter.exact:
        err.print(f"[yellow]No tokenizer on disk: counting with an {escape(counter.description)}.[/]\n"
                  "[dim]  Pass --tokenizer DIR|tokenizer.json, or --model a local model folder, for exact counts.[/]")
    with err.status("Reading the dataset…") as status:
        stats = measure(path, counter, seq_len=options["seq_len"], micro_batch=options["micro_batch"],
                        layout=options["layout"], train_on=options["train_on"], skip_invalid=skip_invalid,
                        seed=options["seed"], progress=lambda n: status.update(f"Reading the dataset… {n:,} examples"))
    if json_output:
        print_json(stats.as_dict())
        return
    _render(stats)


def _is_config(path: str) -> bool:
    return "://" not in path and Path(path).suffix.lower() in CONFIG_SUFFIXES and Path(path).is_file()


def _from_config(config: Path, catalog: Catalog, *, model: str | None, tokenizer: str | None
                 ) -> tuple[str, dict[str, Any], TokenCounter | None]:
    """A run config's dataset file and the settings it is read with (flags given on the command line still win), and
    the token counter the run uses (None when --model or --tokenizer choose another)."""
    from tunecast.config.load import load_spec
    from tunecast.data.counters import spec_counter

    loaded = load_spec(config, [], catalog, hub=hub_access(offline=False))
    spec = loaded.spec
    if spec.dataset.path is None:
        raise TunecastError(f"{config} has no dataset.path: nothing to read", field="dataset.path",
                            hint="set dataset.path in the config, or give the data file itself: tunecast data FILE")
    counter = spec_counter(loaded, catalog) if model is None and tokenizer is None else None
    settings = {"layout": spec.dataset.format, "seq_len": spec.seq_len, "micro_batch": spec.micro_batch_size,
                "train_on": spec.dataset.train_on, "seed": spec.seed, "skip_invalid": spec.dataset.skip_invalid}
    return spec.dataset.path, settings, counter


def _render(stats: DatasetStats) -> None:
    out.print(f"[bold]{escape(stats.source)}[/]: {escape(stats.detection)}")
    out.print(f"tokens counted by {escape(stats.tokenizer)}")
    table = Table(box=box.SIMPLE_HEAD, show_header=False)
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row("examples", f"{stats.examples:,}")
    table.add_row(f"processed tokens (≤ {stats.seq_len:,} per example)", f"{stats.total_tokens:,}")
    table.add_row("trained tokens (in the loss)", f"{stats.trained_tokens:,}")
    table.add_row(f"examples longer than {stats.seq_len:,}", f"{stats.truncated_examples:,}")
    table.add_row("tokens lost to truncation", f"{stats.truncated_tokens:,}")
    p = stats.length_percentiles
    table.add_row("length p50 / p90 / p99 / max", f"{p['p50']:,} / {p['p90']:,} / {p['p99']:,} / {p['max']:,}")
    table.add_row(f"padding efficiency (micro-batch {stats.micro_batch})", f"{stats.padding_efficiency:.1%}")
    table.add_row(f"packing efficiency ({stats.packed_sequences:,} sequences of {stats.seq_len:,})",
                  f"{stats.packing_efficiency:.1%}")
    out.print(table)
    biggest = max((b["examples"] for b in stats.histogram), default=0)
    histogram = Table(box=box.SIMPLE_HEAD, title="Lengths (tokens)", title_justify="left")
    histogram.add_column("tokens", justify="right")
    histogram.add_column("examples", justify="right")
    histogram.add_column("")
    for row in stats.histogram:
        bar = "█" * round(30 * row["examples"] / biggest) if biggest else ""
        span = f"{row['from']:,}–{row['to']:,}"
        if row["from"] > stats.seq_len:
            span += " (truncated)"
        histogram.add_row(span, f"{row['examples']:,}", bar)
    out.print(histogram)
    if stats.skipped_rows:
        err.print(f"[yellow]Skipped {stats.skipped_rows:,} invalid row(s):[/]")
        for row in stats.skipped:
            err.print(f"  {escape(row['where'])}: {escape(row['message'])}")
        if stats.skipped_rows > len(stats.skipped):
            err.print(f"  … and {stats.skipped_rows - len(stats.skipped):,} more")


def register(app: typer.Typer) -> None:
    app.command("data")(data_command)
