"""Build a RunSpec from a YAML file and command-line overrides, reporting every problem at once."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tunecast.catalog.diffusion import Pipeline, is_pipeline, load_pipeline
from tunecast.catalog.gpus import Gpu
from tunecast.catalog.hub import HubAccess
from tunecast.catalog.models import ModelConfig, bnb_bits
from tunecast.catalog.resolve import resolve_model
from tunecast.catalog.store import Catalog
from tunecast.config.checks import catalog_problems, cross_field_problems, model_problems
from tunecast.config.diffusion_runner import apply_diffusion_runner, diffusion_runner_notes
from tunecast.config.messages import all_keys, dotted, model_at, problem_from_error
from tunecast.config.prequantized import Prequantized, by_name, prequantized, unquantized_name
from tunecast.config.runner import apply_runner
from tunecast.config.spec import DIFFUSION_RUNNERS, TEXT_KEYS, RunSpec
from tunecast.errors import ConfigError, Problem, TunecastError

if TYPE_CHECKING:
    from tunecast.config.imported import Imported

# Placeholder for a missing model while the rest of the config is checked; never leaves this module.
_MISSING_MODEL = "<missing>"
# Keys that say one thing two ways: a value of one on the command line replaces the file's value of the other.
_ONE_OF = (("global_batch", "grad_accum"), ("warmup_steps", "warmup_ratio"))


@dataclass(frozen=True)
class Override:
    """One value given on the command line: `key` is dotted, `origin` is what the user typed. It replaces the file's
    value; None (`--set key=null` or `~`) removes the key, so that its default applies."""

    key: str
    value: Any
    origin: str


def parse_set(text: str) -> Override:
    """'lora.dropout=0.1' → Override('lora.dropout', 0.1). Values are read as YAML scalars or lists."""
    key, separator, raw = text.partition("=")
    key = key.strip()
    if not separator or not key:
        raise TunecastError(f"--set {text!r} is not of the form key=value", field="--set",
                            hint="write --set dotted.key=value, for example --set lora.dropout=0.05")
    import yaml  # here: a command given typed flags only reads no YAML

    if key in TEXT_KEYS:  # a version such as 1.10, which YAML would read as the number 1.1
        return Override(key, raw.strip(), f"--set {key}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return Override(key, value, f"--set {key}")


@dataclass(frozen=True)
class LoadedSpec:
    """A valid RunSpec with what its names resolved to and the warnings found on the way."""

    spec: RunSpec
    source: str
    model: ModelConfig
    gpu: Gpu | None
    warnings: tuple[Problem, ...] = field(default=())
    imported: Imported | None = None  # the other tool's config it was read from (`--from`)


@dataclass(frozen=True)
class LoadedPipeline:
    """A valid RunSpec whose model is a diffusion pipeline (docs/diffusion.md), with its GPU and warnings."""

    spec: RunSpec
    source: str
    pipeline: Pipeline
    gpu: Gpu | None
    warnings: tuple[Problem, ...] = field(default=())
    imported: Imported | None = None  # the other tool's config it was read from (`--from`)
    runner_notes: tuple[str, ...] = ()  # its runner's defaults applied, with their sources (config/diffusion_runner.py)


def overrides_from(values: Mapping[str, Any]) -> list[Override]:
    """A request's overrides (`{"dotted.key": value}`, as the web planner sends them) as Overrides in their order,
    each reported as `overrides.KEY`: what `--set KEY=VALUE` is on the command line."""
    overrides = []
    for key, value in values.items():
        if not key.strip():
            raise TunecastError("an override has an empty key", field="overrides",
                                hint='write {"dotted.key": value}, for example {"lora.dropout": 0.05}')
        overrides.append(Override(key.strip(), value, f"overrides.{key.strip()}"))
    return overrides


def load_spec(path: Path | None, overrides: list[Override], catalog: Catalog, *,
              hub: HubAccess | None = None, imported: Imported | None = None) -> LoadedSpec:
    """Read `path` (optional) or the config `imported` from another tool, apply `overrides`, validate, resolve the
    model and GPU. `hub`: whether a model outside the catalog may have its config.json fetched from the Hugging Face
    Hub, and who hears it is (default: it may, unless HF_HUB_OFFLINE is set; nobody hears).

    Raises ConfigError listing every problem found, each naming the key as the user wrote it and
    where the value came from (line number or flag). A diffusion pipeline is one (`load_run` takes it).
    """
    loaded = load_run(path, overrides, catalog, hub=hub, imported=imported, pipelines=False)
    assert isinstance(loaded, LoadedSpec)
    return loaded


def load_run(path: Path | None, overrides: list[Override], catalog: Catalog, *, hub: HubAccess | None = None,
             imported: Imported | None = None, pipelines: bool = True) -> LoadedSpec | LoadedPipeline:
    """`load_spec`, where the model may also be a diffusion pipeline (with `pipelines`): a LoadedPipeline then."""
    source = str(path) if path is not None else "command line"
    raw: dict[str, Any] = {}
    lines: dict[str, int] = {}
    problems: list[Problem] = []
    base_dir = path.parent.resolve() if path is not None else None
    if path is not None:
        raw, lines, problems = _parse(_read_file(path))
    elif imported is not None:
        source = f"{imported.source} (read as {imported.tool})"
        raw, lines = copy.deepcopy(imported.config), dict(imported.lines)
        base_dir = imported.source.parent.resolve()
    return _load(raw, lines, problems, overrides, catalog, source=source, base_dir=base_dir,
                 hub=hub, imported=imported, pipelines=pipelines)


def load_spec_text(yaml_text: str, overrides: list[Override], catalog: Catalog, *, source: str = "config",
                   hub: HubAccess | None = None) -> LoadedSpec:
    """`load_spec` of a config given as YAML text (the web planner's requests): the same checks and messages, each
    problem located by its line in the text or by its override. Empty text is no config, as a command line without
    a file; relative paths in it are relative to the current directory."""
    raw, lines, problems = _parse(yaml_text) if yaml_text.strip() else ({}, {}, [])
    loaded = _load(raw, lines, problems, overrides, catalog, source=source if yaml_text.strip() else "overrides",
                   base_dir=None, hub=hub, imported=None, pipelines=False)
    assert isinstance(loaded, LoadedSpec)
    return loaded


def merged_document(yaml_text: str, overrides: list[Override]) -> dict[str, Any]:
    """The config as written in `yaml_text` with `overrides` applied to it, keys in their order (unvalidated:
    `load_spec_text` checks it)."""
    raw, _, _ = _parse(yaml_text) if yaml_text.strip() else ({}, {}, [])
    for override in overrides:
        if override.value is None and override.key in all_keys():
            _delete(raw, tuple(override.key.split(".")))
        else:
            _set_dotted(raw, override.key, override.value)
    return raw


def _load(raw: dict[str, Any], lines: dict[str, int], problems: list[Problem], overrides: list[Override],
          catalog: Catalog, *, source: str, base_dir: Path | None, hub: HubAccess | None,
          imported: Imported | None, pipelines: bool) -> LoadedSpec | LoadedPipeline:
    origins: dict[str, str] = {key: f"line {line}" for key, line in lines.items()}
    for override in overrides:
        _apply(raw, origins, override, problems)
    problems.extend(_one_of(raw, origins, overrides))

    def locate(key: str) -> str | None:
        while key:
            if key in origins:
                return origins[key]
            key = key.rpartition(".")[0]
        return None

    spec, field_problems = _validate(raw, locate)
    problems.extend(field_problems)
    runner_notes: tuple[str, ...] = ()
    if spec is not None and spec.runner in DIFFUSION_RUNNERS:
        spec, applied = apply_diffusion_runner(spec)
        runner_notes = tuple(diffusion_runner_notes(spec, applied))
    elif spec is not None and spec.runner != "tunecast":
        spec = apply_runner(spec)
    model: ModelConfig | None = None
    pipeline: Pipeline | None = None
    gpu: Gpu | None = None
    if spec is not None:
        problems.extend(cross_field_problems(spec, locate))
        problems.extend(catalog_problems(spec, catalog, locate))
        spec = _resolve_paths(spec, origins, base_dir, problems, locate)
        model_dir = base_dir if origins.get("model", "").startswith("line") else None
        spec = _pipeline_folder(spec, model_dir)
        if spec.model != _MISSING_MODEL and is_pipeline(spec.model):
            if pipelines:
                pipeline = _pipeline(spec, problems, locate)
            else:
                problems.append(Problem("model", f"{spec.model} is a diffusion pipeline, which `tunecast memory` "
                                        "and `plan` estimate; this command does not take one yet (docs/diffusion.md)",
                                        "run tunecast memory --model ... --resolution PIXELS",
                                        location=locate("model")))
        elif spec.model != _MISSING_MODEL and spec.runner in DIFFUSION_RUNNERS:
            problems.append(Problem("model", f"{spec.model} is not a diffusion pipeline tunecast reads (one of the "
                                    f"catalog's, or a folder diffusers saved with model_index.json), which runner "
                                    f"{spec.runner} trains", "give the pipeline, for example --set model=stabilityai/"
                                    "stable-diffusion-xl-base-1.0 (`tunecast models` lists the catalog's), or a "
                                    "language model's runner (docs/runners.md)", location=locate("model")))
        elif spec.model != _MISSING_MODEL:
            try:
                model = resolve_model(spec.model, catalog, base_dir=model_dir, hub=hub)
            except TunecastError as error:
                named = by_name(spec.model)  # offline, or not on the Hub: its name still says why it cannot train
                problems.append(_prequantized_problem(named, spec.model, catalog, locate) if named is not None else
                                Problem("model", error.message, error.hint, location=locate("model")))
            else:
                found = prequantized(model)
                if found is not None:
                    problems.append(_prequantized_problem(found, spec.model, catalog, locate))
                else:
                    spec = _on_bnb_weights(spec, model, problems, locate)
                    problems.extend(model_problems(spec, model, locate))
        if spec.gpus.gpu is not None:
            gpu = catalog.gpus.find(spec.gpus.gpu)
            if gpu is not None:
                spec = spec.model_copy(update={"gpus": spec.gpus.model_copy(update={"gpu": gpu.slug})})

    errors = [p for p in problems if p.severity == "error"]
    warnings = tuple(p for p in problems if p.severity == "warning")
    if not errors and spec is not None and pipeline is not None:
        return LoadedPipeline(spec=spec, source=source, pipeline=pipeline, gpu=gpu, warnings=warnings,
                              imported=imported, runner_notes=runner_notes)
    if errors or spec is None or model is None:
        raise ConfigError(source, problems)
    return LoadedSpec(spec=spec, source=source, model=model, gpu=gpu, warnings=warnings, imported=imported)


def _pipeline_folder(spec: RunSpec, model_dir: Path | None) -> RunSpec:
    """`spec` with its model made absolute where it is a pipeline folder written relative to the config file (as a
    model directory is: resolve_model's `base_dir`)."""
    if model_dir is None or Path(spec.model).is_absolute():
        return spec
    folder = (model_dir / spec.model).resolve()
    return spec.model_copy(update={"model": str(folder)}) if (folder / "model_index.json").is_file() else spec


def _pipeline(spec: RunSpec, problems: list[Problem], locate: Any) -> Pipeline | None:
    """The diffusion pipeline `spec.model` names, and what of `spec` its estimate does not take, each a problem."""
    try:
        pipeline = load_pipeline(spec.model)
    except TunecastError as error:
        problems.append(Problem("model", error.message, error.hint, location=locate("model")))
        return None
    unsupported = [
        ("method", spec.method == "qlora", "QLoRA of a diffusion model is not modelled yet",
         "use method: lora or full"),
        ("runner", spec.runner not in ("tunecast", *DIFFUSION_RUNNERS), f"{spec.runner} trains language models",
         f"use a diffusion runner ({', '.join(DIFFUSION_RUNNERS)}), or leave runner out (diffusers' examples' step)"),
        ("diffusion.base_8bit", spec.diffusion.base_8bit and spec.method == "full",
         "8-bit frozen weights are for LoRA: full fine-tuning trains every weight", "use method: lora"),
        ("diffusion.base_8bit", spec.diffusion.base_8bit and spec.precision == "fp32",
         "8-bit frozen weights are upcast by mixed precision's autocast, which fp32 does not run (kohya asserts "
         "it, train_network.py L831-833)", "set precision: bf16-mixed (or fp16-mixed)"),
        ("grad_checkpointing", spec.grad_checkpointing is True and pipeline.family == "unet3d",
         "diffusers cannot checkpoint the video UNet (UNet3DConditionModel)", "set grad_checkpointing: false"),
        ("gpus.count", spec.gpus.count > 1, "a diffusion step is estimated on one GPU only for now",
         "set gpus.count: 1"),
        ("gpus.offload", spec.gpus.offload != "none", "offloading a diffusion model is not modelled yet",
         "leave gpus.offload out"),
        ("precision", spec.precision == "fp8", "fp8 training of a diffusion model is not modelled yet",
         "use bf16, bf16-mixed, fp16-mixed or fp32"),
    ]
    for key, applies, message, hint in unsupported:
        if applies:
            problems.append(Problem(key, f"{message} ({spec.model} is a diffusion pipeline)", hint,
                                    location=locate(key)))
    step = pipeline.vae_scale * (2 if pipeline.family == "flux" else 1)  # FLUX packs latents in 2 × 2 patches
    for side in sorted(set(spec.diffusion.sides or ())):
        if side % step:
            problems.append(Problem("diffusion.resolution", f"{side} px is not a multiple of {step}, which "
                                    f"{spec.model}'s latents need", f"use {max(step, side // step * step)} or "
                                    f"{(side // step + 1) * step}", location=locate("diffusion.resolution")))
    if spec.diffusion.frames is not None and not pipeline.video:
        problems.append(Problem("diffusion.frames", f"{spec.model} makes images, not video: frames has no effect",
                                "leave diffusion.frames out", severity="warning",
                                location=locate("diffusion.frames")))
    return pipeline


def _on_bnb_weights(spec: RunSpec, model: ModelConfig, problems: list[Problem], locate: Any) -> RunSpec:
    """`spec` on a checkpoint stored in bitsandbytes' 4 or 8 bits (unsloth's `-bnb-4bit` uploads): LoRA on those
    weights is QLoRA, so it is estimated as `method: qlora` with their bits, and said so; full fine-tuning cannot
    train them (bitsandbytes' weights take no gradient)."""
    bits = bnb_bits(model)
    if bits is None or (spec.method == "qlora" and spec.quantization.bits == bits):
        return spec
    stored = f"{model.name} holds bitsandbytes' {bits}-bit weights (its quantization_config)"
    if spec.method == "full":
        problems.append(Problem("method", f"{stored}, which full fine-tuning cannot train (they take no gradient)",
                                "give the unquantized model for full fine-tuning, or set method: qlora",
                                location=locate("method")))
        return spec
    problems.append(Problem("method", f"{stored}: LoRA on them is QLoRA, estimated as method: qlora with "
                            f"quantization.bits: {bits}", f"set method: qlora and quantization.bits: {bits} to say so",
                            severity="warning", location=locate("method")))
    return spec.model_copy(update={"method": "qlora",
                                   "quantization": spec.quantization.model_copy(update={"bits": bits})})


def _prequantized_problem(found: Prequantized, name: str, catalog: Catalog, locate: Any) -> Problem:
    """The AWQ or GPTQ checkpoint refused, with the catalog models close to its name without that part."""
    base = unquantized_name(name).strip("-_.")
    suggestion = catalog.models.suggestion(base) if base else None
    return Problem("model", found.message(), found.hint(suggestion), location=locate("model"))


def imported_part(loaded: LoadedSpec | LoadedPipeline) -> dict[str, Any]:
    """For a `--json` document of a run read `--from` another tool: where it came from, what each of its keys set,
    and `unmapped_keys`, every key not carried over with the reason; {} for a tunecast config."""
    if loaded.imported is None:
        return {}
    described = loaded.imported.as_dict()
    return {"from": {k: v for k, v in described.items() if k != "unmapped_keys"},
            "unmapped_keys": described["unmapped_keys"]}


def _read_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TunecastError(f"config file {path} does not exist", field="config",
                            hint="check the path, or write a starter config with `tunecast init`") from None
    except OSError as error:
        raise TunecastError(f"cannot read {path}: {error.strerror}", field="config",
                            hint="check the file's permissions") from None


def _parse(text: str) -> tuple[dict[str, Any], dict[str, int], list[Problem]]:
    from tunecast.config.yamlfile import read_yaml

    data, lines, problems = read_yaml(text)
    if not isinstance(data, dict):
        problems.append(Problem(None, "the file must hold a mapping of keys (model: …, method: …)",
                                "start from `tunecast init`"))
        data = {}
    return data, lines, problems


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested document as dotted keys (`{"lora": {"rank": 8}}` → `{"lora.rank": 8}`): what `--set` writes."""
    if isinstance(data, dict):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): data}


def _apply(raw: dict[str, Any], origins: dict[str, str], override: Override, problems: list[Problem]) -> None:
    """Put `override` into the document `raw`, replacing the file's value; None unsets a key (its default applies),
    which a required key cannot be."""
    key = override.key
    if override.value is None and key in all_keys():  # an unknown key is set, to be reported with its near names
        path = tuple(key.split("."))
        model = model_at(path)
        field = model.model_fields.get(path[-1]) if model is not None else None
        if field is not None and field.is_required():
            problems.append(Problem(key, "is required: it cannot be unset", f"give {key} a value instead (--set "
                                    f"{key}=…)", location=override.origin))
            return
        _delete(raw, path)
        for known in [k for k in origins if k == key or k.startswith(f"{key}.")]:
            del origins[known]
        return
    if _set_dotted(raw, key, override.value):
        origins[key] = override.origin
    else:
        problems.append(Problem(key, "cannot be set: a parent key is not a section",
                                "fix the parent key in the file first", location=override.origin))


def _one_of(raw: dict[str, Any], origins: dict[str, str], overrides: list[Override]) -> list[Problem]:
    """A command-line value of one of two keys that say the same thing two ways (global_batch and grad_accum)
    replaces the file's value of the other, as it would replace the file's value of its own key: said in a
    warning."""
    given = {o.key for o in overrides if o.value is not None}
    notes = []
    for pair in _ONE_OF:
        for key, other in (pair, pair[::-1]):
            written = origins.get(other, "")
            if key in given and other not in given and other in raw and written.startswith("line"):
                del raw[other]
                del origins[other]
                notes.append(Problem(other, f"gives way to {origins[key]}: the two set one thing, and a value on the "
                                     "command line replaces the file's", f"remove {other} from the file to keep "
                                     f"{key}", severity="warning", location=written))
    return notes


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> bool:
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return False
        node = child
    node[leaf] = value
    return True


def _delete(data: dict[str, Any], loc: tuple[int | str, ...]) -> None:
    """Remove the value at `loc` (or the list that holds it): so that the rest can be checked, or so that the key's
    default applies."""
    names = [part for part in loc if isinstance(part, str)]
    node: Any = data
    for part in names[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict) and names:
        node.pop(names[-1], None)


def _validate(raw: dict[str, Any], locate: Any) -> tuple[RunSpec | None, list[Problem]]:
    """Validate; on errors, drop the bad values and validate again, so that cross-field and catalog
    checks still run on everything else and all problems are reported in one go."""
    problems: list[Problem] = []
    data = copy.deepcopy(raw)
    for _attempt in range(4):
        try:
            return RunSpec.model_validate(data), problems
        except ValidationError as error:
            for item in error.errors():
                loc = tuple(item["loc"])
                if item["type"] == "missing" and loc == ("model",):
                    if not any(p.field == "model" for p in problems):
                        problems.append(problem_from_error(item, locate("model")))
                    data["model"] = _MISSING_MODEL
                    continue
                problems.append(problem_from_error(item, locate(dotted(loc))))
                _delete(data, loc)
    return None, problems


def _resolve_paths(spec: RunSpec, origins: dict[str, str], base_dir: Path | None,
                   problems: list[Problem], locate: Any) -> RunSpec:
    """Relative paths written in the file are relative to the file; those typed on the command line
    are relative to the current directory. Local dataset files must exist."""

    def from_file(key: str) -> bool:
        return origins.get(key, "").startswith("line") and base_dir is not None

    def absolute(key: str, value: str) -> str:
        if "://" in value:
            return value
        candidate = Path(value).expanduser()
        if not candidate.is_absolute():
            candidate = (base_dir if from_file(key) and base_dir else Path.cwd()) / candidate
        return str(candidate.resolve())

    def unusable(key: str, value: str, error: Exception) -> None:
        problems.append(Problem(key, f"{value!r} is not a usable path ({error})", "give a path this system can open",
                                location=locate(key)))

    dataset = spec.dataset
    updates: dict[str, str] = {}
    for key in ("path", "tokenizer"):
        value = getattr(dataset, key)
        if value is None:
            continue
        try:  # a NUL, a name too long, `~nobody`: no path
            resolved = absolute(f"dataset.{key}", value)
            found = "://" in resolved or Path(resolved).exists()
        except (OSError, ValueError, RuntimeError) as error:
            unusable(f"dataset.{key}", value, error)
            continue
        if not found:
            relative = (f"relative to the config file's folder ({base_dir})" if from_file(f"dataset.{key}")
                        else f"relative to the current directory ({Path.cwd()})")
            problems.append(Problem(f"dataset.{key}", f"{resolved} does not exist",
                                    f"check the path; a relative path given there is taken {relative}",
                                    location=locate(f"dataset.{key}")))
        updates[key] = resolved
    dataset = dataset.model_copy(update=updates)
    output = None
    if spec.output is not None:
        try:
            output = absolute("output", spec.output)
        except (OSError, ValueError, RuntimeError) as error:
            unusable("output", spec.output, error)
    return spec.model_copy(update={"dataset": dataset, "output": output})
