"""Build the diffusion profiles tunecast ships (src/tunecast/estimate/data/diffusion-profiles/), so that a cold
`tunecast memory` or `tunecast plan` of a catalog pipeline in common settings traces nothing.

A profile serves one pipeline's step in one setting at any micro-batch of its regime (one, or more), any resolution
on the 64 px grid and any LoRA rank (estimate/diffusion_fit.py). This fits them for each catalog pipeline, in each
of SETTINGS (as `tunecast` and each diffusion runner set the step up, config/diffusion_runner.py), with gradient
checkpointing on and off (where diffusers can checkpoint the denoiser), the VAE resident or its latents cached, for a
batch of one and of more: the keys a cold estimate computes. A fit that does not hold (FLUX.1's: docs/diffusion.md)
is reported and not shipped; those runs are traced. Profiles are keyed by the torch, transformers, peft and diffusers
versions: rebuild them when those change.

Run:  .venv/bin/python scripts/build_diffusion_profiles.py [--pipelines NAME ...] [--settings LABEL ...]
      (a profile is five to seven traces: 20 s to a few minutes each, by pipeline)
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "src" / "tunecast" / "estimate" / "data" / "diffusion-profiles"
SUFFIX = ".json.xz"
# The settings profiles are shipped for, by label: run settings as the command line gives them. `tunecast`'s LoRA and
# full fine-tuning, and each runner's defaults (its LoRA; the rank is a variable of every profile).
SETTINGS: dict[str, dict[str, object]] = {
    "lora": {"method": "lora"},
    "full": {"method": "full"},
    "diffusers": {"method": "lora", "runner": "diffusers"},
    "kohya": {"method": "lora", "runner": "kohya"},
    "simpletuner": {"method": "lora", "runner": "simpletuner"},
    "ai-toolkit": {"method": "lora", "runner": "ai-toolkit"},
}
DEFAULT_SETTINGS = ("lora", "full")


def _spec(name: str, settings: dict[str, object], batch: int, checkpointing: bool, cache_latents: bool) -> object:
    from tunecast.catalog.store import load_catalog
    from tunecast.config.load import LoadedPipeline, Override, load_run

    values = {"model": name, **settings, "micro_batch": batch, "grad_checkpointing": checkpointing,
              "diffusion.cache_latents": cache_latents}
    loaded = load_run(None, [Override(key, value, "build") for key, value in values.items()], load_catalog(None))
    assert isinstance(loaded, LoadedPipeline)
    return loaded


def build(name: str, label: str, log: list[str]) -> None:
    from tunecast.catalog.diffusion import load_pipeline
    from tunecast.estimate.diffusion import (
        _text_encoder_bytes,
        diffusion_settings,
        diffusion_shape,
        trace_diffusion_step,
    )
    from tunecast.estimate.diffusion_fit import FitFailed, fit_regime, profile_key, regime
    from tunecast.step.diffusion import supports_checkpointing

    pipeline = load_pipeline(name)
    for cache_latents in (False, True):
        for checkpointing in ((False, True) if supports_checkpointing(pipeline) else (False,)):
            for batch in (1, 2):
                loaded = _spec(name, SETTINGS[label], batch, checkpointing, cache_latents)
                settings = diffusion_settings(loaded.spec)  # type: ignore[attr-defined]
                shape = diffusion_shape(loaded.spec, pipeline)  # type: ignore[attr-defined]
                key = profile_key(pipeline, settings, regime(batch).single, shape.frames, shape.cache_latents)
                where = (f"{name} {label} checkpointing={checkpointing} cache_latents={cache_latents} "
                         f"batch={'1' if batch == 1 else '2+'}")
                target = OUT / f"{key}{SUFFIX}"
                if target.is_file():
                    print(f"{where}: shipped already ({target.name})", flush=True)
                    continue

                def trace(b: int, side: int, rank: int | None, settings=settings, shape=shape) -> object:
                    ranked = settings if rank is None else replace(settings, lora_rank=rank, lora_alpha=rank)
                    return trace_diffusion_step(pipeline, ranked, replace(shape, batch=b, width=side, height=side),
                                                count_flops=True)

                started = time.perf_counter()
                try:
                    profile = fit_regime(pipeline, settings, batch, trace,
                                         lambda settings=settings: _text_encoder_bytes(pipeline, settings))
                except FitFailed as failure:
                    log.append(f"{where}: not shipped, the fit does not hold ({failure})")
                    print(log[-1], flush=True)
                    continue
                data = lzma.compress(json.dumps(profile.to_json(), separators=(",", ":")).encode(), preset=9)
                OUT.mkdir(parents=True, exist_ok=True)
                partial = target.with_suffix(".partial")
                partial.write_bytes(data)
                partial.replace(target)
                print(f"{where}: {target.name}, {len(data) / 1024:.0f} KiB, fitted in "
                      f"{time.perf_counter() - started:.0f} s", flush=True)


def main() -> int:
    from tunecast.catalog.diffusion import bundled_pipelines

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", nargs="*", help="catalog pipelines (default: all)")
    parser.add_argument("--settings", nargs="*", choices=sorted(SETTINGS), default=list(DEFAULT_SETTINGS))
    args = parser.parse_args()
    import os

    os.environ["TUNECAST_CACHE"] = tempfile.mkdtemp(prefix="tunecast-build-")  # fitted here, not read
    log: list[str] = []
    for name in args.pipelines or bundled_pipelines():
        for label in args.settings:
            build(name, label, log)
    for line in log:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
