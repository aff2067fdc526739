"""`tunecast plan` of a diffusion pipeline (plan/diffusion.py): the images it trains on, the batch shape chosen on each
GPU, images per second from the traced step's work, and the whole run priced per offer, on the tiny UNet pipeline."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any

import pytest

from tunecast.catalog.diffusion import load_pipeline
from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.estimate.diffusion import DiffusionShape, diffusion_settings, estimate_diffusion_memory
from tunecast.plan.diffusion import image_workload, plan_diffusion

pytest.importorskip("diffusers")

from tests.unit.estimate.test_diffusion import tiny_pipeline


def test_the_images_are_those_the_run_reads_or_declared_and_repeated_each_epoch(tmp_path: Path) -> None:
    """A folder counts the images the trainer reads (data/images.py): with captions beside them, the top level only;
    with a metadata.jsonl, the images it names, sub-folders included."""
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.png", "b.JPG", "sub/c.webp"):
        (folder / name).write_bytes(b"\0" * 10)
        (folder / name).with_suffix(".txt").write_text("a caption")

    def workload(path: Path) -> Any:
        return image_workload(RunSpec.model_validate({"model": "m", "dataset": {"path": str(path)}, "epochs": 2,
                                                      "diffusion": {"repeats": 5}}))

    counted = workload(folder)
    assert (counted.images, counted.dataset_bytes, counted.steps(4)) == (2, 20, 3 * 2)  # ⌈10 / 4⌉ × 2
    (folder / "metadata.jsonl").write_text("".join(json.dumps({"file_name": name, "text": "a caption"}) + "\n"
                                                   for name in ("a.png", "b.JPG", "sub/c.webp")))
    assert workload(folder).images == 3
    (folder / "metadata.jsonl").unlink()
    (folder / "b.txt").unlink()
    with pytest.raises(TunecastError, match="no caption") as error:  # as the run would refuse it
        workload(folder)
    assert error.value.field == "dataset.path"
    declared = image_workload(RunSpec.model_validate({"model": "m", "diffusion": {"images": 100}}))
    assert (declared.images, declared.steps(8)) == (100, 13 * RunSpec.model_fields["epochs"].default)
    with pytest.raises(TunecastError, match="no images") as error:
        image_workload(RunSpec.model_validate({"model": "m"}))
    assert error.value.field == "dataset.path"


def test_each_gpu_gets_the_fastest_batch_shape_that_fits_and_the_run_priced_by_its_images(tmp_path: Path) -> None:
    """On a card the whole global batch fits, one micro-batch of it; on a card it does not, the largest divisor that
    fits (its double, the next divisor, does not), with the accumulation that keeps the global batch; the hours are
    the steps of the images at the images per second of the traced step; the options ranked by total cost."""
    folder = str(tiny_pipeline(tmp_path))
    pipeline = load_pipeline(folder)
    catalog = load_catalog(None)
    spec = RunSpec.model_validate({"model": folder, "method": "full", "grad_accum": 4, "epochs": 3,
                                   "diffusion": {"resolution": 256, "images": 1000, "repeats": 2}})
    assert not spec.fixed("micro_batch")
    large = plan_diffusion(spec, pipeline, catalog.gpus.get("a100-80gb"), catalog, optimize="cost", budget_usd=None,
                           deadline_hours=None, interruptions_per_hour=None, today=date(2026, 12, 5))
    first = large["options"][0]
    assert (large["global_batch"], large["steps"]) == (32, 3 * 63)  # ⌈2000 / 32⌉ × 3
    assert (first["micro_batch"], first["grad_accum"], first["grad_checkpointing"]) == (32, 1, False)
    assert first["images_per_second"] == pytest.approx(32 / first["step_s"], rel=1e-3)
    priced = [o["total_usd"] for o in large["options"] if o["total_usd"] is not None]
    assert priced == sorted(priced) and priced
    assert all(o["hours"] >= large["steps"] * first["step_s"] / 3600 for o in large["options"])

    capacity = 0.58  # the context and about 70 MiB: a few of the 256 px images
    small = catalog.gpus.get("a100-80gb").model_copy(update={"usable_memory_gib": capacity / 0.95, "memory_gib": 1})
    tight = plan_diffusion(spec, pipeline, small, catalog, optimize="cost", budget_usd=None, deadline_hours=None,
                           interruptions_per_hour=None, today=date(2026, 12, 5))["options"][0]
    assert tight["fits"] and tight["micro_batch"] < 32 and tight["micro_batch"] * tight["grad_accum"] == 32

    def total(batch: int, checkpointing: bool) -> float:
        changed = spec.with_changes({"grad_checkpointing": checkpointing})
        return estimate_diffusion_memory(pipeline, diffusion_settings(changed), DiffusionShape(batch, 256, 256),
                                         device="cuda", gpu=small, overheads=catalog.overheads).device_total_gib

    chosen = tight["micro_batch"]
    assert total(chosen, tight["grad_checkpointing"]) <= capacity + 1e-6
    if not tight["grad_checkpointing"]:
        assert total(2 * chosen, False) > capacity


def test_plan_of_a_pipeline_on_the_command_line_ranks_offers_and_refuses_a_run_without_images(cli, tmp_path) -> None:
    folder = str(tiny_pipeline(tmp_path))
    planned = cli("plan", "--model", folder, "--resolution", "64", "--gpu", "rtx-4090", "--set", "diffusion.images=40",
                  "--json")
    assert planned.code == 0, planned.stderr
    document = planned.json()
    assert document["dataset"]["images"] == 40 and document["options"][0]["provider"]
    automatic = cli("plan", "--model", folder, "--resolution", "64", "--gpu", "rtx-4090", "--set",
                    "diffusion.images=40", "--micro-batch", "auto", "--global-batch", "4", "--json")
    assert automatic.code == 0, automatic.stderr
    assert automatic.json()["options"][0]["micro_batch"] == 4  # the tiny step: the whole global batch fits at once
    shown = cli("plan", "--model", folder, "--resolution", "64", "--gpu", "rtx-4090", "--set", "diffusion.images=40")
    assert shown.code == 0 and "img/s" in shown.stdout
    missing = cli("plan", "--model", folder, "--gpu", "rtx-4090")
    assert missing.code == 2 and "dataset.path" in missing.stderr and "Traceback" not in missing.stderr


def test_with_aspect_buckets_the_plan_counts_the_micro_batches_each_bucket_makes(tmp_path: Path) -> None:
    """Wide, tall and square images, two of each, twice an epoch in micro-batches of 3: a micro-batch holds one
    bucket's images, so each bucket's 4 make 2 (6 an epoch) where one size would make 4."""
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for index, size in enumerate([(96, 32), (32, 96), (48, 48)] * 2):
        Image.new("RGB", size).save(folder / f"{index}.png")
        (folder / f"{index}.txt").write_text("a shape")
    pipeline = load_pipeline(str(tiny_pipeline(tmp_path)))

    def spec(buckets: bool) -> RunSpec:
        return RunSpec.model_validate({"model": "m", "dataset": {"path": str(folder)}, "epochs": 1,
                                       "diffusion": {"resolution": 32, "repeats": 2, "buckets": buckets}})

    bucketed, plain = image_workload(spec(True), pipeline), image_workload(spec(False), pipeline)
    assert len(set(bucketed.sizes)) == 3 and plain.sizes == ()
    assert (bucketed.steps(3, 3), plain.steps(3, 3)) == (6, 4)
    assert (bucketed.steps(6, 3), bucketed.steps(6, 6)) == (3, 3)  # 6 micro-batches of 3, or 3 of one bucket's 4
