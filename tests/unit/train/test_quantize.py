"""QLoRA's quantized base: evaluation between training steps at any layer width, and what stays unquantized (a
mixture of experts' fused experts) as the runner reports it, the estimate counts it and transformers loads it."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from tests.models import tiny_llama

from tunecast.config.spec import RunSpec
from tunecast.estimate.memory import expert_dropout_note, unquantized_experts_note
from tunecast.estimate.moe import unquantized_numel
from tunecast.step.shape import hf_config
from tunecast.train.quantize import LLM_INT8_THRESHOLD, quantize_int8, quantize_nf4, unquantized_weights

# Every family estimate/moe.py models, tiny; Qwen3-MoE with a dense first layer (mlp_only_layers), whose MLP is
# made of Linear modules and is quantized.
_COMMON = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 128, "num_experts_per_tok": 2, "max_position_embeddings": 512}
MOE = {
    "mixtral": {**_COMMON, "model_type": "mixtral", "intermediate_size": 96, "num_local_experts": 4},
    "qwen3_moe": {**_COMMON, "model_type": "qwen3_moe", "moe_intermediate_size": 48, "intermediate_size": 160,
                  "num_experts": 4, "mlp_only_layers": [0]},
    "gpt_oss": {**_COMMON, "model_type": "gpt_oss", "intermediate_size": 96, "num_local_experts": 4, "head_dim": 16},
}


def _build(config: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(hf_config(config), dtype=dtype)


def _embedding_gradient(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the embeddings' gradient of one training-mode pass (it flows through every quantized layer)."""
    model.train()
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), model.get_input_embeddings().weight.grad.clone()


def test_evaluation_between_steps_runs_the_demo_widths_and_keeps_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny demo's shape (MLP 352 wide, not a multiple of the 64-weight block): an evaluation pass between two
    training passes runs, gives the training pass's logits, and the next training pass has the same gradients.
    bitsandbytes repacks a Linear4bit for its fused CPU kernel in an evaluation pass on CPUs with AVX512-BF16; its
    detection is forced on here, so that the path is reached on any CPU."""
    import bitsandbytes.nn.modules as modules

    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)
    config = tiny_llama(hidden_size=128, intermediate_size=352, num_hidden_layers=2, vocab_size=256)
    model = quantize_nf4(_build(config, torch.float32), compute_dtype=torch.float32, double_quant=True, device="cpu")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, gradient = _embedding_gradient(model, ids)
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=ids).logits
    after_logits, after_gradient = _embedding_gradient(model, ids)
    assert torch.equal(evaluated, logits)
    assert torch.equal(after_logits, logits)
    assert torch.equal(after_gradient, gradient)


def test_a_dense_model_is_quantized_whole() -> None:
    model = quantize_nf4(_build(tiny_llama(num_hidden_layers=2)), compute_dtype=torch.bfloat16, double_quant=True,
                         device="cpu")
    assert unquantized_weights(model) is None


@pytest.mark.parametrize("family", sorted(MOE))
def test_the_runner_and_the_estimate_leave_the_same_expert_weights_unquantized(family: str) -> None:
    """What the runner reports left in bf16 (every decoder matrix that is not NF4) is what the estimate counts."""
    config = MOE[family]
    model = quantize_nf4(_build(config), compute_dtype=torch.bfloat16, double_quant=True, device="cpu")
    kept = unquantized_weights(model)
    assert kept is not None
    assert kept.numel == unquantized_numel(config)
    assert kept.nbytes == 2 * kept.numel
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(kept.names)
    assert "bf16, not NF4" in kept.describe()


def test_the_estimate_notes_unquantized_experts_for_qlora_only() -> None:
    config = MOE["mixtral"]
    qlora = RunSpec.model_validate({"model": "x", "method": "qlora", "precision": "bf16"})
    lora = RunSpec.model_validate({"model": "x", "method": "lora", "precision": "bf16"})
    note = unquantized_experts_note(qlora, config)
    assert note is not None and note.startswith("QLoRA leaves the experts in bf16, not NF4")
    assert unquantized_experts_note(lora, config) is None
    assert unquantized_experts_note(qlora, tiny_llama()) is None


def test_the_estimate_notes_where_lora_dropout_is_not_applied_on_a_mixture_of_experts() -> None:
    config = MOE["mixtral"]
    dropped = RunSpec.model_validate({"model": "x", "method": "lora", "precision": "bf16", "lora": {"dropout": 0.05}})
    note = expert_dropout_note(dropped, config)
    assert note is not None and note.startswith("lora.dropout 0.05 applies to the adapters of Linear layers only")
    assert expert_dropout_note(dropped, tiny_llama()) is None
    assert expert_dropout_note(RunSpec.model_validate({"model": "x", "method": "lora", "precision": "bf16"}),
                               config) is None


def test_transformers_4bit_loading_leaves_fused_experts_in_bf16(tmp_path: Any) -> None:
    """What the estimate assumes of the libraries, loaded through transformers' BitsAndBytesConfig on the CPU: the
    attention's Linear weights become NF4, the fused experts and the router stay bf16. When this fails, a
    transformers or bitsandbytes release quantizes experts: estimate/moe.py `unquantized_numel` must follow."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _build(MOE["mixtral"]).save_pretrained(str(tmp_path))
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=quantization,
                                                      dtype=torch.bfloat16, device_map="cpu")
    layer = loaded.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.weight, bnb.nn.Params4bit)
    assert not isinstance(layer.mlp.experts.gate_up_proj, bnb.nn.Params4bit)
    assert layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert layer.mlp.experts.down_proj.dtype == torch.bfloat16
    assert unquantized_weights(loaded).numel == unquantized_numel(MOE["mixtral"])  # type: ignore[union-attr]


def test_transformers_8bit_loading_gives_the_layers_tunecast_makes(tmp_path: Any) -> None:
    """transformers' BitsAndBytesConfig(load_in_8bit=True) on the CPU (what axolotl's and TRL's load_in_8bit and
    LLaMA-Factory's quantization_bit 8 load): the decoder Linear layers become Linear8bitLt with the outlier threshold
    and int8 rows and scales quantize_int8 gives, the output head stays a plain Linear."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _build(tiny_llama(num_hidden_layers=2)).save_pretrained(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=BitsAndBytesConfig(
            load_in_8bit=True), dtype=torch.bfloat16, device_map="cpu")
    ours = quantize_int8(_build(tiny_llama(num_hidden_layers=2)), device="cpu")
    for theirs, mine in zip(loaded.model.layers[1].modules(), ours.model.layers[1].modules(), strict=True):
        assert type(theirs) is type(mine)
        if isinstance(mine, bnb.nn.Linear8bitLt):
            assert (theirs.state.threshold, theirs.state.has_fp16_weights) == (LLM_INT8_THRESHOLD, False)
            assert (mine.state.threshold, mine.state.has_fp16_weights) == (LLM_INT8_THRESHOLD, False)
            assert theirs.weight.dtype == mine.weight.dtype == torch.int8
            assert torch.equal(theirs.weight.data, mine.weight.data) and torch.equal(theirs.weight.SCB, mine.weight.SCB)
    assert type(loaded.lm_head) is torch.nn.Linear and type(ours.lm_head) is torch.nn.Linear
    assert unquantized_weights(ours) is None


def test_an_8bit_base_is_merged_into_its_dequantized_weights() -> None:
    """`tunecast merge` of an 8-bit run: every Linear8bitLt back to a plain Linear of its int8 rows × absmax / 127,
    within half a quantization step of the weights it was made from."""
    from tunecast.train.merge import _dequantize

    original = _build(tiny_llama(num_hidden_layers=2))
    weights = {name: module.weight.detach().float().clone() for name, module in original.named_modules()
               if type(module) is torch.nn.Linear and name != "lm_head"}
    merged = _dequantize(quantize_int8(original, device="cpu"), torch.bfloat16)
    for name, module in merged.named_modules():
        if name in weights:
            assert type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16
            step = weights[name].abs().amax(dim=1, keepdim=True) / 127
            error = (module.weight.float() - weights[name]).abs()
            assert bool((error <= step / 2 + weights[name].abs() / 128).all()), name  # + bf16's own rounding


def test_moe_experts_left_in_bf16_by_an_8bit_base_are_said_so() -> None:
    kept = unquantized_weights(quantize_int8(_build(MOE["mixtral"]), device="cpu"))
    assert kept is not None and kept.numel == unquantized_numel(MOE["mixtral"])
    assert "bf16, not int8" in kept.describe() and kept.quantized_as == "int8"
