"""Throughput constants as catalog data (catalog/data/throughput.csv), each with its source."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from tunecast.catalog.gpus import Gpu
from tunecast.catalog.rows import CatalogRow


class ThroughputRow(CatalogRow):
    name: str
    value: float = Field(gt=0)
    unit: str


@dataclass(frozen=True)
class ThroughputConstants:
    rows: tuple[ThroughputRow, ...]

    def get(self, name: str) -> float:
        for row in self.rows:
            if row.name == name:
                return row.value
        raise KeyError(f"no throughput constant {name!r} in the catalog")

    def matmul_efficiency(self, gpu: Gpu) -> float:
        """The card's measured figure, else the vendor's default."""
        if gpu.matmul_efficiency is not None:
            return gpu.matmul_efficiency
        return self.get("matmul_efficiency_amd" if gpu.vendor == "amd" else "matmul_efficiency_nvidia")

    def pcie_bytes_per_s(self, generation: int) -> float:
        return self.get(f"pcie_gen{min(max(generation, 3), 5)}") * 1e9
