"""Diffusion pipelines (catalog/diffusion.py) and the traced memory of their training step (estimate/diffusion.py),
on a tiny UNet pipeline written as diffusers saves one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunecast.catalog.diffusion import bundled_pipelines, is_pipeline, load_pipeline
from tunecast.catalog.store import load_catalog
from tunecast.errors import TunecastError
from tunecast.estimate.diffusion import DiffusionShape, estimate_diffusion_memory
from tunecast.step.diffusion import DiffusionSettings

pytest.importorskip("diffusers")

UNET = {"_class_name": "UNet2DConditionModel", "sample_size": 8, "in_channels": 4, "out_channels": 4,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "block_out_channels": [32, 64], "layers_per_block": 1, "cross_attention_dim": 32, "attention_head_dim": 8,
        "norm_num_groups": 8}
VAE = {"_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 4,
       "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
       "block_out_channels": [8, 8, 16, 16], "layers_per_block": 1, "norm_num_groups": 8}
CLIP = {"model_type": "clip_text_model", "architectures": ["CLIPTextModel"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 77,
        "bos_token_id": 0, "eos_token_id": 2}


def tiny_pipeline(folder: Path) -> Path:
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
             "scheduler": ["diffusers", "DDPMScheduler"], "tokenizer": ["transformers", "CLIPTokenizer"]}
    (folder / "model_index.json").write_text(json.dumps(index))
    for name, config in (("unet", UNET), ("vae", VAE), ("text_encoder", CLIP)):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"prediction_type": "epsilon"}))
    return folder


def test_the_catalog_s_pipelines_load_with_their_denoiser_and_objective() -> None:
    found = {name: load_pipeline(name) for name in bundled_pipelines()}
    assert {p.family for p in found.values()} == {"unet", "unet3d", "sd3", "flux"}
    assert found["runwayml/stable-diffusion-v1-5"].objective == "epsilon"
    assert found["black-forest-labs/FLUX.1-dev"].objective == "flow"
    assert found["black-forest-labs/FLUX.1-dev"].latent_channels == 16
    assert found["stabilityai/stable-diffusion-xl-base-1.0"].text_encoders == ("text_encoder", "text_encoder_2")
    assert found["damo-vilab/text-to-video-ms-1.7b"].video


def test_a_folder_without_a_pipeline_is_refused_naming_the_model(tmp_path: Path) -> None:
    assert not is_pipeline(str(tmp_path))
    with pytest.raises(TunecastError) as error:
        load_pipeline(str(tmp_path))
    assert error.value.field == "model"


def _estimate(folder: Path, method: str, optimizer: str = "adamw", **shape: bool) -> dict[str, float]:
    overheads = load_catalog(None).overheads
    found = estimate_diffusion_memory(load_pipeline(str(folder)), DiffusionSettings(method=method, optimizer=optimizer),
                                      DiffusionShape(2, 64, 64, **shape), device="cpu", gpu=None, overheads=overheads)
    return {**found.breakdown_gib, "allocated": found.peak_allocated_gib}


def test_a_tiny_unet_s_step_holds_its_weights_adapters_and_adam_states_byte_for_byte(tmp_path: Path) -> None:
    """What the trace holds at its peak, against what the parts are: the UNet, VAE and text encoder in bf16
    (diffusers' examples: the VAE in the weight dtype for SD 1.5), LoRA's adapters in fp32 with AdamW's two fp32
    moments each and its step count per tensor; full fine-tuning's fp32 UNet with its states; the VAE gone where the latents are cached."""
    import diffusers
    import torch
    import transformers

    from tunecast.step.diffusion import build_denoiser

    folder = tiny_pipeline(tmp_path)
    pipeline = load_pipeline(str(folder))
    gib = 2 ** 30
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel.from_config(UNET)
        vae = diffusers.AutoencoderKL.from_config(VAE)
        text = transformers.CLIPTextModel(transformers.CLIPTextConfig(**{k: v for k, v in CLIP.items()
                                                                         if k not in ("model_type", "architectures")}))
    unet_numel, vae_numel = sum(p.numel() for p in unet.parameters()), sum(p.numel() for p in vae.parameters())
    text_numel = sum(p.numel() for p in text.parameters())
    trained = [p for p in build_denoiser(pipeline, DiffusionSettings()).parameters() if p.requires_grad]
    adapters = sum(p.numel() for p in trained)
    assert adapters > 0

    def adam(numel: int, tensors: int) -> int:  # two fp32 moments per element, and torch's fp32 step per tensor
        return 2 * 4 * numel + 4 * tensors

    lora = _estimate(folder, "lora")
    assert lora["trainable_weights"] * gib == 4 * adapters
    assert lora["optimizer"] * gib == adam(adapters, len(trained))
    assert lora["weights"] * gib == 2 * (unet_numel + vae_numel + text_numel)

    full = _estimate(folder, "full")
    assert full["trainable_weights"] * gib == 4 * unet_numel
    assert full["optimizer"] * gib == adam(unet_numel, len(list(unet.parameters())))

    cached = _estimate(folder, "lora", cache_latents=True, cache_text=True)
    assert cached["weights"] * gib == 2 * unet_numel
    assert cached["allocated"] < lora["allocated"]

    # bitsandbytes' 8-bit AdamW: a byte per state and an fp32 constant per 256 values; fp32 states for tensors under
    # 4,096 elements (its min_8bit_size), as the language models' estimate models it
    eight_bit = _estimate(folder, "full", optimizer="adamw-8bit")
    parameters = [p.numel() for p in unet.parameters()]
    small = sum(n for n in parameters if n < 4096)
    assert eight_bit["optimizer"] * gib == 2 * (unet_numel - small) * (1 + 4 / 256) + 2 * 4 * small
    assert eight_bit["weights"] == full["weights"]


@pytest.mark.parametrize("written, sides", [(1024, (1024, 1024)), ("768x512", (768, 512)), ("768×512", (768, 512)),
                                            ("1024", (1024, 1024)), (None, None)])
def test_a_resolution_is_a_side_or_width_by_height(written: object, sides: object) -> None:
    from tunecast.config.spec import DiffusionSpec

    assert DiffusionSpec(resolution=written).sides == sides


@pytest.mark.parametrize("written", ["wide", "768x", 0, True, "0x512"])
def test_a_resolution_that_is_neither_is_refused(written: object) -> None:
    from pydantic import ValidationError

    from tunecast.config.spec import DiffusionSpec

    with pytest.raises(ValidationError, match="pixels per side"):
        DiffusionSpec(resolution=written)


def test_memory_of_a_pipeline_folder_answers_with_its_fit_and_other_commands_refuse_it(cli, tmp_path: Path) -> None:
    """`tunecast memory --model FOLDER` of a diffusers pipeline: the traced step at the asked resolution, with its
    fit on a GPU; settings its estimate does not take, the options that do not take a pipeline yet and a dry run
    without images are refused in one line each, exit 2."""
    folder = str(tiny_pipeline(tmp_path))
    result = cli("memory", "--model", folder, "--resolution", "64x48", "--micro-batch", "2", "--gpu", "rtx-4090",
                 "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert (document["denoiser"], document["objective"], document["width"], document["height"],
            document["micro_batch"]) == ("UNet2DConditionModel", "epsilon", 64, 48, 2)
    assert document["fits"] is True and document["peak_allocated_gib"] > document["breakdown_gib"]["weights"] > 0
    assert "tracing" in result.stderr  # announced before the trace
    refused = cli("memory", "--model", folder, "--method", "qlora", "--resolution", "60")
    assert refused.code == 2
    assert all(key in refused.stderr for key in ("method", "diffusion.resolution"))
    assert "Traceback" not in refused.stderr
    automatic = cli("memory", "--model", folder, "--micro-batch", "auto")
    assert automatic.code == 2 and "max_micro_batch" in automatic.stderr and "Traceback" not in automatic.stderr
    assert {"max_micro_batch", "max_resolution", "resolution_step"} <= set(document)
    calibrated = cli("plan", "--model", folder, "--calibration", str(tmp_path / "c.json"))
    assert calibrated.code == 2 and "--calibration" in calibrated.stderr and "Traceback" not in calibrated.stderr
    rehearsed = cli("train", "--model", folder, "--dry-run")  # a dry run takes it, and asks for its images
    assert rehearsed.code == 2 and "dataset.path" in rehearsed.stderr and "Traceback" not in rehearsed.stderr


def test_the_largest_micro_batch_and_resolution_that_fit_are_verified_on_both_sides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--gpu`'s limits of a pipeline: the micro-batch returned fits the GPU and the next (within the solver's 1%) does
    not, at the run's resolution; the square side returned fits and the next on its grid does not, at the run's
    micro-batch; each checked here by a trace of its own. On the profiles' grid (a multiple of 64 px) and off it
    (where the limits are solved on the line and checked by traces)."""
    from tunecast.config.spec import RunSpec
    from tunecast.estimate import diffusion_fit
    from tunecast.estimate.diffusion import diffusion_limits
    from tunecast.estimate.fit import SOLVE_TOLERANCE

    folder = str(tiny_pipeline(tmp_path))
    pipeline = load_pipeline(folder)
    catalog = load_catalog(None)
    small = catalog.gpus.get("rtx-4090").model_copy(update={"usable_memory_gib": 0.56, "memory_gib": 0.56})

    def total(batch: int, side: int) -> float:  # from a trace of its own, no fitted profile
        with monkeypatch.context() as direct:
            direct.setattr(diffusion_fit, "_PROFILES", {})
            direct.setenv("TUNECAST_CACHE", str(tmp_path / "no-profiles"))
            return estimate_diffusion_memory(pipeline, DiffusionSettings(method="full"),
                                             DiffusionShape(batch, side, side), device="cuda", gpu=small,
                                             overheads=catalog.overheads).device_total_gib

    for resolution, step in ((64, 64), (72, 8)):
        spec = RunSpec.model_validate({"model": folder, "method": "full", "micro_batch": 2,
                                       "diffusion": {"resolution": resolution}})
        limits = diffusion_limits(spec, pipeline, small, catalog.overheads)
        assert limits.step == step and 2 < limits.max_micro_batch < 1024 and 64 < limits.max_resolution < 4096
        batch, side = limits.max_micro_batch, limits.max_resolution
        margin = 0 if step == 64 else int(batch * SOLVE_TOLERANCE)
        assert total(batch, resolution) <= 0.56 < total(batch + 1 + margin, resolution)
        margin = 0 if step == 64 else int(side // step * SOLVE_TOLERANCE)
        assert total(2, side) <= 0.56 < total(2, side + step * (1 + margin))


def test_a_pipeline_that_does_not_fit_gets_the_changes_that_save_memory_each_traced_when_asked(tmp_path: Path) -> None:
    """On a GPU the run does not fit, each change that saves memory in a diffusion step is listed, without a figure
    unless `trace_suggestions` traces it; none saves less than nothing; a run that fits gets none."""
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.diffusion import answer_diffusion_memory

    folder = str(tiny_pipeline(tmp_path))
    catalog = load_catalog(None)
    base = catalog.gpus.get("rtx-4090")
    small = base.model_copy(update={"usable_memory_gib": 0.51, "memory_gib": 0.51})  # the context and a little
    spec = RunSpec.model_validate({"model": folder, "method": "full", "micro_batch": 2,
                                   "diffusion": {"resolution": 64}})
    listed = answer_diffusion_memory(spec, load_pipeline(folder), small, catalog.overheads, device="cuda")
    assert listed.fits is False
    changes = {tuple(s.settings) for s in listed.suggestions}
    assert {("grad_checkpointing",), ("diffusion.cache_latents",), ("diffusion.cache_text",), ("method",),
            ("optimizer",), ("micro_batch", "grad_accum")} == changes
    assert all(s.device_total_gib is None and s.fits is None for s in listed.suggestions)
    traced = answer_diffusion_memory(spec, load_pipeline(folder), small, catalog.overheads, device="cuda",
                                     trace_suggestions=True)
    figures = {s.settings.get("method", next(iter(s.settings))): s.device_total_gib for s in traced.suggestions}
    base_total = traced.estimate.device_total_gib  # at this size the allocator's 2 MiB blocks hide most savings
    assert all(figure is not None and figure <= base_total for figure in figures.values()), (base_total, figures)
    assert figures["lora"] < base_total
    assert traced.as_dict(spec)["suggestions"][0]["estimated"] is True
    assert answer_diffusion_memory(spec, load_pipeline(folder), base, catalog.overheads, device="cuda").suggestions \
        == ()


def test_checkpointing_a_video_unet_is_refused_in_one_line_and_never_suggested(cli) -> None:
    """diffusers cannot checkpoint UNet3DConditionModel (enable_gradient_checkpointing raises): asked, it is refused
    before anything traces; left open, the plan and the run's batch choice never take it."""
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.diffusion import checkpointing_options

    refused = cli("memory", "--model", "damo-vilab/text-to-video-ms-1.7b", "--grad-checkpointing")
    assert refused.code == 2 and "grad_checkpointing" in refused.stderr and "Traceback" not in refused.stderr
    video = load_pipeline("damo-vilab/text-to-video-ms-1.7b")
    assert checkpointing_options(RunSpec(model=video.name), video) == [False]
    assert checkpointing_options(RunSpec(model="x"), load_pipeline("runwayml/stable-diffusion-v1-5")) == [False, True]
