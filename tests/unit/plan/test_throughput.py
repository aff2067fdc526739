"""The step-time model: each term against the arithmetic it stands for, and the regimes it must tell apart."""

from __future__ import annotations

from typing import Any

import pytest
from tests.models import shallow_llama, tiny_llama

from tunecast.config.spec import RunSpec
from tunecast.estimate.profiles import get_profiles
from tunecast.plan.throughput import forward_seconds, matmul_seconds, step_time
from tunecast.step.settings import TraceSettings

# Wide enough that long sequences are compute-bound, small enough to trace in seconds.
CONFIG = shallow_llama(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)
# At 8B's width, where the weight-gradient matmuls LoRA skips outweigh its adapters' memory-bound operations
# (at width 1024 they do not: the dropout, scaling and addition on every adapted Linear cost more).
WIDE = shallow_llama(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
# Deep enough to be traced at two depths and extrapolated (the others are traced once, at their depth).
DEEP = tiny_llama(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)


pytestmark = pytest.mark.usefixtures("profile_cache")


def step(catalog, gpu: str = "h100-sxm", batch: int = 4, seq: int = 1024, count: int = 1, accum: int = 1,
         checkpointing: bool = False, config: Any = CONFIG, **changes: Any):  # type: ignore[no-untyped-def]
    spec = RunSpec.model_validate({"model": "x", "micro_batch": batch, "seq_len": seq, **changes})
    pair = get_profiles(config, TraceSettings.from_spec(spec, grad_checkpointing=checkpointing), batch, seq)
    return step_time(spec, pair, catalog.gpus.get(gpu), catalog.throughput, micro_batch=batch, seq=seq,
                     grad_accum=accum, gpu_count=count, grad_checkpointing=checkpointing), spec, pair


def test_matmul_roofline_counts_passes_and_falls_to_memory_speed() -> None:
    linear = ((4096, 4096, True),)
    flops_per_s, bytes_per_s = 1e15, 1e12
    seconds, flops = matmul_seconds(linear, 8192, passes=1, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s,
                                    element=2)
    assert flops == 3 * 2 * 8192 * 4096 * 4096  # forward, input gradient, weight gradient
    assert seconds == pytest.approx(flops / flops_per_s)  # compute-bound
    _, frozen_flops = matmul_seconds(((4096, 4096, False),), 8192, passes=2, flops_per_s=flops_per_s,
                                     bytes_per_s=bytes_per_s, element=2)
    assert frozen_flops == 3 * 2 * 8192 * 4096 * 4096  # no weight gradient, one recomputed forward
    one_token, _ = matmul_seconds(linear, 1, passes=1, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, element=2)
    assert one_token == pytest.approx(3 * 2 * (4096 + 4096 * 4096 + 4096) / bytes_per_s)  # memory-bound


def test_lora_skips_weight_gradients_and_checkpointing_recomputes(catalog) -> None:
    full, _, _ = step(catalog, method="full", config=WIDE)
    lora, _, _ = step(catalog, method="lora", lora={"fp32_adapters": False}, config=WIDE)
    assert lora.compute_s < full.compute_s
    full, _, _ = step(catalog, method="full")
    recomputed, _, _ = step(catalog, method="full", checkpointing=True)
    assert 1.15 < recomputed.compute_s / full.compute_s < 1.45  # about (6N + 2N) / 6N, attention aside


def test_peft_fp32_adapters_cost_memory_traffic(catalog) -> None:
    bf16, _, _ = step(catalog, method="lora", lora={"fp32_adapters": False})
    fp32, _, _ = step(catalog, method="lora")
    assert fp32.compute_s > bf16.compute_s * 1.1


def test_faster_cards_and_fp8(catalog) -> None:
    h100, _, _ = step(catalog, "h100-sxm", method="full")
    a100, _, _ = step(catalog, "a100-80gb", method="full")
    assert h100.compute_s < a100.compute_s
    fp8, _, _ = step(catalog, "h100-sxm", method="full", precision="fp8")
    assert fp8.compute_s < h100.compute_s
    no_fp8, _, _ = step(catalog, "a100-80gb", method="full", precision="fp8")  # the A100 has no FP8 cores
    assert no_fp8.compute_s == pytest.approx(a100.compute_s, rel=0.01)


def test_small_micro_batches_are_bound_by_dispatch(catalog) -> None:
    small, _, pair = step(catalog, batch=1, seq=32, method="lora", config=DEEP)
    large, _, _ = step(catalog, batch=4, seq=1024, method="lora", config=WIDE)
    assert small.dispatch_s > 0 and large.dispatch_s == 0
    # kernels counted in the traced shallow models, extrapolated in depth like every other term
    shallow, deeper = (p.flops_at(1, 32)["kernels"] for p in (pair.shallow, pair.deeper))
    assert deeper > shallow > 100
    kernels = shallow + (deeper - shallow) * (pair.layers - pair.shallow.layers) / (
        pair.deeper.layers - pair.shallow.layers)
    # when dispatch-bound, the step takes what the CPU needs to dispatch its kernels
    dispatch = catalog.throughput.get("op_dispatch_us") * 1e-6
    assert small.compute_s + small.dispatch_s == pytest.approx(kernels * dispatch)


def test_qlora_dequantizes_every_pass(catalog) -> None:
    plain, _, pair = step(catalog, method="qlora")
    checkpointed, _, _ = step(catalog, method="qlora", checkpointing=True)
    gpu = catalog.gpus.get("h100-sxm")
    bandwidth = gpu.memory_bandwidth_gb_per_s * 1e9 * catalog.throughput.get("memory_efficiency")
    quantized = pair.deeper.facts.quantizable_numel * pair.layers / pair.deeper.layers
    per_weight = catalog.throughput.get("bnb_dequantize_bytes_per_weight")
    assert plain.dequantize_s == pytest.approx(2 * quantized * per_weight / bandwidth, rel=0.01)
    assert checkpointed.dequantize_s == pytest.approx(1.5 * plain.dequantize_s)


def test_communication_by_strategy_and_link(catalog) -> None:
    single, _, _ = step(catalog, method="full", accum=1)
    assert single.communication_s == 0
    nvlink, _, _ = step(catalog, "h100-sxm", method="full", count=8, batch=1, seq=128, gpus={"strategy": "ddp"})
    pcie, _, _ = step(catalog, "h100-pcie", method="full", count=8, batch=1, seq=128, gpus={"strategy": "ddp"})
    assert 0 < nvlink.communication_s < pcie.communication_s
    fsdp, _, _ = step(catalog, "h100-pcie", method="full", count=8, batch=1, seq=128, accum=4,
                      gpus={"strategy": "fsdp"})
    grad_op, _, _ = step(catalog, "h100-pcie", method="full", count=8, batch=1, seq=128, accum=4,
                         gpus={"strategy": "fsdp-grad-op"})
    assert fsdp.communication_s > grad_op.communication_s  # FSDP gathers the parameters every micro-batch


def test_deepspeed_reduces_once_a_step_at_zero1_and_behind_the_backward_pass_with_overlap(catalog) -> None:
    def exposed(**gpus: Any) -> float:
        return step(catalog, "h100-pcie", method="full", count=8, batch=1, seq=128, accum=4, gpus=gpus)[0]

    buckets = {"reduce_bucket_size": 10_000}  # many buckets: the tiny model's gradients are not one
    zero1, zero2 = exposed(strategy="zero1", deepspeed=buckets), exposed(strategy="zero2", deepspeed=buckets)
    overlapped = exposed(strategy="zero2", deepspeed=buckets | {"overlap_comm": True})
    assert zero1.communication_s < zero2.communication_s  # one reduction a step, not one a micro-batch
    assert overlapped.communication_s < zero2.communication_s  # each bucket reduced while the backward pass goes on
    assert zero2.optimizer_s < exposed(strategy="ddp").optimizer_s  # each GPU steps its shard


def test_offload_moves_the_optimizer_over_pcie(catalog) -> None:
    local, _, _ = step(catalog, method="full", count=2, gpus={"strategy": "fsdp"})
    offloaded, _, _ = step(catalog, method="full", count=2, gpus={"strategy": "fsdp", "offload": "optimizer"})
    # over PCIe, not at the GPU's bandwidth (gradient clipping stays on the GPU in both)
    assert offloaded.optimizer_s > 5 * local.optimizer_s


def test_evaluation_is_a_fraction_of_a_training_step(catalog) -> None:
    training, spec, pair = step(catalog, method="full", config=WIDE)  # wide enough that the GPU's work sets the pace
    forward = forward_seconds(spec, pair, catalog.gpus.get("h100-sxm"), catalog.throughput, micro_batch=4, seq=1024)
    assert 0.25 * training.compute_s < forward < 0.5 * training.compute_s


def test_exposed_communication_counts_what_cannot_hide_behind_computation() -> None:
    """Each engine's collectives against the arithmetic they stand for, on a link of 10 GB/s with no latency."""
    from tunecast.plan.throughput import DDP_BUCKET_BYTES, Link, exposed_communication

    link = Link("test", 10e9, 0.0)
    grads = 4 * DDP_BUCKET_BYTES  # four buckets
    ring = 1 / 2  # 2 GPUs
    reduce, last = 2 * ring * grads / 10e9, 2 * ring * DDP_BUCKET_BYTES / 10e9

    def ddp(compute_s: float, accum: int) -> float:
        return exposed_communication("ddp", link, gpu_count=2, layers=4, layer_param_bytes=0.0,
                                     trainable_bytes=grads, compute_s=compute_s, grad_accum=accum, checkpointing=False)

    assert ddp(100.0, 1) == pytest.approx(last)  # all but the last bucket behind the backward pass
    assert ddp(0.0, 1) == pytest.approx(reduce)  # nothing to hide behind
    # with accumulation only the last micro-batch's backward pass hides it: 4 micro-batches of 0.006 s, 0.004 of
    # backward each (the step's whole backward, 0.016 s, would hide it all)
    assert ddp(4 * 0.006, 4) == pytest.approx(last + (reduce - last - 0.004))
    assert reduce - last > 0.004

    layer, trained = 1e9, 4e8  # 0.05 s to gather a layer over 2 GPUs, 0.005 s to reduce-scatter its gradients
    gather, scatter = ring * layer / 10e9, ring * trained / 4 / 10e9

    def fsdp(compute_s: float, accum: int, checkpointing: bool = False) -> float:
        return exposed_communication("fsdp", link, gpu_count=2, layers=4, layer_param_bytes=layer,
                                     trainable_bytes=trained, compute_s=compute_s, grad_accum=accum,
                                     checkpointing=checkpointing)

    # each layer's gather behind the previous layer's computation: the first gather of the forward pass and the last
    # reduce-scatter of the backward pass are exposed
    assert fsdp(100.0, 1) == pytest.approx(gather + scatter)
    assert fsdp(100.0, 3) == pytest.approx(3 * (gather + scatter))  # gathered again for every micro-batch
    assert fsdp(0.0, 1) == pytest.approx(7 * gather + 4 * scatter)  # nothing to hide behind
    # a layer's forward takes 0.01 s, its backward 0.02 (0.015 with checkpointing's recomputed forward in it)
    assert fsdp(0.12, 1) == pytest.approx(gather + 3 * (gather - 0.01) + scatter + 3 * (gather + scatter - 0.02))
    assert fsdp(0.08, 1, checkpointing=True) == pytest.approx(
        gather + 3 * (gather - 0.005) + scatter + 3 * (gather + scatter - 0.015))


def test_the_link_of_cards_without_peer_to_peer_goes_through_host_memory(catalog) -> None:
    from tunecast.plan.throughput import collective_link

    constants = catalog.throughput
    geforce, nvlink = catalog.gpus.get("rtx-4090"), catalog.gpus.get("a100-80gb")
    through_host = collective_link(geforce, 2, constants)
    assert "through host memory" in through_host.name
    assert through_host.bus_bytes_per_s == pytest.approx(
        geforce.interconnect_gb_per_s / 2 * 1e9 * constants.get("host_route_efficiency"))
    direct = collective_link(nvlink, 8, constants)
    assert direct.bus_bytes_per_s == pytest.approx(
        nvlink.interconnect_gb_per_s / 2 * 1e9 * constants.get("communication_efficiency"))
    assert direct.latency_s == pytest.approx(constants.get("collective_latency_us") * 1e-6)
    two_nodes = collective_link(nvlink, 16, constants, internode_gb_per_s=400.0)  # 50 GB/s a GPU: slower
    assert "network between nodes" in two_nodes.name and two_nodes.bus_bytes_per_s == pytest.approx(
        50e9 * constants.get("communication_efficiency"))
