"""The catalog: bundled GPU, offer and model data, merged with the user's own catalog directory.

A user directory (`--catalog DIR`, `$TUNECAST_CATALOG`, or ~/.local/share/tunecast/catalog) may hold
`gpus.csv`, `offers.csv`, `volume_defaults.csv`, `models.csv` with `models/*.json` and `model_aliases.csv`, in the
bundled files' format, and the devices `tunecast probe` measured (`devices.csv`, `device_measurements.csv`). Its
rows add to the bundled ones and replace those with the same key (a GPU's slug, a model's name, an alias's id, an
offer's provider, GPU, node size, instance type and region, a kind of provider). The snapshots of today's prices
that `tunecast offers --refresh` saves there (`prices/`) replace the rows of each offer they list at least as
recently (catalog/snapshots.py).

Every offer, bundled or the user's, that publishes no volume price is given the default for its kind of
provider here, once the offers are merged (see `tunecast.catalog.offers`): the planner prices storage from the
offers it is handed and needs nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date
from functools import lru_cache
from importlib import resources
from pathlib import Path

from tunecast.catalog.devices import with_measured
from tunecast.catalog.gpus import Gpu, GpuIndex
from tunecast.catalog.models import ModelAlias, ModelEntry, ModelIndex
from tunecast.catalog.offers import Offer, VolumeDefault, VolumeDefaults, volume_defaults, with_volume_default
from tunecast.catalog.overheads import Overhead
from tunecast.catalog.rows import parse_rows
from tunecast.catalog.snapshots import apply_snapshots, latest_snapshots
from tunecast.catalog.throughput import ThroughputConstants, ThroughputRow
from tunecast.errors import ConfigError, Problem, TunecastError

GPUS_FILE = "gpus.csv"
OFFERS_FILE = "offers.csv"
OVERHEADS_FILE = "overheads.csv"
THROUGHPUT_FILE = "throughput.csv"
MODELS_FILE = "models.csv"
MODELS_DIR = "models"
MODEL_ALIASES_FILE = "model_aliases.csv"
VOLUME_DEFAULTS_FILE = "volume_defaults.csv"


def bundled_data_dir() -> Path:
    return Path(str(resources.files("tunecast.catalog") / "data"))


@dataclass(frozen=True)
class Catalog:
    """Everything tunecast knows about hardware, prices and models, with where it came from."""

    version: str
    gpus: GpuIndex
    offers: tuple[Offer, ...]
    models: ModelIndex
    user_dir: Path | None
    volume_defaults: VolumeDefaults
    """Volume prices assumed by kind of provider. The offers above already carry theirs; an offer built
    elsewhere (a user's own price) gets its default with `with_volume_default(offer, catalog.volume_defaults)`."""
    overheads: tuple[Overhead, ...] = ()
    throughput: ThroughputConstants = field(default_factory=lambda: ThroughputConstants(()))

    @property
    def providers(self) -> list[str]:
        return sorted({offer.provider for offer in self.offers})

    def offers_for(self, gpu_slug: str) -> list[Offer]:
        return [offer for offer in self.offers if offer.gpu == gpu_slug]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise TunecastError(f"cannot read {path}: {error.strerror}", field=str(path),
                            hint="check the catalog directory and its permissions") from None


def _model_entries(directory: Path, label: str) -> dict[str, tuple[ModelEntry, Path]]:
    index = directory / MODELS_FILE
    if not index.exists():
        return {}
    entries: dict[str, tuple[ModelEntry, Path]] = {}
    problems: list[Problem] = []
    for entry in parse_rows(_read(index), ModelEntry, f"{label}/{MODELS_FILE}"):
        path = directory / MODELS_DIR / entry.file
        if not path.is_file():
            problems.append(Problem(f"{label}/{MODELS_FILE}: {entry.name}", f"config file {path} is missing",
                                    f"put the model's config.json at {path}"))
        entries[entry.name] = (entry, path)
    if problems:
        raise ConfigError(f"{label}/{MODELS_FILE}", problems)
    return entries


def _model_aliases(directory: Path, label: str) -> dict[str, ModelAlias]:
    index = directory / MODEL_ALIASES_FILE
    if not index.exists():
        return {}
    return {alias.alias.lower(): alias
            for alias in parse_rows(_read(index), ModelAlias, f"{label}/{MODEL_ALIASES_FILE}")}


def _checked_aliases(aliases: dict[str, ModelAlias], models: dict[str, tuple[ModelEntry, Path]],
                     label: str) -> dict[str, ModelAlias]:
    """Every alias names a model of the catalog (its own rows and the bundled ones)."""
    problems = [Problem(f"{label}/{MODEL_ALIASES_FILE}: {alias.alias}",
                        f"names {alias.name!r}, which is not a model of the catalog",
                        f"name a model of models.csv (`tunecast models` lists them), or add {alias.name} first")
                for alias in aliases.values() if alias.name not in models]
    if problems:
        raise ConfigError(f"{label}/{MODEL_ALIASES_FILE}", problems)
    return aliases


def _canonical_offers(offers: list[Offer], gpus: GpuIndex, label: str) -> list[Offer]:
    """Offers name GPUs by slug or alias; store the slug. An unknown GPU is a catalog error."""
    problems: list[Problem] = []
    canonical: list[Offer] = []
    for offer in offers:
        gpu = gpus.find(offer.gpu)
        if gpu is None:
            problems.append(Problem(f"{label}/{OFFERS_FILE}: {offer.provider} {offer.gpu}",
                                    f"unknown GPU {offer.gpu!r}", gpus.unknown_hint(offer.gpu)))
            continue
        canonical.append(offer if gpu.slug == offer.gpu else offer.model_copy(update={"gpu": gpu.slug}))
    if problems:
        raise ConfigError(f"{label}/{OFFERS_FILE}", problems)
    return canonical


@lru_cache(maxsize=8)
def load_catalog(user_dir: Path | None = None) -> Catalog:
    """Bundled catalog merged with `user_dir` (when given and present)."""
    bundled = bundled_data_dir()
    meta = json.loads(_read(bundled / "catalog.json"))
    gpus = {gpu.slug: gpu for gpu in parse_rows(_read(bundled / GPUS_FILE), Gpu, GPUS_FILE)}
    offers = parse_rows(_read(bundled / OFFERS_FILE), Offer, OFFERS_FILE)
    models = _model_entries(bundled, "catalog")
    aliases = _checked_aliases(_model_aliases(bundled, "catalog"), models, "catalog")
    overheads = {(row.name, row.architecture): row
                 for row in parse_rows(_read(bundled / OVERHEADS_FILE), Overhead, OVERHEADS_FILE)}
    volumes = {row.kind: row for row in parse_rows(_read(bundled / VOLUME_DEFAULTS_FILE), VolumeDefault,
                                                   VOLUME_DEFAULTS_FILE)}
    volumes_label = VOLUME_DEFAULTS_FILE

    active_user_dir = user_dir if user_dir is not None and user_dir.is_dir() else None
    user_offers: list[Offer] = []
    if active_user_dir is not None:
        label = str(active_user_dir)
        if (active_user_dir / GPUS_FILE).exists():
            for gpu in parse_rows(_read(active_user_dir / GPUS_FILE), Gpu, f"{label}/{GPUS_FILE}"):
                gpus[gpu.slug] = gpu
        if (active_user_dir / OFFERS_FILE).exists():
            user_offers = parse_rows(_read(active_user_dir / OFFERS_FILE), Offer, f"{label}/{OFFERS_FILE}")
        models.update(_model_entries(active_user_dir, label))
        aliases.update(_checked_aliases(_model_aliases(active_user_dir, label), models, label))
        if (active_user_dir / OVERHEADS_FILE).exists():
            for row in parse_rows(_read(active_user_dir / OVERHEADS_FILE), Overhead, f"{label}/{OVERHEADS_FILE}"):
                overheads[(row.name, row.architecture)] = row
        if (active_user_dir / VOLUME_DEFAULTS_FILE).exists():
            volumes_label = f"{label}/{VOLUME_DEFAULTS_FILE}"
            for volume in parse_rows(_read(active_user_dir / VOLUME_DEFAULTS_FILE), VolumeDefault, volumes_label):
                volumes[volume.kind] = volume

    # devices measured by `tunecast probe` (devices.csv): figures for catalog GPUs, rows for the others
    index = GpuIndex(with_measured(gpus, active_user_dir).values())
    merged = {offer.key: offer for offer in _canonical_offers(offers, index, "catalog")}
    if user_offers:
        for offer in _canonical_offers(user_offers, index, str(active_user_dir)):
            merged[offer.key] = offer
    # today's prices fetched by `tunecast offers --refresh`, where they are the freshest (snapshots.py)
    merged = apply_snapshots(merged, latest_snapshots(active_user_dir))
    defaults = volume_defaults(volumes.values(), volumes_label)
    return Catalog(
        version=str(meta["version"]),
        gpus=index,
        offers=tuple(with_volume_default(offer, defaults) for offer in merged.values()),
        models=ModelIndex(models, aliases),
        user_dir=active_user_dir,
        volume_defaults=defaults,
        overheads=tuple(overheads.values()),
        throughput=ThroughputConstants(tuple(parse_rows(_read(bundled / THROUGHPUT_FILE), ThroughputRow,
                                                        THROUGHPUT_FILE))),
    )


def today() -> date:
    """The date prices are judged against (a function so that tests can pin it)."""
    return date.today()
