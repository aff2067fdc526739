"""The settings a memory trace depends on, taken from a RunSpec: what is traced, and the cache key.

Batch size and sequence length are not among them: allocation sizes are polynomials in both, fitted
from a few traces, so one set of traces serves every micro-batch and length.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from tunecast.config.spec import RunSpec


@dataclass(frozen=True)
class AdapterSettings:
    """LoRA settings as peft receives them."""

    rank: int
    alpha: int
    dropout: float
    targets: tuple[str, ...] | str
    dora: bool
    modules_to_save: tuple[str, ...]
    fp32_adapters: bool = True


# Precisions traced as another of the same sizes: fp16 and bf16 autocast cast the same operations to 2-byte
# floats (the step's sizes were checked equal, tests/unit/estimate/test_templates.py), and fp8 keeps bf16 weights
# and activations (its FP8 matmuls are torchao's, modelled as bf16; memory.py notes it).
TRACED_PRECISION = {"fp16-mixed": "bf16-mixed", "fp8": "bf16"}
# Optimizers the trace runs as they are; bitsandbytes' 8-bit and paged ones are modelled on `adamw`.
TRACED_OPTIMIZERS = ("adamw", "adamw-foreach", "sgd", "adafactor")

# How another tool's step differs from tunecast's where it changes the tensors a step holds; the trace runs each
# (step/setup.py, step/forward.py). Which tools do what, with sources: runners/profiles.py.
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
    "fused-chunks": "the loss in as few chunks as keep each chunk's fp32 logits within 4 GiB, each recomputed in "
                    "the backward pass (unsloth's fused cross-entropy); no full logits",
}
# Variants whose chunk count follows the length: a step template (polynomials in the length) cannot describe them.
CHUNKING_VARIANTS = ("fused-head", "fused-head-cpu", "output-chunks", "fused-chunks", "compiled-loss")


@dataclass(frozen=True)
class TraceSettings:
    method: str
    adapters: AdapterSettings
    precision: str  # the precision traced: fp16-mixed is traced as bf16-mixed and fp8 as bf16 (TRACED_PRECISION)
    optimizer: str  # the optimizer traced: one of TRACED_OPTIMIZERS (8-bit and paged are modelled on adamw)
    optimizer_in_backward: bool
    grad_checkpointing: bool
    attention: str  # sdpa or eager (flash is traced as sdpa: both keep no seq × seq matrix)
    loss: str
    runner_step: tuple[str, ...] = ()  # STEP_VARIANTS of the runner whose step is estimated (none: tunecast's)

    @classmethod
    def from_spec(cls, spec: RunSpec, *, grad_checkpointing: bool | None = None,
                  device: str = "cuda") -> TraceSettings:
        lora = spec.lora
        targets: tuple[str, ...] | str = lora.targets if isinstance(lora.targets, str) else tuple(lora.targets)
        checkpointing = spec.grad_checkpointing is True if grad_checkpointing is None else grad_checkpointing
        traced_optimizer = spec.optimizer if spec.optimizer in TRACED_OPTIMIZERS else "adamw"
        from tunecast.runners.profiles import step_variants

        return cls(
            method=spec.method,
            adapters=AdapterSettings(lora.rank, lora.alpha, lora.dropout, targets, lora.dora,
                                     tuple(lora.modules_to_save), lora.fp32_adapters),
            precision=TRACED_PRECISION.get(spec.precision, spec.precision),
            optimizer=traced_optimizer,
            optimizer_in_backward=spec.optimizer_in_backward,
            grad_checkpointing=checkpointing,
            attention="eager" if spec.attention == "eager" else "sdpa",
            loss=spec.loss,
            runner_step=step_variants(spec, device),
        )

    def fields(self) -> dict[str, Any]:
        """The settings as a key sees them: tunecast's own step (no runner variants) keys as it did before
        runners existed, so shipped templates and cached estimates stay valid."""
        fields = asdict(self)
        if not self.runner_step:
            fields.pop("runner_step")
        else:  # traced since a tied weight's gradients are summed in place (tracer._sums_in_place), which only
            # other runners' own losses make happen: their estimates cached before are not reused
            fields["tied_sums"] = "in-place"
        return fields

    def key(self, config_data: dict[str, Any], versions: dict[str, str]) -> str:
        """Cache key: the model config, these settings, and the library versions that shape a trace."""
        payload = json.dumps({"config": config_data, "settings": self.fields(), "versions": versions},
                             sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:24]
