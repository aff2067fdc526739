"""Rewrite one marked section of a Markdown document, leaving the rest as it is."""

from __future__ import annotations

from pathlib import Path


def write_section(document: Path, mark: str, text: str) -> None:
    """Replace what lies between `<!-- mark:start -->` and `<!-- mark:end -->` (append it if absent)."""
    document.parent.mkdir(parents=True, exist_ok=True)
    current = document.read_text() if document.exists() else ""
    start, end = f"<!-- {mark}:start -->", f"<!-- {mark}:end -->"
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in current:
        before, rest = current.split(start, 1)
        document.write_text(before + block + rest.split(end, 1)[1])
    else:
        document.write_text(current + ("\n" if current else "") + block + "\n")
