"""An 8-bit base (LLM.int8, estimate/int8.py): its bytes against bitsandbytes' own tensors, one layer's temporaries
against a measured bitsandbytes step, and the inputs its layers keep, as the trace runs them and as bitsandbytes
keeps them."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
from tests.models import shallow_llama, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tunecast.config.spec import RunSpec
from tunecast.estimate import int8
from tunecast.estimate.memory import estimate_memory
from tunecast.estimate.profile import profile_from_trace, replay
from tunecast.estimate.tracer import trace_step
from tunecast.step.settings import TraceSettings
from tunecast.step.setup import decoder_layers
from tunecast.step.shape import build_meta_model, hf_config
from tunecast.train.quantize import quantize_int8

GIB = 2**30
BATCH, SEQ = 2, 128


def _linears(model: Any) -> list[torch.nn.Linear]:
    """The decoder layers' plain Linear modules: what bitsandbytes makes 8-bit."""
    return [m for layer in decoder_layers(model) for m in layer.modules() if type(m) is torch.nn.Linear]


def _layer_linears(model: Any) -> tuple[tuple[int, int, bool], ...]:
    return tuple((m.in_features, m.out_features, False) for m in decoder_layers(model)[0].modules()
                 if type(m) is torch.nn.Linear)


def test_int8_weights_and_row_scales_match_bitsandbytes_tensors() -> None:
    """The weights' and SCB's bytes against real bitsandbytes Linear8bitLt layers, from the model's own shapes."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    config = tiny_llama(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                        num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.bfloat16)
    quantized = sum(m.weight.numel() for m in _linears(model))
    shapes = _layer_linears(model)
    quantize_int8(model, device="cpu")
    weights = scales = 0
    for layer in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, bnb.nn.Linear8bitLt):
                weights += module.weight.numel() * module.weight.element_size()
                scales += module.weight.SCB.numel() * module.weight.SCB.element_size()
    assert weights == quantized * int8.INT8_BYTES_PER_WEIGHT
    assert scales == pytest.approx(int8.row_scale_bytes(quantized, shapes), rel=1e-12)


def estimate(catalog, config: dict[str, Any], **settings: Any):  # type: ignore[no-untyped-def]
    spec = RunSpec.model_validate({"model": "x", "micro_batch": 2, "seq_len": 256, **settings})
    return estimate_memory(spec, config, device="cuda", gpu=catalog.gpus.get("h100"), overheads=catalog.overheads)


def test_the_estimate_holds_int8_weights_and_one_scale_per_row(catalog) -> None:
    config = shallow_llama()
    lora = estimate(catalog, config, method="lora")
    eight = estimate(catalog, config, method="qlora", quantization={"bits": 8})
    linears = _linears(build_meta_model(config))
    quantized, rows = sum(m.weight.numel() for m in linears), sum(m.out_features for m in linears)
    saved = (lora.breakdown_gib["weights"] - eight.breakdown_gib["weights"]) * GIB
    assert saved == pytest.approx(quantized * (2 - 1), rel=1e-9)  # bf16 → int8
    assert eight.breakdown_gib["quantization"] * GIB == pytest.approx(rows * 4, rel=1e-9)
    assert eight.notes[0].startswith("8-bit base (LLM.int8): int8 Linear weights")
    nf4 = estimate(catalog, config, method="qlora")
    assert eight.breakdown_gib["weights"] > nf4.breakdown_gib["weights"]


class _Live(TorchDispatchMode):  # type: ignore[misc]
    """The bytes of the storages operations make while it is on (not views or in-place results of their operands),
    live at once: now, and at the most."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        operands = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if (isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in self._sizes
                    and id(tensor.untyped_storage()) not in operands):
                storage = tensor.untyped_storage()
                self._sizes[id(storage)] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._free, id(storage))
        return out

    def _free(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)


def test_one_layer_temporaries_on_a_cpu_match_a_measured_bitsandbytes_step() -> None:
    """A Linear8bitLt trained on the CPU (MatMul8bitFp) dequantizes its weight in the forward pass and again for
    grad_A in the backward pass (the backward shared with MatMul8bitLt): measured beyond the layer's output and its
    input's gradient, the ones the trace holds."""
    import bitsandbytes as bnb

    tokens, inputs, outputs = 96, 256, 384
    layer = bnb.nn.Linear8bitLt(inputs, outputs, bias=False, has_fp16_weights=False, threshold=6.0, device="meta")
    layer.weight = bnb.nn.Int8Params(torch.randn(outputs, inputs, dtype=torch.bfloat16), requires_grad=False,
                                     has_fp16_weights=False)
    layer = layer.to("cpu").train()
    x = torch.randn(tokens, inputs, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, outputs, dtype=torch.bfloat16)
    terms = int8.int8_terms(inputs * outputs, ((inputs, outputs, False),), tokens=tokens, param_bytes=2, cuda=False,
                            checkpointing=False)
    with _Live() as forward:
        y = layer(x)
    assert forward.peak - y.untyped_storage().nbytes() == terms.forward_bytes == inputs * outputs * 2
    with _Live() as backward:
        y.backward(grad)
    assert x.grad is not None
    assert backward.peak - x.grad.untyped_storage().nbytes() == terms.backward_bytes == inputs * outputs * 2


def test_on_a_gpu_a_layer_quantizes_its_input_and_multiplies_in_int32() -> None:
    """MatMul8bitLt's forward pass on CUDA (not run here): the larger of quantizing the input (fp16 copy, |x| and its
    mask, the int8 copy: 6 bytes an element) and the product (int8 input, int32 and fp16 results: 1 byte an input
    element, 6 an output element), and a fp32 scale per token; checkpointed, the backward phase runs it again."""
    tokens, inputs, outputs = 1000, 4096, 14336
    up = int8.forward_temporary_bytes(inputs, outputs, tokens, 2, cuda=True)
    down = int8.forward_temporary_bytes(outputs, inputs, tokens, 2, cuda=True)
    assert up == tokens * (inputs + 4 + 6 * outputs) and down == tokens * (6 * outputs + 4)
    layer = ((inputs, outputs, False), (outputs, inputs, False))
    plain = int8.int8_terms(2 * inputs * outputs, layer, tokens=tokens, param_bytes=2, cuda=True, checkpointing=False)
    again = int8.int8_terms(2 * inputs * outputs, layer, tokens=tokens, param_bytes=2, cuda=True, checkpointing=True)
    assert plain.forward_bytes == up and plain.backward_bytes == inputs * outputs * 2
    assert again.backward_bytes == max(up, inputs * outputs * 2)


def _traced(config: dict[str, Any], settings: TraceSettings) -> Any:
    trace = trace_step(config, settings, BATCH, SEQ, count_flops=False)
    return replay(profile_from_trace(0, trace), BATCH, SEQ, cuda=False)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_trace_keeps_each_8bit_layers_input_also_when_checkpointed(checkpointing: bool) -> None:
    """Per decoder layer, the inputs no other operation keeps: the attention's (q, k and v share it), the MLP's (gate
    and up share it) and down's, in bf16; o_proj's input is a view of the attention output the attention keeps,
    except in a checkpointed layer, which keeps nothing else: there it is kept too."""
    grown = {}
    for layers in (1, 2):
        config = tiny_llama(num_hidden_layers=layers)
        base = replace(TraceSettings.from_spec(RunSpec.model_validate({"model": "x", "method": "qlora"})),
                       grad_checkpointing=checkpointing)
        plain = _traced(config, base)
        kept = _traced(config, replace(base, runner_step=("int8-keeps-input",)))
        grown[layers] = kept.phases["forward"].allocated - plain.phases["forward"].allocated
    width = 2 * config["hidden_size"] + config["intermediate_size"]
    if checkpointing:
        width += config["hidden_size"]  # o_proj's input: heads × head dim, the hidden size here
    assert grown[2] - grown[1] == BATCH * SEQ * width * 2


@pytest.mark.parametrize("training", [True, False])
def test_bitsandbytes_keeps_an_8bit_layers_input_through_non_reentrant_checkpointing(training: bool) -> None:
    """What the trace assumes of the installed bitsandbytes: its 8-bit layer holds its input on the autograd context
    (MatMul8bitFp's ctx.A in training on a CPU, MatMul8bitLt's ctx.tensors otherwise), which non-reentrant
    checkpointing does not free, while a plain frozen Linear keeps nothing. When this fails, a bitsandbytes release
    stopped keeping it: step/setup.py keep_int8_inputs must follow."""
    import bitsandbytes as bnb
    from torch.utils.checkpoint import checkpoint

    int8_layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False, threshold=6.0, device="meta")
    int8_layer.weight = bnb.nn.Int8Params(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False,
                                          has_fp16_weights=False)
    int8_layer = int8_layer.to("cpu").train(training)
    plain = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16).requires_grad_(False)

    def kept_after_forward(layer: torch.nn.Module) -> bool:
        made: list[weakref.ref[torch.Tensor]] = []

        def block(x: torch.Tensor) -> torch.Tensor:
            inputs = x * 2  # a tensor of the block's own, the layer's input
            made.append(weakref.ref(inputs))
            return layer(inputs).sum(-1)

        out = checkpoint(block, torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True), use_reentrant=False)
        gc.collect()
        alive = made[0]() is not None
        out.sum().backward()
        return alive

    assert kept_after_forward(int8_layer)
    assert not kept_after_forward(plain)
