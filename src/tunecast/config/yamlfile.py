"""Read a YAML config into plain data, remembering the line of every key and refusing duplicate keys."""

from __future__ import annotations

from typing import Any

import yaml

from tunecast.errors import Problem


def read_yaml(text: str) -> tuple[Any, dict[str, int], list[Problem]]:
    """Parse `text`; return (data, {dotted key: line}, problems). Problems are syntax errors and
    duplicate keys, which PyYAML would otherwise resolve silently by keeping the last value."""
    lines: dict[str, int] = {}
    problems: list[Problem] = []
    try:
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as error:  # a character YAML does not allow (a control character, a lone surrogate)
        problems.append(Problem(None, f"YAML error: {error}", "remove the character, or save the file as UTF-8 text"))
        return {}, lines, problems
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, lines, problems
        return _build(loader, node, "", lines, problems), lines, problems
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line = mark.line + 1 if mark is not None else None
        problems.append(Problem(None, f"YAML syntax error: {error.problem}",
                                "check indentation, colons and quotes on that line",
                                location=f"line {line}" if line else None))
        return {}, lines, problems
    except yaml.YAMLError as error:
        problems.append(Problem(None, f"YAML error: {error}", "check the file's syntax"))
        return {}, lines, problems
    except RecursionError:
        problems.append(Problem(None, "the YAML nests too deeply (or an alias `*name` holds itself)",
                                "a run config is a few levels of keys: check the anchors (&name) and aliases"))
        return {}, lines, problems
    finally:
        loader.dispose()


def _build(loader: yaml.SafeLoader, node: yaml.Node, path: str, lines: dict[str, int],
           problems: list[Problem]) -> Any:
    if isinstance(node, yaml.MappingNode):
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                problems.append(Problem(f"{path}{key}", "keys must be names, not numbers or lists",
                                        "write the key as a name", location=f"line {line}"))
                continue
            dotted = f"{path}{key}"
            if key in result:
                problems.append(Problem(dotted, f"appears twice (lines {lines[dotted]} and {line})",
                                        "keep one of them", location=f"line {line}"))
                continue
            lines[dotted] = line
            result[key] = _build(loader, value_node, f"{dotted}.", lines, problems)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_build(loader, item, path, lines, problems) for item in node.value]
    return loader.construct_object(node, deep=True)
