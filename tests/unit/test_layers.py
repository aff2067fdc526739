"""The layers of ARCHITECTURE.md hold: every import between packages of src/tunecast (lazy ones and those for type
checking included) is one the table allows, and the table itself points only downwards; only cli prints or exits."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "tunecast"
BASE = ("errors", "units", "paths", "version", "atomic")
UI_LIBRARIES = ("typer", "rich")


def rules(text: str) -> tuple[dict[str, int], dict[str, dict[str, tuple[str, ...]]]]:
    """(layer of each package, what each may import: package → its modules allowed, () for any) from the table."""
    table = text.split("<!-- layers:start -->", 1)[1].split("<!-- layers:end -->", 1)[0]
    layers: dict[str, int] = {}
    allowed: dict[str, dict[str, tuple[str, ...]]] = {}
    for row in table.strip().splitlines()[2:]:
        layer, name, imports = (cell.strip() for cell in row.strip("|").split("|"))
        name = name.replace("\\", "")
        layers[name] = int(layer)
        allowed[name] = {}
        for item in re.findall(r"[\w.]+(?: \([^)]*\))?", imports):
            target, _, modules = item.partition(" (")
            for each in BASE if target == "base" else (target,):
                allowed[name][each] = tuple(m.strip() for m in modules.rstrip(")").split(",")) if modules else ()
    return layers, allowed


def imports(source: str, module: str) -> list[tuple[str, int]]:
    """Every module the code `source` of `module` (dotted, `tunecast.train.loop`) imports, with its line: import
    statements (relative ones resolved; `from X import name` counts as X and X.name, name being maybe a module) and
    the literal start of a name given to importlib.import_module or __import__."""
    found = []
    here = module.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level] if node.level else []  # `here` ends with the module's own name
            prefix = ".".join(base + ([node.module] if node.module else []))
            found += [(prefix, node.lineno)] + [(f"{prefix}.{alias.name}", node.lineno) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            name = node.args[0]
            parts = name.values if isinstance(name, ast.JoinedStr) else [name]
            literal = ""
            for part in parts:  # up to the first value filled in at run time
                if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                    break
                literal += part.value
            found += [(literal.rstrip("."), node.lineno)] if literal else []
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def violations(layers: dict[str, int], allowed: dict[str, dict[str, tuple[str, ...]]]) -> list[str]:
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = package_of(path)
        where = path.relative_to(ROOT)
        if source not in allowed:
            broken.append(f"{where}: package {source} is not in ARCHITECTURE.md's table")
            continue
        for module, line in imports(path.read_text(), module_name(path)):
            parts = module.split(".")
            if parts[0] in UI_LIBRARIES and source != "cli":
                broken.append(f"{where}:{line}: imports {module}; only cli draws")
            if parts[0] != "tunecast" or len(parts) < 2 or parts[1] == source:
                continue
            target = parts[1]
            if target not in allowed[source]:
                broken.append(f"{where}:{line}: {source} imports {module}; {source} may import "
                              f"{', '.join(allowed[source]) or 'nothing'}")
            elif allowed[source][target] and len(parts) > 2 and parts[2] not in allowed[source][target]:
                # `from tunecast.estimate import memory` is read as both the package and the module: the package
                # name alone is too wide to judge, so only named modules count
                broken.append(f"{where}:{line}: {source} imports {module}; from {target} it may import "
                              f"{', '.join(allowed[source][target])} only")
    return broken


@pytest.fixture(scope="module")
def table() -> tuple[dict[str, int], dict[str, dict[str, tuple[str, ...]]]]:
    return rules((ROOT / "ARCHITECTURE.md").read_text())


def test_the_table_points_only_downwards(table: tuple[dict[str, int], dict[str, dict[str, tuple[str, ...]]]]) -> None:
    layers, allowed = table
    for package, targets in allowed.items():
        for target in targets:
            assert target in layers, f"{package} may import {target}, which is not in the table"
            assert layers[target] < layers[package], f"{package} (layer {layers[package]}) may import {target} " \
                                                     f"(layer {layers[target]}): not below it"


def test_every_package_is_in_the_table(table: tuple[dict[str, int], dict[str, dict[str, tuple[str, ...]]]]) -> None:
    packages = {package_of(path) for path in PACKAGE.rglob("*.py")}
    assert packages == set(table[0])


def test_every_import_keeps_to_the_layers(table: tuple[dict[str, int], dict[str, dict[str, tuple[str, ...]]]]) -> None:
    assert violations(*table) == []


def test_only_cli_prints_or_exits() -> None:
    said = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if package_of(path) in ("cli", "__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("print", "sys.exit", "exit", "sys.stdout.write", "sys.stderr.write"):
                    said.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert said == []


def test_an_upward_import_is_caught(table: tuple[dict[str, int], dict[str, dict[str, tuple[str, ...]]]],
                                    tmp_path: Path) -> None:
    layers, allowed = table
    narrowed = {**allowed, "plan": {k: v for k, v in allowed["plan"].items() if k != "train"}}
    assert any("plan imports tunecast.train" in line for line in violations(layers, narrowed))
    upward = {**allowed, "estimate": {**allowed["estimate"], "train": ()}}
    layers_text = "\n".join(f"| {n} | {p} | {', '.join(t) or '—'} |" for p, t in upward.items() for n in [layers[p]])
    with pytest.raises(AssertionError, match=r"estimate \(layer \d+\) may import train"):
        test_the_table_points_only_downwards(rules(f"<!-- layers:start -->\n|a|b|c|\n|-|-|-|\n{layers_text}\n"
                                                   "<!-- layers:end -->"))
    narrow = {**allowed, "plan": {**allowed["plan"], "estimate": ("tracer",)}}
    assert any("from estimate it may import tracer only" in line for line in violations(layers, narrow))


def test_every_way_of_importing_is_read() -> None:
    code = ("from ..estimate import tracer\nimport importlib\nimportlib.import_module(f'tunecast.report.{name}')\n"
            "__import__('tunecast.serve.app')\nimport tunecast.plan.cost as cost\n")
    found = {name for name, _ in imports(code, "tunecast.train.loop")}
    assert {"tunecast.estimate.tracer", "tunecast.report", "tunecast.serve.app", "tunecast.plan.cost"} <= found
