"""Read a YAML config into plain data, remembering the line of every key. A key written twice is refused in a
tunecast config; in another tool's file it is read as that tool reads it (PyYAML keeps the last value), with a
warning."""

from __future__ import annotations

from typing import Any

import yaml

from tunecast.errors import Problem


def read_yaml(text: str, *, last_wins: bool = False) -> tuple[Any, dict[str, int], list[Problem]]:
    """Parse `text`; return (data, {dotted key: line}, problems). Problems are syntax errors and duplicate keys,
    which PyYAML would otherwise resolve silently by keeping the last value: an error, or with `last_wins` (another
    tool's file, which that tool reads with PyYAML) a warning, the last value kept."""
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
        return _build(loader, node, "", lines, problems, last_wins), lines, problems
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
           problems: list[Problem], last_wins: bool) -> Any:
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
                if not last_wins:
                    problems.append(Problem(dotted, f"appears twice (lines {lines[dotted]} and {line})",
                                            "keep one of them", location=f"line {line}"))
                    continue
                problems.append(Problem(dotted, f"appears twice (lines {lines[dotted]} and {line}): the last value is "
                                        "read, as the tool reads it", "keep one of them", location=f"line {line}",
                                        severity="warning"))
                for known in [k for k in lines if k.startswith(f"{dotted}.")]:  # the first value's own keys
                    del lines[known]
            lines[dotted] = line
            result[key] = _build(loader, value_node, f"{dotted}.", lines, problems, last_wins)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_build(loader, item, path, lines, problems, last_wins) for item in node.value]
    return loader.construct_object(node, deep=True)
