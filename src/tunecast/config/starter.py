"""The commented starter config that `tunecast init` writes, generated from RunSpec's own fields so
that its defaults and comments can never drift from the code."""

from __future__ import annotations

import textwrap
from typing import Any

import yaml
from pydantic import BaseModel

from tunecast.config.spec import RunSpec

_HEADER = """\
# tunecast run configuration. Every key is optional except `model`; each comment gives the default.
# Check it:          tunecast validate {path}
# Resolved config:   tunecast validate {path} --show
"""


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("\n...").strip()


def _section(model: type[BaseModel], values: dict[str, Any], indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    for name, field in model.model_fields.items():
        description = " ".join((field.description or "").split())
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.append("")
            out.extend(f"{pad}# {line}" for line in textwrap.wrap(description, 100 - indent, break_on_hyphens=False))
            out.append(f"{pad}{name}:")
            out.extend(_section(annotation, values.get(name, {}), indent + 2))
            continue
        out.extend(f"{pad}# {line}" for line in textwrap.wrap(description, 100 - indent, break_on_hyphens=False))
        value = values.get(name)
        if value is None:
            example = field.examples[0] if field.examples else "…"
            out.append(f"{pad}# {name}: {_scalar(example)}")
        else:
            out.append(f"{pad}{name}: {_scalar(value)}")
    return out


def starter_yaml(model: str, path: str) -> str:
    """A complete, valid config for `model` with every field written out at its default."""
    spec = RunSpec(model=model)
    values = spec.model_dump(mode="json")
    lines = _HEADER.format(path=path).splitlines()
    lines.extend(_section(RunSpec, values, 0))
    return "\n".join(lines).rstrip() + "\n"
