"""`tunecast train` of a diffusion pipeline on the CPU (issue 34's acceptance): a run killed and resumed ends with
the same LoRA bytes and the same loss at every step as an uninterrupted run; SIGTERM saves a checkpoint and exits
75; the result loads with diffusers and makes an image from a prompt; bad data is refused in one line with exit 2.

Runs start in fresh processes forked from a warm server that has imported diffusers (tests/forkserver.py), so each
kill is a real signal to a real process without paying for the libraries' import every time.
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.trainruns import (
    IMAGES,
    REPO,
    ForkServer,
    lora_bytes,
    tiny_diffusion_run,
    tiny_flux_pipeline,
    tiny_sd3_pipeline,
    tiny_sdxl_pipeline,
    train_losses,
)

STEPS = 8


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    # one thread: the tiny UNet's steps are too small to share, and two threads on a busy two-core machine spin
    # against each other (a 0.1 s step took 6 s)
    forks = ForkServer.start(warm=("diffusers",), threads=1)
    yield forks
    forks.stop()


@pytest.fixture(scope="module")
def reference(server: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The uninterrupted run: its output, adapters and losses."""
    tmp = tmp_path_factory.mktemp("reference")
    code = server.run(["train", str(tiny_diffusion_run(tmp))], tmp / "log.txt")
    assert code == 0, (tmp / "log.txt").read_text()[-3000:]
    return {"output": tmp / "out", "lora": lora_bytes(tmp / "out"), "losses": train_losses(tmp / "out")}


def trained(output: Path, steps: int) -> Callable[[], bool]:
    def ready() -> bool:
        metrics = output / "metrics.jsonl"
        return metrics.exists() and metrics.read_text().count('"kind": "train"') >= steps

    return ready


def test_uninterrupted_run_trains_every_step(reference: dict) -> None:
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    output = reference["output"]
    assert (output / "final" / "README.md").is_file() and (output / "base" / "model_index.json").is_file()
    events = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "finished" for e in events)
    assert all("images_per_second" in e for e in events if e["kind"] == "train")


def test_the_run_report_draws_it(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    code = server.run(["report", str(reference["output"]), "--output", str(page)], tmp_path / "log.txt")
    assert code == 0, (tmp_path / "log.txt").read_text()[-3000:]
    text = page.read_text()
    assert "images per second" in text and "img/s" in text and "tokens per second" not in text


def test_merge_refuses_a_diffusion_lora_in_one_line(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    code = server.run(["merge", str(reference["output"]), "--output", str(tmp_path / "merged")], tmp_path / "log.txt")
    text = (tmp_path / "log.txt").read_text()
    assert code == 2 and "fuse_lora" in " ".join(text.split()) and "Traceback" not in text, text[-3000:]


def test_sigkill_then_resume_is_bit_exact(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    """Killed after its checkpoint of step 2 (and maybe 4), then the same command: the same LoRA bytes and losses."""
    config = tiny_diffusion_run(tmp_path)
    code, _ = server.signal_when(["train", str(config)], tmp_path / "log.txt", trained(tmp_path / "out", 3),
                                 signal_number=signal.SIGKILL)
    assert code == -signal.SIGKILL, (tmp_path / "log.txt").read_text()[-3000:]
    assert not (tmp_path / "out" / "final").exists()
    code = server.run(["train", str(config)], tmp_path / "log2.txt")
    assert code == 0, (tmp_path / "log2.txt").read_text()[-3000:]
    assert "resumed from checkpoint" in " ".join((tmp_path / "log2.txt").read_text().split())
    assert lora_bytes(tmp_path / "out") == reference["lora"]
    assert train_losses(tmp_path / "out") == reference["losses"]


def test_sigterm_saves_exits_75_and_resumes_bit_exact(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    config = tiny_diffusion_run(tmp_path, **{"checkpoint.every_steps": 100})  # only the preemption checkpoint
    output = tmp_path / "out"
    code, seconds = server.signal_when(["train", str(config)], tmp_path / "log.txt", trained(output, 3),
                                       signal_number=signal.SIGTERM)
    log = " ".join((tmp_path / "log.txt").read_text().split())
    assert code == 75, log[-3000:]
    assert seconds < 5
    saved = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert len(saved) == 1 and (output / "checkpoints" / saved[0] / "manifest.json").exists()
    events = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "preempted" and e.get("signal") == "SIGTERM" for e in events)
    assert "run the same command again" in log.lower()

    code = server.run(["train", str(config)], tmp_path / "log2.txt")
    assert code == 0, (tmp_path / "log2.txt").read_text()[-3000:]
    assert lora_bytes(output) == reference["lora"]
    assert train_losses(output) == reference["losses"]


def test_lora_result_loads_with_diffusers_and_makes_an_image(server: ForkServer, reference: dict,
                                                              tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    code = server.run_script(REPO / "tests" / "load_diffusion_result.py", [str(reference["output"]), "lora"], log)
    assert code == 0, log.read_text()[-3000:]
    result = json.loads(log.read_text().strip().splitlines()[-1])
    assert result == {"shape": [32, 32, 3], "finite": True, "changed": True}


def test_a_pipeline_folder_with_weights_trains_from_them(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    """The reference run's base/ is a pipeline folder as diffusers saves one: a run loads its weights (from_pretrained
    of each component), and a folder of configs alone is refused without random_weights."""
    config = tiny_diffusion_run(tmp_path, model=str(reference["output"] / "base"), random_weights=False, max_steps=2)
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert "model: loaded from" in " ".join((tmp_path / "log.txt").read_text().split())
    assert not (tmp_path / "out" / "base").exists()
    refused = tiny_diffusion_run(tmp_path, "configs.yaml", random_weights=False, output=str(tmp_path / "other"))
    assert server.run(["train", str(refused)], tmp_path / "log2.txt") == 2
    said = " ".join((tmp_path / "log2.txt").read_text().split())
    assert "holds the pipeline's configs but no weights" in said and "random_weights: true" in said


def test_full_fine_tune_loads_with_diffusers(server: ForkServer, tmp_path: Path) -> None:
    config = tiny_diffusion_run(tmp_path, method="full", max_steps=2, **{"diffusion.cache_latents": True,
                                                                          "diffusion.cache_text": True})
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert (tmp_path / "out" / "final" / "diffusion_pytorch_model.safetensors").is_file()
    log = tmp_path / "load.txt"
    code = server.run_script(REPO / "tests" / "load_diffusion_result.py", [str(tmp_path / "out"), "full"], log)
    assert code == 0, log.read_text()[-3000:]
    assert json.loads(log.read_text().strip().splitlines()[-1])["finite"]


def test_sdxl_lora_trains_and_loads_with_diffusers(server: ForkServer, tmp_path: Path) -> None:
    """SDXL's two text encoders, pooled embedding and size conditioning (the images are 64 × 48 and 48 × 48, cut to
    32 px): the LoRA result loads into StableDiffusionXLPipeline and makes an image."""
    config = tiny_diffusion_run(tmp_path, model=str(tiny_sdxl_pipeline(tmp_path / "sdxl")), max_steps=2)
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0, (tmp_path / "log.txt").read_text()[-3000:]
    log = tmp_path / "load.txt"
    code = server.run_script(REPO / "tests" / "load_diffusion_result.py", [str(tmp_path / "out"), "lora"], log)
    assert code == 0, log.read_text()[-3000:]
    assert json.loads(log.read_text().strip().splitlines()[-1]) == {"shape": [32, 32, 3], "finite": True,
                                                                     "changed": True}


@pytest.fixture(scope="module")
def flux_reference(server: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An uninterrupted LoRA run of the tiny FLUX.1-dev-shaped pipeline (flow matching, CLIP and T5, packed latents,
    the guidance embedding): 8 steps, the captions encoded once (cache_text, FLUX's default), the VAE every step."""
    tmp = tmp_path_factory.mktemp("flux")
    config = tiny_diffusion_run(tmp, model=str(tiny_flux_pipeline(tmp / "flux")))
    code = server.run(["train", str(config)], tmp / "log.txt")
    assert code == 0, (tmp / "log.txt").read_text()[-3000:]
    return {"tmp": tmp, "config": config, "output": tmp / "out", "lora": lora_bytes(tmp / "out"),
            "losses": train_losses(tmp / "out"), "log": (tmp / "log.txt").read_text()}


def _loads_into_its_pipeline(server: ForkServer, output: Path, tmp_path: Path) -> None:
    """The LoRA loads into the run's base with the pipeline class it names and makes an image that it changed; the
    trainer's text encoding equals the pipeline's encode_prompt, and every LoRA tensor is loaded."""
    log = tmp_path / "load.txt"
    code = server.run_script(REPO / "tests" / "load_diffusion_result.py", [str(output), "lora"], log)
    assert code == 0, log.read_text()[-3000:]
    assert json.loads(log.read_text().strip().splitlines()[-1]) == {"shape": [32, 32, 3], "finite": True,
                                                                     "changed": True}
    log = tmp_path / "check.txt"
    code = server.run_script(REPO / "tests" / "flow_pipeline_check.py", [str(output)], log)
    assert code == 0, log.read_text()[-3000:]
    checked = json.loads(log.read_text().strip().splitlines()[-1])
    assert checked["states_equal"] and checked["pooled_equal"], checked
    assert checked["lora_tensors"] == 2 * checked["lora_layers"] > 0, checked


def test_flux_lora_trains_and_loads_into_flux_pipeline(server: ForkServer, flux_reference: dict,
                                                        tmp_path: Path) -> None:
    assert sorted(flux_reference["losses"]) == list(range(1, STEPS + 1))
    assert "flow objective" in " ".join(flux_reference["log"].split())
    _loads_into_its_pipeline(server, flux_reference["output"], tmp_path)


def test_flux_sigkill_then_resume_is_bit_exact(server: ForkServer, flux_reference: dict, tmp_path: Path) -> None:
    """FLUX's draws (the noise, the uniform timestep's index into the scheduler, the latent samples) come from the
    step's generator too: killed after its checkpoint of step 2 and resumed, the same LoRA bytes and losses."""
    config = tiny_diffusion_run(tmp_path, model=str(flux_reference["tmp"] / "flux"))
    code, _ = server.signal_when(["train", str(config)], tmp_path / "log.txt", trained(tmp_path / "out", 3),
                                 signal_number=signal.SIGKILL)
    assert code == -signal.SIGKILL, (tmp_path / "log.txt").read_text()[-3000:]
    code = server.run(["train", str(config)], tmp_path / "log2.txt")
    assert code == 0, (tmp_path / "log2.txt").read_text()[-3000:]
    assert "resumed from checkpoint" in " ".join((tmp_path / "log2.txt").read_text().split())
    assert lora_bytes(tmp_path / "out") == flux_reference["lora"]
    assert train_losses(tmp_path / "out") == flux_reference["losses"]


def test_sd3_lora_trains_and_loads_into_sd3_pipeline(server: ForkServer, tmp_path: Path) -> None:
    """SD3's two CLIP encoders and T5 encoding every batch (cache_text off), the logit-normal timesteps: the LoRA
    loads into StableDiffusion3Pipeline and makes an image."""
    config = tiny_diffusion_run(tmp_path, model=str(tiny_sd3_pipeline(tmp_path / "sd3")), max_steps=2,
                                **{"diffusion.cache_text": False})
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert "cached: nothing" in " ".join((tmp_path / "log.txt").read_text().split())
    _loads_into_its_pipeline(server, tmp_path / "out", tmp_path)


def test_flux_full_fine_tune_loads_into_flux_pipeline(server: ForkServer, flux_reference: dict,
                                                      tmp_path: Path) -> None:
    """Full fine-tuning of the transformer, latents and text cached: FluxTransformer2DModel.from_pretrained loads
    final/ and FluxPipeline makes an image with it."""
    config = tiny_diffusion_run(tmp_path, model=str(flux_reference["tmp"] / "flux"), method="full", max_steps=2,
                                **{"diffusion.cache_latents": True})
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert (tmp_path / "out" / "final" / "diffusion_pytorch_model.safetensors").is_file()
    log = tmp_path / "load.txt"
    code = server.run_script(REPO / "tests" / "load_diffusion_result.py", [str(tmp_path / "out"), "full"], log)
    assert code == 0, log.read_text()[-3000:]
    assert json.loads(log.read_text().strip().splitlines()[-1])["finite"]


def _no_caption(folder: Path) -> str:
    (folder / "red-circle.txt").unlink()
    return "red-circle.png: no caption (red-circle.txt is missing)"


def _bad_metadata(folder: Path) -> str:
    (folder / "metadata.jsonl").write_text('{"file_name": "red-circle.png", "text": "a red circle"}\n'
                                           '{"file_name": "blue-square.png"}\n')
    return "metadata.jsonl line 2: field 'text' is missing or not text"


def _not_an_image(folder: Path) -> str:
    (folder / "blue-square.png").write_bytes(b"not a png")
    return "blue-square.png: cannot be read as an image"


@pytest.mark.parametrize("damage", [_no_caption, _bad_metadata, _not_an_image], ids=lambda d: d.__name__[1:])
def test_bad_data_is_refused_in_one_line(server: ForkServer, tmp_path: Path,
                                         damage: Callable[[Path], str]) -> None:
    folder = tmp_path / "images"
    shutil.copytree(IMAGES, folder)
    said = damage(folder)
    log = tmp_path / "log.txt"
    code = server.run(["train", str(tiny_diffusion_run(tmp_path, **{"dataset.path": str(folder)}))], log)
    text = log.read_text()
    assert code == 2, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and said in " ".join(text.split()), text
    assert "Traceback" not in text
    assert not (tmp_path / "out").exists()


def test_micro_batch_auto_takes_the_largest_that_fits_the_device(server: ForkServer, tmp_path: Path) -> None:
    """`micro_batch: auto` on a pipeline: the run's batch shape from the traced step's memory on this device (all 4
    images of a step fit the CPU at once), said before the first step and kept in the run's metrics."""
    config = tiny_diffusion_run(tmp_path, micro_batch="auto", grad_accum=None, global_batch=4, max_steps=2)
    code = server.run(["train", str(config)], tmp_path / "log.txt")
    text = (tmp_path / "log.txt").read_text()
    assert code == 0, text[-3000:]
    assert "batch shape:" in text and "micro_batch 4: all 4 images of a step fit" in " ".join(text.split())
    start = next(json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
                 if '"event": "start"' in line)
    assert (start["micro_batch"], start["grad_accum"]) == (4, 1)


def test_repeats_make_each_epoch_see_every_image_that_many_times_as_the_plan_counts(server: ForkServer,
                                                                                    tmp_path: Path) -> None:
    """`diffusion.repeats: 3` with one epoch: the run trains ⌈images × 3 / 4⌉ steps, the steps `tunecast plan` counts
    for the same config, and every image is trained three times."""
    from tunecast.config.spec import RunSpec
    from tunecast.plan.diffusion import image_workload

    config = tiny_diffusion_run(tmp_path, max_steps=None, epochs=1, diffusion={"resolution": 32, "repeats": 3},
                                checkpoint={"every_steps": 100, "keep": 1})
    code = server.run(["train", str(config)], tmp_path / "log.txt")
    text = (tmp_path / "log.txt").read_text()
    assert code == 0, text[-3000:]
    images = len([path for path in IMAGES.iterdir() if path.suffix == ".png"])
    planned = image_workload(RunSpec.model_validate({"model": "m", "dataset": {"path": str(IMAGES)}, "epochs": 1,
                                                     "diffusion": {"repeats": 3}})).steps(4)
    events = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "train"]
    assert len(steps) == planned == -(-images * 3 // 4)
    assert sum(e["images"] for e in steps) == images * 3
    assert f"{images} images with captions × 3 repeats" in " ".join(text.split())


def test_dry_run_says_the_batch_shape_and_steps_without_writing(server: ForkServer, tmp_path: Path) -> None:
    """`train --dry-run` of a pipeline: the batch shape the run would take on this device, its images, repeats and
    steps as the run counts them, and nothing written; a folder of images without captions refused as the run does."""
    config = tiny_diffusion_run(tmp_path, max_steps=None, epochs=2, diffusion={"resolution": 32, "repeats": 3})
    code = server.run(["train", "--dry-run", "--json", str(config)], tmp_path / "log.txt")
    text = (tmp_path / "log.txt").read_text()
    assert code == 0, text[-3000:]
    result = json.loads(text[text.index("{"):text.rindex("}") + 1])
    images = len([path for path in IMAGES.iterdir() if path.suffix == ".png"])
    assert (result["micro_batch"], result["grad_accum"], result["examples"], result["sequences"]) == \
        (2, 2, images, images * 3)
    assert result["steps"] == 2 * -(-images * 3 // 4) and result["resume_step"] is None
    assert not (tmp_path / "out").exists()
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(next(IMAGES.glob("*.png")), bare / "one.png")
    config = tiny_diffusion_run(tmp_path, "bare.yaml", dataset={"path": str(bare)})
    code = server.run(["train", "--dry-run", str(config)], tmp_path / "bare.txt")
    text = (tmp_path / "bare.txt").read_text()
    assert code == 2 and "no caption" in text and "Traceback" not in text


def _bucketed_images(folder: Path) -> Path:
    """Three shapes of image, two of each, with captions: wide (96×32), tall (32×96) and square (48×48)."""
    from PIL import Image

    folder.mkdir()
    for index, (size, colour) in enumerate([((96, 32), "red"), ((32, 96), "blue"), ((48, 48), "green")] * 2):
        Image.new("RGB", size, colour).save(folder / f"{index}.png")
        (folder / f"{index}.txt").write_text(f"a {colour} shape")
    return folder


def test_aspect_buckets_train_each_shape_at_its_own_bucket_and_resume_bit_exact(server: ForkServer,
                                                                               tmp_path: Path) -> None:
    """`diffusion.buckets`: wide, tall and square images each trained at their own bucket (a micro-batch holds one
    bucket's images), the steps those micro-batches make, as the dry run counts them; killed after a checkpoint and
    run again, the same LoRA bytes and losses as a run left alone."""
    images = _bucketed_images(tmp_path / "images")

    def config(name: str) -> Path:
        # 3 images a micro-batch: 12 units an epoch make 4 without buckets, 6 in three buckets of 4 (3 + 1 each)
        return tiny_diffusion_run(tmp_path / name, max_steps=None, epochs=2, micro_batch=3, grad_accum=1,
                                  dataset={"path": str(images)}, diffusion={"resolution": 32, "repeats": 2,
                                                                           "buckets": True})

    for name in ("left-alone", "killed"):
        (tmp_path / name).mkdir()
    code = server.run(["train", "--dry-run", "--json", str(config("left-alone"))], tmp_path / "dry.txt")
    dry = (tmp_path / "dry.txt").read_text()
    assert code == 0 and json.loads(dry[dry.index("{"):dry.rindex("}") + 1])["steps"] == 2 * 6, dry[-3000:]
    code = server.run(["train", str(config("left-alone"))], tmp_path / "alone.txt")
    text = " ".join((tmp_path / "alone.txt").read_text().split())
    assert code == 0, text[-3000:]
    assert "6 images with captions × 2 repeats in 3 aspect buckets; 12 steps (6 per epoch)" in text
    alone = tmp_path / "left-alone" / "out"
    assert len(train_losses(alone)) == 12

    killed = tmp_path / "killed" / "out"
    code, _ = server.signal_when(["train", str(config("killed"))], tmp_path / "log.txt", trained(killed, 5),
                                 signal_number=signal.SIGKILL)
    assert code == -signal.SIGKILL, (tmp_path / "log.txt").read_text()[-3000:]
    code = server.run(["train", str(config("killed"))], tmp_path / "log2.txt")
    assert code == 0, (tmp_path / "log2.txt").read_text()[-3000:]
    assert "resumed from checkpoint" in " ".join((tmp_path / "log2.txt").read_text().split())
    assert lora_bytes(killed) == lora_bytes(alone)
    assert train_losses(killed) == train_losses(alone)
