"""An 8-bit base (LLM.int8, bitsandbytes Linear8bitLt): what it changes in the traced LoRA step, term by term.

A QLoRA run with `quantization.bits: 8` trains adapters on frozen decoder Linear weights that bitsandbytes keeps in
int8 (Dettmers et al. 2022, "LLM.int8()", arXiv:2208.07339), as transformers' BitsAndBytesConfig(load_in_8bit=True)
loads them: outlier threshold 6.0, no fp16 copy of the weights (`llm_int8_threshold`, `llm_int8_has_fp16_weight`),
the output head and embeddings left in the compute dtype. The trace runs the LoRA step with those weights in the
compute dtype; memory.py applies these terms to it. Each was read in the installed bitsandbytes 0.50.2:

* weights: one int8 per weight (nn/modules.py `Int8Params._quantize`: `int8_vectorwise_quant` of the fp16 weight, kept
  as CB) and one fp32 absmax per output row (SCB), in the estimate's "quantization" category. No blocks and no second
  level of constants, unlike NF4;
* kept for the backward pass: the layer's input (autograd/_functions.py `MatMul8bitLt.forward`, `ctx.tensors = (CAt,
  subA, A)`). That one is traced, not modelled here (step/setup.py `keep_int8_inputs`): which inputs are new tensors,
  and what checkpointing frees, only the trace sees. `subA`, the input's columns holding an outlier (|x| ≥ 6.0, kept in
  the input's dtype), depends on the data and is not modelled: the paper finds the outliers in about 6 of a 6.7B
  model's hidden dimensions (section 4.1), a few columns of a layer's input;
* temporaries of one layer's forward pass on a GPU (`MatMul8bitLt.forward` with the CUDA kernels of
  backends/cuda/ops.py), at the larger of two moments:
  - quantizing the input: its fp16 copy (`A.to(torch.float16)`, 2 bytes an element) while `int8_vectorwise_quant`
    holds the int8 copy CA (1), the outlier test's |x| in fp16 (2) and its bool mask (1), and one fp32 scale per token;
  - the product: CA and its scales still held, the int32 product of `int8_linear_matmul` (4 bytes an output element)
    and `int8_mm_dequant`'s fp16 result (2), beside the output in the input's dtype (which the trace holds);
* one layer's forward pass on a CPU in training (`MatMul8bitFp`, which `bnb.matmul` takes on a CPU): the weight
  dequantized to the input's dtype for `F.linear`;
* one layer's backward pass, on both: `grad_A = grad_output @ CB` with CB dequantized to the input's dtype
  (`state.CB.to(ctx.dtype_A, copy=True).mul_(SCB / 127)`), a copy the size of the weight in the compute dtype.

As for NF4, one layer's temporaries are added at each phase's peak, for the largest layer: at a peak that comes at
another operation (the loss) that is an upper bound. Under checkpointing a layer's forward pass is run again inside
the backward pass, so the backward phase takes the larger of the two layers' temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

INT8_BYTES_PER_WEIGHT = 1
ROW_SCALE_BYTES = 4  # SCB: one fp32 absmax per output row of each 8-bit weight
# Quantizing one layer's input (MatMul8bitLt.forward, int8_vectorwise_quant on CUDA), bytes per input element: the
# fp16 copy (2), |x| in fp16 for the outlier test (2), its bool mask (1), the int8 copy CA (1).
QUANTIZE_BYTES_PER_INPUT = 2 + 2 + 1 + 1
TOKEN_SCALE_BYTES = 4  # SCA: one fp32 absmax per token of the input
INT8_BYTES_PER_INPUT = 1  # CA, held through the product
# The product (int8_scaled_mm on CUDA), bytes per output element beside the traced output: int32 (4), fp16 (2).
PRODUCT_BYTES_PER_OUTPUT = 4 + 2


@dataclass(frozen=True)
class Int8Terms:
    """What an 8-bit base changes in a step, in bytes: the weights' bytes it saves against the compute dtype, its
    row scales, and one layer's temporaries in the forward and backward phases."""

    weights_saved_bytes: float
    scale_bytes: float
    forward_bytes: float
    backward_bytes: float


def frozen_linears(layer_linears: tuple[tuple[int, int, bool], ...]) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's frozen Linear layers: those bitsandbytes makes 8-bit."""
    return [(inputs, outputs) for inputs, outputs, trains in layer_linears if not trains]


def row_scale_bytes(quantized_numel: float, layer_linears: tuple[tuple[int, int, bool], ...]) -> float:
    """SCB's bytes: one fp32 per output row of every 8-bit weight. Rows are counted as the model's quantized weights
    times one decoder layer's rows per weight (its frozen Linear layers'), so that they follow the depth the weights
    are extrapolated to."""
    shapes = frozen_linears(layer_linears)
    weights = sum(inputs * outputs for inputs, outputs in shapes)
    if not weights:
        return 0.0
    return quantized_numel * sum(outputs for _, outputs in shapes) / weights * ROW_SCALE_BYTES


def forward_temporary_bytes(inputs: int, outputs: int, tokens: int, input_bytes: int, *, cuda: bool) -> float:
    """One 8-bit layer's temporaries in its forward pass beyond its output, for `tokens` tokens (see the module's
    docstring)."""
    if not cuda:
        return float(inputs * outputs * input_bytes)  # MatMul8bitFp: the dequantized weight
    quantize = tokens * (inputs * QUANTIZE_BYTES_PER_INPUT + TOKEN_SCALE_BYTES)
    product = tokens * (inputs * INT8_BYTES_PER_INPUT + TOKEN_SCALE_BYTES + outputs * PRODUCT_BYTES_PER_OUTPUT)
    return float(max(quantize, product))


def int8_terms(quantized_numel: float, layer_linears: tuple[tuple[int, int, bool], ...], *, tokens: int,
               param_bytes: int, cuda: bool, checkpointing: bool) -> Int8Terms:
    """The terms of an 8-bit base on a step of `tokens` tokens per micro-batch whose frozen weights the trace holds
    at `param_bytes` each (the compute dtype: the inputs' too)."""
    shapes = frozen_linears(layer_linears)
    forward = max((forward_temporary_bytes(i, o, tokens, param_bytes, cuda=cuda) for i, o in shapes), default=0.0)
    backward = float(max((i * o * param_bytes for i, o in shapes), default=0))  # CB dequantized for grad_A
    if checkpointing:
        backward = max(backward, forward)
    return Int8Terms(weights_saved_bytes=quantized_numel * (param_bytes - INT8_BYTES_PER_WEIGHT),
                     scale_bytes=row_scale_bytes(quantized_numel, layer_linears),
                     forward_bytes=forward, backward_bytes=backward)


def int8_note(cuda: bool) -> str:
    """What an estimate says of its 8-bit base."""
    kernel = "MatMul8bitLt's int8 matmul" if cuda else "MatMul8bitFp, its CPU path"
    return ("8-bit base (LLM.int8): int8 Linear weights with one fp32 scale per output row, and one layer's "
            f"temporaries of {kernel}, modelled on the traced LoRA step (bitsandbytes Linear8bitLt); step time "
            "counts NF4's dequantization cost, not LLM.int8's own kernels")
