"""A loss's form (estimate/forms.py) against traces of the loss: event by event, in every kind of layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunecast.estimate import forms
from tunecast.estimate.tracer import SegmentTrace, trace_segment
from tunecast.step.chunking import chunks_of


def _family(variant: str, **changed: object) -> forms.Family:
    fields: dict[str, object] = {"inputs_dtype": "torch.bfloat16", "weight_dtype": "torch.bfloat16", "trains": False,
                                 "bias": False, "bias_trains": False, "autocast": None, "category": "activations",
                                 "backward_category": "activation-grads", "softcap": None, **changed}
    return forms.Family(variant, **fields)  # type: ignore[arg-type]


def _traced(family: forms.Family, shape: tuple[int, ...], vocab: int, once: bool) -> SegmentTrace:
    return trace_segment(family.variant, inputs_shape=shape, inputs_dtype=family.inputs_dtype,
                         targets_shape=shape[:-1], hidden=shape[-1], vocab=vocab, weight_dtype=family.weight_dtype,
                         trains=family.trains, bias=family.bias, bias_trains=family.bias_trains,
                         autocast=family.autocast, category=family.category,
                         backward_category=family.backward_category, softcap=family.softcap, compiled=False,
                         once=once)


def _held(trace: SegmentTrace) -> tuple[object, ...]:
    return (trace.forward, trace.deferred, trace.backward, trace.result, trace.grads, trace.accumulated, trace.views,
            trace.externals)


MIXED = {"inputs_dtype": "torch.float32", "autocast": "torch.bfloat16"}


@pytest.mark.parametrize("family, shape, vocab, layout", [
    # unsloth's chunks of the hidden states: one chunk; two; three; many, run as three and a piece between
    (_family("fused-chunks"), (2, 1000, 64), 3000, (1, 0, ())),
    (_family("fused-chunks", trains=True), (2, 2001, 48), 400000, (2, 0, ())),
    (_family("fused-chunks", softcap=30.0), (3, 4001, 48), 900000, (4, 0, ())),
    (_family("fused-chunks"), (1, 9000, 64), 900000, (4, 0, ("b",))),
    (_family("fused-chunks", inputs_dtype="torch.float32", weight_dtype="torch.float32"), (4096, 1024, 32), 128256,
     (4, 0, ("m",))),  # more chunks than fit a length evenly: the last of one position
    # `loss: chunked`: 8 chunks along the length, the last shorter; or fewer where the length is short
    (_family("loss-chunks", trains=True, softcap=50.0), (2, 999, 64), 3000, (4, 0, ())),
    (_family("loss-chunks", **MIXED), (1, 23, 64), 3000, (4, 0, ("b",))),
    (_family("loss-chunks"), (2, 3, 64), 3000, None),  # chunks of one position: traced
    # TRL 1.10's 256-token chunks: one, two, several
    (_family("trl-chunks", **MIXED), (100, 64), 5000, (1, 0, ())),
    (_family("trl-chunks"), (257, 64), 5000, (2, 0, ("m",))),
    (_family("trl-chunks", trains=True), (1000, 64), 5000, (3, 0, ())),
    # torchtune's 8 chunks, every one run; fewer where the tokens are few
    (_family("output-chunks"), (1000, 64), 5000, (8, 0, ())),
    (_family("output-chunks", trains=True, category="temporaries"), (20, 64), 5000, (7, 0, ())),
    # TRL's fused head: tiles of 4,096 tokens × 32,768 entries
    (_family("fused-head", **MIXED), (100, 64), 30000, (1, 1, ())),
    (_family("fused-head"), (5000, 64), 100000, (2, 3, ())),
    (_family("fused-head", trains=True), (20000, 64), 70000, (3, 3, ())),
    (_family("fused-head"), (9000, 64), 40000, (3, 2, ())),
    (_family("fused-head", **MIXED), (8184, 64), 128256, (2, 3, ())),  # whole: every one of 4 tiles runs
    (_family("fused-head", trains=True), (4096, 64), 262208, (1, 3, ())),  # whole: 9 tiles (Gemma 3)
])
def test_a_loss_s_form_equals_its_trace(family: forms.Family, shape: tuple[int, ...], vocab: int,
                                        layout: forms.Layout | None) -> None:
    chunks = chunks_of(family.variant, shape, vocab)
    found = forms.layout(family.variant, shape, shape[-1], vocab, chunks, once=True)
    assert (found[0] if found else None) == layout
    for once in (True, False):
        evaluated = forms.segment(family, shape, shape[-1], vocab, once)
        whole = (len(chunks.rows) <= 3 and len(chunks.columns) <= 10) or family.variant == "output-chunks"
        if layout is None or not (once or whole):
            assert evaluated is None
            continue
        assert evaluated is not None and evaluated.sums is None
        assert _held(evaluated) == _held(_traced(family, shape, vocab, once))


@pytest.mark.parametrize("variant", ["fused-chunks", "loss-chunks", "trl-chunks", "output-chunks", "fused-head"])
def test_the_shipped_forms_are_those_a_read_gives_now(variant: str) -> None:
    """Rebuild them (scripts/build_loss_forms.py) when step/loss.py or torch changes."""
    shipped = forms._shipped_forms()
    assert shipped, "no forms are shipped for the installed torch: run scripts/build_loss_forms.py"
    families = [key for key in sorted(shipped) if json.loads(key)[0] == variant]
    assert families
    key = families[len(families) // 2]
    family = forms.Family(*json.loads(key))
    for layout in forms.layouts(variant):
        read = forms._read(family, layout)
        assert read is not None and read == forms.shipped(family, layout), forms.layout_key(layout)


@pytest.mark.parametrize("runner, model, method", [
    ("unsloth", "meta-llama/Llama-3.1-8B", "full"),
    ("torchtune", "Qwen/Qwen3-30B-A3B", "lora"),
    ("trl", "mistralai/Mistral-7B-v0.1", "qlora"),
])
def test_a_composed_estimate_and_its_limits_import_no_torch(runner: str, model: str, method: str,
                                                            tmp_path: Path) -> None:
    """The loss and every check of the limits come from shipped forms: no trace, so no torch."""
    code = (
        "import sys\n"
        "from tunecast.catalog.store import load_catalog\n"
        "from tunecast.config.runner import apply_runner\n"
        "from tunecast.config.spec import RunSpec\n"
        "from tunecast.estimate.fit import estimator_total, fit_report\n"
        "from tunecast.estimate.memory import estimate_memory\n"
        "catalog = load_catalog(None)\n"
        f"spec = apply_runner(RunSpec.model_validate({{'model': {model!r}, 'runner': {runner!r}, "
        f"'method': {method!r}}}))\n"
        f"data = catalog.models.find({model!r}).data\n"
        "gpu = catalog.gpus.get('a100-80gb')\n"
        "estimate = estimate_memory(spec, data, device='cuda', gpu=gpu, overheads=catalog.overheads)\n"
        "report = fit_report(spec, estimate, gpu, estimator_total(data, gpu, catalog.overheads), context_len=None)\n"
        "assert estimate.composed and report.max_micro_batch > 0\n"
        "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env={"TUNECAST_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
