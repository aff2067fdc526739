"""How a RunSpec turns a causal-LM model into the model that is trained: dtypes, adapters, checkpointing.

The memory estimator traces exactly this setup on the meta device, and the trainer applies it to real
weights, so that what is estimated is what runs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tunecast.step.settings import AdapterSettings
from tunecast.step.shape import has_experts

# bitsandbytes (imported by peft when present) logs at import that optional CPU kernels are missing; that
# is not the user's concern.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

# Parameter dtype and autocast dtype per `precision` (fp8 keeps bf16 master weights; its FP8 matmuls
# run through torchao's float8 training, which the estimator models as bf16).
_PARAM_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "bf16-mixed": torch.float32,
                "fp16-mixed": torch.float32, "fp32": torch.float32}
_AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def param_dtype(precision: str) -> torch.dtype:
    return _PARAM_DTYPE[precision]


def autocast_dtype(precision: str) -> torch.dtype | None:
    return _AUTOCAST_DTYPE.get(precision)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in: the autocast dtype under mixed precision, else the parameter dtype."""
    return _AUTOCAST_DTYPE.get(precision, _PARAM_DTYPE[precision])


def apply_adapters(model: Any, adapters: AdapterSettings) -> Any:
    """Wrap `model` with LoRA adapters (peft). Frozen base weights; adapters in fp32 (peft's default
    `autocast_adapter_dtype=True` upcasts bf16/fp16 adapters) unless `fp32_adapters` is off.

    A mixture of experts' expert weights are 3-D parameters, which peft adapts with a ParamWrapper that takes no
    dropout (it refuses `lora_dropout` outright, peft/tuners/lora/layer.py): there the dropout is applied where
    peft can apply it, on the adapters of whole Linear layers, and the experts' adapters take none. That is the
    adapter peft builds with `lora_dropout` on those layers alone (it differs only by an Identity in place of the
    Dropout), and what memory.py notes as `expert_dropout_note`."""
    from peft import LoraConfig, get_peft_model

    from tunecast.step.targets import check_targets

    targets: list[str] | str = adapters.targets if isinstance(adapters.targets, str) else list(adapters.targets)
    check_targets(model, targets)  # every name must adapt a layer: peft trains the others silently, or fails
    experts = adapters.dropout > 0 and has_experts(model.config.to_dict())
    config = LoraConfig(
        r=adapters.rank, lora_alpha=adapters.alpha, lora_dropout=0.0 if experts else adapters.dropout,
        target_modules=targets, use_dora=adapters.dora, modules_to_save=list(adapters.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    adapted = get_peft_model(model, config, autocast_adapter_dtype=adapters.fp32_adapters)
    if experts:
        _dropout_on_whole_layers(adapted, adapters.dropout)
    return adapted


def _dropout_on_whole_layers(model: Any, probability: float) -> None:
    """Dropout before the adapters of every adapted layer but the parameter-wrapped (expert) ones."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            for name in list(module.lora_dropout):
                module.lora_dropout[name] = torch.nn.Dropout(p=probability)


# Activations that transformers implements op by op, and their fused equivalents: same function, but one
# saved tensor instead of five per call (HF's NewGELUActivation keeps x, tanh(.), 0.5·x and 1 + tanh(.)).
_FUSED_ACTIVATIONS = {"gelu_new": "gelu_pytorch_tanh"}


def training_config(config_data: dict[str, Any]) -> dict[str, Any]:
    """The model config as tunecast trains it: unfused activations replaced by their fused twins
    (transformers documents `gelu_pytorch_tanh` as equivalent to `gelu_new`, and faster)."""
    adjusted = dict(config_data)
    for key in ("hidden_act", "activation_function"):
        value = adjusted.get(key)
        if isinstance(value, str) and value in _FUSED_ACTIVATIONS:
            adjusted[key] = _FUSED_ACTIVATIONS[value]
    return adjusted


def prepare_for_training(model: Any, settings: Any) -> Any:
    """The causal-LM `model` as it is trained under `settings` (a TraceSettings): every weight trainable
    for `full`, LoRA adapters on frozen weights otherwise, checkpointing when asked, train mode."""
    variants = getattr(settings, "runner_step", ())
    if settings.method == "full":
        model.requires_grad_(True)
    else:
        if "kbit-fp32" in variants:
            cast_unquantized_to_fp32(model, linear_experts="linear-experts" in variants)
        model = apply_adapters(model, settings.adapters)
        if "kbit-bf16-head" in variants:
            cast_head_to_bf16(model)
        if "kbit-keeps-input" in variants or "kbit-input-dtype" in variants:
            as_linear4bit(model, keeps_input="kbit-keeps-input" in variants,
                          input_dtype="kbit-input-dtype" in variants)
        if "int8-keeps-input" in variants:
            keep_int8_inputs(model)
    if settings.grad_checkpointing:
        enable_checkpointing(model)
    model.train()
    return model


def cast_unquantized_to_fp32(model: Any, *, linear_experts: bool = False) -> None:
    """What peft's `prepare_model_for_kbit_training` does to a 4-bit model's other weights: every 16-bit parameter
    that bitsandbytes did not quantize becomes fp32. On a model whose decoder Linear weights stand for the 4-bit
    ones (the trace models NF4 on them, estimate/memory.py), that is every parameter but those weights; with
    `linear_experts` (a mixture of experts built of Linear modules, as transformers did before 5), every decoder
    matrix: the fused experts and the router stand for those Linears."""
    quantized = {id(layer.weight) for block in decoder_layers(model) for layer in block.modules()
                 if isinstance(layer, torch.nn.Linear)}
    if linear_experts:
        quantized |= {id(p) for block in decoder_layers(model) for p in block.parameters() if p.ndim >= 2}
    for parameter in model.parameters():
        if id(parameter) not in quantized and parameter.dtype in (torch.float16, torch.bfloat16):
            parameter.data = parameter.data.to(torch.float32)


def cast_head_to_bf16(model: Any) -> None:
    """TRL's `peft_module_casting_to_bf16` (trl/trainer/utils.py, called with bf16=True before TRL 0.22): after
    peft's fp32 cast, modules named like an output head or embeddings go back to bf16; norms stay fp32."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (any(part in name for part in ("lm_head", "embed_tokens", "wte", "wpe")) and "norm" not in name
                and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32):
            module.to(torch.bfloat16)


class _KeepsInput(torch.autograd.Function):  # type: ignore[misc]
    """A frozen Linear as bitsandbytes' MatMul4Bit ran it before 0.43.2 (bitsandbytes/autograd/_functions.py): its
    input kept for the backward pass, which needs only the weight. Kept with save_for_backward, so a checkpointed
    layer keeps nothing, as under the transformers Trainer's reentrant checkpointing, whose forward runs without
    gradients."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        return torch.nn.functional.linear(inputs, weight.to(inputs.dtype),
                                          None if bias is None else bias.to(inputs.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _, weight = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def _linear4bit(layer: torch.nn.Linear, keeps_input: bool, input_dtype: bool) -> Any:
    def forward(inputs: torch.Tensor) -> torch.Tensor:
        # Linear4bit casts its input to its compute dtype (the autocast dtype of a mixed step) before MatMul4Bit,
        # which before 0.43.2 keeps that tensor
        device = inputs.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else layer.weight.dtype
        if keeps_input:
            with torch.autocast(device, enabled=False):
                out = _KeepsInput.apply(inputs.to(dtype), layer.weight, layer.bias)
        else:
            out = torch.nn.functional.linear(inputs.to(dtype), layer.weight.to(dtype),
                                             None if layer.bias is None else layer.bias.to(dtype))
        return out.to(inputs.dtype) if input_dtype else out
    return forward


def as_linear4bit(model: Any, *, keeps_input: bool, input_dtype: bool) -> None:
    """Every frozen Linear of the decoder layers (those bitsandbytes makes 4-bit; estimate/memory.py models their NF4
    bytes) run as bitsandbytes' Linear4bit runs: its input cast to the compute dtype; with `keeps_input` that copy kept
    for the backward pass, as bitsandbytes before 0.43.2 did; with `input_dtype` the output cast back to the input's
    dtype (`out.to(inp_dtype)`, every version). The model's stand-ins only: a real bitsandbytes Linear4bit is left
    as the installed bitsandbytes runs it."""
    for block in decoder_layers(model):
        for layer in block.modules():
            if type(layer) is torch.nn.Linear and not layer.weight.requires_grad:
                layer.forward = _linear4bit(layer, keeps_input, input_dtype)


class _KeptInContext(torch.autograd.Function):  # type: ignore[misc]
    """The identity on an 8-bit layer's output that holds the layer's input as bitsandbytes' MatMul8bitLt does
    (bitsandbytes 0.50.2 bitsandbytes/autograd/_functions.py: `ctx.tensors = (CAt, subA, A)` whenever an input needs a
    gradient): an attribute of the autograd context, not save_for_backward, so non-reentrant checkpointing's
    saved-tensor hooks never see it and a checkpointed layer keeps it until the backward pass. Under a forward pass
    without gradients (reentrant checkpointing) no context is kept, and neither is the input."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        if ctx.needs_input_grad[1]:
            ctx.kept = inputs  # the input as it comes: Linear8bitLt casts nothing before MatMul8bitLt
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _keeping_input_in_context(layer: torch.nn.Linear) -> Any:
    plain = layer.forward

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        return _KeptInContext.apply(plain(inputs), inputs)
    return forward


def keep_int8_inputs(model: Any) -> None:
    """Every frozen Linear of the decoder layers (those bitsandbytes makes 8-bit; estimate/int8.py models their bytes
    and temporaries) keeps its input as bitsandbytes' 8-bit layers do, checkpointed or not. The model's stand-ins
    only: a real bitsandbytes Linear8bitLt is left as the installed bitsandbytes runs it."""
    for block in decoder_layers(model):
        for layer in block.modules():
            if type(layer) is torch.nn.Linear and not layer.weight.requires_grad:
                layer.forward = _keeping_input_in_context(layer)


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float = 1e-4,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer `name` (RunSpec.optimizer). `adamw` is torch's fused kernel (transformers' default
    `adamw_torch_fused`), `adamw-foreach` torch's multi-tensor one; the 8-bit and paged variants are
    bitsandbytes'."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False,
                         weight_decay=weight_decay)
    if name in ("adamw-8bit", "paged-adamw", "paged-adamw-8bit"):
        import bitsandbytes as bnb

        kind = {"adamw-8bit": bnb.optim.AdamW8bit, "paged-adamw": bnb.optim.PagedAdamW,
                "paged-adamw-8bit": bnb.optim.PagedAdamW8bit}[name]
        return kind(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


def enable_checkpointing(model: Any) -> None:
    """Activation checkpointing of every decoder layer, non-reentrant (no input-grad hack needed)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False


def decoder_and_head(model: Any) -> tuple[Any, Any]:
    """The decoder stack (returns hidden states) and the output head of a causal-LM model or PeftModel."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a causal-LM model (transformers names the list `layers`, `h` or `blocks`)."""
    decoder, _ = decoder_and_head(model)
    for name in ("layers", "h", "blocks"):
        candidate = getattr(decoder, name, None)
        if isinstance(candidate, torch.nn.ModuleList):
            return list(candidate)
    return []
