"""Public memory figures of diffusion training runs against tunecast's estimate of the same settings.

The figures are the ones `docs/research/diffusion/measurements.md` gathered, each with its tool, settings, source and
how it was read, restricted to runs the estimate models: LoRA or full fine-tuning of a catalog pipeline, with no
quantized or fp8 base and no offload. Three kinds of figure are compared differently:
- a measured peak is compared with the estimate's device total (`measured`);
- an out-of-memory report gives a lower bound on what the step allocates (`oom`);
- a "fits on X GB" claim gives an upper bound (`claim`).
A figure the source gives in "GB" is taken as GiB where the source's script computes bytes / 1024³, and as
10⁹ bytes otherwise, as each row says.

Run:  .venv/bin/python benchmarks/diffusion_public_check.py   (about 6 min here; each estimate traces)
Writes the table between the diffusion-public markers of docs/validation/memory.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "validation" / "memory.md"
MARK = "diffusion-public"
GB = 1e9 / 2**30  # GiB per decimal GB
# "Works with 24 GB (16 GB) GPUs" names a class of card, whose memory is 24 (16) GiB: the claim is read as the usable
# memory of the class's common card, as the catalog has it (gpus.csv: rtx-4090, rtx-4080).
CARD_24 = 23.99
CARD_16 = 15.67

SD15 = "runwayml/stable-diffusion-v1-5"
SDXL = "stabilityai/stable-diffusion-xl-base-1.0"
SD3 = "stabilityai/stable-diffusion-3-medium-diffusers"
FLUX = "black-forest-labs/FLUX.1-dev"
ATTENTION = ["to_k", "to_q", "to_v", "to_out.0"]
SHIVAM = ("ShivamShrirao/diffusers@b2983e7f:examples/dreambooth/README.md (table; Tesla T4, SD v1.4 = SD 1.5's "
          "architecture, xformers)")

# id, pipeline, RunSpec settings, kind, figure in GiB, what the figure is, tool, source
ROWS: list[tuple[str, str, dict, str, float, str, str, str]] = [
    ("SD15-2", SD15, {"method": "full", "precision": "fp16-mixed", "micro_batch": 1, "grad_checkpointing": True,
                      "diffusion": {"resolution": 512}},
     "measured", 15.79 * GB, "15.79 GB VRAM (a monitor's reading)", "DreamBooth, fp32 AdamW", SHIVAM),
    ("SD15-1", SD15, {"method": "full", "precision": "fp16-mixed", "optimizer": "adamw-8bit", "micro_batch": 1,
                      "grad_checkpointing": True, "diffusion": {"resolution": 512}},
     "measured", 9.92 * GB, "9.92 GB VRAM", "DreamBooth, 8-bit AdamW", SHIVAM),
    ("SD15-3", SD15, {"method": "full", "precision": "fp16-mixed", "optimizer": "adamw-8bit", "micro_batch": 2,
                      "grad_checkpointing": True, "diffusion": {"resolution": 512}},
     "measured", 10.4 * GB, "10.4 GB VRAM", "DreamBooth, 8-bit AdamW, batch 2", SHIVAM),
    ("SD15-4", SD15, {"method": "full", "precision": "fp16-mixed", "optimizer": "adamw-8bit", "micro_batch": 1,
                      "diffusion": {"resolution": 512}},
     "measured", 11.17 * GB, "11.17 GB VRAM", "DreamBooth, 8-bit AdamW, no checkpointing", SHIVAM),
    ("SD15-5", SD15, {"method": "lora", "lora": {"rank": 4, "targets": ATTENTION}, "precision": "fp16-mixed",
                      "micro_batch": 1, "diffusion": {"resolution": 512}},
     "claim", 11 * GB, "runs on an 11 GB RTX 2080 Ti", "diffusers train_text_to_image_lora.py (v0.12)",
     "huggingface/blog@1a18bdd2:lora.md"),
    ("SDXL-1", SDXL, {"method": "lora", "lora": {"rank": 4, "targets": ATTENTION}, "precision": "fp16-mixed",
                      "optimizer": "adamw-8bit", "micro_batch": 1, "grad_checkpointing": True,
                      "diffusion": {"resolution": 1024, "cache_text": True}},
     "claim", 16 * GB, "under 16 GB", "diffusers train_dreambooth_lora_sdxl.py (with the fp16-fix VAE)",
     "huggingface/diffusers@58eb52c0:examples/dreambooth/README_sdxl.md#L107-L115"),
    ("SD3-3", SD3, {"method": "full", "precision": "fp16-mixed", "optimizer": "adamw-8bit", "micro_batch": 1,
                    "diffusion": {"resolution": 256, "cache_text": False}},
     "oom", 38.05, "out of memory on a 40 GB A100, 38.05 GiB allocated", "diffusers train_dreambooth_sd3.py",
     "github.com/huggingface/diffusers/issues/10120"),
    ("FLUX-2", FLUX, {"method": "lora", "lora": {"rank": 4, "targets": ATTENTION}, "precision": "bf16-mixed",
                      "optimizer": "adamw-8bit", "micro_batch": 1, "grad_checkpointing": True,
                      "diffusion": {"resolution": "512x768", "cache_latents": True, "cache_text": True}},
     "measured", 26 * GB, "26 GB peak VRAM (how read not stated)", "diffusers train_dreambooth_lora_flux_miniature.py",
     "huggingface/blog@2ece681f:flux-qlora.md"),
    ("FLUX-8", FLUX, {"method": "lora", "lora": {"rank": 4, "alpha": 1}, "precision": "bf16-mixed",
                      "optimizer": "adamw-8bit", "micro_batch": 2, "grad_checkpointing": True,
                      "diffusion": {"resolution": 1024, "cache_latents": True, "cache_text": True, "base_8bit": True,
                                    "lora_layers": "blocks"}},
     "claim", CARD_24, "works with 24 GB GPUs (an RTX 4090's usable memory)",
     "kohya sd-scripts flux_train_network.py, --fp8_base, batch 2",
     "kohya-ss/sd-scripts@8b36d907:README.md#L68-L79"),
    ("FLUX-9", FLUX, {"method": "lora", "lora": {"rank": 4, "alpha": 1}, "precision": "bf16-mixed",
                      "optimizer": "adamw-8bit", "micro_batch": 1, "grad_checkpointing": True,
                      "diffusion": {"resolution": 1024, "cache_latents": True, "cache_text": True, "base_8bit": True,
                                    "lora_layers": "blocks"}},
     "claim", CARD_16, "works with 16 GB GPUs at batch 1 (an RTX 4080's usable memory)",
     "kohya sd-scripts flux_train_network.py, --fp8_base",
     "kohya-ss/sd-scripts@8b36d907:README.md#L98-L114"),
    ("FLUX-11", FLUX, {"method": "lora", "lora": {"rank": 16, "alpha": 16}, "precision": "bf16",
                       "optimizer": "adamw-8bit", "micro_batch": 1, "grad_checkpointing": True,
                       "diffusion": {"resolution": 1024, "cache_latents": True, "cache_text": False,
                                     "base_8bit": True, "lora_layers": "blocks"}},
     "claim", CARD_24, "needs a 24 GB GPU (an RTX 4090's usable memory; largest bucket 1024 px)",
     "ai-toolkit train_lora_flux_24gb.yaml, "
     "quantize: true", "ostris/ai-toolkit@27a03a91:config/examples/train_lora_flux_24gb.yaml"),
    ("FLUX-13", FLUX, {"method": "lora", "lora": {"rank": 4}, "precision": "bf16-mixed", "micro_batch": 2,
                       "diffusion": {"resolution": 512, "cache_text": False}},
     "oom", 78.20, "out of memory on an 80 GB GPU, 78.20 GiB allocated (validation on)",
     "diffusers train_dreambooth_lora_flux.py, Prodigy", "github.com/huggingface/diffusers/issues/10994"),
]
COLUMNS = ("id", "pipeline", "settings", "tool", "public figure", "kind", "predicted device GiB",
           "predicted allocated GiB", "agrees", "source")


def estimate(model: str, settings: dict) -> dict:
    from tunecast.catalog.diffusion import load_pipeline
    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.diffusion import answer_diffusion_memory

    spec = RunSpec.model_validate({"model": model, **settings})
    answer = answer_diffusion_memory(spec, load_pipeline(model), None, load_catalog(None).overheads, device="cuda")
    return answer.estimate.as_dict()


def verdict(kind: str, figure: float, predicted: dict) -> str:
    if kind == "measured":
        return f"{(predicted['device_total_gib'] - figure) / figure:+.1%}"
    if kind == "oom":
        return "yes (above the bound)" if predicted["peak_allocated_gib"] > figure else \
            "no (the estimate fits under the bound)"
    return "yes (fits)" if predicted["device_total_gib"] <= figure else "no (over the claim)"


def main() -> int:
    lines = [
        f"Measured with `.venv/bin/python benchmarks/diffusion_public_check.py` on {time.strftime('%Y-%m-%d')} "
        f"(estimates on a GPU, CUDA context included; torch {__import__('torch').__version__}, diffusers "
        f"{__import__('diffusers').__version__}). Figures in GiB.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|---:|---|---:|---:|---|---|",
    ]
    for row_id, model, settings, kind, figure, what, tool, source in ROWS:
        predicted = estimate(model, settings)
        agrees = verdict(kind, figure, predicted)
        shown = ", ".join(f"{k}={v}" for k, v in settings.items()).replace("|", "/")
        lines.append(f"| {row_id} | {model} | {shown} | {tool} | {figure:.2f} ({what}) | {kind} | "
                     f"{predicted['device_total_gib']:.2f} | {predicted['peak_allocated_gib']:.2f} | {agrees} | "
                     f"{source} |")
        print(f"{row_id}: {kind} {figure:.2f} GiB, predicted {predicted['device_total_gib']:.2f} GiB "
              f"({predicted['peak_allocated_gib']:.2f} allocated): {agrees}", flush=True)
    write_section(DOC, MARK, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
