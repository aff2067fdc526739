"""What `runner:` means for a diffusion pipeline: the tool whose training defaults the estimate follows.

The step itself is diffusers' (step/diffusion.py), which every one of these tools runs on the same denoisers; what
differs between them, for memory, is how each sets the step up where the config leaves a key unset: the LoRA rank
and which layers it adapts, gradient checkpointing, the optimizer, the precision of the trained and of the frozen
parts (the VAE's included), and whether the VAE's latents and the text encoders' outputs are cached, unloading the
parts that make them. Each tool is written here once (DIFFUSION_RUNNERS) with those defaults, each with the file
and line it was read at (the commits in SOURCES), and what it does by default that the trace does not run
(`unmodelled`, said with every estimate). Loading a pipeline's config applies them (load.py): a key the config or a
flag sets wins, as for the language models' runners (config/runner.py). What the run is, its batch, resolution and
length, stays the config's; a tool's own defaults for those are read with its config (`--from`, runners/kohya.py,
runners/ai_toolkit.py).

`tunecast` (no runner) is diffusers' training examples' step as tunecast estimates it: `diffusers` is that step
with the examples' defaults for the keys tunecast would otherwise fill with its own (rank 4, torch's AdamW).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tunecast.config.runner import Default
from tunecast.config.spec import RunSpec

# The commits each tool was read at (file and line numbers in the sources below are of these).
SOURCES = {
    "diffusers": "huggingface/diffusers @ 58eb52c0803ea9af3abec60841c2a093bdf1f951 (examples/)",
    "kohya": "kohya-ss/sd-scripts @ 48d368fa557731ad0488c07304dfeba8c07910eb",
    "simpletuner": "bghira/SimpleTuner @ bc8e6ab7738ce457a2ed8eb2d26cadd91c6442cb",
    "ai-toolkit": "ostris/ai-toolkit @ 27a03a91f23eb1b757d5ec2e80ee3e129cfcc350",
}


@dataclass(frozen=True)
class DiffusionRunner:
    name: str
    label: str
    version: str  # what was read: the repository and commit
    defaults: tuple[Default, ...] = ()
    unmodelled: tuple[str, ...] = ()  # what the tool does by default that the estimate does not trace


_TORCH_ADAMW = "torch.optim.AdamW with no fused flag: its multi-tensor (foreach) step on a GPU"

DIFFUSION_RUNNERS: dict[str, DiffusionRunner] = {runner.name: runner for runner in (
    DiffusionRunner(
        "diffusers", "diffusers training examples", SOURCES["diffusers"],
        defaults=(
            Default("lora.rank", 4, "--rank default 4 (examples/dreambooth/train_dreambooth_lora_sdxl.py L658-660, "
                    "and the other LoRA examples)", methods=("lora",)),
            Default("lora.alpha", 4, "lora_alpha=args.rank (train_dreambooth_lora_sdxl.py L1209); the FLUX script's "
                    "--lora_alpha defaults to 4 as well (train_dreambooth_lora_flux.py L382)", methods=("lora",)),
            Default("optimizer", "adamw-foreach", f"{_TORCH_ADAMW} unless --use_8bit_adam "
                    "(train_dreambooth_lora_sdxl.py L1409)"),
            Default("grad_checkpointing", False, "--gradient_checkpointing is off unless given "
                    "(train_dreambooth_lora_sdxl.py L486)"),
        ),
        unmodelled=("--mixed_precision defaults to accelerate's config (train_dreambooth_lora_sdxl.py L633-636): the "
                    "estimate takes the config's precision",),
    ),
    DiffusionRunner(
        "kohya", "kohya sd-scripts", SOURCES["kohya"],
        defaults=(
            Default("lora.rank", 4, "--network_dim unset: networks/lora.py uses 4 (L429-430)", methods=("lora",)),
            Default("lora.alpha", 1, "--network_alpha default 1 (train_network.py L1791-1794)", methods=("lora",)),
            Default("diffusion.lora_layers", "blocks", "every Linear and 1 × 1 Conv2d in a U-Net's "
                    "Transformer2DModel (networks/lora.py L867, L960-990); every Linear of FLUX's double and single "
                    "blocks (networks/lora_flux.py L709-710)", methods=("lora",)),
            Default("precision", "fp32", "--mixed_precision default 'no' (library/train_util.py L3981-3986): "
                    "weight_dtype float32 (prepare_dtype, L5507-5512)"),
            Default("optimizer", "adamw-foreach", f"--optimizer_type unset is 'AdamW' (library/train_util.py "
                    f"get_optimizer), {_TORCH_ADAMW} (L5095-5098)"),
            Default("grad_checkpointing", False, "--gradient_checkpointing is off unless given "
                    "(library/train_util.py L3972)"),
            Default("diffusion.cache_latents", False, "--cache_latents is off unless given (library/train_util.py "
                    "L4567)"),
            Default("diffusion.cache_text", False, "--cache_text_encoder_outputs is off unless given "
                    "(library/train_util.py L4254): the text encoders stay loaded, FLUX's T5-XXL too"),
            Default("diffusion.vae_fp32", False, "the VAE in weight_dtype unless --no_half_vae (train_network.py "
                    "L599)"),
        ),
        unmodelled=("the text encoders' LoRA, trained unless --network_train_unet_only (train_network.py L1810; "
                    "CLIP-L's for FLUX, flux_train_network.py L71): the estimate traces the denoiser's only, low by "
                    "the encoders' activations and adapters (small beside a U-Net's or FLUX's)",
                    "kohya's own U-Net and FLUX modules, estimated as diffusers' (the same layers: FLUX's fused qkv "
                    "projection is three layers in diffusers')"),
    ),
    DiffusionRunner(
        "simpletuner", "SimpleTuner", SOURCES["simpletuner"],
        defaults=(
            Default("lora.rank", 16, "--lora_rank default 16 (simpletuner/simpletuner_sdk/server/services/"
                    "field_registry/sections/lora.py L18-25)", methods=("lora",)),
            Default("diffusion.lora_layers", "attention", "the attention projections: SDXL's DEFAULT_LORA_TARGET "
                    "(simpletuner/helpers/models/sdxl/model.py L57), FLUX's --flux_lora_target 'all' "
                    "(simpletuner/helpers/models/flux/model.py L1249-1261)", methods=("lora",)),
            Default("grad_checkpointing", True, "--gradient_checkpointing default true (field_registry/sections/"
                    "training.py L218-224)"),
            Default("diffusion.cache_latents", True, "the VAE's latents precomputed to a cache and the VAE unloaded "
                    "unless --vae_cache_ondemand (default false: sections/model.py L369-375; "
                    "simpletuner/helpers/training/trainer.py init_unload_vae, L4642-4651)"),
            Default("diffusion.cache_text", True, "the text embeddings precomputed to a cache and the encoders "
                    "unloaded when they are not trained (simpletuner/helpers/training/trainer.py "
                    "init_unload_text_encoder, L2930-2944)"),
            Default("diffusion.vae_fp32", False, "--vae_dtype default bf16 (sections/model.py L346-352)"),
        ),
        unmodelled=("--optimizer default adamw_bf16 (sections/training.py L108-114) keeps its states in bf16: "
                    "estimated with the config's optimizer (torch's AdamW, fp32 states, unless set), high by up to 4 "
                    "bytes per trained parameter",),
    ),
    DiffusionRunner(
        "ai-toolkit", "ai-toolkit", SOURCES["ai-toolkit"],
        defaults=(
            Default("lora.rank", 4, "network linear (rank) default 4 (toolkit/config_modules.py L172-182)",
                    methods=("lora",)),
            Default("lora.alpha", 1, "network linear_alpha default alpha, 1.0 (toolkit/config_modules.py L184-185)",
                    methods=("lora",)),
            Default("diffusion.lora_layers", "blocks", "every Linear of the transformer blocks "
                    "(toolkit/lora_special.py L540-555, transformer_only default true: toolkit/config_modules.py "
                    "L202)", methods=("lora",)),
            Default("precision", "fp32", "train dtype default 'fp32' (toolkit/config_modules.py L395), the dtype the "
                    "model is loaded in (jobs/process/BaseSDTrainProcess.py L1505)"),
            Default("optimizer", "adamw-foreach", f"train optimizer default 'adamw' (toolkit/config_modules.py L387): "
                    f"{_TORCH_ADAMW} (toolkit/optimizer.py L78-79)"),
            Default("grad_checkpointing", True, "train gradient_checkpointing default true (toolkit/config_modules.py "
                    "L413)"),
            Default("diffusion.cache_latents", False, "dataset cache_latents and cache_latents_to_disk default false "
                    "(toolkit/config_modules.py DatasetConfig)"),
            Default("diffusion.cache_text", False, "dataset cache_text_embeddings default false and "
                    "unload_text_encoder default false (toolkit/config_modules.py L564-566, L1011)"),
            Default("diffusion.vae_fp32", False, "model vae_dtype defaults to model dtype, float16 "
                    "(toolkit/config_modules.py L645, L680)"),
        ),
        unmodelled=("optimum-quanto's qfloat8 weights (model quantize: true) are modelled as float8 weights upcast "
                    "layer by layer; their per-channel scales are not counted",),
    ),
)}


def diffusion_runner_defaults(spec: RunSpec) -> dict[str, Any]:
    """The keys `spec`'s diffusion runner sets because the config left them unset; {} for any other runner."""
    runner = DIFFUSION_RUNNERS.get(spec.runner)
    if runner is None:
        return {}
    return {d.key: d.value for d in runner.defaults if d.applies(spec) and not spec.fixed(d.key)}


def apply_diffusion_runner(spec: RunSpec) -> tuple[RunSpec, tuple[Default, ...]]:
    """`spec` with its diffusion runner's defaults for the keys it left unset, and the defaults applied. The keys the
    config set stay the only ones that count as its own, with the runner's beside them (`RunSpec.fixed`)."""
    changes = diffusion_runner_defaults(spec)
    if not changes:
        return spec, ()
    applied = tuple(d for d in DIFFUSION_RUNNERS[spec.runner].defaults if d.key in changes)
    updated = spec.with_changes(changes)
    object.__setattr__(updated, "__pydantic_fields_set__",
                       set(spec.model_fields_set) | {key.partition(".")[0] for key in changes})
    for section in [name for name in RunSpec.model_fields if isinstance(getattr(spec, name), BaseModel)]:
        own = set(getattr(spec, section).model_fields_set)
        own |= {key.partition(".")[2] for key in changes if key.startswith(f"{section}.")}
        object.__setattr__(getattr(updated, section), "__pydantic_fields_set__", own)
    return updated, applied


def diffusion_runner_notes(spec: RunSpec, applied: tuple[Default, ...]) -> list[str]:
    """What an estimate says of `spec`'s diffusion runner: whose defaults, each applied with its source, and what is
    not traced; [] without one."""
    runner = DIFFUSION_RUNNERS.get(spec.runner)
    if runner is None:
        return []
    lines = [f"runner {runner.label}: the defaults of {runner.version} for the keys the config leaves unset"]
    lines += [f"runner {runner.label}: {d.key} {_text(d.value)} ({d.source})" for d in applied]
    return lines + [f"runner {runner.label}: not modelled: {text}" for text in runner.unmodelled]


def differences_table() -> str:
    """Every diffusion runner's defaults and what is not modelled, with sources, as Markdown (docs/diffusion.md
    holds it; a test keeps the two equal)."""
    lines = ["| runner | read at | defaults for unset keys | not modelled |", "|---|---|---|---|"]
    for runner in DIFFUSION_RUNNERS.values():
        defaults = []
        for default in runner.defaults:
            where = "" if default.methods == ("full", "lora", "qlora") else f" ({', '.join(default.methods)})"
            defaults.append(f"`{default.key}: {_text(default.value)}`{where} — {default.source}")
        cells = [f"`{runner.name}` ({runner.label})", runner.version, "<br>".join(defaults) or "—",
                 "<br>".join(runner.unmodelled) or "—"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
