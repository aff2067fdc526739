"""How each runner (config/runner.py) differs from tunecast's step, in words: an estimate's notes, and the table in
docs/runners.md. What a runner is, its defaults and its step variants, is config/runner.py's; what each variant does,
step/variants.py's."""

from __future__ import annotations

from typing import Any

from tunecast.config.runner import RUNNERS
from tunecast.config.spec import RunSpec
from tunecast.step.variants import STEP_VARIANTS, runner_step


def runner_notes(spec: RunSpec, device: str = "cuda") -> list[str]:
    """What `spec`'s runner changes in its step on `device`, and what it does that is not traced, for an estimate's
    notes."""
    runner = RUNNERS[spec.runner]
    lines = [f"runner {runner.label} ({runner.version}): {STEP_VARIANTS[v]}" for v in runner_step(spec, device)]
    return lines + [f"runner {runner.label}: not modelled: {text}" for text in runner.unmodelled]


def differences_table() -> str:
    """Every runner's differences from tunecast's step, with sources, as Markdown (docs/runners.md holds it; a test
    keeps the two equal)."""
    lines = ["| runner | modelled version | step, as traced | defaults for unset keys | not modelled |",
             "|---|---|---|---|---|"]
    for runner in RUNNERS.values():
        if runner.name == "tunecast":
            continue
        steps = [f"`{v}` (always): {STEP_VARIANTS[v]}" for v in runner.step]
        steps += [f"`{v}` (bf16, bf16-mixed, fp16-mixed): {STEP_VARIANTS[v]}" for v in runner.mixed_step]
        steps += [f"`{v}` (QLoRA): {STEP_VARIANTS[v]}" for v in runner.qlora_step]
        defaults = []
        for default in runner.defaults:
            limits = [] if default.methods == ("full", "lora", "qlora") else list(default.methods)
            limits += ["one GPU"] if default.single_gpu else []
            where = f" ({', '.join(limits)})" if limits else ""
            defaults.append(f"`{default.key}: {_text(default.value)}`{where} — {default.source}")
        cells = [f"`{runner.name}` ({runner.label})", runner.version,
                 "<br>".join(steps + [f"source: {text}" for text in runner.sources]) or "—",
                 "<br>".join(defaults) or "—", "<br>".join(runner.unmodelled) or "—"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
