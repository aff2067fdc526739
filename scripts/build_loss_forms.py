"""Build the forms of the losses a composition traces alone (src/tunecast/estimate/data/loss-forms.json.xz), so that
a cold estimate of a runner whose loss is composed (TRL's fused head and chunks, unsloth's and torchtune's chunks,
`loss: chunked`) traces nothing, and a limit's checks (`--gpu`) are evaluations, not traces.

What a loss is traced with comes from the marks of the shipped step templates (the stand-in's inputs and head, per
pass: estimate/compose.py); each mark is read for every loss whose stand-in it names, in each of its layouts
(estimate/forms.py `layouts`), with no soft cap and with each soft cap of the catalog's models. Forms are read at
the installed torch's release and serve only it: rebuild them when torch or step/loss.py change.

Run:  .venv/bin/python scripts/build_loss_forms.py   (about a minute)
"""

from __future__ import annotations

import json
import lzma
import sys
import time
from pathlib import Path
from typing import Any

from tunecast.catalog.models import with_class_defaults
from tunecast.catalog.store import load_catalog
from tunecast.estimate import forms
from tunecast.estimate.profiles import release
from tunecast.estimate.tracer import SEGMENT_MARK
from tunecast.step.shape import text_config_data
from tunecast.step.variants import STUBS

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "src" / "tunecast" / "estimate" / "data" / "templates"
OUT = REPO / "src" / "tunecast" / "estimate" / "data" / forms.SHIPPED


def _marks() -> set[tuple[str, tuple[Any, ...], str]]:
    """Each pass pair of the shipped templates' marks: (stub, the forward mark's fields of forms.TRACED, the backward
    mark's category)."""
    found: set[tuple[str, tuple[Any, ...], str]] = set()
    for path in sorted(TEMPLATES.glob("*.json.xz")):
        text = lzma.decompress(path.read_bytes()).decode()
        if SEGMENT_MARK not in text:
            continue
        for profile in json.loads(text)["profiles"]:
            marks = [json.loads(name.removeprefix(SEGMENT_MARK)) for name in profile["events"]["names"]
                     if name.startswith(SEGMENT_MARK)]
            forward = None
            for mark in marks:
                if mark["part"] == "forward":
                    forward = mark
                elif mark["part"] == "backward" and forward is not None:
                    found.add((forward["stub"], tuple(forward[name] for name in forms.TRACED), mark["category"]))
                    forward = None
    return found


def main() -> int:
    catalog = load_catalog(None)
    softcaps = {None} | {cap for name in catalog.models.names if (model := catalog.models.find(name)) is not None
                         and (cap := with_class_defaults(text_config_data(model.data)).get("final_logit_softcapping"))}
    families: set[forms.Family] = set()
    for stub, fields, backward in _marks():
        for variant in (v for v, s in STUBS.items() if s == stub):
            # the losses over the hidden states cap their logits where the model does (compose.py)
            for softcap in softcaps if variant in forms.HIDDEN_INPUTS else {None}:
                families.add(forms.Family.of(variant, dict(zip(forms.TRACED, fields, strict=True)), backward,
                                             softcap))
    built: dict[str, dict[str, object]] = {}
    missing = 0
    started = time.perf_counter()
    for family in sorted(families, key=forms.Family.key):
        for shape in forms.layouts(family.variant):
            form = forms.read(family, shape)
            if form is None:
                print(f"{family.key()} {forms.layout_key(shape)}: no form (the traces did not read as one)",
                      file=sys.stderr)
                missing += 1
                continue
            built.setdefault(family.key(), {})[forms.layout_key(shape)] = form.to_json()
    # each loss's forms as text of their own: a process reads only the losses it composes
    document = {"torch": release("torch"), "format": forms.FORMAT,
                "forms": {key: json.dumps(layouts, sort_keys=True) for key, layouts in built.items()}}
    OUT.write_bytes(lzma.compress(json.dumps(document, sort_keys=True).encode(), preset=9))
    count = sum(len(layouts) for layouts in built.values())
    print(f"{count} forms of {len(built)} losses ({missing} layouts without one) in "
          f"{time.perf_counter() - started:.0f} s: {OUT.relative_to(REPO)}, {OUT.stat().st_size / 1e6:.2f} MB",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
