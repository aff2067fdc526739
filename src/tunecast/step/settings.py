"""The settings a memory trace depends on, taken from a RunSpec: what is traced, and the cache key.

Batch size and sequence length are not among them: allocation sizes are polynomials in both, fitted
from a few traces, so one set of traces serves every micro-batch and length.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from tunecast.config.spec import DEEPSPEED_STRATEGIES, RunSpec
from tunecast.step.variants import experts_were_linear, runner_step


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

# The runners whose FSDP is accelerate's (LLaMA-Factory v1's own FSDP2 engine does the same): under bf16 or fp16
# mixed precision it gathers each unit's weights in 16 bits (MixedPrecisionPolicy's param_dtype), so the step computes
# on 16-bit weights, with no autocast copies of them, and the fp32 weights exist only as shards.
ACCELERATE_FSDP_RUNNERS = ("hf-trainer", "trl", "axolotl", "llamafactory")


def sixteen_bit_weights(spec: RunSpec) -> bool:
    """Whether a mixed-precision run computes on 16-bit weights kept apart from its fp32 ones: DeepSpeed's bf16 and
    fp16 modes (the model cast to 16 bits, the fp32 master inside its optimizer: estimate/deepspeed.py) and
    accelerate's FSDP (the fp32 shards gathered in 16 bits: estimate/memory.py `_apply_strategy`). Their step is
    traced in bf16."""
    if spec.precision not in ("bf16-mixed", "fp16-mixed"):
        return False
    if spec.gpus.strategy in DEEPSPEED_STRATEGIES:
        return True
    return spec.gpus.strategy in ("fsdp", "fsdp-grad-op") and spec.gpus.count > 1 and \
        spec.runner in ACCELERATE_FSDP_RUNNERS


def _traced_precision(spec: RunSpec) -> str:
    """The precision traced (fp16 autocast as bf16's, fp8 as bf16; 16-bit weights apart from fp32 ones as bf16)."""
    if sixteen_bit_weights(spec):
        return "bf16"
    return TRACED_PRECISION.get(spec.precision, spec.precision)


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
    runner_step: tuple[str, ...] = ()  # variants.py STEP_VARIANTS of the runner's step (none: tunecast's)

    @classmethod
    def from_spec(cls, spec: RunSpec, *, grad_checkpointing: bool | None = None, device: str = "cuda",
                  config_data: dict[str, Any] | None = None) -> TraceSettings:
        """`spec`'s trace; `config_data` (the model's) adds the variants that depend on the model as well
        (`linear-experts`: a mixture of experts as the runner's transformers built it, for peft's fp32 cast)."""
        lora = spec.lora
        targets: tuple[str, ...] | str = lora.targets if isinstance(lora.targets, str) else tuple(lora.targets)
        checkpointing = spec.grad_checkpointing is True if grad_checkpointing is None else grad_checkpointing
        traced_optimizer = spec.optimizer if spec.optimizer in TRACED_OPTIMIZERS else "adamw"
        step = runner_step(spec, device)
        if config_data is not None and "kbit-fp32" in step and experts_were_linear(config_data, spec):
            step = (*step, "linear-experts")
        return cls(
            method=spec.method,
            adapters=AdapterSettings(lora.rank, lora.alpha, lora.dropout, targets, lora.dora,
                                     tuple(lora.modules_to_save), lora.fp32_adapters),
            precision=_traced_precision(spec),
            optimizer=traced_optimizer,
            optimizer_in_backward=spec.optimizer_in_backward,
            grad_checkpointing=checkpointing,
            attention="eager" if spec.attention == "eager" else "sdpa",
            loss=spec.loss,
            runner_step=step,
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
