"""One training step of a diffusion model: the denoiser as it is trained (dtype, LoRA adapters, checkpointing) and
its loss on a batch of latents, as diffusers' training examples run it. The tracer runs it on fake tensors
(estimate/diffusion.py) with zeros for the text; `tunecast train` runs the same loss on real images and captions
with a seeded generator and the pipeline's scheduler (train/diffusion_loop.py). Torch and diffusers are imported
lazily.

What the examples do (docs/research/diffusion/NOTES.md, with files and lines):
- LoRA: the frozen denoiser in the weight dtype (bf16 under bf16 mixed precision), the adapters upcast to fp32, the
  forward pass under accelerate's autocast; targets `to_k, to_q, to_v, to_out.0` on UNets
  (train_text_to_image_lora.py, train_dreambooth_lora_sdxl.py), and on SD3 and FLUX also the joint attention's
  `add_*_proj` and `to_add_out` (and FLUX's feed-forward layers) (train_dreambooth_lora_sd3.py, _flux.py).
- Full fine-tuning: the denoiser's weights in fp32 under autocast (train_text_to_image.py).
- The objective: the noise (`epsilon`) or the velocity (`v_prediction`) for the UNet models, `noise - latents` for
  the flow-matching SD3 and FLUX; the loss is the mean squared error in fp32.
- SD3's and FLUX's flow matching (train_dreambooth_lora_sd3.py L1775-1821, train_dreambooth_lora_flux.py L1748-1820,
  diffusers' main at 58eb52c080): latents `(sample - shift_factor) * scaling_factor`; a draw u of the weighting
  scheme (training_utils.py compute_density_for_timestep_sampling L365-389: logit_normal, the SD3 script's default,
  L522-525; uniform, the FLUX script's `none`, L543-547); the timestep and sigma at index `u * 1000` of the
  FlowMatchEulerDiscreteScheduler's (shifted) schedule; `(1 - sigma) latents + sigma noise` against `noise -
  latents`; both schemes weigh the loss by 1 (compute_loss_weighting_for_sd3 L392-407). The pipelines' lines cited
  (pipeline_flux.py, pipeline_stable_diffusion_3.py) are diffusers 0.42.1's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tunecast.catalog.diffusion import Pipeline

LORA_TARGETS = {
    "unet": ("to_k", "to_q", "to_v", "to_out.0"),
    "unet3d": ("to_k", "to_q", "to_v", "to_out.0"),
    "sd3": ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
            "attn.to_q", "attn.to_v"),
    "flux": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
             "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
             "ff_context.net.2"),
}
# The attention projections only (joint attention's included): SimpleTuner's targets (its SDXL
# DEFAULT_LORA_TARGET and flux_lora_target "all", helpers/models/sdxl/model.py L57, flux/model.py L1249-1261).
ATTENTION_TARGETS = {
    "unet": LORA_TARGETS["unet"], "unet3d": LORA_TARGETS["unet3d"], "sd3": LORA_TARGETS["sd3"],
    "flux": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
             "attn.add_v_proj", "attn.to_add_out"),
}
# Every linear layer of the transformer blocks, as kohya's networks (networks/lora.py L867: every Linear and 1 × 1
# Conv2d inside a UNet's Transformer2DModel; networks/lora_flux.py L709-710: every Linear of FLUX's double and single
# blocks) and ai-toolkit's (toolkit/lora_special.py: the transformer blocks' Linear layers) adapt them, in diffusers'
# names. FLUX's `proj_out` also names the model's last projection outside the blocks: one layer more than theirs.
BLOCK_TARGETS = {
    "unet": (*LORA_TARGETS["unet"], "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"),
    "unet3d": (*LORA_TARGETS["unet3d"], "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"),
    "sd3": (*LORA_TARGETS["sd3"], "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
            "norm1.linear", "norm1_context.linear"),
    "flux": (*LORA_TARGETS["flux"], "norm1.linear", "norm1_context.linear", "norm.linear", "proj_mlp", "proj_out"),
}
_TARGETS_OF_LAYERS = {"examples": LORA_TARGETS, "attention": ATTENTION_TARGETS, "blocks": BLOCK_TARGETS}
# FLUX.1 and SD3 encode with T5 at these lengths (diffusers' FluxPipeline and StableDiffusion3Pipeline defaults).
T5_TOKENS = {"flux-dev": 512, "flux-schnell": 256, "sd3": 256}
CLIP_TOKENS = 77  # every CLIP encoder's text length (the SD3 and FLUX pipelines' tokenizer_max_length)
# How the flow-matching examples draw their timesteps (training_utils.py compute_density_for_timestep_sampling,
# L365-389): SD3's script defaults to `logit_normal` (train_dreambooth_lora_sd3.py L522-525, mean 0 and std 1,
# L528-533), FLUX's to `none`, a uniform draw (train_dreambooth_lora_flux.py L543-547).
WEIGHTING_SCHEME = {"sd3": "logit_normal", "flux": "none"}
# FLUX.1-dev is guidance-distilled: its example trains with the guidance embedding at --guidance_scale's default
# (train_dreambooth_lora_flux.py L497-501, L1790-1794).
FLUX_TRAINING_GUIDANCE = 3.5


@dataclass(frozen=True)
class DiffusionSettings:
    """What decides a diffusion training step's memory, besides the batch's shape."""

    method: str = "lora"  # lora | full
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    grad_checkpointing: bool = False
    lora_rank: int = 4  # diffusers' examples' default (--rank 4)
    lora_alpha: int = 4
    lora_targets: tuple[str, ...] | None = None  # None: those of `lora_layers` for the model
    lora_layers: str = "examples"  # examples | attention | blocks (LORA_TARGETS, ATTENTION_TARGETS, BLOCK_TARGETS)
    vae_fp32: bool | None = None  # None: as diffusers' example for the model (vae_dtype)
    base_8bit: bool = False  # frozen linear weights stored in float8, upcast layer by layer under autocast


def lora_targets(pipeline: Pipeline, settings: DiffusionSettings) -> tuple[str, ...]:
    """The module names LoRA adapts in the denoiser: the settings' own, else those of their `lora_layers`."""
    return settings.lora_targets or _TARGETS_OF_LAYERS[settings.lora_layers][pipeline.family]


def _store_8bit(model: Any) -> None:
    """The frozen linear weights of `model` stored in float8 (e4m3): autocast upcasts each to the compute dtype as its
    layer runs, which is how kohya's fp8_base trains (train_network.py L829-851: the U-Net cast to float8_e4m3fn,
    mixed precision required) and the memory of optimum-quanto's qfloat8 weights, dequantized layer by layer, that
    ai-toolkit's `quantize` makes (its per-channel scales not counted)."""
    import torch

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None and not weight.requires_grad:
            module.weight.data = weight.data.to(torch.float8_e4m3fn)


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """Within: new floating-point tensors in `dtype`, so that weights built on a real device are made in their
    training dtype (no fp32 copy first, which would be the process's peak)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def quiet() -> None:
    """diffusers' notices (a cast with `to()`) are for its maintainers, not our users."""
    from diffusers.utils import logging

    logging.set_verbosity_error()


def denoiser_class(pipeline: Pipeline) -> Any:
    import diffusers

    return getattr(diffusers, pipeline.classes[pipeline.denoiser])


def weight_dtype(settings: DiffusionSettings) -> Any:
    """The dtype of the frozen weights (the examples' `weight_dtype`): the mixed precision's, else fp32."""
    import torch

    return autocast_dtype(settings) or torch.float32


def vae_dtype(pipeline: Pipeline, settings: DiffusionSettings) -> Any:
    """The VAE's dtype: fp32 where the settings say (`vae_fp32`); where they do not, as diffusers' examples: fp32 for
    SDXL and SD3 whatever the weight dtype, "to avoid NaN losses" (train_dreambooth_lora_sdxl.py L1181,
    train_dreambooth_lora_sd3.py L1237), the weight dtype otherwise."""
    import torch

    sdxl = pipeline.configs[pipeline.denoiser].get("addition_embed_type") == "text_time"
    fp32 = settings.vae_fp32 if settings.vae_fp32 is not None else sdxl or pipeline.family == "sd3"
    return torch.float32 if fp32 else weight_dtype(settings)


def build_denoiser(pipeline: Pipeline, settings: DiffusionSettings, device: str = "meta") -> Any:
    """The denoiser as it is trained, on `device` (meta for a trace; a real device: random weights)."""
    return adapt_denoiser(make_denoiser(pipeline, settings, device), pipeline, settings)


def supports_checkpointing(pipeline: Pipeline) -> bool:
    """Whether diffusers can checkpoint the denoiser: not the video UNet (UNet3DConditionModel sets
    `_supports_gradient_checkpointing = False` in diffusers 0.42; enable_gradient_checkpointing raises)."""
    return pipeline.family != "unet3d"


def denoiser_dtype(settings: DiffusionSettings) -> Any:
    """The dtype the denoiser's weights are built or loaded in: LoRA's frozen weight dtype, full training's."""
    from tunecast.step.setup import param_dtype

    return weight_dtype(settings) if settings.method == "lora" else param_dtype(settings.precision)


def make_denoiser(pipeline: Pipeline, settings: DiffusionSettings, device: str = "meta") -> Any:
    """The denoiser built from its config in its dtype (`denoiser_dtype`), on `device`, before training changes it
    (random weights drawn from torch's generator on a real device)."""
    import torch

    quiet()
    with torch.device(device), _default_dtype(denoiser_dtype(settings)):
        return denoiser_class(pipeline).from_config(pipeline.configs[pipeline.denoiser])


def adapt_denoiser(model: Any, pipeline: Pipeline, settings: DiffusionSettings) -> Any:
    """`model` (built or loaded) as it is trained: LoRA's adapters in fp32 on frozen weights, or every weight
    trained; gradient checkpointing when asked."""
    from peft import inject_adapter_in_model

    from tunecast.step.setup import param_dtype

    if settings.method == "lora":
        model.to(weight_dtype(settings))
        model.requires_grad_(False)
        model = inject_adapter_in_model(lora_config(pipeline, settings), model)
        for name, parameter in model.named_parameters():
            if "lora_" in name:  # the examples' cast_training_params: adapters in fp32
                parameter.data = parameter.data.float()
                parameter.requires_grad_(True)
        if settings.base_8bit:
            _store_8bit(model)
    else:
        model.to(param_dtype(settings.precision))
        model.requires_grad_(True)
    model.train()
    if settings.grad_checkpointing:
        model.enable_gradient_checkpointing()
    return model


def lora_config(pipeline: Pipeline, settings: DiffusionSettings) -> Any:
    """The adapters' peft config: the examples' (gaussian initialisation, rank, alpha, targets)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, init_lora_weights="gaussian",
                      target_modules=list(lora_targets(pipeline, settings)))


def autocast_dtype(settings: DiffusionSettings) -> Any:
    """The forward pass's autocast dtype: accelerate's under `--mixed_precision bf16|fp16`, as every example runs,
    with the frozen weights in that dtype too (`bf16` and `bf16-mixed` alike); None in fp32."""
    import torch

    return {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(settings.precision)


def build_vae(pipeline: Pipeline, settings: DiffusionSettings, device: str = "meta") -> Any:
    """The frozen VAE in its dtype (`vae_dtype`), on `device`."""
    import diffusers
    import torch

    quiet()
    dtype = vae_dtype(pipeline, settings)
    with torch.device(device), _default_dtype(dtype):
        vae = getattr(diffusers, pipeline.classes["vae"]).from_config(pipeline.configs["vae"])
    vae.to(dtype)
    vae.requires_grad_(False)
    return vae


def build_text_encoders(pipeline: Pipeline, settings: DiffusionSettings, device: str = "meta") -> list[Any]:
    """The frozen text encoders in the weight dtype, on `device`, each built from its config by its class."""
    import torch
    import transformers

    encoders = []
    for name in pipeline.text_encoders:
        data = dict(pipeline.configs[name])
        config = transformers.AutoConfig.for_model(data.pop("model_type"), **{
            key: value for key, value in data.items() if not key.startswith("_")})
        with torch.device(device), _default_dtype(weight_dtype(settings)):
            encoder = getattr(transformers, pipeline.classes[name])(config)
        encoder.to(weight_dtype(settings))
        encoder.requires_grad_(False)
        if settings.base_8bit:  # kohya's fp8_base and ai-toolkit's quantize_te (its default: quantize) store them too
            _store_8bit(encoder)
        encoders.append(encoder)
    return encoders


def train_step(model: Any, vae: Any | None, optimizer_step: Callable[[], None], pipeline: Pipeline,
               settings: DiffusionSettings, batch: int, height: int, width: int, frames: int, *,
               on: Callable[[str], None] = lambda part: None) -> None:
    """One training step: the batch's images encoded by the VAE without gradients (random pixels; none where the
    latents are cached, `vae` None), the loss under autocast, its backward pass, the optimizer's step. `on` hears
    "encoding", "encoded" and "backward" as each part starts (the tracer's categories and phases)."""
    import torch

    dtype = weight_dtype(settings)
    if vae is None:
        latents = torch.randn(latent_shape(pipeline, batch, height, width, frames), dtype=dtype)
    else:
        on("encoding")
        with torch.no_grad():
            pixels = torch.randn(batch * (frames if pipeline.video else 1), 3, height, width, dtype=vae.dtype)
            encoded = vae.encode(pixels).latent_dist.sample()
            del pixels
            on("encoded")
            latents = encoded.to(dtype)
            del encoded
            if pipeline.video:  # frames encoded as images, then (b, c, f, h, w)
                _, channels, side_h, side_w = latents.shape
                latents = latents.view(batch, frames, channels, side_h, side_w).permute(0, 2, 1, 3, 4)
    cast = autocast_dtype(settings)
    with torch.autocast(latents.device.type, dtype=cast, enabled=cast is not None):
        loss = training_loss(model, pipeline, latents, dtype)
    on("backward")
    loss.backward()
    del loss, latents
    optimizer_step()


def text_length(pipeline: Pipeline) -> int:
    """The tokens of the text the denoiser attends to: CLIP's 77; SD3's 77 + its T5's; FLUX's T5 tokens."""
    if pipeline.family == "sd3":
        return CLIP_TOKENS + t5_tokens(pipeline)
    if pipeline.family == "flux":
        return t5_tokens(pipeline)
    return CLIP_TOKENS


def t5_tokens(pipeline: Pipeline) -> int:
    """The T5 length SD3 and FLUX encode captions at: their pipelines' `max_sequence_length` defaults (T5_TOKENS),
    which the memory estimate traces and the trainer encodes at. (The FLUX example's --max_sequence_length is 512 as
    well, train_dreambooth_lora_flux.py L348-352; the SD3 example's is 77, train_dreambooth_lora_sd3.py L338-342.)"""
    if pipeline.family == "sd3":
        return T5_TOKENS["sd3"]
    return T5_TOKENS["flux-dev" if pipeline.configs[pipeline.denoiser].get("guidance_embeds") else "flux-schnell"]


def latent_shape(pipeline: Pipeline, batch: int, height: int, width: int, frames: int) -> tuple[int, ...]:
    """The VAE latents of a batch of images (or clips) of that size in pixels."""
    scale = pipeline.vae_scale
    side = (height // scale, width // scale)
    if pipeline.video:
        return (batch, pipeline.latent_channels, frames, *side)
    return (batch, pipeline.latent_channels, *side)


@dataclass(frozen=True)
class Conditioning:
    """What the denoiser attends to besides the noisy latents, for one batch: the text encoders' hidden states, and
    SDXL's pooled text embedding and size conditioning (`time_ids`), SD3's and FLUX's pooled embedding."""

    states: Any  # (batch, text tokens, width)
    pooled: Any | None = None  # (batch, width)
    time_ids: Any | None = None  # (batch, 6)


@dataclass(frozen=True)
class NoiseSource:
    """Where a step's noise and timesteps come from. `generator`: a torch.Generator the run seeds for each step, so a
    resumed run draws the same (None: torch's global generator, as the tracer draws). `scheduler`: the pipeline's
    DDPMScheduler, whose `add_noise` and `get_velocity` the UNet models train with (None: the plain sum of the same
    tensors, which allocates what add_noise's result does and is all the tracer needs)."""

    generator: Any | None = None
    scheduler: Any | None = None

    # A generator draws on its own device (the CPU's), and the values move to the batch's device, as diffusers'
    # randn_tensor does: the same draws on any device.
    def normal(self, like: Any) -> Any:
        import torch

        if self.generator is None:
            return torch.randn_like(like)
        return torch.randn(like.shape, generator=self.generator, dtype=like.dtype).to(like.device)

    def uniform(self, count: int, device: Any) -> Any:
        import torch

        if self.generator is None:
            return torch.rand(count, device=device)
        return torch.rand(count, generator=self.generator).to(device)

    def flow_sigmas(self, family: str, count: int, latents: Any) -> tuple[Any, Any]:
        """A flow-matching step's sigmas, (count, 1, 1, 1) in the latents' dtype (the examples' get_sigmas casts
        to model_input.dtype), and its timesteps, (count,) in fp32. With a scheduler (the trainer's), as the examples
        draw them: u from the family's weighting scheme, the index `u * num_train_timesteps`, and the scheduler's
        timestep and sigma at that index (the examples look each timestep's index up again, get_sigmas, which finds
        the same index: the schedule's timesteps are distinct). Without one (the tracer's), a uniform sigma and its
        timestep `sigma * 1000`, tensors of the same shapes."""
        import torch

        device = latents.device
        if self.scheduler is None:
            drawn = self.uniform(count, device)
            return drawn.to(latents.dtype).view(count, 1, 1, 1), drawn * 1000.0
        if WEIGHTING_SCHEME[family] == "logit_normal":
            u = torch.sigmoid(torch.normal(0.0, 1.0, (count,), generator=self.generator))
        else:
            u = torch.rand(count, generator=self.generator)
        indices = (u * int(self.scheduler.config.num_train_timesteps)).long()
        sigmas = self.scheduler.sigmas[indices].to(device, latents.dtype).view(count, 1, 1, 1)
        return sigmas, self.scheduler.timesteps[indices].to(device)

    def timesteps(self, count: int, device: Any) -> Any:
        import torch

        steps = int(self.scheduler.config.num_train_timesteps) if self.scheduler is not None else 1000
        if self.generator is None:
            return torch.randint(0, steps, (count,), device=device)
        return torch.randint(0, steps, (count,), generator=self.generator).to(device)


def training_loss(model: Any, pipeline: Pipeline, latents: Any, dtype: Any, conditioning: Conditioning | None = None,
                  source: NoiseSource | None = None) -> Any:
    """The step's loss on `latents` (clean VAE latents in `dtype`): noise and a timestep drawn from `source`, the
    denoiser's prediction under `conditioning` (zeros of its shape where None: the tracer's) against the objective's
    target, in fp32. The objectives are diffusers' examples': for the UNet models the scheduler's noisy latents and
    its target (the noise for `epsilon`, `get_velocity` for `v_prediction`); for SD3 and FLUX flow matching, a sigma
    from the scheduler's schedule (NoiseSource.flow_sigmas), `(1 - sigma) latents + sigma noise` against
    `noise - latents`. SD3's script by default preconditions the output instead (--precondition_outputs 1,
    L540-545, L1810-1821: `pred * -sigma + noisy` against the latents, which is sigma² times this loss); this is its
    `--precondition_outputs 0`, and the FLUX script's only loss."""
    import torch

    draw = source or NoiseSource()
    batch = latents.shape[0]
    config = pipeline.configs[pipeline.denoiser]
    noise = draw.normal(latents)
    text = text_length(pipeline)
    if pipeline.family in ("sd3", "flux"):
        sigmas, timesteps = draw.flow_sigmas(pipeline.family, batch, latents)  # (batch, 1, 1, 1), (batch,)
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        target = noise - latents
        states = _states(conditioning, batch, text, int(config["joint_attention_dim"]), dtype, latents.device)
        pooled = conditioning.pooled if conditioning is not None else \
            torch.zeros(batch, int(config["pooled_projection_dim"]), dtype=dtype, device=latents.device)
        if pipeline.family == "sd3":
            prediction = model(hidden_states=noisy, encoder_hidden_states=states, pooled_projections=pooled,
                               timestep=timesteps, return_dict=False)[0]
        else:
            prediction = _flux_forward(model, config, noisy, states, pooled, timesteps)
    else:
        timesteps = draw.timesteps(batch, latents.device)
        scheduler = draw.scheduler
        noisy = scheduler.add_noise(latents, noise, timesteps) if scheduler is not None else latents + noise
        target = noise  # epsilon; v_prediction's velocity is a tensor of the same shape
        if scheduler is not None and pipeline.objective == "v_prediction":
            target = scheduler.get_velocity(latents, noise, timesteps)
        states = _states(conditioning, batch, text, int(config["cross_attention_dim"]), dtype, latents.device)
        extra: dict[str, Any] = {}
        if config.get("addition_embed_type") == "text_time":  # SDXL: the pooled text and the size conditioning
            time_ids = 6 * int(config["addition_time_embed_dim"])
            pooled = int(config["projection_class_embeddings_input_dim"]) - time_ids
            extra["added_cond_kwargs"] = {
                "text_embeds": conditioning.pooled if conditioning is not None else
                torch.zeros(batch, pooled, dtype=dtype, device=latents.device),
                "time_ids": conditioning.time_ids if conditioning is not None else
                torch.zeros(batch, 6, dtype=dtype, device=latents.device)}
        prediction = model(noisy, timesteps, states, return_dict=False, **extra)[0]
    return torch.nn.functional.mse_loss(prediction.float(), target.float(), reduction="mean")


def _states(conditioning: Conditioning | None, batch: int, tokens: int, width: int, dtype: Any, device: Any) -> Any:
    """The text hidden states the denoiser attends to: the batch's, or zeros of their shape (the tracer's)."""
    import torch

    if conditioning is not None:
        return conditioning.states
    return torch.zeros(batch, tokens, width, dtype=dtype, device=device)


def _flux_forward(model: Any, config: dict[str, Any], noisy: Any, states: Any, pooled: Any, timesteps: Any) -> Any:
    """FLUX's transformer as train_dreambooth_lora_flux.py calls it (L1753-1812): the latents packed into 2 × 2
    patches (FluxPipeline._pack_latents, pipeline_flux.py L522-527), each patch's position as its id (row, column:
    _prepare_latent_image_ids L508-519), the text's ids zeros (encode_prompt L387), the timestep over 1000, the
    guidance embedding at the example's scale where the config has one; the prediction unpacked (_unpack_latents
    L530-543)."""
    import torch

    batch, channels, height, width = noisy.shape
    packed = noisy.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(
        batch, (height // 2) * (width // 2), channels * 4)  # (batch, patches, channels × 4)
    rows = torch.arange(height // 2).view(-1, 1).expand(height // 2, width // 2)
    columns = torch.arange(width // 2).view(1, -1).expand(height // 2, width // 2)
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3).to(
        device=noisy.device, dtype=noisy.dtype)  # (patches, 3)
    text_ids = torch.zeros(states.shape[1], 3, dtype=noisy.dtype, device=noisy.device)
    guidance = torch.full((batch,), FLUX_TRAINING_GUIDANCE, device=noisy.device) \
        if config.get("guidance_embeds") else None
    prediction = model(hidden_states=packed, encoder_hidden_states=states, pooled_projections=pooled,
                       timestep=timesteps / 1000.0, img_ids=image_ids, txt_ids=text_ids, guidance=guidance,
                       return_dict=False)[0]
    return prediction.reshape(batch, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(
        batch, channels, height, width)


def is_sdxl(pipeline: Pipeline) -> bool:
    """SDXL's UNet: conditioned on the pooled text embedding and the images' sizes (`text_time`)."""
    return pipeline.configs[pipeline.denoiser].get("addition_embed_type") == "text_time"


# The text encoders each denoiser is trained with, in the pipeline's order (text_encoder, text_encoder_2, ...).
TRAINED_ENCODERS = {"sd3": "two CLIP encoders and a T5 encoder", "flux": "a CLIP encoder and a T5 encoder"}
_ENCODER_COUNT = {"sd3": 3, "flux": 2}


def untrained_reason(pipeline: Pipeline) -> str | None:
    """Why `tunecast train` cannot train this pipeline yet (None: it can). It trains the UNet models conditioned on
    one CLIP text encoder (Stable Diffusion 1.x and 2.x, epsilon or v-prediction), SDXL (two CLIP encoders, the
    pooled embedding and the size conditioning), SD3 (two CLIP encoders and T5) and FLUX (CLIP and T5) by flow
    matching; video is not built yet."""
    config = pipeline.configs[pipeline.denoiser]
    if pipeline.family in _ENCODER_COUNT:
        if len(pipeline.text_encoders) != _ENCODER_COUNT[pipeline.family]:
            return (f"a {pipeline.classes[pipeline.denoiser]} trains with {TRAINED_ENCODERS[pipeline.family]}; "
                    f"this pipeline has {len(pipeline.text_encoders)} text encoders")
        return None
    if pipeline.family != "unet":
        return f"training a {pipeline.classes[pipeline.denoiser]} is not built yet"
    if is_sdxl(pipeline):
        return None if len(pipeline.text_encoders) == 2 else "SDXL's UNet trains with its two text encoders"
    if config.get("addition_embed_type") is not None:
        return f"training a UNet with addition_embed_type {config['addition_embed_type']!r} is not built yet"
    if len(pipeline.text_encoders) != 1:
        return f"training with {len(pipeline.text_encoders)} text encoders is not built yet"
    return None


def encode_captions(pipeline: Pipeline, tokenizers: list[Any], encoders: list[Any], captions: list[str]
                    ) -> Conditioning:
    """The captions as the denoiser attends to them, as diffusers' examples make them, without gradients. Each CLIP
    tokenizer's ids are padded and truncated to its `model_max_length` (77); T5's to the pipeline's T5 length
    (t5_tokens).
    - One encoder (train_text_to_image.py): its last hidden state.
    - SDXL's two (train_text_to_image_sdxl.py encode_prompt): the hidden states before each one's last layer, side by
      side, and the second one's pooled projection.
    - SD3's (train_dreambooth_lora_sd3.py encode_prompt L1014-1060, as StableDiffusion3Pipeline.encode_prompt): the
      two CLIP encoders' hidden states before their last layer side by side, padded with zeros to T5's width, then
      T5's last hidden state after them along the tokens; the two pooled projections side by side.
    - FLUX's (train_dreambooth_lora_flux.py encode_prompt L1031-1068, as FluxPipeline.encode_prompt): T5's last
      hidden state, and the CLIP encoder's pooled output."""
    import torch

    def ids(tokenizer: Any, encoder: Any, length: int) -> Any:
        return tokenizer(captions, padding="max_length", max_length=length, truncation=True,
                         return_tensors="pt").input_ids.to(encoder.device)

    with torch.no_grad():
        if pipeline.family == "flux":
            (clip_tokenizer, t5_tokenizer), (clip, t5) = tokenizers, encoders
            clip_pooled = clip(ids(clip_tokenizer, clip, CLIP_TOKENS), return_dict=True).pooler_output  # (batch, d)
            t5_out = t5(ids(t5_tokenizer, t5, t5_tokens(pipeline)), return_dict=False)[0]  # (batch, T5 tokens, d)
            return Conditioning(t5_out, clip_pooled)
        if pipeline.family == "sd3":
            clip_states, pooled_parts = [], []
            for tokenizer, encoder in zip(tokenizers[:2], encoders[:2], strict=True):
                output = encoder(ids(tokenizer, encoder, CLIP_TOKENS), output_hidden_states=True, return_dict=False)
                pooled_parts.append(output[0])  # (batch, projection): text_embeds
                clip_states.append(output[-1][-2])  # (batch, 77, hidden)
            t5 = encoders[2]
            t5_states = t5(ids(tokenizers[2], t5, t5_tokens(pipeline)), return_dict=False)[0]  # (batch, T5 tokens, d)
            joined = torch.cat(clip_states, dim=-1)
            joined = torch.nn.functional.pad(joined, (0, t5_states.shape[-1] - joined.shape[-1]))
            return Conditioning(torch.cat([joined, t5_states], dim=-2), torch.cat(pooled_parts, dim=-1))
        states: list[Any] = []
        pooled: Any = None
        for tokenizer, encoder in zip(tokenizers, encoders, strict=True):
            tokens = ids(tokenizer, encoder, tokenizer.model_max_length)
            if len(encoders) == 1:
                return Conditioning(encoder(tokens, return_dict=False)[0])
            output = encoder(tokens, output_hidden_states=True, return_dict=False)
            pooled = output[0]  # (batch, projection): the text_embeds of CLIPTextModelWithProjection
            states.append(output[-1][-2])  # (batch, tokens, hidden)
    assert pooled is not None
    return Conditioning(torch.cat(states, dim=-1), pooled.view(len(captions), -1))
