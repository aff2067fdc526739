"""The run-setting flags shared by every command that takes a RunSpec.

Each flag maps to one RunSpec key; its help text is that field's own docstring, so flags, config keys
and `tunecast init` comments never disagree. `@spec_command` adds all of them (plus `--set`, `--from` and
`--offline`) to a command and hands it the collected overrides; the command is registered with
`cls=SpecCommand`, which reads those docstrings when its help is shown. Building RunSpec (a pydantic model) is
left to the commands that load a run: listing the commands (`tunecast --help`) builds none of it.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from tunecast.catalog.hub import TIMEOUT_S as HUB_TIMEOUT_S

if TYPE_CHECKING:
    from typer._click import Context, HelpFormatter

    from tunecast.config.load import Override

PANEL = "Run settings (override the config file)"


@dataclass(frozen=True)
class Flag:
    param: str
    key: str
    names: tuple[str, ...]
    kind: type


FLAGS: tuple[Flag, ...] = (
    Flag("model", "model", ("--model", "-m"), str),
    Flag("random_weights", "random_weights", ("--random-weights/--no-random-weights",), bool),
    Flag("method", "method", ("--method",), str),
    Flag("lora_rank", "lora.rank", ("--lora-rank",), int),
    Flag("lora_alpha", "lora.alpha", ("--lora-alpha",), int),
    Flag("lora_targets", "lora.targets", ("--lora-targets",), str),
    Flag("precision", "precision", ("--precision",), str),
    Flag("optimizer", "optimizer", ("--optimizer",), str),
    Flag("micro_batch", "micro_batch", ("--micro-batch",), str),
    Flag("grad_accum", "grad_accum", ("--grad-accum",), int),
    Flag("global_batch", "global_batch", ("--global-batch",), int),
    Flag("seq_len", "seq_len", ("--seq-len",), int),
    Flag("resolution", "diffusion.resolution", ("--resolution",), str),
    Flag("frames", "diffusion.frames", ("--frames",), int),
    Flag("grad_checkpointing", "grad_checkpointing", ("--grad-checkpointing/--no-grad-checkpointing",), bool),
    Flag("attention", "attention", ("--attention",), str),
    Flag("epochs", "epochs", ("--epochs",), float),
    Flag("max_steps", "max_steps", ("--max-steps",), int),
    Flag("dataset", "dataset.path", ("--dataset",), str),
    Flag("gpu", "gpus.gpu", ("--gpu",), str),
    Flag("gpus", "gpus.count", ("--gpus",), int),
    Flag("strategy", "gpus.strategy", ("--strategy",), str),
    Flag("offload", "gpus.offload", ("--offload",), str),
    Flag("output", "output", ("--output", "-o"), str),
    Flag("usd_per_hour", "pricing.usd_per_hour", ("--usd-per-hour",), float),
    Flag("runner", "runner", ("--runner",), str),
)


def _field(key: str) -> Any:
    from pydantic import BaseModel

    from tunecast.config.spec import RunSpec

    model: type[BaseModel] = RunSpec
    *parents, leaf = key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    return model.model_fields[leaf]


def _help(key: str) -> str:
    """The field's docstring, first sentence and its choices; the full text is in `tunecast init`."""
    field = _field(key)
    text = " ".join((field.description or "").split())
    choices = [a for a in typing.get_args(field.annotation) if isinstance(a, str)]
    first = text.split(". ")[0].rstrip(".") + "."
    default = text[text.find("Default"):] if "Default" in text else ""
    extra = f" One of: {', '.join(choices)}." if choices and len(choices) > 1 and "`" not in first else ""
    return f"[{key}] {first}{extra} {default}".strip()


_KEYS = {flag.param: flag.key for flag in FLAGS}


class SpecCommand(TyperCommand):
    """A command with the run-setting flags. Their help text is the RunSpec fields' docstrings, read when this
    command's help is shown: building the command (as `tunecast --help` builds every one) reads no RunSpec."""

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        for param in self.params:
            if param.name in _KEYS and getattr(param, "rich_help_panel", None) == PANEL and not param.help:
                param.help = inspect.cleandoc(_help(_KEYS[param.name]))  # as typer would have at the flag's making
        super().format_help(ctx, formatter)


@dataclass(frozen=True)
class SpecArgs:
    """What the user typed for the run settings: overrides in the order they apply."""

    overrides: list[Override]
    offline: bool = False  # `--offline`: never ask the Hugging Face Hub (a model's config.json, a run's weights)
    source: tuple[str, Path] | None = None  # `--from TOOL FILE`: another tool's config instead of a tunecast one


def spec_command(function: Callable[..., Any] | None = None, *,
                 without: tuple[str, ...] = ()) -> Any:
    """Give `function` every run-setting flag (but those named in `without`, whose names the command uses for
    itself); it receives them as `spec_args: SpecArgs`."""
    if function is None:
        return functools.partial(spec_command, without=without)
    flags = [flag for flag in FLAGS if flag.param not in without]
    signature = inspect.signature(function, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "spec_args"]
    extra: list[inspect.Parameter] = []
    for flag in flags:  # the help text comes when it is shown (SpecCommand)
        option = typer.Option(*flag.names, rich_help_panel=PANEL, show_default=False)
        annotation = Annotated[flag.kind | None, option]  # type: ignore[valid-type]
        extra.append(inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                                       annotation=annotation))
    extra.append(inspect.Parameter(
        "set_values", inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[list[str] | None, typer.Option(
            "--set", metavar="KEY=VALUE", rich_help_panel=PANEL,
            help="Set any config key, e.g. --set lora.dropout=0.05 --set packing=true. Repeatable.")],
    ))
    extra.append(inspect.Parameter(
        "source", inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[tuple[str, Path] | None, typer.Option(
            "--from", metavar="TOOL FILE", rich_help_panel=PANEL,
            help="Read the run from another tool's config instead of a tunecast one: axolotl, llamafactory, trl (a "
                 "`trl sft --config` file) or torchtune (a recipe config); for a diffusion pipeline kohya (sd-scripts' "
                 "TOML) or ai-toolkit. Its runner is estimated; every key not carried over is listed with the "
                 "reason.")],
    ))
    extra.append(inspect.Parameter(
        "offline", inspect.Parameter.KEYWORD_ONLY, default=False,
        annotation=Annotated[bool, typer.Option(
            "--offline", rich_help_panel=PANEL,
            help="Never contact the Hugging Face Hub. Without it, a model that is neither a local path nor in the "
                 "catalog has its config.json (only that) fetched from the Hub (honouring HF_ENDPOINT and "
                 f"HF_TOKEN), within {HUB_TIMEOUT_S:g} s, and `train` downloads the weights it lacks. "
                 "HF_HUB_OFFLINE=1 does the same.")],
    ))
    # Kept so that scripts and exported SkyPilot tasks written before fetching became the default still run.
    extra.append(inspect.Parameter(
        "allow_download", inspect.Parameter.KEYWORD_ONLY, default=False,
        annotation=Annotated[bool, typer.Option(
            "--allow-download", rich_help_panel=PANEL,
            help="Deprecated, does nothing: the Hub is asked by default now (see --offline).")],
    ))

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from tunecast.config.load import Override, parse_set

        overrides: list[Override] = []
        for flag in flags:
            value = kwargs.pop(flag.param)
            if value is not None:
                overrides.append(Override(flag.key, value, flag.names[0].split("/")[0]))
        overrides.extend(parse_set(text) for text in kwargs.pop("set_values") or [])
        kwargs.pop("allow_download")
        spec_args = SpecArgs(overrides, kwargs.pop("offline"), kwargs.pop("source"))
        return function(*args, spec_args=spec_args, **kwargs)

    parameters = own + extra
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper
