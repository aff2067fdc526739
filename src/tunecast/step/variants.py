"""How other tools' training steps differ from tunecast's, as the tracer runs them: each variant by name, which of them
a config's runner runs (`runner_step`), and what an estimate says of them (`runner_notes`). Which tool names which
variants, with sources: config/runner.py."""

from __future__ import annotations

from typing import Any

from tunecast.config.runner import bitsandbytes_entry, runner_entry, transformers_entry
from tunecast.config.spec import RunSpec
from tunecast.config.versions import parse_version

# How another tool's step differs from tunecast's where it changes the tensors a step holds; the trace runs each
# (setup.py, forward.py, loss.py). Which tools run which, with sources: config/runner.py.
STEP_VARIANTS = {
    "autocast": "bf16 weights computed under bf16 autocast (accelerate's mixed precision, which the transformers "
                "Trainer turns on with bf16=True whatever dtype the weights were loaded in)",
    "fp32-outputs": "the logits the model returns copied to fp32 at the end of the forward pass (accelerate's "
                    "convert_outputs_to_fp32 under mixed precision), alive until the loss is taken",
    "kbit-fp32": "for QLoRA, every weight that is not 4-bit (embeddings, norms, output head, biases) cast to fp32 "
                 "(peft's prepare_model_for_kbit_training)",
    "fused-head": "the loss through a fused output head: logits one tile of 4,096 tokens × 32,768 entries at a "
                  "time, per-token statistics in fp32, the hidden states' gradient accumulated in fp32 (TRL's "
                  "SFTTrainer since 1.15); no full logits",
    "fused-head-cpu": "TRL's fused output head as it runs without Triton (on a CPU): its torch fallback folds each "
                      "whole tile of 4,096 tokens × 32,768 entries with tile-sized fp32 temporaries (traced from "
                      "trl/kernels/chunked_logprob.py when TRL is installed; else as on a GPU)",
    "output-chunks": "the loss in 8 chunks of tokens, each chunk's logits upcast to fp32 and kept for the backward "
                     "pass (torchtune's LinearCrossEntropyLoss); no full logits",
    "compiled-loss": "the cross-entropy compiled (torch.compile): its backward keeps the logits in their own dtype "
                     "and a log-sum-exp per token, not fp32 log-probabilities, and recomputes the softmax",
    "trl-chunks": "the loss over the trained tokens' gathered hidden states, 256 tokens at a time, each chunk's "
                  "logits computed in fp32 from fp32 copies of its hidden states and of the output head, and "
                  "recomputed in the backward pass (TRL 1.7-1.14's chunked_nll); no full logits",
    "accuracy-copy": "after the loss, a copy of the logits (as the model returned them) for the token accuracy the "
                     "trainer reports (TRL 0.16-1.5's compute_loss)",
    "kbit-bf16-head": "for QLoRA under bf16, the output head and embeddings cast back to bf16 after the fp32 cast, "
                      "the norms left in fp32 (TRL's peft_module_casting_to_bf16, before TRL 0.22)",
    "kbit-input-dtype": "for QLoRA, each 4-bit layer computes in the compute dtype and returns its input's dtype "
                        "(bitsandbytes' Linear4bit.forward, x.to(compute_dtype) then out.to(inp_dtype)): after "
                        "peft's fp32 casts the norms feed it fp32, so the residual stream and each checkpointed "
                        "layer's input turn fp32",
    "kbit-keeps-input": "for QLoRA, each 4-bit layer keeps its input (in the compute dtype) for the backward pass, "
                        "outside a checkpointed layer (bitsandbytes' MatMul4Bit before 0.43.2)",
    "linear-experts": "for QLoRA, the experts and the router as nn.Linear modules, one MLP per expert (transformers "
                      "before 5): bitsandbytes quantizes them with the other Linear weights, so peft's fp32 cast "
                      "leaves them",
    "int8-keeps-input": "for an 8-bit base, each 8-bit layer keeps its input (as it comes) for the backward pass, "
                        "also inside a checkpointed layer: bitsandbytes keeps it as an attribute of the autograd "
                        "context, which non-reentrant checkpointing does not free (MatMul8bitLt, bitsandbytes 0.50)",
    "fused-chunks": "the loss in as few chunks as keep each chunk's fp32 logits within 4 GiB, each recomputed in "
                    "the backward pass (unsloth's fused cross-entropy); no full logits",
    "shifted-logits-copy": "the model's loss takes a contiguous fp32 copy of the logits but each sequence's last "
                           "position beside their fp32 upcast, both alive while the cross-entropy runs (transformers "
                           "4.46-4.48's ForCausalLMLoss)",
}
# Variants whose chunk count follows the length: a step template (polynomials in the length) cannot describe them.
CHUNKING_VARIANTS = ("fused-head", "fused-head-cpu", "output-chunks", "fused-chunks", "compiled-loss", "trl-chunks")
# The losses an estimate composes onto a template of the rest of the step (estimate/compose.py), and the stand-in
# each is templated with: what it takes (the gathered trained tokens, or the hidden states), and whether it calls the
# output head as a module (which makes what follows temporaries, as the tracer counts them).
# `loss-chunks` is no runner's variant but `loss: chunked` (tunecast's own chunked loss, and what axolotl's and
# LLaMA-Factory's Liger fused cross-entropy are estimated with): its chunks over the hidden states are composed alike.
SEGMENT_LOSSES = ("fused-head", "trl-chunks", "output-chunks", "fused-chunks", "loss-chunks")
STUBS = {"fused-head": "stub-tokens", "trl-chunks": "stub-tokens", "output-chunks": "stub-tokens-head",
         "fused-chunks": "stub-hidden-head", "loss-chunks": "stub-hidden-head"}
STUB_INPUTS = {"stub-tokens": "tokens", "stub-tokens-head": "tokens", "stub-hidden-head": "hidden"}
STUB_CALLS_HEAD = ("stub-tokens-head", "stub-hidden-head")
# Variants that take the loss from the hidden states themselves (the model returns no logits).
OWN_LOSSES = ("fused-head", "fused-head-cpu", "output-chunks", "fused-chunks", "trl-chunks")
# Variants of the loss the model computes itself from its full logits (transformers' ForCausalLMLoss): a step whose
# loss is another (chunked, compiled, or a tool's own) does not run them.
MODEL_LOSS = ("shifted-logits-copy",)
# Variants that run only where the trainer's bf16=True (or fp16=True) is on: the precisions of MIXED.
MIXED_ONLY = ("kbit-bf16-head",)
# Variants a step runs otherwise where its tool finds no GPU kernels: on the CPU (`--device cpu`).
ON_CPU = {"fused-head": "fused-head-cpu"}
# Precisions under which a tool built on the transformers Trainer runs accelerate's autocast (bf16=True or
# fp16=True in its arguments; `bf16` here is bf16 weights with the Trainer's bf16=True): its `mixed_step` runs.
MIXED = ("bf16", "bf16-mixed", "fp16-mixed")


# Families whose experts transformers 4.x built as one MLP of nn.Linear modules per expert in an nn.ModuleList, and
# the router as an nn.Linear (Mixtral since transformers PR #27942: MixtralBlockSparseTop2MLP's w1/w2/w3 and `gate`;
# Qwen3-MoE's Qwen3MoeMLP alike); bitsandbytes' 4-bit conversion replaced them as it does every nn.Linear.
# transformers 5 fused them into 3-D parameters (vLLM PR #33413: "In Transformers v5 the parameters are already
# fused"). gpt-oss had fused 3-D experts from its first release (4.55, GptOssExperts).
LINEAR_EXPERTS_BEFORE_5 = frozenset({"qwen3_moe", "mixtral"})


def experts_were_linear(config: dict[str, Any], spec: RunSpec | None) -> bool:
    """Whether the transformers `spec`'s runner ran (its `transformers_version`; unset, tunecast's own step, or no
    spec: today's) built this model's experts and router as nn.Linear modules (LINEAR_EXPERTS_BEFORE_5, before
    transformers 5)."""
    ran = spec.transformers_version if spec is not None and spec.runner != "tunecast" else None
    version = parse_version(ran) if ran else None
    if version is None or version[0] >= 5:
        return False
    inner = config.get("text_config")
    text = inner if isinstance(inner, dict) and "model_type" in inner else config
    return text.get("model_type") in LINEAR_EXPERTS_BEFORE_5


def runner_step(spec: RunSpec, device: str = "cuda") -> tuple[str, ...]:
    """The variants the tracer runs for `spec`'s runner (at its `runner_version`) on `device`, those of its loss at
    its `transformers_version`, and for QLoRA those of bitsandbytes' layers of its `quantization.bits` at its
    `bitsandbytes_version` (none for tunecast's own step on 4-bit weights with today's bitsandbytes)."""
    runner = runner_entry(spec)
    chosen = [*runner.step, *transformers_entry(spec).step, *(runner.mixed_step if spec.precision in MIXED else ())]
    if device == "cpu":
        chosen = [ON_CPU.get(variant, variant) for variant in chosen]
    if spec.method == "qlora":
        chosen += [*runner.qlora_step, *bitsandbytes_entry(spec).qlora_step]
        if "kbit-fp32" in chosen and spec.quantization.bits == 4:
            # bitsandbytes' 4-bit layers return their input's dtype in every version (0.39-0.50); only fp32 inputs,
            # which peft's fp32 norms make, change the step, so the variant goes with kbit-fp32
            chosen.append("kbit-input-dtype")
    if spec.precision not in MIXED:
        chosen = [variant for variant in chosen if variant not in MIXED_ONLY]
    if any(variant in OWN_LOSSES for variant in chosen):  # the model returns no logits to copy, and takes no loss
        chosen = [variant for variant in chosen if variant not in ("fp32-outputs", "accuracy-copy", *MODEL_LOSS)]
    if spec.loss == "chunked" or spec.compile:  # tunecast's chunks, or a compiled cross-entropy: not the model's loss
        chosen = [variant for variant in chosen if variant not in MODEL_LOSS]
    if spec.compile and not any(v in ("fused-head", "fused-head-cpu", "fused-chunks", "trl-chunks") for v in chosen):
        # those hold no logits
        chosen.append("compiled-loss")
    return tuple(dict.fromkeys(chosen))


def runner_notes(spec: RunSpec, device: str = "cuda") -> list[str]:
    """What `spec`'s runner (at its `runner_version`) changes in its step on `device`, which transformers loss and
    which bitsandbytes a QLoRA step follows, and what is not traced, for an estimate's notes."""
    runner, bitsandbytes, transformers = runner_entry(spec), bitsandbytes_entry(spec), transformers_entry(spec)
    chosen = runner_step(spec, device)
    lines = []
    if spec.runner != "tunecast":
        lines.append(f"runner {runner.label}: the step and defaults of {runner.version}"
                     + (f" (runner_version {spec.runner_version})" if spec.runner_version is not None else
                        "; set runner_version for an older version (docs/runners.md)"))
    of_bitsandbytes = (*bitsandbytes.qlora_step, "kbit-input-dtype")  # its 4-bit layers' outputs, in every version
    libraries = (*of_bitsandbytes, *transformers.step)
    lines += [f"runner {runner.label} ({runner.version}): {STEP_VARIANTS[v]}" for v in chosen if v not in libraries]
    lines += [f"{transformers.version} (transformers_version {spec.transformers_version}): {STEP_VARIANTS[v]}"
              for v in chosen if v in transformers.step]
    lines += [f"{bitsandbytes.version}: {STEP_VARIANTS[v]}" for v in chosen if v in of_bitsandbytes]
    return lines + [f"runner {runner.label}: not modelled: {text}" for text in runner.unmodelled]
