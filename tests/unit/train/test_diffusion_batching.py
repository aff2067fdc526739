"""A diffusion run's batch shape from its traced memory (train/batching.py choose_diffusion_batch), on the tiny UNet
pipeline and a device made small enough that the step's images do not all fit at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunecast.catalog.diffusion import load_pipeline
from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.estimate.diffusion import diffusion_settings, diffusion_shape, estimate_diffusion_memory
from tunecast.train.batching import Device, choose_diffusion_batch

pytest.importorskip("diffusers")

from tests.unit.estimate.test_diffusion import tiny_pipeline


def test_auto_takes_the_largest_divisor_that_fits_and_a_fixed_one_that_does_not_is_refused(tmp_path: Path) -> None:
    folder = str(tiny_pipeline(tmp_path))
    pipeline = load_pipeline(folder)
    catalog = load_catalog(None)
    gpu = catalog.gpus.get("rtx-4090")
    spec = RunSpec.model_validate({"model": folder, "method": "full", "micro_batch": "auto", "global_batch": 16,
                                   "diffusion": {"resolution": 256}})

    def total(batch: int) -> float:
        changed = spec.with_changes({"micro_batch": batch})
        return estimate_diffusion_memory(pipeline, diffusion_settings(changed), diffusion_shape(changed, pipeline),
                                         device="cuda", gpu=gpu, overheads=catalog.overheads).device_total_gib

    free = (total(4) + total(8)) / 2 / (1 - spec.plan.memory_margin)  # 4 fits, 8 does not
    device = Device("cuda", "a small GPU", free, gpu)
    choice = choose_diffusion_batch(spec, pipeline, device, catalog)
    assert (choice.micro_batch, choice.grad_accum, choice.grad_checkpointing) == (4, 4, False)
    assert any("largest divisor of 16" in reason for reason in choice.reasons)
    fixed = spec.with_changes({"micro_batch": 8})
    with pytest.raises(TunecastError, match="does not fit a small GPU") as error:
        choose_diffusion_batch(fixed, pipeline, device, catalog)
    assert error.value.field == "micro_batch" and "micro_batch: auto" in (error.value.hint or "")
