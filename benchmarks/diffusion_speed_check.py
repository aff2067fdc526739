"""Public measurements of diffusion training speed against the images per second `tunecast plan` predicts for the
same settings on the same card.

The rows are those `docs/research/diffusion/throughput.md` found clean enough for a validation: one GPU, a step time
measured after warm-up, every setting stated (or set by a named config at a named commit). Each prediction is the
plan's own: the step traced with its work counted, on the card's roofline (plan/diffusion.py `step_time`). Where a
row's run differs from what the catalog holds (SD 3.5 Medium measured, SD 3 Medium in the catalog; SimpleTuner's
LoKr measured, LoRA predicted), the row says so.

Run:  .venv/bin/python benchmarks/diffusion_speed_check.py   (about 4 min here; each distinct step is traced once)
Writes the table between the diffusion-speed markers of docs/validation/throughput.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "validation" / "throughput.md"
MARK = "diffusion-speed"

SD15 = "runwayml/stable-diffusion-v1-5"
SDXL = "stabilityai/stable-diffusion-xl-base-1.0"
SD3 = "stabilityai/stable-diffusion-3-medium-diffusers"
FLUX = "black-forest-labs/FLUX.1-dev"
ATTENTION = ["to_k", "to_q", "to_v", "to_out.0"]
CACHED = {"cache_latents": True, "cache_text": True}
SWEEP = "bghira/SimpleTuner@bc8e6ab7:documentation/SEGMENTED_CHECKPOINTING.md (benchmark table)"
UNSLOTH = "unslothai/unsloth pull request (FLUX benchmark table; docs/research/diffusion/throughput.md T-FLUX-9)"


def _simpletuner(model: str, rank: int, targets: list[str] | None, side: int, batch: int, checkpointing: bool
                 ) -> dict:
    lora: dict = {"rank": rank, "alpha": rank} | ({"targets": targets} if targets else {})
    return {"model": model, "method": "lora", "lora": lora, "precision": "bf16", "micro_batch": batch,
            "grad_checkpointing": checkpointing, "diffusion": {"resolution": side, **CACHED}}


# id, RunSpec settings, GPU, measured images per second, tool and what differs, source
ROWS: list[tuple[str, dict, str, float, str, str]] = [
    ("T-SD15-1", _simpletuner(SD15, 16, ATTENTION, 512, 1, False), "h100-sxm", 5.52, "SimpleTuner (H100 SXM or PCIe: "
     "not said)", SWEEP),
    ("T-SD15-2", _simpletuner(SD15, 16, ATTENTION, 512, 1, False), "l40s", 5.68, "SimpleTuner", SWEEP),
    ("T-SD15-3", _simpletuner(SD15, 16, ATTENTION, 512, 1, True), "h100-sxm", 3.28, "SimpleTuner", SWEEP),
    ("T-SD15-4", _simpletuner(SD15, 16, ATTENTION, 512, 1, True), "l40s", 3.42, "SimpleTuner", SWEEP),
    ("T-SDXL-1", _simpletuner(SDXL, 8, ATTENTION, 1024, 1, False), "h100-sxm", 1.65, "SimpleTuner, LoKr (LoRA r8 "
     "predicted)", SWEEP),
    ("T-SDXL-2", _simpletuner(SDXL, 8, ATTENTION, 1024, 1, False), "l40s", 1.71, "SimpleTuner, LoKr", SWEEP),
    ("T-SDXL-3", _simpletuner(SDXL, 8, ATTENTION, 1024, 1, True), "h100-sxm", 0.93, "SimpleTuner, LoKr", SWEEP),
    ("T-SDXL-4", _simpletuner(SDXL, 8, ATTENTION, 1024, 1, True), "l40s", 0.97, "SimpleTuner, LoKr", SWEEP),
    ("T-SD3-1", _simpletuner(SD3, 128, None, 1024, 3, False), "h100-sxm", 5.67, "SimpleTuner, SD 3.5 Medium "
     "(SD 3 Medium predicted)", SWEEP),
    ("T-SD3-2", _simpletuner(SD3, 128, None, 1024, 3, False), "l40s", 2.52, "SimpleTuner, SD 3.5 Medium", SWEEP),
    ("T-SD3-3", _simpletuner(SD3, 128, None, 1024, 3, True), "h100-sxm", 4.16, "SimpleTuner, SD 3.5 Medium", SWEEP),
    ("T-SD3-4", _simpletuner(SD3, 128, None, 1024, 3, True), "l40s", 1.87, "SimpleTuner, SD 3.5 Medium", SWEEP),
    ("T-FLUX-9", {"model": FLUX, "method": "lora", "lora": {"rank": 16, "alpha": 16}, "precision": "bf16-mixed",
                  "optimizer": "adamw-8bit", "micro_batch": 1, "grad_checkpointing": True,
                  "diffusion": {"resolution": 512, **CACHED}}, "b200", 4.12, "unsloth, torch.compile on", UNSLOTH),
]
COLUMNS = ("id", "pipeline", "settings", "GPU", "tool", "measured img/s", "predicted img/s", "error", "source")


def predicted_images_per_second(settings: dict, gpu_slug: str) -> float:
    from tunecast.catalog.diffusion import load_pipeline
    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.diffusion import diffusion_settings, diffusion_shape, traced_step
    from tunecast.plan.diffusion import step_time

    catalog = load_catalog(None)
    spec = RunSpec.model_validate(settings)
    pipeline = load_pipeline(spec.model)
    shape = diffusion_shape(spec, pipeline)
    flops = traced_step(pipeline, diffusion_settings(spec), shape, count_flops=True).flops
    return shape.batch / step_time(flops, spec, catalog.gpus.get(gpu_slug), catalog, 1).total_s


def main() -> int:
    lines = [
        f"Measured with `.venv/bin/python benchmarks/diffusion_speed_check.py` on {time.strftime('%Y-%m-%d')} "
        f"(torch {__import__('torch').__version__}, diffusers {__import__('diffusers').__version__}). The error is "
        "(predicted − measured) / measured.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for row_id, settings, gpu, measured, tool, source in ROWS:
        predicted = predicted_images_per_second(settings, gpu)
        error = (predicted - measured) / measured
        shown = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "model").replace("|", "/")
        lines.append(f"| {row_id} | {settings['model']} | {shown} | {gpu} | {tool} | {measured:.2f} | "
                     f"{predicted:.2f} | {error:+.0%} | {source} |")
        print(f"{row_id} on {gpu}: measured {measured:.2f} img/s, predicted {predicted:.2f} ({error:+.0%})",
              flush=True)
    write_section(DOC, MARK, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
