"""QLoRA's quantized base weights for a model built in memory (random weights, or loaded without a
quantization config): every nn.Linear of the decoder layers becomes a bitsandbytes NF4 Linear4bit, or with
`quantization.bits: 8` an LLM.int8 Linear8bitLt.

Loading a checkpoint with transformers' BitsAndBytesConfig gives the same layers (load_in_4bit with NF4, or
load_in_8bit: `replace_with_bnb_linear` in integrations/bitsandbytes.py makes `Linear8bitLt(has_fp16_weights=
llm_int8_has_fp16_weight, threshold=llm_int8_threshold)`, False and 6.0 by default); this path exists for
models whose weights are created in place, as the benchmarks and tests do.

What stays in the compute dtype, as with transformers' BitsAndBytesConfig (integrations/bitsandbytes.py,
`replace_with_bnb_linear`, converts `type(module) is nn.Linear` only): the output head and embeddings, and every
decoder weight that is a plain parameter rather than a Linear module. In transformers 5 that is the experts of a
mixture-of-experts layer (Mixtral, Qwen3-MoE, gpt-oss keep them as fused 3-D `gate_up_proj` / `down_proj`
parameters) and its router: most of such a model's weights. `unquantized_weights` says which and how many.

Evaluation runs the same dequantize-and-matmul as training. On a CPU with AVX512-BF16, bitsandbytes' Linear4bit
repacks its weight for a fused kernel the first time it runs in eval mode without gradients (bitsandbytes 0.50,
nn/modules.py `Linear4bit.forward` → functional.py `_convert_weight_packed_for_cpu`). That repacking takes only
out_features divisible by 32 and in_features divisible by the 64-weight block (the tiny demo's down_proj, 352 in,
stops with "shape '[128, 5]' is invalid for input of size 704"), and the packed weight has no autograd kernel:
training after an evaluation would pass no gradient through the layer. So tunecast turns it off per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tunecast.step.setup import decoder_layers
from tunecast.units import BYTES_PER_GIB, format_params


def _replace_linears(model: Any, quantized: Callable[[torch.nn.Linear], torch.nn.Module], device: str) -> Any:
    """Replace every Linear module of the decoder layers by `quantized(linear)`, moved to `device` (the output head
    and embeddings stay as they are)."""
    for layer in decoder_layers(model):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                setattr(parent, name, quantized(child).to(device))
                del child
    return model


def quantize_nf4(model: Any, *, compute_dtype: torch.dtype, double_quant: bool, device: str) -> Any:
    """Replace the decoder layers' Linear modules by NF4 Linear4bit (the output head and embeddings stay
    in the compute dtype, as bitsandbytes' default `llm_int8_skip_modules` keeps them)."""
    import bitsandbytes as bnb

    def nf4(child: torch.nn.Linear) -> torch.nn.Module:
        quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=double_quant,
                                      quant_type="nf4", device="meta")
        quantized.weight = bnb.nn.Params4bit(child.weight.data.to(compute_dtype).cpu(), requires_grad=False,
                                             compress_statistics=double_quant, quant_type="nf4")
        if child.bias is not None:
            quantized.bias = torch.nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
        # no CPU inference repacking (see the module docstring): any width, and gradients after an eval
        quantized.support_avx512bf16_for_cpu = False
        return quantized

    return _replace_linears(model, nf4, device)


# transformers' BitsAndBytesConfig defaults for load_in_8bit (utils/quantization_config.py): LLM.int8's outlier
# threshold (inputs' columns holding a value of at least this magnitude are multiplied in fp16, Dettmers et al. 2022
# section 3.2), and no fp16 copy of the weights kept beside the int8 ones.
LLM_INT8_THRESHOLD = 6.0


def quantize_int8(model: Any, *, device: str) -> Any:
    """Replace the decoder layers' Linear modules by LLM.int8 Linear8bitLt (the output head and embeddings stay in
    the model's dtype, as transformers' BitsAndBytesConfig(load_in_8bit=True) leaves them). bitsandbytes quantizes
    each weight when it is moved to `device` (nn/modules.py Int8Params.to → _quantize: int8 rows and an fp32 absmax
    per row, CB and SCB)."""
    import bitsandbytes as bnb

    def int8(child: torch.nn.Linear) -> torch.nn.Module:
        quantized = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                        has_fp16_weights=False, threshold=LLM_INT8_THRESHOLD, device="meta")
        quantized.weight = bnb.nn.Int8Params(child.weight.data.cpu(), requires_grad=False, has_fp16_weights=False)
        if child.bias is not None:
            quantized.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
        return quantized

    return _replace_linears(model, int8, device)


@dataclass(frozen=True)
class Unquantized:
    """Decoder weights (matrices and larger) that QLoRA leaves in the compute dtype."""

    names: tuple[str, ...]  # as named inside a decoder layer: "mlp.experts.gate_up_proj"
    numel: int
    nbytes: int
    dtype: str
    quantized_numel: int  # the decoder weights that are quantized
    quantized_as: str = "NF4"  # what those are: NF4, or int8 (LLM.int8)

    def describe(self) -> str:
        share = self.numel / max(self.numel + self.quantized_numel, 1)
        why = "bitsandbytes quantizes nn.Linear layers only"
        if any(".experts." in name for name in self.names):
            why += "; transformers keeps a mixture of experts as fused 3-D parameters"
        return (f"QLoRA leaves {format_params(self.numel)} decoder weights in {self.dtype}, not {self.quantized_as} "
                f"({self.nbytes / BYTES_PER_GIB:.2f} GiB, {share:.0%} of the decoder's): {', '.join(self.names)} "
                f"({why})")


def unquantized_weights(model: Any) -> Unquantized | None:
    """The decoder weights of a quantized model that are not NF4 or int8 (one-dimensional ones, norms and biases,
    aside); None when every decoder matrix is quantized."""
    import bitsandbytes as bnb

    names: dict[str, None] = {}
    numel = nbytes = quantized = 0
    dtype = ""
    quantized_as = "NF4"
    for layer in decoder_layers(model):
        for name, parameter in layer.named_parameters():
            if isinstance(parameter, bnb.nn.Params4bit):
                quantized += int(parameter.quant_state.shape.numel()) if parameter.quant_state is not None else 0
                continue
            if isinstance(parameter, bnb.nn.Int8Params):
                quantized += parameter.numel()
                quantized_as = "int8"
                continue
            if parameter.ndim < 2:
                continue
            names[name] = None
            numel += parameter.numel()
            nbytes += parameter.numel() * parameter.element_size()
            dtype = str(parameter.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")
    if not names:
        return None
    return Unquantized(tuple(names), numel, nbytes, dtype, quantized, quantized_as)
