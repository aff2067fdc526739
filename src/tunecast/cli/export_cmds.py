"""`tunecast export skypilot` (a SkyPilot task for this training), `tunecast export accelerate` (an
accelerate config for its strategy), `tunecast export axolotl|llamafactory` (the run in that tool's format). GPU,
count, strategy (and for the tools' configs the batch shape) default to the plan's best option."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tunecast.cli.app import state
from tunecast.cli.config_cmds import load_from_cli
from tunecast.cli.render import err, out, working
from tunecast.cli.spec_flags import SpecArgs, SpecCommand, spec_command
from tunecast.errors import TunecastError

if TYPE_CHECKING:
    from tunecast.config.load import LoadedSpec
    from tunecast.config.spec import RunSpec

export_app = typer.Typer(help="Write what other tools need to run this training: a SkyPilot task, an accelerate "
                              "config, an axolotl or LLaMA-Factory config.", no_args_is_help=True)

OutFile = Annotated[Path | None, typer.Option("--out", "-o", metavar="FILE",
                                              help="Write to FILE instead of standard output.")]


def _best(ctx: typer.Context, loaded: LoadedSpec) -> dict[str, Any]:
    """The plan's first option that fits (the ranking of `tunecast plan`)."""
    from tunecast.catalog.store import today
    from tunecast.plan.report import PlanRequest, make_plan

    with working("Planning…"):
        document = make_plan(loaded, state(ctx).catalog(), PlanRequest(), today=today())
    for option in document["options"]:
        if option["fits"] and option["total_usd"] is not None:
            return dict(option)
    raise TunecastError("no GPU option of the catalog fits this run", field="gpus.gpu",
                        hint="`tunecast plan` shows why each does not fit; give --gpu and --gpus to export anyway")


def _target(ctx: typer.Context, loaded: LoadedSpec) -> tuple[str, int, str, bool | None, str]:
    """(GPU slug, total count, strategy, spot or None when the plan did not choose, what chose them)."""
    spec = loaded.spec
    if spec.gpus.gpu is not None and spec.fixed("gpus.count"):
        return spec.gpus.gpu, spec.gpus.count, spec.gpus.strategy, None, "the config"
    best = _best(ctx, loaded)
    return (best["gpu"], int(best["gpu_count"]), best["strategy"] or spec.gpus.strategy, bool(best["spot"]),
            f"the plan's best option ({best['provider']}, ${best['total_usd']:,.2f} in {best['hours']:.1f} h)")


def block_yaml(document: dict[str, Any]) -> str:
    """YAML with multi-line strings (the setup and run scripts) as literal blocks, as people write them."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump(document, Dumper=Dumper, sort_keys=False, allow_unicode=True, width=1000)


def _write(text: str, path: Path | None) -> None:
    if path is None:
        out.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        return
    from tunecast.atomic import write_user_file

    write_user_file(path, text, field="--out")
    err.print(f"wrote {path}")


@spec_command(without=("output",))  # type: ignore[untyped-decorator]
def skypilot_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    nodes: Annotated[int | None, typer.Option("--nodes", min=1, help="Nodes to spread --gpus over (default: one "
                                              "node up to 8 GPUs, else nodes of 8).")] = None,
    spot: Annotated[bool | None, typer.Option("--spot/--on-demand", help="Spot capacity with recovery, or "
                                              "on-demand (default: what the plan's best option uses).")] = None,
    bucket: Annotated[str | None, typer.Option("--bucket", metavar="URL", help="The bucket that keeps the "
                                               "checkpoints (default: the config's output, when it is one).")]
    = None,
    out_file: OutFile = None,
    *,
    spec_args: SpecArgs,
) -> None:
    """A SkyPilot task YAML that trains this config: `sky jobs launch FILE` runs it as a managed job, relaunched
    after every preemption and resumed from its newest checkpoint."""
    from tunecast.launch.skypilot import Target, split_count, task

    loaded = load_from_cli(ctx, config, spec_args)
    if loaded.spec.dataset.path is None:
        raise TunecastError("the SkyPilot task trains, and training needs a dataset file", field="dataset.path",
                            hint="set dataset.path (or --dataset) to a JSONL, JSON, CSV or Parquet file, or a bucket "
                                 "object")
    gpu, total, strategy, planned_spot, chosen_by = _target(ctx, loaded)
    per_node, node_count = split_count(total, nodes)
    target = Target(gpu, per_node, node_count, spot if spot is not None else bool(planned_spot))
    document = task(loaded.spec, loaded.model, target, strategy=strategy, bucket=bucket)
    err.print(f"{node_count} node(s) × {per_node} {gpu}, {strategy}, {'spot' if target.spot else 'on-demand'}: "
              f"{chosen_by}")
    _write(block_yaml(document), out_file)


@spec_command(without=("output",))  # type: ignore[untyped-decorator]
def accelerate_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    nodes: Annotated[int | None, typer.Option("--nodes", min=1, help="Machines to spread --gpus over.")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Processes on the CPU (gloo), not GPUs.")] = False,
    out_file: OutFile = None,
    *,
    spec_args: SpecArgs,
) -> None:
    """An accelerate config for this run's strategy and GPU count: `accelerate launch --config_file FILE -m tunecast
    train CONFIG`."""
    import yaml

    from tunecast.launch.accelerate import accelerate_config
    from tunecast.launch.skypilot import split_count

    loaded = load_from_cli(ctx, config, spec_args)
    spec = loaded.spec
    strategy: str = spec.gpus.strategy
    if spec.fixed("gpus.count") or cpu:
        total = spec.gpus.count
    else:
        _, total, strategy, _, chosen_by = _target(ctx, loaded)
        err.print(f"{total} GPU(s), {strategy}: {chosen_by}")
    per_node, node_count = split_count(total, nodes)
    document = accelerate_config(spec.with_changes({"gpus.strategy": strategy}), gpus_per_node=per_node,
                                 nodes=node_count, on_cpu=cpu)
    _write(yaml.safe_dump(document, sort_keys=False), out_file)


def _planned_spec(ctx: typer.Context, loaded: LoadedSpec) -> tuple[RunSpec, str]:
    """The run as the plan chose it: its best option's GPUs, strategy, batch shape, checkpointing and the changes it
    made (plan.allow); the config as it is when it fixes the GPU, the count and the micro-batch."""
    from tunecast.plan.planner import ALLOWED_CHANGES

    spec = loaded.spec
    if spec.gpus.gpu is not None and spec.fixed("gpus.count") and spec.fixed("micro_batch"):
        return spec, "the config"
    best = _best(ctx, loaded)
    changes: dict[str, Any] = {"gpus.gpu": best["gpu"], "gpus.count": int(best["gpu_count"]),
                               "micro_batch": best["micro_batch"], "grad_checkpointing": best["grad_checkpointing"]}
    if best["strategy"]:
        changes["gpus.strategy"] = best["strategy"]
    if spec.global_batch is None:
        changes["grad_accum"] = best["grad_accum"]
    for name in best["changes"]:
        changes.update(dict(ALLOWED_CHANGES)[name])
    chosen = (f"the plan's best option: {best['gpu_count']} × {best['gpu']} ({best['provider']}, "
              f"${best['total_usd']:,.2f} in {best['hours']:.1f} h)")
    return spec.with_changes(changes), chosen


def _tool_spec(ctx: typer.Context, config: Path | None, spec_args: SpecArgs, tool: str) -> tuple[RunSpec, str]:
    """The config planned as `tool` runs it (its runner), then chosen as the plan chooses."""
    from tunecast.config.load import Override

    with_runner = SpecArgs([Override("runner", tool, f"export {tool}"), *spec_args.overrides],
                           spec_args.offline, spec_args.source)
    spec, chosen_by = _planned_spec(ctx, load_from_cli(ctx, config, with_runner))
    if spec.dataset.path is not None and spec.dataset.format == "auto":  # the tools name the layout
        from tunecast.data.formats import detect_format
        from tunecast.data.readers import Row, read_rows

        rows = (row.data for _, row in zip(range(1000), read_rows(spec.dataset.path), strict=False)
                if isinstance(row, Row))
        detected = detect_format(rows)
        err.print(f"dataset.format: {detected.explanation}")
        spec = spec.with_changes({"dataset.format": detected.format})
    return spec, chosen_by


@spec_command(without=("output",))  # type: ignore[untyped-decorator]
def axolotl_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    out_file: OutFile = None,
    *,
    spec_args: SpecArgs,
) -> None:
    """An axolotl config of this run, as the plan chose it for axolotl's step (GPUs, batch shape, checkpointing):
    `axolotl train FILE`. What axolotl cannot express is an error naming the key."""
    from tunecast.runners.export import to_axolotl

    spec, chosen_by = _tool_spec(ctx, config, spec_args, "axolotl")
    _write_tool_config(spec, chosen_by, to_axolotl(spec), out_file)


@spec_command(without=("output",))  # type: ignore[untyped-decorator]
def llamafactory_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    out_file: OutFile = None,
    *,
    spec_args: SpecArgs,
) -> None:
    """A LLaMA-Factory config of this run, as the plan chose it for LLaMA-Factory's step: `llamafactory-cli train
    FILE`. LLaMA-Factory names datasets in a dataset_info.json: the dataset file's entry is added to the one in its
    folder (made when there is none; an entry of the same name that differs is an error, never overwritten)."""
    from tunecast.runners.export import llamafactory_dataset_info, to_llamafactory

    spec, chosen_by = _tool_spec(ctx, config, spec_args, "llamafactory")
    document = to_llamafactory(spec)
    registered = llamafactory_dataset_info(spec)
    if registered:
        _register_dataset(Path(document["dataset_dir"]) / "dataset_info.json", registered)
    _write_tool_config(spec, chosen_by, document, out_file)


def _write_tool_config(spec: RunSpec, chosen_by: str, document: dict[str, Any], out_file: Path | None) -> None:
    import yaml

    err.print(f"{spec.gpus.count} × {spec.gpus.gpu or 'any GPU'}, micro_batch {spec.micro_batch}: {chosen_by}")
    _write(yaml.safe_dump(document, sort_keys=False, allow_unicode=True), out_file)


def _register_dataset(path: Path, entries: dict[str, Any]) -> None:
    """Add `entries` to LLaMA-Factory's dataset_info.json at `path`, keeping every entry already there."""
    import json

    from tunecast.atomic import write_user_file

    known: dict[str, Any] = {}
    if path.exists():
        try:
            known = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise TunecastError(f"cannot read {path}: {error}", field="dataset.path",
                                hint="fix or move that dataset_info.json; the export adds the dataset's entry to it"
                                ) from None
        if not isinstance(known, dict):
            raise TunecastError(f"{path} does not hold a mapping of dataset names", field="dataset.path",
                                hint="fix or move that dataset_info.json")
    for name, entry in entries.items():
        if name in known and known[name] != entry:
            raise TunecastError(f"{path} already names a dataset {name!r}, with another definition",
                                field="dataset.path",
                                hint="rename the dataset file, or remove that entry if it is stale")
    if all(name in known for name in entries):
        return
    write_user_file(path, json.dumps({**known, **entries}, indent=2) + "\n", field="dataset.path")
    err.print(f"registered {', '.join(entries)} in {path}")


def register(app: typer.Typer) -> None:
    export_app.command("skypilot", cls=SpecCommand)(skypilot_command)
    export_app.command("accelerate", cls=SpecCommand)(accelerate_command)
    export_app.command("axolotl", cls=SpecCommand)(axolotl_command)
    export_app.command("llamafactory", cls=SpecCommand)(llamafactory_command)
    app.add_typer(export_app, name="export")
