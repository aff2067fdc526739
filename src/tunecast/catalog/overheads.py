"""Runtime overheads a trace cannot see (CUDA context, library workspaces), as catalog data."""

from __future__ import annotations

from pydantic import Field

from tunecast.catalog.rows import CatalogRow


class Overhead(CatalogRow):
    """One overhead: `architecture` is a GPU architecture from gpus.csv, or `*` for every one."""

    name: str
    architecture: str
    value: float = Field(ge=0)
    unit: str = Field(pattern=r"^(GiB|bytes)$")

    @property
    def bytes(self) -> int:
        return int(self.value * 2**30) if self.unit == "GiB" else int(self.value)


def overhead_bytes(rows: tuple[Overhead, ...], name: str, architecture: str) -> int:
    """The overhead `name` for `architecture`; a row for the architecture wins over the `*` row."""
    exact = [row for row in rows if row.name == name and row.architecture == architecture]
    generic = [row for row in rows if row.name == name and row.architecture == "*"]
    chosen = exact or generic
    if not chosen:
        raise KeyError(f"no {name} overhead for {architecture}")
    return chosen[0].bytes
