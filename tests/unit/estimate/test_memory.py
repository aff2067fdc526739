"""The modelled terms of the memory estimate, each against a traced or measured value."""

from typing import Any

import pytest
import torch
from tests.models import shallow_llama, tiny_llama

from tunecast.catalog.overheads import overhead_bytes
from tunecast.config.spec import RunSpec
from tunecast.estimate import memory
from tunecast.estimate.memory import estimate_memory

GIB = 2**30


def estimate(catalog, config: dict[str, Any], device: str = "cuda", gpu: str | None = "h100", **settings: Any):
    spec = RunSpec.model_validate({"model": "x", "micro_batch": 2, "seq_len": 256, **settings})
    return estimate_memory(spec, config, device=device, gpu=catalog.gpus.get(gpu) if gpu else None,
                           overheads=catalog.overheads)


def _quantizable(config: dict[str, Any]) -> int:
    h, i, q, kv = config["hidden_size"], config["intermediate_size"], config["hidden_size"], 2 * 16
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    return config["num_hidden_layers"] * (h * q + 2 * h * kv + q * h + 3 * h * i)


def test_nf4_weights_and_constants_match_bitsandbytes_tensors(catalog) -> None:
    """The NF4 formula against the bytes of real bitsandbytes Linear4bit layers (double quantization)."""
    from transformers import AutoModelForCausalLM

    from tunecast.step.setup import decoder_layers
    from tunecast.step.shape import hf_config
    from tunecast.train.quantize import quantize_nf4

    config = tiny_llama(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                        num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.bfloat16)
    quantize_nf4(model, compute_dtype=torch.bfloat16, double_quant=True, device="cpu")
    measured_weights = measured_constants = 0
    for layer in decoder_layers(model):
        for module in layer.modules():
            state = getattr(getattr(module, "weight", None), "quant_state", None)
            if state is None:
                continue
            measured_weights += module.weight.numel() * module.weight.element_size()
            measured_constants += state.absmax.numel() * state.absmax.element_size()
            measured_constants += state.state2.absmax.numel() * state.state2.absmax.element_size()
    quantized = _quantizable(config)
    assert measured_weights == quantized * memory.NF4_BYTES_PER_WEIGHT
    modelled = quantized / memory.NF4_BLOCK + quantized / memory.NF4_BLOCK / memory.DOUBLE_QUANT_BLOCK * 4
    assert measured_constants == pytest.approx(modelled, rel=0.02)


def test_qlora_estimate_swaps_bf16_weights_for_nf4(catalog) -> None:
    config = shallow_llama()
    lora = estimate(catalog, config, method="lora")
    qlora = estimate(catalog, config, method="qlora")
    quantized = _quantizable(config)
    saved = (lora.breakdown_gib["weights"] - qlora.breakdown_gib["weights"]) * GIB
    assert saved == pytest.approx(quantized * (2 - memory.NF4_BYTES_PER_WEIGHT), rel=1e-6)
    assert qlora.breakdown_gib["quantization"] > 0


def test_8bit_optimizer_states_match_bitsandbytes(catalog) -> None:
    import bitsandbytes as bnb

    params = [torch.nn.Parameter(torch.zeros(1000, 300)), torch.nn.Parameter(torch.zeros(100))]
    optimizer = bnb.optim.AdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    measured = sum(v.numel() * v.element_size() for state in optimizer.state.values()
                   for k, v in state.items() if isinstance(v, torch.Tensor) and k not in ("qmap1", "qmap2"))
    facts = memory.Facts(quantizable_numel=0, largest_quantizable_numel=0, trainable_numel=300_100,
                         trainable_small_numel=100, layer_bytes=0, layer_numel=0)
    spec = RunSpec(model="x", optimizer="adamw-8bit")
    device, managed = memory._optimizer_state_bytes(spec, facts, traced_state_bytes=0)
    assert managed == 0 and device == pytest.approx(measured, abs=16)  # the small tensor's unorm/step scalars


def test_paged_states_leave_the_allocator(catalog) -> None:
    config = shallow_llama(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4)
    adamw = estimate(catalog, config, method="full")
    paged = estimate(catalog, config, method="full", optimizer="paged-adamw-8bit")
    assert paged.managed_gib > 0 and paged.breakdown_gib["optimizer"] < adamw.breakdown_gib["optimizer"] / 10


def test_activation_offload_moves_activations_to_host(catalog) -> None:
    config = tiny_llama()
    plain = estimate(catalog, config, method="lora")
    offloaded = estimate(catalog, config, method="lora", activation_offload=True)
    layers = config["num_hidden_layers"]
    # Everything saved moves to the host; two layers' worth stays on the device.
    assert offloaded.host_ram_gib >= plain.breakdown_gib["activations"]
    assert offloaded.breakdown_gib["activations"] == pytest.approx(offloaded.host_ram_gib * 2 / layers)
    assert offloaded.device_total_gib < plain.device_total_gib


def test_ddp_adds_gradient_buckets_and_fsdp_shards(catalog) -> None:
    config = shallow_llama(hidden_size=256, intermediate_size=512)
    single = estimate(catalog, config, method="full")
    ddp = estimate(catalog, config, method="full", gpus={"count": 4})
    fsdp = estimate(catalog, config, method="full", gpus={"count": 4, "strategy": "fsdp"})
    trainable = single.breakdown_gib["trainable_weights"]
    assert ddp.breakdown_gib["gradients"] - single.breakdown_gib["gradients"] == pytest.approx(trainable)
    assert fsdp.breakdown_gib["trainable_weights"] == pytest.approx(trainable / 4)
    assert fsdp.breakdown_gib["optimizer"] == pytest.approx(single.breakdown_gib["optimizer"] / 4)


def test_cpu_offload_of_optimizer_states(catalog) -> None:
    config = shallow_llama(hidden_size=256, intermediate_size=512)
    sharded = estimate(catalog, config, method="full", gpus={"count": 2, "strategy": "fsdp"})
    offloaded = estimate(catalog, config, method="full", gpus={"count": 2, "strategy": "fsdp", "offload": "optimizer"})
    assert offloaded.breakdown_gib["optimizer"] == 0
    assert offloaded.host_ram_gib == pytest.approx(sharded.breakdown_gib["optimizer"], rel=1e-6)


def test_cuda_terms_context_and_workspace(catalog) -> None:
    config = shallow_llama()
    result = estimate(catalog, config, method="lora")
    context = overhead_bytes(catalog.overheads, "cuda_context", "hopper") / GIB
    workspace = overhead_bytes(catalog.overheads, "cublas_workspace", "hopper") / GIB
    assert result.device_total_gib - result.peak_reserved_gib == pytest.approx(context)
    assert result.peak_reserved_gib >= result.peak_allocated_gib
    assert result.breakdown_gib["overhead"] >= context + workspace - 1e-9
    assert sum(result.breakdown_gib.values()) == pytest.approx(result.device_total_gib)


def test_cpu_estimate_is_live_tensors_plus_framework_overhead(catalog) -> None:
    config = shallow_llama()
    result = estimate(catalog, config, device="cpu", gpu=None, method="lora")
    framework = overhead_bytes(catalog.overheads, "cpu_framework", "*") / GIB
    assert result.peak_reserved_gib == result.peak_allocated_gib
    assert result.device_total_gib == pytest.approx(result.peak_allocated_gib + framework)


def test_closed_form_fallback_when_tracing_is_unavailable(catalog, monkeypatch) -> None:
    from tunecast.estimate import tracer

    config = shallow_llama(hidden_size=256, intermediate_size=512, vocab_size=2048)
    traced = estimate(catalog, config, device="cpu", gpu=None, method="lora")
    monkeypatch.setattr(tracer, "tracing_available", lambda: "no fake tensors in this build")
    monkeypatch.setenv("TUNECAST_CACHE", str(__import__("tempfile").mkdtemp()))
    fallback = estimate(catalog, config, device="cpu", gpu=None, method="lora")
    assert any("closed-form" in note for note in fallback.notes)
    assert fallback.peak_allocated_gib == pytest.approx(traced.peak_allocated_gib, rel=0.05)


def test_adapters_in_the_model_dtype_save_peft_fp32_copies(catalog) -> None:
    """peft upcasts adapters to fp32 by default (`autocast_adapter_dtype`) and casts each adapted layer's
    input to fp32; with `lora.fp32_adapters: false` the adapters stay bf16 and the copies disappear."""
    from transformers import AutoModelForCausalLM

    from tunecast.step.settings import TraceSettings
    from tunecast.step.setup import apply_adapters
    from tunecast.step.shape import hf_config

    config = shallow_llama()
    for fp32 in (True, False):
        spec = RunSpec.model_validate({"model": "x", "lora": {"fp32_adapters": fp32}})
        model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.bfloat16)
        model = apply_adapters(model, TraceSettings.from_spec(spec).adapters)
        dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
        assert dtypes == {torch.float32 if fp32 else torch.bfloat16}
    default = estimate(catalog, config, method="lora")
    same_dtype = estimate(catalog, config, method="lora", lora={"fp32_adapters": False})
    assert same_dtype.breakdown_gib["activations"] < default.breakdown_gib["activations"]
