"""QLoRA's 4-bit base weights for a model built in memory (random weights, or loaded without a
quantization config): every nn.Linear of the decoder layers becomes a bitsandbytes NF4 Linear4bit.

Loading a checkpoint with transformers' BitsAndBytesConfig gives the same layers; this path exists for
models whose weights are created in place, as the benchmarks and tests do.
"""

from __future__ import annotations

from typing import Any

import torch

from tunecast.train.setup import decoder_layers


def quantize_nf4(model: Any, *, compute_dtype: torch.dtype, double_quant: bool, device: str) -> Any:
    """Replace the decoder layers' Linear modules by NF4 Linear4bit (the output head and embeddings stay
    in the compute dtype, as bitsandbytes' default `llm_int8_skip_modules` keeps them)."""
    import bitsandbytes as bnb

    for layer in decoder_layers(model):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=compute_dtype, compress_statistics=double_quant,
                                              quant_type="nf4", device="meta")
                quantized.weight = bnb.nn.Params4bit(child.weight.data.to(compute_dtype).cpu(), requires_grad=False,
                                                     compress_statistics=double_quant, quant_type="nf4")
                if child.bias is not None:
                    quantized.bias = torch.nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
                setattr(parent, name, quantized.to(device))
                del child
    return model
