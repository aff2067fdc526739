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
* what it does that the trace cannot run (`unmodelled`), said with every estimate (runners/profiles.py);
* its history (`history`): older versions of the tool whose step or defaults differ from the entry's, each with its
  version range and sources. `runner_version` picks one (`runner_entry`); unset, the entry itself (today's) counts.

bitsandbytes is no runner, but every runner's QLoRA runs its quantized layers: `bitsandbytes_version` picks an older
behaviour of those the same way (BITSANDBYTES for 4-bit layers, BITSANDBYTES_INT8 for 8-bit ones). transformers is no
runner either, but the runners that take the loss from the model's full logits run its causal-LM loss:
`transformers_version` picks an older one (TRANSFORMERS).

`tunecast` is the runner tunecast trains with; the others are for estimates (`memory`, `plan`, `train --dry-run`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from tunecast.config.spec import RunSpec
from tunecast.config.versions import Version, VersionRange, parse_version


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


_EVERY_VERSION = VersionRange()


@dataclass(frozen=True)
class Era:
    """Older versions of a tool (`versions`), and how their step or defaults differ from the tool's entry: each
    field given replaces the entry's (None keeps it). `label` names the versions in notes; `sources` say where each
    difference was read."""

    versions: VersionRange
    label: str
    step: tuple[str, ...] | None = None
    mixed_step: tuple[str, ...] | None = None
    qlora_step: tuple[str, ...] | None = None
    defaults: tuple[Default, ...] | None = None
    sources: tuple[str, ...] = ()


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
    versions: VersionRange = _EVERY_VERSION  # the versions `version` covers, as `runner_version` names them
    history: tuple[Era, ...] = ()  # older versions that differ, newest first

    def known(self) -> str:
        """The versions this runner knows, in words (for errors and docs)."""
        ranges = [self.versions, *(era.versions for era in self.history)]
        since = [r.since for r in ranges if r.since is not None]
        oldest = min(since) if len(since) == len(ranges) else None
        return VersionRange(oldest, None).text()

    def at(self, version: Version) -> Runner | None:
        """This entry as the tool behaved at `version`; None for a version it does not know."""
        if self.versions.contains(version):
            return self
        for era in self.history:
            if era.versions.contains(version):
                changed = {name: getattr(era, name) for name in ("step", "mixed_step", "qlora_step", "defaults")
                           if getattr(era, name) is not None}
                return replace(self, version=era.label, sources=(*era.sources, *self.sources), history=(),
                               **changed)
        return None


_TRAINER = ("autocast", "fp32-outputs")
_ACCELERATE = ("the transformers Trainer with bf16=True (or fp16=True) prepares the model through accelerate, whose "
               "Accelerator.prepare_model wraps forward in autocast and convert_outputs_to_fp32 (accelerate 1.15 "
               "accelerator.py prepare_model; utils/operations.py ConvertOutputsToFp32)")
_TRAINER_OPTIMIZER = Default("optimizer", "adamw", "TrainingArguments.optim is adamw_torch_fused on torch >= 2.8 "
                             "(transformers 5.24 training_args.py, default_optim)")

# TRL's older SFTTrainer, read at the tags of huggingface/trl named in each source. Newest first.
_TRL_BF16 = Default("precision", "bf16-mixed", "a model named by its id is loaded in float32 (from_pretrained's "
                    "default) and SFTConfig sets bf16 = not fp16 when unset (trl/trainer/sft_config.py __post_init__, "
                    "since TRL 0.19)")
_TRL_CHECKPOINTING = Default("grad_checkpointing", True, "gradient_checkpointing=True (trl/trainer/sft_config.py, "
                             "since TRL 0.22)")
_TRL_FP32 = Default("precision", "fp32", "before TRL 0.19 bf16 is TrainingArguments' False and a model named by its id "
                    "is loaded in float32 (from_pretrained's default): it trains in fp32")
_TRL_KBIT = ("kbit-fp32", "kbit-bf16-head")
_TRL_KBIT_SOURCE = ("QLoRA: SFTTrainer calls peft's prepare_model_for_kbit_training (every weight that is not 4-bit "
                    "cast to fp32), get_peft_model (fp32 adapters), then with bf16=True peft_module_casting_to_bf16, "
                    "which casts lm_head and embed_tokens back to bf16 and keeps the norms in fp32 (trl v0.13.0-"
                    "v0.21.0 trl/trainer/sft_trainer.py; trl/trainer/utils.py peft_module_casting_to_bf16); TRL 0.22 "
                    "stopped calling prepare_model_for_kbit_training")
_TRL_ACCURACY_SOURCE = ("SFTTrainer.compute_loss reports token accuracy from outputs.logits[..., :-1, :].contiguous(), "
                        "a copy of the logits made after the loss (trl v0.16.0-v1.5.1 trl/trainer/sft_trainer.py; "
                        "TRL 1.6 takes the argmax of a view, no copy)")
_TRL_LOGITS_SOURCE = ("the loss from the model's full logits, as the transformers Trainer computes it: loss_type "
                      "'nll' is the default before TRL 1.7 (trl/trainer/sft_config.py)")
_TRL_HISTORY = (
    Era(VersionRange((1, 7), (1, 15)), "TRL 1.7-1.14", step=("trl-chunks",),
        sources=("loss_type defaults to 'chunked_nll' (trl v1.7.0 trl/trainer/sft_config.py __post_init__): the "
                 "trained tokens' hidden states gathered, the loss over 256 of them at a time, each chunk's logits "
                 "computed in fp32 and checkpointed (trl/trainer/sft_trainer.py _chunked_cross_entropy_loss, _chunk, "
                 "_CHUNKED_LM_HEAD_CHUNK_SIZE)",)),
    Era(VersionRange((1, 6), (1, 7)), "TRL 1.6", step=(), sources=(_TRL_LOGITS_SOURCE,)),
    Era(VersionRange((0, 26), (1, 6)), "TRL 0.26-1.5", step=("accuracy-copy",),
        sources=(_TRL_LOGITS_SOURCE, _TRL_ACCURACY_SOURCE)),
    Era(VersionRange((0, 22), (0, 26)), "TRL 0.22-0.25", step=("accuracy-copy",),
        defaults=(_TRAINER_OPTIMIZER, _TRL_CHECKPOINTING, _TRL_BF16),
        sources=(_TRL_LOGITS_SOURCE, _TRL_ACCURACY_SOURCE, "QLoRA: adapters stay in fp32 (peft's get_peft_model); "
                 "the cast of a 4-bit model's trainable parameters to bf16 came in TRL 0.26")),
    Era(VersionRange((0, 19), (0, 22)), "TRL 0.19-0.21", step=("accuracy-copy",), qlora_step=_TRL_KBIT,
        defaults=(_TRAINER_OPTIMIZER, _TRL_BF16),
        sources=(_TRL_LOGITS_SOURCE, _TRL_ACCURACY_SOURCE, _TRL_KBIT_SOURCE, "gradient_checkpointing is "
                 "TrainingArguments' False before TRL 0.22")),
    Era(VersionRange((0, 16), (0, 19)), "TRL 0.16-0.18", step=("accuracy-copy",), qlora_step=_TRL_KBIT,
        defaults=(_TRAINER_OPTIMIZER, _TRL_FP32),
        sources=(_TRL_LOGITS_SOURCE, _TRL_ACCURACY_SOURCE, _TRL_KBIT_SOURCE)),
    Era(VersionRange((0, 13), (0, 16)), "TRL 0.13-0.15", step=(), qlora_step=_TRL_KBIT,
        defaults=(_TRAINER_OPTIMIZER, _TRL_FP32),
        sources=(_TRL_LOGITS_SOURCE, _TRL_KBIT_SOURCE, "no token accuracy before TRL 0.16 (compute_loss is the "
                 "Trainer's)")),
)

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
        versions=VersionRange((5, 24)),  # runner_version: the transformers version
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
            Default("lora.fp32_adapters", False, "a 4-bit or 8-bit model's trainable parameters are cast to bf16 "
                    "(trl/trainer/sft_trainer.py, after get_peft_model: is_loaded_in_4bit or is_loaded_in_8bit)",
                    methods=("qlora",)),
        ),
        sources=(_ACCELERATE, "SFTTrainer adds a fused LM head to the model (trl/trainer/utils.py add_fused_lm_head; "
                 "trl/kernels/chunked_logprob.py ChunkedLogProbFunction): TRL 1.7-1.14 computed the loss in "
                 "256-token chunks instead, and earlier versions from full logits"),
        versions=VersionRange((1, 15)),
        history=_TRL_HISTORY,
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
        versions=VersionRange((0, 18)),
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
        versions=VersionRange((0, 9, 6)),
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
        versions=VersionRange((2026, 8)),
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
        versions=VersionRange((0, 6)),
    ),
)}


# bitsandbytes, whose 4-bit layers every runner's QLoRA runs (bitsandbytes-foundation/bitsandbytes, read at its tags).
BITSANDBYTES = Runner(
    "bitsandbytes", "bitsandbytes", "bitsandbytes 0.43.2 and later",
    versions=VersionRange((0, 43, 2)),
    sources=("MatMul4Bit keeps no input for the backward pass (bitsandbytes/autograd/_functions.py; PR #1270, "
             "commit 9e75374, first released in 0.43.2)",),
    history=(Era(VersionRange((0, 39), (0, 43, 2)), "bitsandbytes 0.39-0.43.1", qlora_step=("kbit-keeps-input",),
                 sources=("MatMul4Bit.forward keeps its input A for the backward pass whenever an input needs a "
                          "gradient (ctx.tensors = (A, B), bitsandbytes 0.43.1 bitsandbytes/autograd/_functions.py), "
                          "which only grad_A's dequantized weight needs; 4-bit layers (Linear4bit) came in 0.39",)),),
)

# bitsandbytes' 8-bit layers (LLM.int8, Linear8bitLt), which a QLoRA run with quantization.bits 8 trains on; read in
# the installed bitsandbytes 0.50.2 only, so no older behaviour is known.
BITSANDBYTES_INT8 = Runner(
    "bitsandbytes-int8", "bitsandbytes LLM.int8", "bitsandbytes 0.50 and later (8-bit layers)",
    versions=VersionRange((0, 50)), qlora_step=("int8-keeps-input",),
    sources=("MatMul8bitLt.forward keeps its input A as ctx.tensors = (CAt, subA, A) whenever an input needs a "
             "gradient, a ctx attribute rather than save_for_backward, so non-reentrant checkpointing does not free "
             "it; MatMul8bitFp (the CPU path in training) keeps ctx.A = A alike (bitsandbytes 0.50.2 "
             "bitsandbytes/autograd/_functions.py)",),
)

_BITSANDBYTES_BY_BITS = {4: BITSANDBYTES, 8: BITSANDBYTES_INT8}

# transformers' causal-LM loss (ForCausalLMLoss, which a model's forward calls when given labels), read in
# huggingface/transformers' released wheels: what every runner whose loss comes from the model's full logits runs (the
# Trainer's, TRL's before 1.7, axolotl's, LLaMA-Factory's). The entry is what tunecast's trace runs (transformers 5.24).
TRANSFORMERS = Runner(
    "transformers", "transformers", "transformers 4.49 and later",
    versions=VersionRange((4, 49)),
    sources=("ForCausalLMLoss upcasts the logits to fp32 and pads the labels by one position, so the cross-entropy "
             "reads the upcast logits as they are (transformers/loss/loss_utils.py, read in 4.49.0 and 5.24.0; PR "
             "#35646, 'Optimize ForCausalLMLoss by removing unnecessary contiguous() call', first released in "
             "4.49.0)",),
    history=(Era(VersionRange((4, 46), (4, 49)), "transformers 4.46-4.48", step=("shifted-logits-copy",),
                 sources=("ForCausalLMLoss takes logits.float() and then shift_logits = logits[..., :-1, :]"
                          ".contiguous(), a second fp32 tensor of every position but each sequence's last, both "
                          "alive while the cross-entropy runs (transformers 4.46.0-4.48.3 loss/loss_utils.py); the "
                          "models' forward calls it from 4.46 (Llama, Qwen2, Phi-3, Mixtral, Gemma 1 and 2, Phi). "
                          "Mistral's forward calls it from 4.48; in 4.46-4.47 it takes the same copy itself and "
                          "returns the fp32 logits in place of its own, 2 bytes per logit less than estimated "
                          "(transformers 4.46.0, 4.47.1 models/mistral/modeling_mistral.py); GPT-2's copies the "
                          "shifted logits in their own dtype, estimated as ForCausalLMLoss. Before 4.46 each model's "
                          "forward computed the loss in its own way, not modelled",)),),
)


class UnknownVersion(ValueError):
    """A version the entry has no behaviour for: the message says which it knows."""


def _resolved(entry: Runner, text: str | None) -> Runner:
    if text is None:
        return entry
    version = parse_version(text)
    found = entry.at(version) if version is not None else None
    if found is None:
        raise UnknownVersion(f"{entry.label} {text} is not one tunecast models: it knows {entry.known()}")
    return found


def runner_entry(spec: RunSpec) -> Runner:
    """`spec`'s runner as its `runner_version` ran (today's without one). A version the runner does not know raises
    UnknownVersion (config checks report it first, checks.py)."""
    return _resolved(RUNNERS[spec.runner], spec.runner_version)


def bitsandbytes_entry(spec: RunSpec) -> Runner:
    """bitsandbytes' layers of `spec.quantization.bits` as `spec.bitsandbytes_version` ran (today's without one)."""
    return _resolved(_BITSANDBYTES_BY_BITS[spec.quantization.bits], spec.bitsandbytes_version)


def transformers_entry(spec: RunSpec) -> Runner:
    """transformers' causal-LM loss as `spec.transformers_version` ran it (today's without one, and for runner
    tunecast, whose step runs the transformers installed: the config checks refuse a version there)."""
    return _resolved(TRANSFORMERS, spec.transformers_version if spec.runner != "tunecast" else None)


def version_problem(spec: RunSpec) -> tuple[str, str, str] | None:
    """(key, what is wrong, how to fix) for a version `spec` names that no entry knows; None when all are known."""
    if spec.runner not in RUNNERS:  # a diffusion pipeline's runner (config/diffusion_runner.py): no versions
        if spec.runner_version is not None:
            return ("runner_version", f"{spec.runner} is read at one version only (docs/diffusion.md)",
                    "remove runner_version")
        return None
    if spec.runner_version is not None and spec.runner == "tunecast":
        return ("runner_version", "names a version of another tool, and runner is tunecast (this version's own step)",
                "set runner to the tool that version is of (trl, hf-trainer, axolotl, …), or remove runner_version")
    if spec.transformers_version is not None and spec.runner == "tunecast":
        return ("transformers_version", "names the transformers another tool ran, and runner is tunecast (this "
                "version's own step, on the transformers installed)", "set runner to the tool that ran on that "
                "transformers (trl, hf-trainer, axolotl, llamafactory), or remove transformers_version")
    for key, entry, text in (("runner_version", RUNNERS[spec.runner], spec.runner_version),
                             ("bitsandbytes_version", _BITSANDBYTES_BY_BITS[spec.quantization.bits],
                              spec.bitsandbytes_version),
                             ("transformers_version", TRANSFORMERS, spec.transformers_version)):
        if text is None:
            continue
        if parse_version(text) is None:
            return key, f"'{text}' is not a version", "write dotted numbers, such as 0.13 or 1.7.1"
        try:
            _resolved(entry, text)
        except UnknownVersion as error:
            eras = ", ".join(era.label for era in entry.history)
            return key, str(error), (f"give a version of {entry.known()} ({entry.version}"
                                     + (f"; older: {eras}" if eras else "") + "), or remove it for today's")
    return None


def runner_defaults(spec: RunSpec) -> dict[str, Any]:
    """The keys `spec`'s runner (at its `runner_version`) sets because the config left them unset; {} for a
    diffusion pipeline's runner (config/diffusion_runner.py applies those)."""
    if spec.runner not in RUNNERS:
        return {}
    try:
        entry = runner_entry(spec)
    except UnknownVersion:  # reported by the config checks; no defaults from a version nobody knows
        return {}
    return {d.key: d.value for d in entry.defaults if d.applies(spec) and not spec.fixed(d.key)}


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
