"""Another tool's config read into a tunecast config (`--from TOOL FILE`), and what could not be carried over.

Each reader (runners/axolotl.py, llamafactory.py, trl.py, torchtune.py; for diffusion pipelines kohya.py, whose
configs are TOML, and ai_toolkit.py) turns the tool's file into the nested
mapping a tunecast config file holds — with `runner:` set to the tool, so that the estimate is of that tool's
step — and accounts for every key of the file: mapped (to which tunecast keys), or unmapped with the reason. No key
is dropped silently. The mapping is then validated like any config file (config/load.py), so a value that
cannot be used gets the usual message naming the key. What a reader returns is config/imported.py's Imported.
"""

from __future__ import annotations

from pathlib import Path

from tunecast.config.imported import Imported

TOOLS = ("axolotl", "llamafactory", "trl", "torchtune", "kohya", "ai-toolkit")


def read_config(tool: str, path: Path) -> Imported:
    """`path` read as `tool`'s config (one of TOOLS)."""
    import importlib

    from tunecast.errors import TunecastError

    if tool not in TOOLS:
        from difflib import get_close_matches

        close = get_close_matches(tool, TOOLS, n=1)
        raise TunecastError(f"--from {tool}: not a tool whose configs tunecast reads" +
                            (f" (did you mean {close[0]}?)" if close else ""), field="--from",
                            hint=f"use one of: {', '.join(TOOLS)}")
    reader = importlib.import_module(f"tunecast.runners.{tool.replace('-', '_')}")
    imported: Imported = reader.read(path)
    return imported
