"""Build the step templates tunecast ships (src/tunecast/estimate/data/templates/), so that a cold
`tunecast memory` or `tunecast plan` of a catalog model in common settings traces nothing.

A template serves every model of one structure at any rank, vocabulary, width, micro-batch and length
(docs/memory.md, "Speed"); this builds one per structure of the catalog's dense and mixture-of-experts models,
in each of SETTINGS (LoRA in the default settings, with adapter dropout, on the attention projections, on q and
v alone, on q, k and v, in fp32 and in mixed precision, with eager attention; full fine-tuning), checkpointing on
and off, micro-batch 1 and 2+, below and above a sliding window. With them, the settings of the published example
configs of axolotl, LLaMA-Factory, TRL and torchtune that tests/data/runners/published/ holds, as `--from` reads
them (their model, runner, method, targets, precision, checkpointing), so that a cold `--from` of those files traces
nothing. Templates are keyed by the torch, transformers and peft versions: rebuild them when those change.

Run:  .venv/bin/python scripts/build_templates.py [--models NAME ...] [--settings LABEL ...] [--published]
      (about 15 s a template)
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import lzma
import sys
import time
from collections import Counter
from pathlib import Path

from tunecast.catalog.hub import HubAccess
from tunecast.catalog.store import Catalog, load_catalog
from tunecast.config.load import load_spec
from tunecast.config.runner import apply_runner
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.estimate import templates
from tunecast.runners.imported import TOOLS, read_config
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import text_config_data

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "src" / "tunecast" / "estimate" / "data" / "templates"
PUBLISHED = REPO / "tests" / "data" / "runners" / "published"
SUFFIX = ".json.xz"
# The settings templates are shipped for, by label: RunSpec fields. fp16-mixed and fp8 are traced as bf16-mixed
# and bf16 (TraceSettings.from_spec), and QLoRA as LoRA, so their templates are these.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
SETTINGS: dict[str, dict] = {
    "lora": {"method": "lora"},
    "lora-dropout": {"method": "lora", "lora": {"dropout": 0.05}},
    "lora-attention": {"method": "lora", "lora": {"targets": ATTENTION}},  # models that name them otherwise: none
    "lora-qv": {"method": "lora", "lora": {"targets": ["q_proj", "v_proj"]}},  # peft's default for Llama-likes
    "lora-qkv": {"method": "lora", "lora": {"targets": ["q_proj", "k_proj", "v_proj"]}},
    "lora-fp32": {"method": "lora", "precision": "fp32"},
    "lora-mixed": {"method": "lora", "precision": "bf16-mixed"},
    "lora-eager": {"method": "lora", "attention": "eager"},
    "full": {"method": "full"},
    "qlora": {"method": "qlora"},  # tunecast's own QLoRA step is its LoRA step; a runner's may differ (kbit-fp32)
    "full-mixed": {"method": "full", "precision": "bf16-mixed"},  # `bf16: true` on fp32 weights (TRL, the Trainer)
    # The settings of the other tools' own example configs, for the runners whose examples use them:
    "lora-qvo-mlp": {"method": "lora", "lora": {"targets": ["q_proj", "v_proj", "o_proj", *MLP]}},  # torchtune's
    "int8": {"method": "qlora", "quantization": {"bits": 8}},  # `load_in_8bit: true` (axolotl, TRL, LLaMA-Factory)
    "int8-dropout": {"method": "qlora", "quantization": {"bits": 8}, "lora": {"dropout": 0.05}},
    # `loss: chunked`, and the Liger fused cross-entropy of axolotl and LLaMA-Factory estimated with it: the template
    # holds the rest of the step, with a stand-in for the chunks (estimate/compose.py)
    "lora-chunked": {"method": "lora", "loss": "chunked"},
    "full-chunked": {"method": "full", "loss": "chunked"},
    "qlora-dropout": {"method": "qlora", "lora": {"dropout": 0.05}},  # where a runner's QLoRA step is not its LoRA's
    # TRL configs that load the weights in bf16 (`torch_dtype: bfloat16`, as the alignment-handbook's do)
    "full-bf16": {"method": "full", "precision": "bf16"},
    "lora-dropout-bf16": {"method": "lora", "precision": "bf16", "lora": {"dropout": 0.05}},
    "qlora-dropout-bf16": {"method": "qlora", "precision": "bf16", "lora": {"dropout": 0.05}},
    # torchtune's distributed full recipes step the optimizer after the backward pass
    "full-step-after": {"method": "full", "optimizer_in_backward": False},
    # LLaMA-Factory v1's own loop: torch's AdamW as constructed (multi-tensor), adapters with peft's dropout
    "v1-lora": {"method": "lora", "optimizer": "adamw-foreach", "lora": {"dropout": 0.05}},
    "v1-full": {"method": "full", "precision": "bf16-mixed", "optimizer": "adamw-foreach"},
}
# Labels built for some runners only: the other runners' configs do not name these settings in their examples.
_CHUNKED = ("tunecast", "axolotl", "llamafactory", "hf-trainer")  # the runners `loss: chunked` changes the step of
RUNNERS_OF = {"lora-qvo-mlp": ("torchtune",), "int8": ("axolotl", "llamafactory", "trl", "hf-trainer", "tunecast"),
              "int8-dropout": ("axolotl", "llamafactory", "trl", "hf-trainer"), "v1-lora": ("llamafactory",),
              "v1-full": ("llamafactory",), "lora-chunked": _CHUNKED, "full-chunked": _CHUNKED,
              "qlora-dropout": ("axolotl", "llamafactory", "hf-trainer", "trl"), "full-bf16": ("trl",),
              "lora-dropout-bf16": ("trl",), "qlora-dropout-bf16": ("trl",), "full-step-after": ("torchtune",)}
# Runners whose step variants a template can hold: their templates differ from tunecast's own only where the
# runner's variants apply (in fp32 the Trainer's none do: those keys are tunecast's). TRL's, torchtune's and
# unsloth's losses are composed onto the template of the rest of their step (estimate/compose.py): theirs hold a
# stand-in for the loss.
TEMPLATED_RUNNERS = ("tunecast", "hf-trainer", "axolotl", "llamafactory", "trl", "torchtune", "unsloth")


def _write(key: str, template: dict) -> None:
    data = json.dumps(template, separators=(",", ":")).encode()
    path = OUT / f"{key}{SUFFIX}"
    part = path.with_name(path.name + ".part")  # renamed into place: a build stopped mid-write leaves no damaged file
    part.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    part.replace(path)


def _published(catalog: Catalog) -> list[tuple[str, dict, RunSpec]]:
    """(model name, text config, spec) of every published example config `--from` plans, read offline as it reads
    them; the ones it refuses (another stage, a multimodal model, a model outside the catalog) give none."""
    found = []
    for tool in TOOLS:
        for path in sorted((PUBLISHED / tool).rglob("*.y*ml")):
            try:
                loaded = load_spec(None, [], catalog, hub=HubAccess(offline=True), imported=read_config(tool, path))
            except TunecastError:
                continue
            found.append((loaded.model.name, text_config_data(loaded.model.data), loaded.spec))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="catalog names (default: every catalog model a template serves)")
    parser.add_argument("--settings", nargs="*", choices=sorted(SETTINGS), help="labels of SETTINGS (default: all)")
    parser.add_argument("--runners", nargs="*", choices=TEMPLATED_RUNNERS,
                        help="the runners whose steps are templated (default: all of TEMPLATED_RUNNERS)")
    parser.add_argument("--published", action="store_true",
                        help="the published example configs' settings only (a build without --models, --settings or "
                             "--runners includes them)")
    parser.add_argument("--list", action="store_true", help="say what would be built, by model, and build nothing")
    args = parser.parse_args()
    catalog = load_catalog(None)
    names = [] if args.published else args.models or catalog.models.names
    OUT.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, tuple[str, dict, TraceSettings, bool, bool]] = {}
    if args.published or not (args.models or args.settings or args.runners):
        for name, data, spec in _published(catalog):
            for checkpointing in (False, True):
                settings = TraceSettings.from_spec(spec, grad_checkpointing=checkpointing)
                if not templates.applies(data, settings):
                    continue
                for multi, above in templates.template_shapes(data):
                    wanted.setdefault(templates.template_key(data, settings, multi, above),
                                      (name, data, settings, multi, above))
    for name in names:
        model = catalog.models.find(name)
        if model is None:
            print(f"{name}: not in the catalog", file=sys.stderr)
            return 2
        data = text_config_data(model.data)
        for label, runner in itertools.product(args.settings or SETTINGS, args.runners or TEMPLATED_RUNNERS):
            if runner not in RUNNERS_OF.get(label, TEMPLATED_RUNNERS):
                continue
            for checkpointing in (False, True):
                # as a config names it: the runner's defaults where the settings leave a key unset (load.py)
                spec = apply_runner(RunSpec.model_validate({"model": name, "runner": runner, **SETTINGS[label]}))
                settings = TraceSettings.from_spec(spec, grad_checkpointing=checkpointing)
                if not templates.applies(data, settings):
                    continue
                for multi, above in templates.template_shapes(data):
                    key = templates.template_key(data, settings, multi, above)
                    wanted.setdefault(key, (name, data, settings, multi, above))
    for old in OUT.glob("*.json.gz"):  # the earlier format: recompressed (xz holds a template in about half)
        _write(old.name.removesuffix(".json.gz"), json.loads(gzip.decompress(old.read_bytes())))
        old.unlink()
    kept = {path.name.removesuffix(SUFFIX) for path in OUT.glob(f"*{SUFFIX}")}
    if args.list:
        missing = Counter(name for key, (name, *_) in wanted.items() if key not in kept)
        for name, count in missing.items():
            print(f"{name}: {count} to build", file=sys.stderr)
        print(f"{sum(missing.values())} of {len(wanted)} templates to build", file=sys.stderr)
        return 0
    for key, (name, data, settings, multi, above) in wanted.items():
        if key in kept:
            continue
        started = time.perf_counter()
        what = (f"{name} {settings.method} runner_step={','.join(settings.runner_step) or '-'} "
                f"dropout={settings.adapters.dropout} targets={settings.adapters.targets} "
                f"precision={settings.precision} attention={settings.attention} "
                f"checkpointing={settings.grad_checkpointing} multi={multi} above_window={above}")
        try:
            built = templates.build_template(data, settings, multi, above)
        except Exception as error:  # a setting this model cannot train with (peft refuses, a kernel asks for bf16)
            print(f"{what}: not built, the step does not run: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        if built is None:
            print(f"{what}: no template (a size had no reading, or the check trace differed)", file=sys.stderr)
            continue
        _write(key, built)
        print(f"{what}: {key} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    # Stale: what a build of every model in every setting no longer wants (a partial build removes none).
    stale = kept - set(wanted) if not (args.models or args.settings or args.runners or args.published) else set()
    for key in stale:
        (OUT / f"{key}{SUFFIX}").unlink()
    models = len({name for name, *_ in wanted.values()})
    print(f"{len(wanted)} templates for {models} models; {len(stale)} stale removed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
