"""GPU specifications: one row per card, looked up by canonical slug or a forgiving alias."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import Field, field_validator, model_validator

from tunecast.catalog.rows import CatalogRow
from tunecast.errors import ConfigError, Problem, TunecastError, did_you_mean

# The name of this machine's device once `tunecast probe` has measured it (catalog/devices.py saves it)
LOCAL = "local"


class Gpu(CatalogRow):
    """One GPU model. Units are in the field names; figures are the vendor's unless `notes` says."""

    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    name: str
    vendor: str
    architecture: str
    aliases: tuple[str, ...] = ()
    memory_gib: float = Field(gt=0)
    """Nominal memory as marketed (an "80GB" card is 80)."""
    usable_memory_gib: float = Field(gt=0)
    """Total memory the driver reports to PyTorch (`torch.cuda.get_device_properties().total_memory`)."""
    bf16_tflops: float = Field(gt=0)
    """Dense BF16 tensor-core TFLOPS with FP32 accumulate (no sparsity)."""
    fp8_tflops: float | None = Field(None, gt=0)
    """Dense FP8 TFLOPS; empty for cards without FP8 tensor cores."""
    matmul_efficiency: float | None = Field(None, gt=0, le=1)
    """Measured largest fraction of bf16_tflops a large matmul reaches; empty where not measured."""
    memory_bandwidth_gb_per_s: float = Field(gt=0)
    interconnect: str
    interconnect_gb_per_s: float = Field(gt=0)
    pcie_gen: int = Field(ge=3)
    tdp_w: float = Field(gt=0)
    purchase_usd: float | None = Field(None, gt=0)
    measured: Any = Field(None, exclude=True, repr=False)
    """What `tunecast probe` measured on this device (a `catalog.devices.DeviceFigures`); None for a row of
    datasheet figures. Not a CSV column."""

    @classmethod
    def columns(cls) -> list[str]:
        return [name for name in super().columns() if name != "measured"]

    @field_validator("aliases", mode="before")
    @classmethod
    def _split_aliases(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(";") if part.strip())
        return value

    @model_validator(mode="after")
    def _usable_below_nominal(self) -> Gpu:
        # The driver never reports more than the card has; nominal "GB" figures can exceed GiB totals.
        if self.usable_memory_gib > self.memory_gib * 1.08:
            raise ValueError(
                f"usable_memory_gib {self.usable_memory_gib} exceeds nominal memory_gib {self.memory_gib}"
            )
        return self

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops is not None


GPU_COLUMNS = Gpu.columns()


def normalize_gpu_name(name: str) -> str:
    """'NVIDIA GeForce RTX 4090' → 'rtx4090'; 'A100:80GB' → 'a10080gb'; 'h100-sxm' → 'h100sxm'."""
    lowered = name.lower()
    for noise in ("nvidia", "geforce", "amd instinct", "amd"):
        lowered = lowered.replace(noise, "")
    return re.sub(r"[^a-z0-9]", "", lowered)


class GpuIndex:
    """Lookup of GPUs by slug or alias. Built from rows; checks that no name means two cards."""

    def __init__(self, gpus: Iterable[Gpu]) -> None:
        self._by_slug: dict[str, Gpu] = {}
        self._by_key: dict[str, str] = {}
        problems: list[Problem] = []
        for gpu in gpus:
            self._by_slug[gpu.slug] = gpu
        for gpu in self._by_slug.values():
            for name in (gpu.slug, *gpu.aliases):
                key = normalize_gpu_name(name)
                owner = self._by_key.setdefault(key, gpu.slug)
                if owner != gpu.slug:
                    problems.append(Problem(f"gpus.csv: {gpu.slug}", f"alias {name!r} also names {owner}",
                                            "give each alias to one GPU only"))
        if problems:
            raise ConfigError("GPU catalog", problems)

    def __iter__(self) -> Iterator[Gpu]:
        return iter(self._by_slug.values())

    def __len__(self) -> int:
        return len(self._by_slug)

    @property
    def slugs(self) -> list[str]:
        return list(self._by_slug)

    def find(self, name: str) -> Gpu | None:
        slug = self._by_key.get(normalize_gpu_name(name))
        return self._by_slug[slug] if slug else None

    def get(self, name: str, *, field: str = "gpu") -> Gpu:
        """The GPU named by slug or alias; an unknown name is a user error with close matches."""
        gpu = self.find(name)
        if gpu is not None:
            return gpu
        raise TunecastError(f"unknown GPU {name!r}", field=field, hint=self.unknown_hint(name))

    def unknown_hint(self, name: str) -> str:
        if name.strip().lower() == LOCAL:
            return ("'local' is this machine's device once measured: run `tunecast probe` first (with the same "
                    "--catalog, if you give one)")
        names = [*self._by_slug, *(alias for gpu in self._by_slug.values() for alias in gpu.aliases)]
        close = did_you_mean(name, names, n=5, cutoff=0.5)
        slugs = list(dict.fromkeys(self.get_slug(c) for c in close))
        if slugs:
            return f"Did you mean {' or '.join(repr(s) for s in slugs[:3])}? `tunecast gpus` lists them all."
        return "`tunecast gpus` lists the known GPUs; add your own with a gpus.csv in --catalog DIR."

    def get_slug(self, name: str) -> str:
        gpu = self.find(name)
        assert gpu is not None, name
        return gpu.slug
