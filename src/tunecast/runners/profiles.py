"""How each runner (config/runner.py) differs from tunecast's step, as the table in docs/runners.md. What a runner is,
its defaults and its step variants, is config/runner.py's; what each variant does, and the notes an estimate gives,
step/variants.py's."""

from __future__ import annotations

from typing import Any

from tunecast.config.runner import BITSANDBYTES, BITSANDBYTES_INT8, RUNNERS, TRANSFORMERS, Runner
from tunecast.step.variants import MIXED, MIXED_ONLY, STEP_VARIANTS


def differences_table() -> str:
    """Every runner's differences from tunecast's step, with sources, as Markdown (docs/runners.md holds it; a test
    keeps the two equal): today's, then each older version range `runner_version` selects, then transformers' loss
    (`transformers_version`, every runner that takes the loss from the full logits), bitsandbytes'
    (`bitsandbytes_version`, every runner's QLoRA), and its 8-bit layers (`quantization.bits: 8`)."""
    lines = ["| runner | modelled version | step, as traced | defaults for unset keys | not modelled |",
             "|---|---|---|---|---|"]
    for runner in RUNNERS.values():
        if runner.name == "tunecast":
            continue
        lines.append(_row(runner, f"`{runner.name}` ({runner.label})",
                          f"{runner.version} (`runner_version` unset, or {runner.versions.text()})"))
        for era in runner.history:
            older = runner.at(era.versions.since or era.versions.until or ())
            assert older is not None
            lines.append(_row(older, f"`{runner.name}`, older", f"{era.label} (`runner_version` "
                                                                   f"{era.versions.text()})"))
    for era in TRANSFORMERS.history:
        older = TRANSFORMERS.at(era.versions.since or ())
        assert older is not None
        lines.append(_row(older, "any runner's loss from the full logits (not `tunecast`)",
                          f"{era.label} (`transformers_version` {era.versions.text()}; unset: {TRANSFORMERS.version})"))
    for era in BITSANDBYTES.history:
        older = BITSANDBYTES.at(era.versions.since or ())
        assert older is not None
        lines.append(_row(older, "any runner's QLoRA", f"{era.label} (`bitsandbytes_version` {era.versions.text()}; "
                                                      f"unset: {BITSANDBYTES.version})"))
    lines.append(_row(BITSANDBYTES_INT8, "any runner's QLoRA on an 8-bit base (`quantization.bits: 8`)",
                      f"{BITSANDBYTES_INT8.version} (`bitsandbytes_version` unset, or "
                      f"{BITSANDBYTES_INT8.versions.text()})"))
    return "\n".join(lines)


def _row(runner: Runner, name: str, version: str) -> str:
    steps = [f"`{v}` (always): {STEP_VARIANTS[v]}" for v in runner.step]
    steps += [f"`{v}` ({', '.join(MIXED)}): {STEP_VARIANTS[v]}" for v in runner.mixed_step]
    steps += [f"`{v}` (QLoRA{', ' + ', '.join(MIXED) if v in MIXED_ONLY else ''}): {STEP_VARIANTS[v]}"
              for v in runner.qlora_step]
    defaults = []
    for default in runner.defaults:
        limits = [] if default.methods == ("full", "lora", "qlora") else list(default.methods)
        limits += ["one GPU"] if default.single_gpu else []
        where = f" ({', '.join(limits)})" if limits else ""
        defaults.append(f"`{default.key}: {_text(default.value)}`{where} — {default.source}")
    cells = [name, version, "<br>".join(steps + [f"source: {text}" for text in runner.sources]) or "—",
             "<br>".join(defaults) or "—", "<br>".join(runner.unmodelled) or "—"]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
