"""`tunecast validate` and `tunecast init`: check a run config, write a starter one. No torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from tunecast.atomic import write_text_atomic
from tunecast.cli.app import state
from tunecast.cli.render import err, estimate_line, out, print_json, print_problems
from tunecast.cli.spec_flags import SpecArgs, SpecCommand, spec_command
from tunecast.errors import TunecastError
from tunecast.units import format_params

if TYPE_CHECKING:
    from tunecast.catalog.hub import HubAccess
    from tunecast.config.load import LoadedPipeline, LoadedSpec
    from tunecast.config.spec import RunSpec


def load_from_cli(ctx: typer.Context, config: Path | None, spec_args: SpecArgs) -> LoadedSpec:
    """The RunSpec every spec command works on: file (or `--from` another tool's) + flags + --set, validated against
    the catalog."""
    from tunecast.config.load import LoadedSpec

    loaded = load_run_from_cli(ctx, config, spec_args, pipelines=False)
    assert isinstance(loaded, LoadedSpec)
    return loaded


def load_run_from_cli(ctx: typer.Context, config: Path | None, spec_args: SpecArgs, *,
                      pipelines: bool = True) -> LoadedSpec | LoadedPipeline:
    """`load_from_cli`, where the model may also be a diffusion pipeline (docs/diffusion.md)."""
    from tunecast.config.load import load_run

    imported = None
    if spec_args.source is not None:
        from tunecast.runners.imported import read_config

        if config is not None:
            raise TunecastError(f"both a config file ({config}) and --from were given", field="--from",
                                hint="give one: the tunecast config, or --from TOOL FILE")
        imported = read_config(*spec_args.source)
    return load_run(config, spec_args.overrides, state(ctx).catalog(), hub=hub_access(spec_args.offline),
                    imported=imported, pipelines=pipelines)


def hub_access(offline: bool) -> HubAccess:
    """What a command lets the Hub do: nothing with `--offline`; else fetch a config.json, said on stderr first."""
    from tunecast.catalog.hub import HubAccess

    return HubAccess(offline, progress=lambda text: estimate_line("progress", text))


def print_imported(loaded: LoadedSpec | LoadedPipeline) -> None:
    """Under a command's output: what was not carried over from the other tool's config, and the approximations."""
    imported = loaded.imported
    if imported is None:
        return
    err.print(f"read {escape(str(imported.source))} ({imported.tool} config): {len(imported.mapped)} key(s) "
              f"carried over, {len(imported.unmapped)} not")
    for item in imported.unmapped:
        err.print(f"  [yellow]·[/] {escape(item.key)}: {escape(item.reason)}")
    for note in imported.notes:
        err.print(f"  [dim]· {escape(note)}[/]")


def resolved_document(loaded: LoadedSpec | LoadedPipeline) -> dict[str, Any]:
    """The config with every default filled in and names resolved (canonical GPU slug, output path)."""
    spec = loaded.spec
    document = spec.model_dump(mode="json")
    if document["output"] is None:
        document["output"] = str((Path.cwd() / spec.default_output).resolve())
    return document


def _summary(loaded: LoadedSpec) -> list[tuple[str, str]]:
    spec, model = loaded.spec, loaded.model
    params = f", {format_params(model.params)} parameters" if model.params else ""
    rows = [("model", f"{model.name} ({model.origin}: {model.model_type}{params})")]
    method = spec.method + (" on an 8-bit base (LLM.int8)" if spec.method == "qlora" and spec.quantization.bits == 8
                            else "")
    if spec.method != "full":
        targets = spec.lora.targets if isinstance(spec.lora.targets, str) else ",".join(spec.lora.targets)
        method += f" (rank {spec.lora.rank}, alpha {spec.lora.alpha}, {targets}{', DoRA' if spec.lora.dora else ''})"
    rows.append(("method", method))
    rows.append(("precision", f"{spec.precision}, optimizer {spec.optimizer}"))
    rows.append(("batch", f"micro_batch {spec.micro_batch} × {spec.seq_len} tokens; {spec.sequences_per_step} "
                          "sequences per optimizer step"))
    rows.append(("length", _length(spec)))
    gpu = f"{spec.gpus.count} × {loaded.gpu.slug}" if loaded.gpu else f"{spec.gpus.count} × any GPU"
    rows.append(("gpus", f"{gpu} ({spec.gpus.strategy}, offload {spec.gpus.offload})"))
    data = spec.dataset
    if data.path:
        rows.append(("dataset", f"{data.path} (format {data.format})"))
    elif data.examples and data.mean_tokens:
        rows.append(("dataset", f"{data.examples:,} examples × {data.mean_tokens:g} tokens (declared)"))
    else:
        rows.append(("dataset", "none given (needed by plan and train)"))
    return rows


def _length(spec: RunSpec) -> str:
    """How long the run is, in the words of its keys (the steps they make need the dataset: `plan`, `train`)."""
    epochs = f"{spec.epochs:g} epoch{'' if spec.epochs == 1 else 's'}"
    if spec.max_steps is None:
        return epochs
    if not spec.fixed("epochs"):
        return f"max_steps {spec.max_steps} (as many passes as they take; the schedule over {spec.max_steps} steps)"
    return (f"max_steps {spec.max_steps} ends the run early, or the {epochs} if they end first; the learning-rate "
            f"schedule is the {epochs}'")


@spec_command
def validate_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(help="The run config (YAML). Optional when --model is given.")]
    = None,
    show: Annotated[bool, typer.Option("--show", help="Print the resolved config, defaults filled in.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    *,
    spec_args: SpecArgs,
) -> None:
    """Check a run config: every problem at once, each with its key, the reason and the fix."""
    if config is None and not spec_args.overrides and spec_args.source is None:
        raise TunecastError("nothing to validate", field="config",
                            hint="give a config file (tunecast validate run.yaml) or flags such as --model")
    from tunecast.config.load import LoadedPipeline, imported_part

    run = load_run_from_cli(ctx, config, spec_args)
    if isinstance(run, LoadedPipeline):
        _validate_pipeline(run, show, json_output)
        return
    loaded = run
    if json_output:
        print_json({"valid": True, "source": loaded.source, "spec": resolved_document(loaded),
                    "model": {"name": loaded.model.name, "origin": loaded.model.origin,
                              "config_path": str(loaded.model.path), "model_type": loaded.model.model_type,
                              "params": loaded.model.params},
                    "warnings": [w.as_dict() for w in loaded.warnings], **imported_part(loaded)})
        return
    if show:
        import yaml  # here: the commands that share load_from_cli print no YAML

        out.print(escape(yaml.safe_dump(resolved_document(loaded), sort_keys=False, allow_unicode=True)),
                  end="")
    else:
        out.print(f"[green]✓[/] {escape(loaded.source)} is valid")
        for label, text in _summary(loaded):
            out.print(f"  {label:<10} {escape(text)}")
    print_problems(list(loaded.warnings))
    print_imported(loaded)


def _validate_pipeline(loaded: LoadedPipeline, show: bool, json_output: bool) -> None:
    """`validate` of a run whose model is a diffusion pipeline (docs/diffusion.md)."""
    pipeline = loaded.pipeline
    described = {"name": pipeline.name, "pipeline_class": pipeline.pipeline_class,
                 "denoiser": pipeline.classes[pipeline.denoiser], "objective": pipeline.objective}
    if json_output:
        print_json({"valid": True, "source": loaded.source, "spec": resolved_document(loaded), "pipeline": described,
                    "warnings": [w.as_dict() for w in loaded.warnings]})
        return
    if show:
        import yaml

        out.print(escape(yaml.safe_dump(resolved_document(loaded), sort_keys=False, allow_unicode=True)), end="")
    else:
        spec = loaded.spec
        out.print(f"[green]✓[/] {escape(loaded.source)} is valid")
        out.print(f"  {'pipeline':<10} {escape(pipeline.name)} ({described['pipeline_class']}, "
                  f"{described['denoiser']}, {pipeline.objective} objective)")
        out.print(f"  {'method':<10} {spec.method}, {spec.precision}, {spec.optimizer}, micro_batch "
                  f"{spec.micro_batch} × grad_accum {spec.grad_accum}")
    print_problems(list(loaded.warnings))


def init_command(
    path: Annotated[Path, typer.Argument(help="Where to write the starter config.")] = Path("tunecast.yaml"),
    model: Annotated[str, typer.Option("--model", "-m", help="Model to put in the config.")]
    = "meta-llama/Llama-3.1-8B",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented starter config: every key, its default, and what it means."""
    if path.exists() and not force:
        raise TunecastError(f"{path} already exists", field="path",
                            hint="choose another path, or pass --force to overwrite it")
    from tunecast.config.starter import starter_yaml  # here: it reads YAML, which other commands do not need

    write_text_atomic(path, starter_yaml(model, str(path)))
    out.print(f"Wrote {escape(str(path))}. Check it with: tunecast validate {escape(str(path))}")
    err.print("[dim]Every key in it is at its default; delete the ones you do not change.[/]")


def register(app: typer.Typer) -> None:
    app.command("validate", cls=SpecCommand)(validate_command)
    app.command("init")(init_command)
