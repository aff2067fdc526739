"""What `runner:` means in a config: the tool that runs the training step, which tunecast estimates.

Each tool is written here once (RUNNERS), with where each fact was read (the tool's file and function at the version
read; docs/runners.md lists them, with the research behind them in docs/research/runners.md):

* its step variants, by name: what the tool's step does to the tensors it holds that tunecast's does not — the
  dtype it leaves a 4-bit model's other weights in, the autocast it runs under, the copies of the logits it
  returns, its loss. What each name means, and when it runs, is step/variants.py's; the tracer runs them, so their
  memory is traced, not guessed;
* its defaults: how the tool runs a step where the config leaves a key unset (its optimizer, whether it checkpoints
  or offloads, its master weights' and adapters' dtype). Loading a config applies them (load.py, `apply_runner`);
  a key the config or a flag sets wins. What the run is — its batch, length, epochs, learning rate — stays the
  config's: a tool's defaults for those are read with its own config (`--from`, runners/<tool>.py);
* what it does that the trace cannot run (`unmodelled`), said with every estimate (runners/profiles.py).

`tunecast` is the runner tunecast trains with; the others are for estimates (`memory`, `plan`, `train --dry-run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tunecast.config.spec import RunSpec


@dataclass(frozen=True)
class Default:
    """A RunSpec key the runner sets when the config leaves it unset: for `methods`, on one GPU only when
    `single_gpu`."""

    key: str
    value: Any
    source: str
    methods: tuple[str, ...] = ("full", "lora", "qlora")
    single_gpu: bool = False

    def applies(self, spec: RunSpec) -> bool:
        return spec.method in self.methods and (not self.single_gpu or spec.gpus.count == 1)


@dataclass(frozen=True)
class Runner:
    name: str
    label: str
    version: str  # the versions whose code and defaults this entry describes
    mixed_step: tuple[str, ...] = ()  # step variants under mixed precision (step/variants.py MIXED)
    step: tuple[str, ...] = ()  # step variants always
    qlora_step: tuple[str, ...] = ()  # step variants for QLoRA
    defaults: tuple[Default, ...] = ()
    sources: tuple[str, ...] = ()  # where the step variants are written
    unmodelled: tuple[str, ...] = ()  # what the tool does that the estimate does not trace


_TRAINER = ("autocast", "fp32-outputs")
_ACCELERATE = ("the transformers Trainer with bf16=True (or fp16=True) prepares the model through accelerate, whose "
               "Accelerator.prepare_model wraps forward in autocast and convert_outputs_to_fp32 (accelerate 1.15 "
               "accelerator.py prepare_model; utils/operations.py ConvertOutputsToFp32)")
_TRAINER_OPTIMIZER = Default("optimizer", "adamw", "TrainingArguments.optim is adamw_torch_fused on torch >= 2.8 "
                             "(transformers 5.24 training_args.py, default_optim)")

RUNNERS: dict[str, Runner] = {runner.name: runner for runner in (
    Runner("tunecast", "tunecast", "this version", sources=("step/forward.py, step/setup.py",)),
    Runner(
        "hf-trainer", "transformers Trainer", "transformers 5.24, peft 0.21, accelerate 1.15",
        mixed_step=_TRAINER, qlora_step=("kbit-fp32",),
        defaults=(
            _TRAINER_OPTIMIZER,
            Default("grad_checkpointing", True, "peft's prepare_model_for_kbit_training enables it unless "
                    "use_gradient_checkpointing=False (peft 0.21 src/peft/utils/other.py)", methods=("qlora",)),
        ),
        sources=(_ACCELERATE, "QLoRA as peft's documentation prepares it: prepare_model_for_kbit_training casts "
                 "every fp16/bf16 parameter that is not Params4bit to fp32 (peft 0.21 src/peft/utils/other.py)"),
    ),
    Runner(
        "trl", "TRL SFTTrainer", "TRL 1.15-1.16",
        mixed_step=_TRAINER, step=("fused-head",),
        defaults=(
            _TRAINER_OPTIMIZER,
            Default("grad_checkpointing", True, "gradient_checkpointing=True (trl/trainer/base_config.py, since TRL "
                    "0.22)"),
            Default("precision", "bf16-mixed", "a model named by its id is loaded in float32 (trl/trainer/utils.py, "
                    "create_model_from_path: dtype float32) and bf16=True is the default (trl/trainer/"
                    "base_config.py)"),
            Default("lora.fp32_adapters", False, "a 4-bit model's trainable parameters are cast to bf16 "
                    "(trl/trainer/sft_trainer.py, after get_peft_model)", methods=("qlora",)),
        ),
        sources=(_ACCELERATE, "SFTTrainer adds a fused LM head to the model (trl/trainer/utils.py add_fused_lm_head; "
                 "trl/kernels/chunked_logprob.py ChunkedLogProbFunction): TRL 1.7-1.14 computed the loss in "
                 "256-token chunks instead, and earlier versions from full logits"),
    ),
    Runner(
        "axolotl", "axolotl", "axolotl 0.18",
        mixed_step=_TRAINER,
        defaults=(
            Default("optimizer", "adamw", "optimizer defaults to adamw_torch_fused (axolotl "
                    "utils/schemas/training.py)"),
        ),
        sources=(_ACCELERATE, "QLoRA: embeddings, head and norms are cast to fp32 for "
                 "prepare_model_for_kbit_training and back to the model's dtype afterwards "
                 "(axolotl loaders/model.py _configure_embedding_dtypes): bf16 when training starts"),
        unmodelled=("the fused LoRA Triton kernels axolotl enables by itself for LoRA and QLoRA on supported "
                    "models (lora_mlp_kernel, lora_qkv_kernel, lora_o_kernel) keep fewer activations than the "
                    "traced peft layers: the estimate is high by that",),
    ),
    Runner(
        "llamafactory", "LLaMA-Factory", "LLaMA-Factory 0.9.6",
        mixed_step=_TRAINER,
        defaults=(
            _TRAINER_OPTIMIZER,
            Default("grad_checkpointing", True, "on unless disable_gradient_checkpointing (LLaMA-Factory "
                    "hparams/model_args.py; model/model_utils/checkpointing.py prepare_model_for_training)"),
            Default("precision", "bf16-mixed", "full fine-tuning upcasts every trainable parameter to fp32 unless "
                    "pure_bf16 (LLaMA-Factory model/adapter.py _setup_full_tuning)", methods=("full",)),
        ),
        sources=(_ACCELERATE, "QLoRA keeps the weights that are not 4-bit in the model's dtype: "
                 "upcast_layernorm and upcast_lmhead_output default to false (LLaMA-Factory hparams/model_args.py)"),
    ),
    Runner(
        "unsloth", "unsloth", "unsloth 2026.8",
        mixed_step=("autocast",), step=("fused-chunks",),
        defaults=(
            Default("grad_checkpointing", True, "use_gradient_checkpointing='unsloth' (unsloth models/llama.py "
                    "get_peft_model)"),
            Default("activation_offload", True, "the 'unsloth' checkpointing keeps each layer's input in CPU "
                    "memory (unsloth_zoo/gradient_checkpointing.py Unsloth_Offloaded_Gradient_Checkpointer)"),
            Default("optimizer", "adamw-8bit", "optim='adamw_8bit' in unsloth's generated trainer configs "
                    "(unsloth models/rl.py)"),
        ),
        sources=("the Llama-family forward computes the loss with unsloth's fused cross-entropy and returns no "
                 "logits (unsloth models/llama.py; unsloth_zoo/fused_losses/cross_entropy_loss.py)",
                 "QLoRA: only the adapters are upcast to fp32; embeddings, norms and head stay in the model's dtype "
                 "(unsloth_zoo/training_utils.py prepare_model_for_training)"),
        unmodelled=("unsloth's own Triton kernels (RoPE, RMSNorm, SwiGLU, LoRA MLP) keep fewer activations than "
                    "the traced transformers layers: the estimate is high by that",
                    "the fused cross-entropy's chunks shrink when less than 8 GiB of the GPU is free"),
    ),
    Runner(
        "torchtune", "torchtune", "torchtune 0.6-0.7",
        step=("output-chunks",),
        defaults=(
            Default("lora.fp32_adapters", False, "the model and its adapters are built in the recipe's dtype "
                    "(torchtune recipes/lora_finetune_single_device.py, training.set_default_dtype)"),
            Default("grad_checkpointing", True, "enable_activation_checkpointing: True in the published Llama 3.1 "
                    "8B and 70B recipe configs (recipes/configs/llama3_1; the recipes' own default is False, and "
                    "the 1B configs turn it off)"),
            Default("optimizer", "paged-adamw-8bit", "8B_full_single_device.yaml: bitsandbytes PagedAdamW8bit",
                    methods=("full",), single_gpu=True),
            Default("optimizer_in_backward", True, "8B_full_single_device.yaml: optimizer_in_bwd: True",
                    methods=("full",), single_gpu=True),
        ),
        sources=("loss LinearCrossEntropyLoss, num_output_chunks 8 (torchtune modules/loss/cross_entropy_loss.py)",
                 "no autocast: dtype bf16 trains bf16 weights (torchtune training/precision.py)"),
        unmodelled=("QLoRA's NF4 weights are torchao's (same 4 bits per weight as bitsandbytes' NF4, modelled "
                    "alike)",),
    ),
)}


def runner_defaults(spec: RunSpec) -> dict[str, Any]:
    """The keys `spec`'s runner sets because the config left them unset."""
    return {d.key: d.value for d in RUNNERS[spec.runner].defaults if d.applies(spec) and not spec.fixed(d.key)}


def apply_runner(spec: RunSpec) -> RunSpec:
    """`spec` with its runner's defaults for the keys it left unset. The keys the config set stay the only ones
    that count as set, with the runner's beside them (`RunSpec.fixed`), so the planner still varies the rest."""
    changes = runner_defaults(spec)
    if not changes:
        return spec
    updated = spec.with_changes(changes)
    object.__setattr__(updated, "__pydantic_fields_set__",
                       set(spec.model_fields_set) | {key.partition(".")[0] for key in changes})
    sections = [name for name in RunSpec.model_fields if isinstance(getattr(spec, name), BaseModel)]
    for section in sections:
        own = set(getattr(spec, section).model_fields_set)
        own |= {key.partition(".")[2] for key in changes if key.startswith(f"{section}.")}
        object.__setattr__(getattr(updated, section), "__pydantic_fields_set__", own)
    return updated
