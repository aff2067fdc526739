"""The diffusion profiles tunecast ships (scripts/build_diffusion_profiles.py, estimate/diffusion_fit.py): each one
reads back whole, a cold estimate of a catalog pipeline in shipped settings traces nothing, at any batch, resolution
on the grid and rank, and a shipped profile replays a shape and rank outside its fit as that shape's own trace does."""

from __future__ import annotations

import json
import lzma
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest

from tunecast.catalog.diffusion import load_pipeline
from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.estimate import diffusion, diffusion_fit
from tunecast.estimate.diffusion import (
    diffusion_limits,
    diffusion_settings,
    estimate_diffusion_memory,
    trace_diffusion_step,
)
from tunecast.estimate.diffusion_fit import SHIPPED, DiffusionProfile, canonical, latent_pixels, latent_side
from tunecast.estimate.profile import profile_from_trace, replay

pytest.importorskip("diffusers")

SD15 = "runwayml/stable-diffusion-v1-5"


def _shipped_files() -> list[Path]:
    return sorted(Path(str(resources.files("tunecast.estimate").joinpath(SHIPPED))).glob("*.json.xz"))


def test_every_shipped_profile_reads_back_with_its_events_and_work() -> None:
    files = _shipped_files()
    assert files, "no diffusion profile is shipped: run scripts/build_diffusion_profiles.py"
    for path in files:
        profile = DiffusionProfile.from_json(json.loads(lzma.decompress(path.read_bytes())))
        assert len(profile.columns.kinds) == len(profile.columns.sizes) > 1000, path.name
        assert len(profile.scaled) == len(profile.columns.polys), path.name
        assert {"matmul", "attention", "kernels"} <= set(profile.flops), path.name


@pytest.fixture
def no_tracing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty cache, nothing fitted in this process, and a trace an error."""
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(diffusion_fit, "_PROFILES", {})
    monkeypatch.setattr(diffusion, "_TRACES", {})

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced: no shipped profile served this run")

    monkeypatch.setattr(diffusion, "trace_diffusion_step", refuse)


@pytest.mark.parametrize("settings", [{"method": "lora", "lora": {"rank": 32}}, {"method": "full"},
                                      {"method": "lora", "grad_checkpointing": True,
                                       "diffusion": {"cache_latents": True}}])
def test_a_cold_estimate_in_shipped_settings_traces_nothing_limits_included(settings: dict, no_tracing: None) -> None:
    catalog = load_catalog(None)
    pipeline = load_pipeline(SD15)
    for batch, resolution in ((1, 512), (3, "768x512")):
        spec = RunSpec.model_validate({"model": SD15, "micro_batch": batch, **settings,
                                       "diffusion": {**settings.get("diffusion", {}), "resolution": resolution}})
        memory = estimate_diffusion_memory(pipeline, diffusion_settings(spec), diffusion.diffusion_shape(spec, pipeline),
                                           device="cuda", gpu=None, overheads=catalog.overheads)
        assert memory.peak_reserved_gib > 1
    limits = diffusion_limits(spec, pipeline, catalog.gpus.get("rtx-4090"), catalog.overheads)
    assert limits.max_micro_batch > 1 and limits.max_resolution >= 1024


@pytest.mark.parametrize("name, width, height", [(SD15, 576, 768), ("damo-vilab/text-to-video-ms-1.7b", 384, 320)])
def test_a_shipped_profile_replays_a_shape_and_rank_outside_its_fit_as_their_own_trace(name: str, width: int,
                                                                                       height: int) -> None:
    """A shipped LoRA profile (fitted at rank 4, 512 and 640 px, the VAE resident) at rank 16 and 3 images (or clips
    of 16 frames) of a shape outside the fit, against that step's trace: the same peak in every phase, the same
    reserve, the same trainable parameters. The video UNet's VAE encodes every frame at once, and its padded
    temporaries, fitted in each image's side as well as its area, set the peak."""
    pipeline = load_pipeline(name)
    spec = RunSpec.model_validate({"model": name, "method": "lora", "lora": {"rank": 16}})
    settings = diffusion_settings(spec)
    shape = replace(diffusion.diffusion_shape(spec, pipeline), batch=3, width=width, height=height)
    profile = diffusion_fit.cached_profile(pipeline, settings, shape.batch, shape.frames, shape.cache_latents)
    assert profile is not None
    step = profile.step(settings.lora_rank, latent_side(pipeline, shape.width, shape.height))
    own = trace_diffusion_step(pipeline, settings, shape)
    direct = replay(profile_from_trace(1, replace(own, events=canonical(own.events))), shape.batch, 1, cuda=True)
    fitted = replay(step, shape.batch, latent_pixels(pipeline, shape.width, shape.height), cuda=True)
    assert fitted.peak_reserved == direct.peak_reserved
    assert {k: v.allocated for k, v in fitted.phases.items()} == {k: v.allocated for k, v in direct.phases.items()}
    assert step.facts.trainable_numel == own.facts.trainable_numel
