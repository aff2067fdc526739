"""Step templates: one trace of a model at marker dimensions serves every model of the same structure.

A template holds the allocation events of a traced step with every size as a polynomial in the model's
dimensions, the LoRA rank, the micro-batch and the length (symbols.py reads them off a trace whose
dimensions are distinct primes), and the same for the figures the throughput model sums and the facts the
memory model reads. Instantiating it for a real config is arithmetic: no torch, no transformers, no trace.

A template is trusted only after it reproduced, byte for byte, a second trace at other primes (a
different rank, vocabulary, head layout, micro-batch and length); one that does not is recorded as
failed and the caller traces the model itself (profiles.py). So a template claims exactness wherever it
is used. Templates exist for micro-batches of two or more (b a variable) and for a micro-batch of one
(b = 1 takes a few different operations), below a sliding window and above it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from tunecast.atomic import write_text_atomic
from tunecast.estimate import progress, symbols, tracetime
from tunecast.estimate.memo import Memo, config_digest
from tunecast.estimate.profile import BASIS_NAMES, EventColumns, LazyEvents, ProfileEvent, StepProfile
from tunecast.estimate.tracer import ALLOC, FREE, SUMMED, ModelFacts, Trace, facts_from_parts
from tunecast.paths import cache_file
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import (
    layer_period,
    num_layers,
    shallow_config_data,
    sliding_window,
    sliding_window_offset,
    text_config_data,
)
from tunecast.step.variants import CHUNKING_VARIANTS

TEMPLATE_FORMAT = 3  # 3: events stored by column (columns())
# The basis slot of each (b, s) exponent pair a size may have.
_SLOTS = {(0, 0): 0, (0, 1): 1, (0, 2): 2, (1, 1): 3, (1, 2): 4, (1, 0): 5}
_B, _S = symbols.VARIABLES.index("b"), symbols.VARIABLES.index("s")


class NoTemplate(Exception):
    """No template serves this model and these settings: the caller traces the model itself."""


def depths(config_data: dict[str, Any]) -> tuple[int, ...]:
    """The shallow depths traced: 4 and 8 periods of the layer pattern, or the whole model when shorter."""
    period = layer_period(config_data)
    full = num_layers(config_data)
    return (4 * period, 8 * period) if full > 8 * period else (full,)


def _marker_settings(settings: TraceSettings, markers: dict[str, int]) -> TraceSettings:
    if settings.method == "full":
        return settings
    from dataclasses import replace

    return replace(settings, adapters=replace(settings.adapters, rank=markers["r"]))


@functools.cache
def _versions() -> dict[str, str]:
    from tunecast.estimate.profiles import library_versions

    return {**library_versions(), "template_format": str(TEMPLATE_FORMAT)}


def template_shapes(config_data: dict[str, Any]) -> list[tuple[bool, bool]]:
    """The (multi, above) of every template of one structure and settings: a micro-batch of one and of more, each on
    both sides of a sliding window where the model has one (an estimate above the window also reads the shapes
    below it: memory.py, the reserve ladder)."""
    sides = (False, True) if sliding_window(config_data) is not None else (False,)
    return [(multi, above) for multi in (False, True) for above in sides]


def above_window(config_data: dict[str, Any], seq: int) -> bool:
    """Whether `seq` lies above the config's sliding window (attention masks differ on either side, so each
    side has its templates)."""
    return sliding_window_offset(config_data, seq) > 0


def _marker_window(config_data: dict[str, Any], above: bool, *, check: bool) -> int | None:
    """The sliding window of a marker model: below the window, one above both marker lengths (the real one
    when it is); above it, one below both, other in the check trace, so that a size that depends on the
    window fails the check instead of being read as a constant."""
    window = sliding_window(config_data)
    if window is None:
        return None
    if above:
        return 48 if check else 32
    return max(window, 512)


# A family's linear layers but the output head: the modules peft's `all-linear` adapts, so a target list that
# names exactly these (as axolotl configs often do) is the same adapter and has the same template (checked by
# tracing both, tests/unit/estimate/test_templates.py).
_DECODER = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
LINEAR_LAYERS = {**dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"), _DECODER),
                 "phi": frozenset({"q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"}),
                 "phi3": frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),  # fused q/k/v, gate/up
                 "gpt2": frozenset({"c_attn", "c_proj", "c_fc"})}


_KEYS = Memo()
_APPLIES = Memo()


def template_key(config_data: dict[str, Any], settings: TraceSettings, multi: bool, above: bool = False) -> str:
    """What a template depends on: the model's structure (not its dimensions), the settings but the LoRA
    rank, the micro-batch regime, the side of the sliding window, the depths traced and the library
    versions."""
    settings = template_settings(settings)
    return _KEYS.get((config_digest(config_data), settings, multi, above),
                     lambda: _template_key(config_data, settings, multi, above))


def _template_key(config_data: dict[str, Any], settings: TraceSettings, multi: bool, above: bool) -> str:
    chosen = depths(config_data)
    shallow = shallow_config_data(config_data, chosen[-1])
    fields = settings.fields()
    if settings.method == "qlora":  # the same step as LoRA's: NF4 weights are modelled on it (memory.py)
        fields["method"] = "lora"
    if settings.method == "full":
        fields.pop("adapters")
    else:  # the rank is a variable; the scale alpha / rank changes no size; any dropout draws the same masks;
        # peft keeps a list of target modules as a set, so their order changes nothing
        targets = settings.adapters.targets
        if not isinstance(targets, str) and frozenset(targets) == LINEAR_LAYERS.get(shallow.get("model_type")):
            targets = "all-linear"  # the same adapter
        fields["adapters"].update(rank="r", alpha=None, dropout=settings.adapters.dropout > 0,
                                  targets=targets if isinstance(targets, str) else sorted(set(targets)))
    regime: dict[str, Any] = {"multi": multi}
    if above:
        regime["above_window"] = True

    def key(shape: dict[str, Any]) -> str:
        payload = json.dumps({"structure": shape, "settings": fields, **regime, "depths": chosen,
                              "versions": _versions()}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:24]

    own = key(_structure(shallow))
    if _kept(own):
        return own
    # a config that leaves out entries its class fills in (one written by hand, or saved with only what differs)
    # builds the model of a catalog config that states them: that structure's template serves it
    return next((alias for shape in _stated_alike(shallow) if _kept(alias := key(shape))), own)


def _structure(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in symbols.structure(config).items() if k != "num_hidden_layers"}


def _kept(key: str) -> bool:
    """Whether a template of this key is shipped or cached (a failed one too)."""
    try:
        shipped = _shipped_file(key).is_file()
    except OSError:
        shipped = False
    return shipped or cache_path(key).is_file()


def _stated_alike(shallow: dict[str, Any]) -> list[dict[str, Any]]:
    """The structures of the catalog's models of this type that differ from `shallow`'s only in entries one states
    and the other leaves to its config class's default: the same model as transformers builds it (each taken at
    `shallow`'s depth)."""
    from tunecast.catalog.models import with_class_defaults
    from tunecast.catalog.store import load_catalog

    own = _structure(shallow)
    filled = _structure(with_class_defaults(shallow))
    models = load_catalog(None).models
    found: list[dict[str, Any]] = []
    for name in models.names:
        model = models.find(name)
        data = text_config_data(model.data) if model is not None else {}
        if data.get("model_type") != shallow.get("model_type"):
            continue
        other = shallow_config_data(data, num_layers(shallow))
        stated = _structure(other)
        if stated != own and stated not in found and _structure(with_class_defaults(other)) == filled:
            found.append(stated)
    return found


def template_settings(settings: TraceSettings) -> TraceSettings:
    """The settings whose template serves `settings`: a loss composed onto a template (compose.py) replaced by
    its stand-in."""
    from tunecast.estimate.compose import composable, stub_settings

    return stub_settings(settings) if composable(settings) else settings


def applies(config_data: dict[str, Any], settings: TraceSettings) -> bool:
    """Whether a template may serve this config: a model whose sizes the variables describe, not a chunked
    loss (its number of chunks depends on the length) unless it is composed onto the template (compose.py)."""
    settings = template_settings(settings)
    return _APPLIES.get((config_digest(config_data), settings), lambda: _applies(config_data, settings))


def _applies(config_data: dict[str, Any], settings: TraceSettings) -> bool:
    config = text_config_data(config_data)
    chunking = settings.loss == "chunked" or any(v in CHUNKING_VARIANTS for v in settings.runner_step)
    return symbols.dense_dimensions(config) is not None and not chunking


def why_traced(config_data: dict[str, Any], settings: TraceSettings) -> str:
    """Why no template serves this model and these settings, in words an estimate announces before it traces."""
    config = text_config_data(config_data)
    chunking = [v for v in settings.runner_step if v in CHUNKING_VARIANTS]
    if settings.loss == "chunked" or chunking:
        what = "the chunked loss" if settings.loss == "chunked" else f"the runner's {', '.join(chunking)} loss"
        return f"{what} splits the logits into chunks whose number follows the length, which a template cannot hold"
    if symbols.dense_dimensions(config) is None:
        return f"no template reads the sizes of a {config.get('model_type') or 'model'} config yet"
    return "this structure's template could not be read back exactly from its marker traces"


def _read_trace(trace: Trace, reader: Any) -> dict[str, Any] | None:
    """A traced step at marker dimensions as polynomials; None when a size has no reading."""
    if trace.unread:
        return None
    events = []
    for event in trace.events:
        poly: symbols.Poly = ()
        if event.kind == ALLOC:
            read = reader(event.nbytes)
            if read is None:
                return None
            poly = read
        events.append((event.kind, event.key, symbols.to_json(poly), event.category, event.phase, event.step))
    summed = {name: terms for name, terms in trace.terms.items() if not name.startswith("fact_")}
    sums = {name: symbols.to_json(symbols.add(terms)) for name, terms in summed.items()
            if not name.endswith("_capped")}
    capped = {name.removesuffix("_capped"): [[symbols.to_json(symbols.add(side)) for side in pair] for pair in terms]
              for name, terms in summed.items() if name.endswith("_capped")}
    facts = _facts_terms(trace.terms)
    if facts is None:
        return None
    return {"events": columns(events), "sums": sums, "capped": capped, "facts": facts,
            "attention": trace.facts.attention, "param_dtype_bytes": trace.facts.param_dtype_bytes}


def columns(events: list[tuple[str, int, Any, str, str, int]]) -> dict[str, Any]:
    """Events (kind, key, size polynomial, category, phase, step) stored by column: the strings as indices
    into `names`, the sizes as indices into `polys` (a step allocates thousands of tensors of a few dozen
    sizes). A warm `tunecast memory` reads a template in a fifth of the time the rows took."""
    names: dict[str, int] = {}
    polys: dict[str, int] = {}
    kept: list[Any] = []

    def name(text: str) -> int:
        return names.setdefault(text, len(names))

    def poly(value: Any) -> int:
        text = json.dumps(value)
        if text not in polys:
            polys[text] = len(polys)
            kept.append(value)
        return polys[text]

    kind, key, size, category, phase, step = zip(*events, strict=True) if events else ((),) * 6
    return {"kind": [name(k) for k in kind], "key": list(key), "size": [poly(p) for p in size],
            "category": [name(c) for c in category], "phase": [name(p) for p in phase], "step": list(step),
            "names": list(names), "polys": kept}


def _facts_terms(terms: dict[str, Any]) -> dict[str, Any] | None:
    flat = [*terms["fact_quantizable"], *terms["fact_trainable"], *(p for p, _ in terms["fact_layer"]),
            *(p for a, b, _ in terms["fact_linears"] for p in (a, b)), *terms["fact_head"][:2]]
    if any(p is None for p in flat):
        return None
    return {
        "quantizable": [symbols.to_json(p) for p in terms["fact_quantizable"]],
        "trainable": [symbols.to_json(p) for p in terms["fact_trainable"]],
        "layer": [[symbols.to_json(p), size] for p, size in terms["fact_layer"]],
        "linears": [[symbols.to_json(a), symbols.to_json(b), t] for a, b, t in terms["fact_linears"]],
        "head": [symbols.to_json(terms["fact_head"][0]), symbols.to_json(terms["fact_head"][1]),
                 terms["fact_head"][2]],
    }


def _coefficients(poly: symbols.Poly, values: dict[str, int]) -> tuple[float, ...] | None:
    """A polynomial's coefficients over the profile basis once every variable but b and s has its value."""
    slots = [0] * len(BASIS_NAMES)
    rest = {name: value for name, value in values.items() if name not in ("b", "s")}
    for coefficient, exponents in poly:
        slot = _SLOTS.get((exponents[_B], exponents[_S]))
        if slot is None:
            return None
        slots[slot] += symbols.evaluate(((coefficient, tuple(0 if i in (_B, _S) else e
                                                             for i, e in enumerate(exponents))),), rest)
    return tuple(float(c) for c in slots)


def _instantiate_depth(data: dict[str, Any], layers: int, values: dict[str, int]) -> StepProfile:
    table = data["events"]
    sizes = []
    for poly in table["polys"]:
        coefficients = _coefficients(symbols.from_json(poly), values)
        if coefficients is None:
            raise NoTemplate("a size outside the profile's basis")
        sizes.append(coefficients)
    names = table["names"]
    alloc = names.index(ALLOC) if ALLOC in names else -1

    def build() -> list[ProfileEvent]:
        return [ProfileEvent(names[kind], key, sizes[size] if kind == alloc else (), names[category],
                             names[phase], step)
                for kind, key, size, category, phase, step in zip(table["kind"], table["key"], table["size"],
                                                                  table["category"], table["phase"],
                                                                  table["step"], strict=True)]

    def by_column() -> EventColumns:
        return EventColumns([names[kind] for kind in table["kind"]], table["key"], table["size"],
                            [names[category] for category in table["category"]],
                            [names[phase] for phase in table["phase"]], table["step"], sizes)

    events = LazyEvents(build, by_column)
    flops = {}
    for name, poly in data["sums"].items():
        coefficients = _coefficients(symbols.from_json(poly), values)
        if coefficients is None:
            raise NoTemplate("a summed figure outside the profile's basis")
        flops[name.removeprefix("flops_")] = coefficients
    for name in ("matmul", "attention", *SUMMED):
        flops.setdefault(name, (0.0,) * len(BASIS_NAMES))
    capped = {}
    for name, pairs in data["capped"].items():
        read = [tuple(_coefficients(symbols.from_json(side), values) for side in pair) for pair in pairs]
        if any(side is None for pair in read for side in pair):
            raise NoTemplate("a lookup's size outside the profile's basis")
        capped[name] = read
    return StepProfile(layers, events, _instantiate_facts(data, values), flops, capped)  # type: ignore[arg-type]


def _instantiate_facts(data: dict[str, Any], values: dict[str, int]) -> ModelFacts:
    facts = data["facts"]

    def value(poly: Any) -> int:
        return symbols.evaluate(symbols.from_json(poly), values)

    parts: dict[str, Any] = {
        "quantizable": [value(p) for p in facts["quantizable"]],
        "trainable": [value(p) for p in facts["trainable"]],
        "layer": [[value(p), size] for p, size in facts["layer"]],
        "linears": [[value(a), value(b), t] for a, b, t in facts["linears"]],
        "head": [value(facts["head"][0]), value(facts["head"][1]), facts["head"][2]],
    }
    return facts_from_parts(parts, attention=data["attention"], param_dtype_bytes=data["param_dtype_bytes"])


def instantiate(template: dict[str, Any], config_data: dict[str, Any], settings: TraceSettings
                ) -> list[StepProfile]:
    """The profiles (one per traced depth) of a real config, from its template."""
    config = text_config_data(config_data)
    rank = settings.adapters.rank if settings.method != "full" else 1
    values = symbols.variable_values(config, rank, None)
    if values is None:
        raise NoTemplate("the config's dimensions are not of the template's form")
    return [_instantiate_depth(data, layers, values) for layers, data in zip(template["depths"],
                                                                              template["profiles"], strict=True)]


def _trace_at(config_data: dict[str, Any], settings: TraceSettings, markers: dict[str, int], multi: bool,
              layers: int, reader: Any, window: int | None) -> Trace | None:
    """The step of the marker model (with sliding window `window`); None when it does not run (a rotary size
    gone odd, a kernel's alignment)."""
    from tunecast.estimate.tracer import trace_step

    shaped = symbols.marker_config(shallow_config_data(config_data, layers), markers)
    if window is not None:
        shaped["sliding_window"] = window
    batch = markers["b"] if multi else 1
    try:
        return trace_step(shaped, _marker_settings(settings, markers), batch, markers["s"], reader=reader)
    except Exception:  # a failed marker model means no template; the model itself is then traced
        return None


def _free_runs_sorted(events: Sequence[Any]) -> list[Any]:
    """Events with each run of consecutive frees in key order. Frees with no allocation between them happen
    at one instant: their order changes no size and no allocator state (freed neighbours merge alike in any
    order), and where the tensors sit in a hash table it differs from trace to trace (autocast's cache of cast
    weights, emptied as the forward pass leaves autocast)."""
    ordered: list[Any] = []
    run: list[Any] = []
    for event in [*events, None]:
        if event is not None and event.kind == FREE:
            run.append(event)
            continue
        ordered.extend(sorted(run, key=lambda free: free.key))
        run = []
        if event is not None:
            ordered.append(event)
    return ordered


def _same(profile: StepProfile, trace: Trace, batch: int, seq: int) -> bool:
    """The template's profile evaluated at (batch, seq) equals the trace: every event, sum and fact."""
    from tunecast.estimate.profile import basis

    terms = basis(batch, seq)
    if len(profile.events) != len(trace.events):
        return False
    for expected, got in zip(_free_runs_sorted(profile.events), _free_runs_sorted(trace.events), strict=True):
        if (expected.kind, expected.key, expected.category, expected.phase, expected.step) != \
                (got.kind, got.key, got.category, got.phase, got.step):
            return False
        if got.kind == ALLOC and round(sum(c * t for c, t in zip(expected.size, terms, strict=True))) != got.nbytes:
            return False
    sums = profile.flops_at(batch, seq)
    if any(round(sums.get(name, 0.0)) != round(value) for name, value in trace.flops.items()):
        return False
    return profile.facts == trace.facts


def build_template(config_data: dict[str, Any], settings: TraceSettings, multi: bool, above: bool = False
                   ) -> dict[str, Any] | None:
    """Trace the marker model at every depth, read the sizes, and check the reading against a trace at
    the other markers (and another sliding window); the template, or None when a size has no reading or the
    check fails. `above`: the template of lengths above the sliding window."""
    settings = template_settings(settings)
    config = text_config_data(config_data)
    chosen_markers = symbols.markers(config)
    active = symbols.marker_values(config, chosen_markers, multi=multi)
    shifted = symbols.shifts(config)

    def reader(n: int) -> symbols.Poly | None:
        return symbols.factor(n, active, shifted=shifted)

    chosen = depths(config_data)
    traces = len(chosen) + 1
    what = f"{settings.method}, micro-batch {'2 and more' if multi else '1'}" + (", above the window" if above else "")
    profiles = []
    for index, layers in enumerate(chosen):
        progress.progress(f"building the step template of this model's structure ({what}): trace {index + 1} of "
                          f"{traces} ({layers} layers at marker dimensions)")
        traced = _trace_at(config_data, settings, chosen_markers, multi, layers, reader,
                           _marker_window(config_data, above, check=False))
        read = None if traced is None else _read_trace(traced, reader)
        if read is None:
            return None
        profiles.append(read)
    template = {"depths": list(chosen), "profiles": profiles, "multi": multi}
    check = symbols.markers(config, check=True)
    shallow = shallow_config_data(config_data, chosen[0])
    values = symbols.variable_values(symbols.marker_config(text_config_data(shallow), check),
                                     check["r"] if settings.method != "full" else 1, None)
    if values is None:
        return None
    expected = _instantiate_depth(profiles[0], chosen[0], values)
    batch = check["b"] if multi else 1
    progress.progress(f"building the step template of this model's structure ({what}): trace {traces} of {traces} "
                      "(the check at other dimensions)")
    traced = _trace_at(config_data, settings, check, multi, chosen[0], None,
                       _marker_window(config_data, above, check=True))
    return template if traced is not None and _same(expected, traced, batch, check["s"]) else None


def cache_path(key: str) -> Path:
    return cache_file("templates", f"{key}.json")


def _shipped_file(key: str) -> Traversable:
    """Where tunecast ships the template of this key (scripts/build_templates.py writes it)."""
    return resources.files("tunecast.estimate").joinpath(f"data/templates/{key}.json.xz")


def _shipped(key: str) -> dict[str, Any] | None:
    """A template shipped with tunecast (built by scripts/build_templates.py), or None."""
    try:
        import lzma  # a Python built without liblzma has none: templates are then built on first use

        data = _shipped_file(key).read_bytes()
    except (OSError, ImportError):
        return None
    loaded: dict[str, Any] = json.loads(lzma.decompress(data))
    return loaded


# Templates read in this process, by cache file.
_READ: dict[Path, dict[str, Any]] = {}


def cached_template(key: str) -> dict[str, Any] | None:
    """A template from this process, tunecast's shipped ones or the cache; {"failed": ...} records a
    structure no template serves."""
    path = cache_path(key)
    if path in _READ:
        return _READ[path]
    found = _shipped(key)
    if found is None and path.is_file():
        try:
            found = json.loads(path.read_text())
            if not isinstance(found, dict) or not ("failed" in found or "profiles" in found):
                raise ValueError("not a template")
        except (OSError, ValueError) as damaged:
            progress.warning(f"the cached step template {path} is damaged ({damaged}); building it again")
            found = None
    if found is not None:
        _READ[path] = found
    return found


def get_template(config_data: dict[str, Any], settings: TraceSettings, multi: bool, *, above: bool = False,
                 trace: bool = True) -> dict[str, Any]:
    """The template for this structure and these settings, built (and cached) on first use; without `trace`,
    one that would have to be built raises NeedsTrace."""
    from tunecast.estimate.profiles import NeedsTrace, TracingUnavailable
    from tunecast.estimate.tracer import tracing_available

    key = template_key(config_data, settings, multi, above)
    found = cached_template(key)
    if found is None and not trace:
        raise NeedsTrace("no template of this structure and these settings is shipped or cached")
    if found is None and key in _BESIDE:
        found = _built_beside(key, config_data, settings)
    if found is None:
        missing = tracing_available()
        if missing is not None:
            raise TracingUnavailable(missing)
        chosen = depths(config_data)
        seconds = tracetime.expected((*chosen, chosen[0]), len(chosen) + 1, "marker")
        beside = _start_beside(config_data, settings, multi, above)
        progress.notice(f"no shipped step template serves this model's structure in these settings: building it "
                        f"from {len(chosen) + 1} traces at marker dimensions, about {seconds} s on this machine"
                        + (f" (and {len(beside)} other template{'s' if len(beside) > 1 else ''} of these settings "
                           "that the estimate reads too, built at the same time by a second process)" if beside
                           else ""))
        started = time.perf_counter()
        found = _built(config_data, settings, multi, above)
        tracetime.remember(time.perf_counter() - started, (*chosen, chosen[0]), len(chosen) + 1, "marker")
    if "failed" in found:
        raise NoTemplate(found["failed"])
    return found


def _built(config_data: dict[str, Any], settings: TraceSettings, multi: bool, above: bool) -> dict[str, Any]:
    """The template built now, or the record of its failure; written to the cache, and kept for this process."""
    built = build_template(config_data, settings, multi, above)
    found = built if built is not None else {"failed": "a size had no reading or the check trace differed"}
    path = cache_path(template_key(config_data, settings, multi, above))
    if os.environ.get("TUNECAST_NO_CACHE") != "1":
        write_text_atomic(path, json.dumps(found))
    _READ[path] = found
    return found


# Templates a second process is building (`building_beside`), by key: that process.
_BESIDE: dict[str, subprocess.Popen[bytes]] = {}
_BESIDE_ON: ContextVar[bool] = ContextVar("building_beside", default=False)
BESIDE_TIMEOUT_S = 900  # longer than any template takes; past it, this process builds what it waited for


@contextlib.contextmanager
def building_beside() -> Iterator[None]:
    """Within (the command line's estimates): where a template must be built, a second process builds at the same
    time some of the other templates of the same settings, those of a micro-batch of one or of more and of either
    side of a sliding window, which the estimate reads too (memory.py, the reserve ladder reads the micro-batch of
    one and the shapes below the window); this process builds the rest as it comes to them. Two cores build four
    templates in the time of two. The second process is a new interpreter, not a fork: a fork of a process with
    threads (a progress display's, a test runner's) can inherit a lock held for ever. One still building when the
    estimate ends is stopped."""
    token = _BESIDE_ON.set(True)
    try:
        yield
    finally:
        _BESIDE_ON.reset(token)
        for process in {id(process): process for process in _BESIDE.values()}.values():
            _stop(process)
        _BESIDE.clear()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def _start_beside(config_data: dict[str, Any], settings: TraceSettings, multi: bool, above: bool) -> list[str]:
    """Within `building_beside`: the keys a second process now builds (the first half of the other templates of
    these settings that are neither shipped, cached nor already being built); none where none is started."""
    if not _BESIDE_ON.get() or os.environ.get("TUNECAST_NO_CACHE") == "1" or \
            os.environ.get("TUNECAST_NO_PREWARM") == "1":
        return []
    wanted = [(m, a) for m, a in template_shapes(config_data) if (m, a) != (multi, above)
              and (key := template_key(config_data, settings, m, a)) not in _BESIDE and cached_template(key) is None]
    given = wanted[:(len(wanted) + 1) // 2]
    if not given:
        return []
    try:
        process = subprocess.Popen([sys.executable, "-c", "from tunecast.estimate.templates import _build_ordered; "
                                    "_build_ordered()"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        assert process.stdin is not None
        with process.stdin as order:
            order.write(pickle.dumps((config_data, settings, given)))
    except OSError:
        return []
    keys = [template_key(config_data, settings, m, a) for m, a in given]
    _BESIDE.update(dict.fromkeys(keys, process))
    return keys


def _built_beside(key: str, config_data: dict[str, Any], settings: TraceSettings) -> dict[str, Any] | None:
    """The template the second process was building, once it is done; None where it failed (this process then
    builds it). Before it waits, this process builds its own share of the other templates of these settings (those
    it did not give the second process), which the estimate reads too."""
    process = _BESIDE[key]
    for m, a in template_shapes(config_data):
        other = template_key(config_data, settings, m, a)
        if other not in _BESIDE and cached_template(other) is None and process.poll() is None:
            progress.progress(f"building the {'micro-batch 2 and more' if m else 'micro-batch 1'} step template"
                              f"{(' above' if a else ' below') + ' the window' if sliding_window(config_data) else ''}"
                              " while the second process builds others")
            _built(config_data, settings, m, a)
    if process.poll() is None:
        progress.progress("waiting for the second process building this model's other step templates")
        try:
            process.wait(BESIDE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(process)
    for other in [k for k, p in _BESIDE.items() if p is process]:
        del _BESIDE[other]
    return cached_template(key)


def _build_ordered() -> None:
    """The second process of `building_beside`: builds the templates its standard input names, pickled by the first
    (the same tunecast), into the cache, saying nothing."""
    config_data, settings, given = pickle.loads(sys.stdin.buffer.read())
    with progress.listening(lambda kind, message: None):
        for multi, above in given:
            _built(config_data, settings, multi, above)
