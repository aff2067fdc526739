"""Pydantic's validation errors, rewritten as Problems that name the user's key and say how to fix it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from tunecast.config.spec import RunSpec
from tunecast.errors import Problem, did_you_mean, suggestion_text

_COMPARISONS = {
    "greater_than_equal": ("ge", "≥"),
    "greater_than": ("gt", ">"),
    "less_than_equal": ("le", "≤"),
    "less_than": ("lt", "<"),
}
_TYPE_WORDS = {
    "int_parsing": "a whole number", "int_type": "a whole number", "int_from_float": "a whole number",
    "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true or false",
    "bool_type": "true or false", "string_type": "text", "list_type": "a list", "finite_number": "a finite number",
}


def dotted(loc: tuple[int | str, ...]) -> str:
    """('lora', 'targets', 1) → 'lora.targets[1]'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def field_path(loc: tuple[int | str, ...]) -> tuple[str, ...]:
    """The part of `loc` that names fields (without list indices)."""
    return tuple(part for part in loc if isinstance(part, str))


def model_at(path: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model that holds the last key of `path` (RunSpec for top-level keys)."""
    model: type[BaseModel] = RunSpec
    for part in path[:-1]:
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def all_keys(model: type[BaseModel] = RunSpec, prefix: str = "") -> list[str]:
    """Every dotted key a RunSpec accepts, sections included."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(all_keys(annotation, f"{prefix}{name}."))
    return keys


def example_for(path: tuple[str, ...]) -> Any:
    model = model_at(path)
    field = model.model_fields.get(path[-1]) if model and path else None
    if field is None:
        return None
    if field.examples:
        return field.examples[0]
    return None


def _format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _literal_choices(path: tuple[str, ...]) -> list[str]:
    import typing

    model = model_at(path)
    field = model.model_fields.get(path[-1]) if model and path else None
    if field is None:
        return []
    choices: list[str] = []

    def collect(annotation: Any) -> None:
        if typing.get_origin(annotation) is typing.Literal:
            choices.extend(_format_value(a).strip("'") for a in typing.get_args(annotation))
        for argument in typing.get_args(annotation):
            if typing.get_origin(argument) is typing.Literal or typing.get_args(argument):
                collect(argument)

    collect(field.annotation)
    return list(dict.fromkeys(choices))


def unknown_key_hint(key_path: tuple[str, ...]) -> str:
    """'Did you mean …?' among the keys of the same section, then among keys of other sections."""
    model = model_at(key_path)
    siblings = list(model.model_fields) if model else []
    *parents, key = key_path
    near = did_you_mean(key, siblings)
    if near:
        return "Did you mean " + " or ".join(repr(".".join((*parents, n))) for n in near) + "?"
    # A key of another section written at this level: `rank:` at the top for `lora.rank`.
    elsewhere = [k for k in all_keys() if k.split(".")[-1] == key]
    if elsewhere:
        return f"Did you mean '{elsewhere[0]}'? It belongs in the {elsewhere[0].split('.')[0]} section."
    near_anywhere = suggestion_text(".".join(key_path), all_keys())
    if near_anywhere:
        return near_anywhere
    where = f"in {'.'.join(parents)}" if parents else "at the top level"
    return f"remove it; keys {where}: {', '.join(siblings)}"


def problem_from_error(error: ErrorDetails, location: str | None) -> Problem:
    loc = tuple(error["loc"])
    key = dotted(loc)
    path = field_path(loc)
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    example = example_for(path) if path else None
    example_text = f", for example {_format_value(example)}" if example is not None else ""

    if kind == "extra_forbidden":
        return Problem(key, "unknown key", unknown_key_hint(path), location=location)
    if kind == "missing":
        hint = f"add `{key}: {_format_value(example) if example is not None else '…'}` to the config"
        if key == "model":
            hint += " or pass --model (a catalog name, a model directory or a config JSON file)"
        return Problem(key, "is required", hint, location=location)
    if kind == "literal_error":
        choices = _literal_choices(path)
        near = suggestion_text(str(value), choices) if isinstance(value, str) else None
        hint = near or f"set {key} to one of: {', '.join(choices)}"
        return Problem(key, f"must be one of: {', '.join(choices)} (got {_format_value(value)})", hint,
                       location=location)
    if kind in _COMPARISONS:
        bound_name, symbol = _COMPARISONS[kind]
        bound = ctx.get(bound_name)
        if isinstance(bound, int) and abs(bound) >= 10_000:
            bound = f"{bound:,}"  # 4,194,304 reads at a glance; 4194304 does not
        return Problem(key, f"must be {symbol} {bound} (got {_format_value(value)})",
                       f"set {key} to a value {symbol} {bound}{example_text}", location=location)
    if kind in _TYPE_WORDS:
        word = _TYPE_WORDS[kind]
        return Problem(key, f"must be {word} (got {_format_value(value)})", f"set {key} to {word}{example_text}",
                       location=location)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return Problem(key, f"must be a section of keys (got {_format_value(value)})",
                       f"write {key}: on its own line with indented keys below it", location=location)
    if kind in ("string_too_short", "string_pattern_mismatch"):
        return Problem(key, f"is not a valid value (got {_format_value(value)})",
                       f"set {key}{example_text}", location=location)
    if kind == "value_error":
        reason = str(ctx.get("error", error["msg"]))
        return Problem(key, f"{reason} (got {_format_value(value)})", f"set {key}{example_text}",
                       location=location)
    return Problem(key, f"{error['msg']} (got {_format_value(value)})", f"set {key}{example_text}",
                   location=location)
