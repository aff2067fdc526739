"""`tunecast gpus`, `tunecast offers`, `tunecast models`: the catalogs as tables or JSON. No torch, except in
`models add`, which counts a new model's parameters on the meta device."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from tunecast.cli.app import state
from tunecast.cli.render import err, out, print_json
from tunecast.units import format_params, format_usd

if TYPE_CHECKING:
    from tunecast.catalog.offers import Offer
    from tunecast.catalog.store import Catalog

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def _offer_doc(offer: Offer, on: date) -> dict[str, Any]:
    return {**offer.document(), "stale": offer.is_stale(on), "age_days": offer.age_days(on)}


def _short_source(source: str) -> str:
    """A refreshed price's source as named (`gpuhunt 20261205-1`); else the domain of the first cited URL that is
    not a copy on GitHub (the provider's own page)."""
    if source.startswith(("gpuhunt", "skypilot")):
        return source.split(" ; ")[0]
    domains = []
    for cited in source.split(" ; "):
        text = cited.strip()
        for prefix in ("https://", "http://", "www."):
            text = text.removeprefix(prefix)
        domains.append(text.split("/")[0])
    own = [d for d in domains if "github" not in d]
    return (own or domains)[0]


def gpus_command(
    ctx: typer.Context,
    json_output: JsonFlag = False,
    min_memory: Annotated[float | None, typer.Option("--min-memory", metavar="GIB",
                                                     help="Only cards with at least this much memory.")] = None,
) -> None:
    """GPU specifications: memory, dense bf16/fp8 TFLOPS, bandwidth, interconnect, power, price."""
    from tunecast.catalog.listing import listed_gpus

    catalog = state(ctx).catalog()
    gpus = listed_gpus(catalog, min_memory_gib=min_memory)
    if json_output:
        print_json([g.document() for g in gpus])
        return
    table = Table(box=box.SIMPLE_HEAD, title=f"GPUs (catalog {catalog.version})", title_justify="left")
    for heading, justify in (("gpu", "left"), ("memory GiB", "right"), ("usable GiB", "right"),
                             ("bf16 TFLOPS", "right"), ("fp8 TFLOPS", "right"), ("HBM/GDDR GB/s", "right"),
                             ("link GB/s", "left"), ("TDP W", "right"), ("price", "right")):
        table.add_column(heading, justify=justify)  # type: ignore[arg-type]
    for g in gpus:
        link = f"{g.interconnect} {g.interconnect_gb_per_s:g}"
        table.add_row(g.slug, f"{g.memory_gib:g}", f"{g.usable_memory_gib:.2f}",
                      f"{g.bf16_tflops:g}", f"{g.fp8_tflops:g}" if g.fp8_tflops else "—",
                      f"{g.memory_bandwidth_gb_per_s:,.0f}", link, f"{g.tdp_w:g}",
                      f"${g.purchase_usd:,.0f}" if g.purchase_usd else "—")
    out.print(table)
    out.print("[dim]Dense figures (no sparsity), bf16 with fp32 accumulate. Usable = what the driver reports to "
              "PyTorch. Sources: `tunecast gpus --json`.[/]")


offers_app = typer.Typer(help="Price offers per GPU-hour, and imports from SkyPilot catalogs.",
                         invoke_without_command=True, no_args_is_help=False)


@offers_app.callback()
def offers_command(
    ctx: typer.Context,
    json_output: JsonFlag = False,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Only offers for this GPU (slug or alias).")] = None,
    provider: Annotated[list[str] | None, typer.Option(
        "--provider", help="Only this provider (repeat for several); with --refresh, refresh only these.")] = None,
    spot: Annotated[bool, typer.Option("--spot", help="Only offers with a spot price.")] = False,
    refresh: Annotated[bool, typer.Option(
        "--refresh", help="First fetch today's offers from the price sources (gpuhunt, SkyPilot's catalogs) into "
        "your catalog; a source that cannot be reached is said in one line and its last snapshot kept.")] = False,
    source: Annotated[list[str] | None, typer.Option(
        "--source", help="With --refresh: only this source, gpuhunt or skypilot (repeat for both).")] = None,
) -> None:
    """Price offers: provider, GPU, node size, on-demand and spot USD per GPU-hour, billing, as_of, source."""
    if ctx.invoked_subcommand is not None:
        return
    from tunecast.catalog.offers import STALE_AFTER_DAYS
    from tunecast.catalog.store import today

    refreshed = refresh_offers(ctx, provider, source, json_output=json_output) if refresh else None
    catalog = state(ctx).catalog()
    offers = _filter_offers(catalog, gpu, provider, spot, strict=not refresh)
    on = today()
    if json_output:
        documents = [_offer_doc(o, on) for o in offers]
        print_json(documents if refreshed is None else {"refreshed": refreshed, "offers": documents})
        return
    only_gpu = offers[0].gpu if gpu is not None and offers else None
    title = f"Price offers{f' for {only_gpu}' if only_gpu else ''} (catalog {catalog.version}; USD per GPU-hour)"
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left")
    columns = [("gpu", "left")] if only_gpu is None else []
    columns += [("provider", "left"), ("GPUs", "right"), ("on-demand", "right"), ("spot", "right"),
                ("billing", "left"), ("disk $/GB·mo", "right"), ("as of", "left"), ("source", "left")]
    listed = any(o.available is not None for o in offers)  # a live marketplace's snapshot says how many
    columns += [("listed", "right")] if listed else []
    for heading, justify in columns:
        table.add_column(heading, justify=justify, no_wrap=True,  # type: ignore[arg-type]
                         max_width=22 if heading == "source" else None, overflow="ellipsis",
                         min_width=7 if heading in ("on-demand", "spot") else None)
    stale = 0
    for o in offers:
        as_of = o.as_of.isoformat()
        if o.is_stale(on):
            stale += 1
            as_of = f"[yellow]{as_of}*[/]"
        cells = [o.gpu] if only_gpu is None else []
        cells += [o.provider, str(o.gpu_count), format_usd(o.usd_per_hour),
                  format_usd(o.spot_usd_per_hour) if o.spot_usd_per_hour else "—", _billing(o),
                  _volume(o),
                  as_of, escape(_short_source(o.source))]
        cells += ([str(o.available) if o.available is not None else "—"] if listed else [])
        table.add_row(*cells)
    out.print(table)
    if any(o.volume_default is not None for o in offers):
        out.print("[dim]~ assumed: no published disk price, so the default for the provider's kind "
                  "(`tunecast offers --json` shows it, with its source).[/]")
    if stale:
        err.print(f"[yellow]* {stale} offer(s) are older than their kind's limit (a marketplace's: "
                  f"{STALE_AFTER_DAYS['marketplace']} day; a list price's: {STALE_AFTER_DAYS['list']} days); prices "
                  "may have moved: `tunecast offers --refresh` fetches today's.[/]")


def _volume(offer: Offer) -> str:
    """The disk price a run is charged; an assumed default is marked with ~."""
    price = offer.storage_usd_per_gb_month
    if price is None:
        return "—"
    return f"~{price:g}" if offer.volume_default is not None else f"{price:g}"


def _billing(offer: Offer) -> str:
    unit = {1: "per s", 60: "per min", 3600: "per h"}.get(offer.billing_increment_s,
                                                          f"per {offer.billing_increment_s} s")
    if offer.minimum_charge_s > offer.billing_increment_s:
        unit += f", ≥{offer.minimum_charge_s} s"
    return unit


def refresh_offers(ctx: typer.Context, providers: list[str] | None, sources: list[str] | None, *,
                   json_output: bool) -> list[dict[str, Any]]:
    """`--refresh`: today's offers into the user's catalog, a line for each source and provider on stderr (one per
    source that could not be reached). Never fails for a source; an unknown provider or source is a user error."""
    from tunecast.catalog.refresh import REFRESHABLE, refresh, unreachable
    from tunecast.catalog.snapshots import SOURCES
    from tunecast.catalog.user import user_catalog_dir
    from tunecast.errors import TunecastError, suggestion_text

    for name, given, known in (("--provider", providers or [], REFRESHABLE), ("--source", sources or [], SOURCES)):
        for value in given:
            if value not in known:
                raise TunecastError(f"{name} {value}: " + ("no price source refreshes this provider"
                                                            if name == "--provider" else "no such price source"),
                                    field=name,
                                    hint=suggestion_text(value, list(known)) or f"one of: {', '.join(known)}")
    results = refresh(user_catalog_dir(state(ctx).catalog_dir), providers or None, tuple(sources or SOURCES))
    for fetched in results if not json_output else ():
        if fetched.offers is not None:
            err.print(f"{fetched.source} {fetched.provider}: {len(fetched.offers)} offer(s), {fetched.added} new, "
                      f"{fetched.updated} changed, {fetched.dropped} gone")
    for line in unreachable(results):  # said with --json too: on stderr, beside the document
        err.print(f"[yellow]{escape(line)}[/]", soft_wrap=True)  # one line each, whatever the terminal's width
    return [fetched.as_dict() for fetched in results]


def _filter_offers(catalog: Catalog, gpu: str | None, providers: list[str] | None, spot: bool, *,
                   strict: bool = True) -> list[Offer]:
    """The offers asked for; `strict`: a provider the catalog does not know is an error (after a refresh that could
    not reach it, it is simply not listed)."""
    offers = list(catalog.offers)
    if gpu is not None:
        slug = catalog.gpus.get(gpu, field="--gpu").slug
        offers = [o for o in offers if o.gpu == slug]
    if providers:
        from tunecast.errors import TunecastError, suggestion_text

        for provider in providers if strict else ():
            if provider not in catalog.providers:
                raise TunecastError(f"unknown provider {provider!r}", field="--provider",
                                    hint=suggestion_text(provider, catalog.providers)
                                    or f"known providers: {', '.join(catalog.providers)}")
        offers = [o for o in offers if o.provider in providers]
    if spot:
        offers = [o for o in offers if o.spot_usd_per_hour is not None]
    return sorted(offers, key=lambda o: (o.gpu, o.usd_per_hour, o.provider))


@offers_app.command("import-skypilot")
def import_skypilot_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="A SkyPilot catalog file (catalogs/v8/<cloud>/vms.csv).")],
    provider: Annotated[str | None, typer.Option(
        "--provider", help="Provider name for the offers. Default: the folder the file is in (aws, gcp, …).")] = None,
    as_of: Annotated[str | None, typer.Option(
        "--as-of", metavar="YYYY-MM-DD", help="Date the prices were published. Default: today.")] = None,
    json_output: JsonFlag = False,
) -> None:
    """Merge a SkyPilot catalog file into your catalog: one offer per instance type, cheapest region."""
    from tunecast.catalog.skypilot import import_skypilot

    st = state(ctx)
    result = import_skypilot(file, st.catalog(), provider=provider, as_of=as_of, user_dir=st.catalog_dir)
    if json_output:
        print_json(result.as_dict())
        return
    out.print(f"Imported {len(result.offers)} offer(s) from {escape(str(file))} as provider "
              f"[bold]{escape(result.provider)}[/] into {escape(str(result.written_to))}")
    for reason, count in result.skipped.items():
        out.print(f"  skipped {count} row(s): {escape(reason)}")


models_app = typer.Typer(help="Models in the catalog, with exact parameter counts.",
                         invoke_without_command=True, no_args_is_help=False)


@models_app.callback()
def models_command(
    ctx: typer.Context,
    json_output: JsonFlag = False,
    search: Annotated[str | None, typer.Option("--search", help="Only the models this text names, best first: case, "
                                               "spaces, dashes and dots alike, the vendor optional (`llama 3.1 8b`)."
                                               )] = None,
) -> None:
    """Catalog models: name, architecture, layers, hidden size, vocabulary and exact parameter count."""
    if ctx.invoked_subcommand is not None:
        return
    from tunecast.catalog.listing import model_documents

    catalog = state(ctx).catalog()
    documents = model_documents(catalog, search=search)
    if json_output:
        print_json(documents)
        return
    table = Table(box=box.SIMPLE_HEAD, title=f"Models (catalog {catalog.version})", title_justify="left")
    for heading, justify in (("name", "left"), ("type", "left"), ("params", "right"), ("layers", "right"),
                             ("hidden", "right"), ("vocab", "right"), ("experts", "right"), ("context", "right")):
        table.add_column(heading, justify=justify)  # type: ignore[arg-type]
    for d in documents:
        # A config of a type whose defaults tunecast does not fill in may leave out its vocabulary: "—" (null in JSON).
        table.add_row(d["name"], d["model_type"], format_params(d["params"]), str(d["num_layers"]),
                      str(d["hidden_size"]), f"{d['vocab_size']:,}" if d["vocab_size"] else "—",
                      str(d["num_experts"] or "—"),
                      f"{d['max_position_embeddings']:,}" if d["max_position_embeddings"] else "—")
    out.print(table)


@models_app.command("add")
def models_add_command(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="A config.json (or a model directory holding one).")],
    name: Annotated[str, typer.Option("--name", help="Model id to list it under, org/name.")],
    source: Annotated[str, typer.Option("--source", help="Where the config came from (URL or citation).")],
    json_output: JsonFlag = False,
) -> None:
    """Add a model config to your catalog, with its exact parameter count (builds it on the meta device)."""
    from tunecast.catalog.user import add_model, read_model_config
    from tunecast.step.shape import build_meta_model, count_parameters

    st = state(ctx)
    data = read_model_config(config)
    params = count_parameters(build_meta_model(data, name=name))
    entry, path = add_model(data, name=name, params=params, source=source, user_dir=st.catalog_dir)
    if json_output:
        print_json({"name": entry.name, "params": entry.params, "file": str(path)})
        return
    catalog_dir = escape(str(path.parent.parent))
    out.print(f"Added {escape(entry.name)} ({format_params(entry.params)} parameters) to {catalog_dir}")


def register(app: typer.Typer) -> None:
    app.command("gpus")(gpus_command)
    app.add_typer(offers_app, name="offers")
    app.add_typer(models_app, name="models")
