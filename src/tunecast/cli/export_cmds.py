"""`tunecast export skypilot` (a SkyPilot task for this training) and `tunecast export accelerate` (an
accelerate config for its strategy). GPU, count and strategy default to the plan's best option."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunecast.cli.app import state
from tunecast.cli.config_cmds import load_from_cli
from tunecast.cli.render import err, out, working
from tunecast.cli.spec_flags import SpecArgs, spec_command
from tunecast.config.load import LoadedSpec
from tunecast.errors import TunecastError

export_app = typer.Typer(help="Write what other tools need to run this training: a SkyPilot task, an accelerate "
                              "config.", no_args_is_help=True)

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


def register(app: typer.Typer) -> None:
    export_app.command("skypilot")(skypilot_command)
    export_app.command("accelerate")(accelerate_command)
    app.add_typer(export_app, name="export")
