"""Build the step templates tunecast ships (src/tunecast/estimate/data/templates/), so that a cold
`tunecast memory` or `tunecast plan` of a catalog model in common settings traces nothing.

A template serves every model of one structure at any rank, vocabulary, width, micro-batch and length
(docs/memory.md, "Speed"); this builds one per structure of the catalog's dense and mixture-of-experts models,
for LoRA (without and with adapter dropout, and on the attention projections alone) and full fine-tuning,
checkpointing on and off, micro-batch 1 and 2+, below and above a sliding window, in the default precision,
attention and optimizer. Templates are keyed by the torch, transformers and peft versions: rebuild them when
those change.

Run:  .venv/bin/python scripts/build_templates.py [--models NAME ...]     (about 15 s a template)
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import lzma
import sys
import time
from pathlib import Path

from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.estimate import templates
from tunecast.estimate.settings import TraceSettings
from tunecast.estimate.shape import sliding_window, text_config_data

OUT = Path(__file__).resolve().parent.parent / "src" / "tunecast" / "estimate" / "data" / "templates"
SUFFIX = ".json.xz"
# (method, LoRA dropout, LoRA targets): LoRA without and with dropout on every linear layer, LoRA on the
# attention projections (the other common choice; models that name them otherwise get none), full fine-tuning.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SETTINGS = (("lora", 0.0, "all-linear"), ("lora", 0.05, "all-linear"), ("lora", 0.0, ATTENTION),
            ("full", 0.0, "all-linear"))


def _write(key: str, template: dict) -> None:
    data = json.dumps(template, separators=(",", ":")).encode()
    (OUT / f"{key}{SUFFIX}").write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


def _sides(data: dict) -> tuple[bool, ...]:
    """Which sides of the sliding window get templates (above it: True): both where the model has one, since
    an estimate above the window also reads the shapes below it (memory.py, the reserve ladder)."""
    return (False, True) if sliding_window(data) is not None else (False,)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="catalog names (default: every catalog model a template serves)")
    args = parser.parse_args()
    catalog = load_catalog(None)
    names = args.models or catalog.models.names
    OUT.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, tuple[str, dict, TraceSettings, bool, bool]] = {}
    for name in names:
        model = catalog.models.find(name)
        if model is None:
            print(f"{name}: not in the catalog", file=sys.stderr)
            return 2
        data = text_config_data(model.data)
        for method, dropout, targets in SETTINGS:
            for checkpointing in (False, True):
                spec = RunSpec.model_validate({"model": name, "method": method,
                                               "lora": {"dropout": dropout, "targets": targets}})
                settings = TraceSettings.from_spec(spec, grad_checkpointing=checkpointing)
                if not templates.applies(data, settings):
                    continue
                for multi, above in itertools.product((False, True), _sides(data)):
                    key = templates.template_key(data, settings, multi, above)
                    wanted.setdefault(key, (name, data, settings, multi, above))
    for old in OUT.glob("*.json.gz"):  # the earlier format: recompressed (xz holds a template in about half)
        _write(old.name.removesuffix(".json.gz"), json.loads(gzip.decompress(old.read_bytes())))
        old.unlink()
    kept = {path.name.removesuffix(SUFFIX) for path in OUT.glob(f"*{SUFFIX}")}
    for key, (name, data, settings, multi, above) in wanted.items():
        if key in kept:
            continue
        started = time.perf_counter()
        what = (f"{name} {settings.method} dropout={settings.adapters.dropout} targets={settings.adapters.targets} "
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
    stale = kept - set(wanted)
    for key in stale:
        (OUT / f"{key}{SUFFIX}").unlink()
    print(f"{len(wanted)} templates for {len(names)} models; {len(stale)} stale removed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
