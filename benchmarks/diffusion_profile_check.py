"""A diffusion step's fitted profile (estimate/diffusion_fit.py) against its own traces at shapes outside the fit.

For each catalog pipeline (LoRA with checkpointing where diffusers can checkpoint it, latents and text cached: the
common low-memory run), the profiles for a batch of one and of more are fitted as `tunecast memory --gpu` fits them
(512 and 640 px at rank 4, checked at 1024 px and at a second rank), then replayed at larger shapes, square or not,
at rank 16, and compared with a direct trace of each: every phase's peak and the allocator's reserve must be the
same integers. The step's work (matmul and attention FLOPs) is compared too.

Run:  .venv/bin/python benchmarks/diffusion_profile_check.py   (about 25 min here)
Writes the table between the diffusion-profiles markers of docs/validation/memory.md.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "validation" / "memory.md"
MARK = "diffusion-profiles"
PIPELINES = ("runwayml/stable-diffusion-v1-5", "stabilityai/stable-diffusion-xl-base-1.0",
             "stabilityai/stable-diffusion-3-medium-diffusers", "black-forest-labs/FLUX.1-dev",
             "damo-vilab/text-to-video-ms-1.7b")
SHAPES = ((4, 1024, 1024), (1, 768, 768), (2, 768, 512))  # (batch, width, height), outside the fit
VIDEO_FRAMES = 8
FIT_RANK, CHECK_RANK = 4, 16  # fitted at one LoRA rank, replayed at another


def check(name: str) -> list[str]:
    from tunecast.catalog.diffusion import load_pipeline
    from tunecast.estimate.diffusion import DiffusionShape, trace_diffusion_step
    from tunecast.estimate.diffusion_fit import (
        cached_profile,
        canonical,
        fitted_profile,
        latent_pixels,
        latent_side,
        why_not_fitted,
    )
    from tunecast.estimate.profile import profile_from_trace, replay
    from tunecast.step.diffusion import DiffusionSettings, supports_checkpointing

    pipeline = load_pipeline(name)
    settings = DiffusionSettings(grad_checkpointing=supports_checkpointing(pipeline), lora_rank=FIT_RANK,
                                 lora_alpha=FIT_RANK)
    frames = VIDEO_FRAMES if pipeline.video else 1

    def trace(batch: int, width: int, height: int, rank: int) -> object:
        return trace_diffusion_step(pipeline, replace(settings, lora_rank=rank, lora_alpha=rank),
                                    DiffusionShape(batch, width, height, frames, cache_latents=True, cache_text=True),
                                    count_flops=True)

    shipped = all(cached_profile(pipeline, settings, batch, frames, True) is not None for batch in (1, 2))
    started = time.perf_counter()
    profiles = {batch: fitted_profile(pipeline, settings, batch, frames, True,
                                      lambda b, side, rank: trace(b, side, side, rank or FIT_RANK), lambda: 0)
                for batch in (1, 2)}
    fitted_s = time.perf_counter() - started
    rows = []
    for batch, width, height in SHAPES:
        profile = profiles[min(batch, 2)]
        own = trace(batch, width, height, CHECK_RANK)
        direct = replay(profile_from_trace(1, replace(own, events=canonical(own.events))), batch, 1, cuda=True)
        where = f"{batch} × {width}×{height}{f' × {frames} frames' if pipeline.video else ''}, rank {CHECK_RANK}"
        if profile is None:
            why = why_not_fitted(pipeline, settings, batch, frames, True)
            rows.append(f"| {name} | {where} | not fitted ({why}) | {direct.peak_reserved / 2**30:.3f} | — | "
                        "traced directly | — |")
            continue
        step = profile.step(CHECK_RANK, latent_side(pipeline, width, height))
        fitted = replay(step, batch, latent_pixels(pipeline, width, height), cuda=True)
        same = fitted.peak_reserved == direct.peak_reserved and all(
            fitted.phases[phase].allocated == direct.phases[phase].allocated for phase in direct.phases)
        apart = max(abs(fitted.phases[phase].allocated - direct.phases[phase].allocated) for phase in direct.phases)
        work = step.flops_at(batch, latent_pixels(pipeline, width, height))
        flops = (work["matmul"] + work["attention"]) / (own.flops["matmul"] + own.flops["attention"]) - 1
        fit = "shipped" if shipped else f"{fitted_s:.0f} s"
        rows.append(f"| {name} | {where} | {fit} | {direct.peak_reserved / 2**30:.3f} | "
                    f"{fitted.peak_reserved / 2**30:.3f} | "
                    f"{'the same integers' if same else f'DIFFERENT (peaks {apart:,} bytes apart)'} | "
                    f"{flops:+.4%} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    os.environ["TUNECAST_CACHE"] = tempfile.mkdtemp(prefix="tunecast-profile-check-")  # fitted here, not read
    lines = [
        f"Measured with `.venv/bin/python benchmarks/diffusion_profile_check.py` on {time.strftime('%Y-%m-%d')} "
        f"(torch {__import__('torch').__version__}, diffusers {__import__('diffusers').__version__}): LoRA, "
        "checkpointing, latents and text cached; reserved GiB on a GPU. \"Fit\" is the time of the two profiles' "
        "ten traces (two at a second rank), or \"shipped\" where tunecast ships them (read, then checked the same "
        "way). FLOPs: the profile's matmul and attention FLOPs against the trace's count.",
        "",
        "| pipeline | shape | fit | direct trace: reserved GiB | profile: reserved GiB | every phase's peak and the "
        "reserve | FLOPs |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for name in PIPELINES:
        lines += check(name)
    write_section(DOC, MARK, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
