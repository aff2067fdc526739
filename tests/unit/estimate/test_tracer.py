"""What the tracer counts, category by category, on tiny real models."""

from typing import Any

import pytest
from tests.models import tiny_llama, tiny_qwen3

from tunecast.config.spec import RunSpec
from tunecast.estimate.profile import profile_from_trace, replay
from tunecast.estimate.tracer import trace_step
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import build_meta_model, count_parameters


def peaks(config: dict[str, Any], batch: int = 2, seq: int = 128, **spec: Any):  # type: ignore[no-untyped-def]
    settings = TraceSettings.from_spec(RunSpec(model="x", **spec))
    trace = trace_step(config, settings, batch, seq)
    return replay(profile_from_trace(0, trace), batch, seq, cuda=False), trace.facts


def test_full_fine_tuning_weights_gradients_and_adamw_states() -> None:
    config = tiny_llama(num_hidden_layers=2)
    params = count_parameters(build_meta_model(config))
    result, facts = peaks(config, method="full", precision="bf16")
    optimizer_phase = result.phases["optimizer"].breakdown
    assert optimizer_phase["trainable_weights"] == params * 2  # bf16
    assert optimizer_phase["gradients"] == params * 2  # gradients live until zero_grad
    assert optimizer_phase["optimizer"] >= 2 * params * 2  # exp_avg + exp_avg_sq in bf16 (+ step counters)
    assert optimizer_phase["optimizer"] - 2 * params * 2 < 4096
    assert facts.trainable_numel == params


def test_lora_adapters_are_fp32_and_base_weights_frozen() -> None:
    config = tiny_llama(num_hidden_layers=2)
    result, facts = peaks(config, method="lora", lora={"rank": 4, "targets": ["q_proj", "v_proj"]})
    forward = result.phases["forward"].breakdown
    # q: 64→64, v: 64→32 (2 kv heads × 16); each layer adds r·(in + out) per target.
    adapters = 2 * 4 * ((64 + 64) + (64 + 32))
    assert facts.trainable_numel == adapters
    assert forward["trainable_weights"] == adapters * 4
    buffers = sum(b.numel() * b.element_size() for b in build_meta_model(config).buffers())  # rotary tables
    assert forward["weights"] == count_parameters(build_meta_model(config)) * 2 + buffers


def test_tied_embeddings_are_counted_once() -> None:
    config = tiny_qwen3(num_hidden_layers=2)
    result, _ = peaks(config, method="full")
    assert result.phases["forward"].breakdown["trainable_weights"] == count_parameters(build_meta_model(config)) * 2


def test_checkpointing_keeps_only_layer_inputs() -> None:
    config = tiny_llama(num_hidden_layers=4)
    plain, _ = peaks(config, method="lora", batch=2, seq=256)
    checkpointed, _ = peaks(config, method="lora", batch=2, seq=256, grad_checkpointing=True)
    assert checkpointed.phases["forward"].breakdown["activations"] < plain.phases["forward"].breakdown[
        "activations"] / 4
    # and the recomputation in the backward pass holds one layer at a time, not all of them
    saved = plain.phases["backward"].allocated - checkpointed.phases["backward"].allocated
    assert saved > plain.phases["forward"].breakdown["activations"] / 2


def test_chunked_loss_never_holds_all_logits() -> None:
    config = tiny_llama(num_hidden_layers=2, vocab_size=8192)
    standard, _ = peaks(config, method="lora", batch=2, seq=512)
    chunked, _ = peaks(config, method="lora", batch=2, seq=512, loss="chunked")
    logits_fp32 = 2 * 512 * 8192 * 4
    assert standard.phases["backward"].breakdown["temporaries"] >= 2 * logits_fp32
    assert chunked.phases["backward"].breakdown["temporaries"] < logits_fp32


def test_optimizer_in_backward_frees_gradients_as_it_goes() -> None:
    config = tiny_llama(num_hidden_layers=4)
    params = count_parameters(build_meta_model(config))
    normal, _ = peaks(config, method="full")
    in_backward, _ = peaks(config, method="full", optimizer_in_backward=True, grad_accum=1)
    assert normal.phases["optimizer"].breakdown["gradients"] == params * 2
    assert max(p.breakdown["gradients"] for p in in_backward.phases.values()) < params * 2 / 2


def test_sgd_keeps_no_state_and_adafactor_factors_it() -> None:
    config = tiny_llama(num_hidden_layers=2)
    sgd, _ = peaks(config, method="full", optimizer="sgd")
    adafactor, _ = peaks(config, method="full", optimizer="adafactor")
    adamw, _ = peaks(config, method="full")
    assert sgd.phases["optimizer"].breakdown["optimizer"] == 0
    assert 0 < adafactor.phases["optimizer"].breakdown["optimizer"] < adamw.phases["optimizer"].breakdown["optimizer"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_fp32_master_weights(precision: str) -> None:
    config = tiny_llama(num_hidden_layers=2)
    result, facts = peaks(config, method="full", precision=precision)
    assert facts.param_dtype_bytes == 4
    assert result.phases["forward"].breakdown["trainable_weights"] == count_parameters(build_meta_model(config)) * 4


def test_dora_and_modules_to_save_add_what_peft_adds() -> None:
    config = tiny_llama(num_hidden_layers=2)
    _, plain_facts = peaks(config, method="lora")
    _, dora_facts = peaks(config, method="lora", lora={"dora": True})
    _, saved_facts = peaks(config, method="lora", lora={"modules_to_save": ["lm_head"]})
    assert dora_facts.trainable_numel > plain_facts.trainable_numel  # a magnitude vector per adapted layer
    assert saved_facts.trainable_numel - plain_facts.trainable_numel == 512 * 64  # a trainable copy of lm_head


def _moved(operation: Any) -> list[tuple[str, int]]:
    """(operator, bytes moved) of each kernel `operation` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tunecast.estimate.tracer import _launches_kernel, moved_bytes

    seen: list[tuple[str, int]] = []

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if _launches_kernel(func):
                seen.append((func.overloadpacket.__name__, moved_bytes(func, args, kwargs or {}, out)))
            return out

    with Counting():
        operation()
    return seen


def test_moved_bytes_count_every_operand_read_and_every_tensor_written() -> None:
    import torch

    a, b = torch.ones(1000), torch.ones(1000)  # 4,000 bytes each
    assert _moved(lambda: a + b) == [("add", 12_000)]  # two read, one written
    assert _moved(lambda: a.add_(b)) == [("add_", 12_000)]  # in place: read both, write a
    assert _moved(lambda: torch.zeros_like(a)) == [("zeros_like", 4_000)]  # a gives only the shape
    assert _moved(lambda: a.copy_(b)) == [("copy_", 8_000)]  # the target is overwritten, not read
    row, full = torch.ones(1, 10), torch.ones(100, 10)
    assert _moved(lambda: row.expand(100, 10) + full) == [("add", 40 + 4_000 + 4_000)]  # broadcast: read once
    table, ids = torch.ones(50_000, 8), torch.zeros(16, dtype=torch.long)
    moved = dict(_moved(lambda: torch.nn.functional.embedding(ids, table)))
    assert moved["embedding"] == 16 * 8 * 4 + 16 * 8 + 16 * 8 * 4  # rows looked up, indices, rows written


def test_optimizer_bytes_follow_the_kernels_each_optimizer_runs() -> None:
    config = tiny_llama(num_hidden_layers=2)

    def per_parameter(**spec: Any) -> float:
        trace = trace_step(config, TraceSettings.from_spec(RunSpec(model="x", method="full", **spec)), 2, 32)
        return trace.flops["optimizer_bytes"] / trace.facts.trainable_numel

    fused = per_parameter(precision="bf16")
    # parameter, gradient and both states read; parameter and states written (the schema of torch's fused
    # kernel declares the gradient written too), 2 bytes each
    assert 7 * 2 <= fused <= 8 * 2 + 0.01
    assert per_parameter(precision="bf16", optimizer="adamw-foreach") > 2.2 * fused  # many passes, not one
    assert per_parameter(precision="fp32", optimizer="sgd") == pytest.approx(3 * 4, rel=0.01)  # read p, g; write p


def _flop_counter_mode(config: dict[str, Any], settings: TraceSettings, batch: int, seq: int) -> dict[str, float]:
    """The FLOPs of one forward and backward pass counted by torch's FlopCounterMode itself (its module tracking, its
    decompositions), on the model the tracer builds."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from tunecast.estimate import tracer
    from tunecast.step.forward import forward_backward

    tracer._register_attention_flops()
    model = tracer.build_training_model(config, settings)
    mode = FakeTensorMode()
    tracer._fakeify(model, mode)
    counter = FlopCounterMode(display=False)
    with mode, tracer._as_on_real_tensors(), counter:
        tokens = torch.zeros((batch, seq), dtype=torch.long)
        forward_backward(model, tokens, tokens, precision=settings.precision, chunked_loss=settings.loss == "chunked",
                         runner_step=settings.runner_step)
    counted = {"matmul": 0.0, "attention": 0.0}
    for op, count in counter.get_flop_counts().get("Global", {}).items():
        counted["attention" if "scaled_dot_product" in str(op) else "matmul"] += count
    return counted


@pytest.mark.parametrize("config, spec", [
    (tiny_qwen3(num_hidden_layers=2), {"method": "lora", "grad_checkpointing": True}),  # the recomputed forward too
    (tiny_llama(num_hidden_layers=2), {"method": "full", "loss": "chunked"}),
    (tiny_llama(num_hidden_layers=2), {"method": "lora", "runner": "trl"}),  # TRL's fused head, under autocast
])
def test_the_flops_counted_as_the_step_runs_are_flop_counter_mode_s(config: dict[str, Any],
                                                                     spec: dict[str, Any]) -> None:
    """The tracer counts a step's matmul and attention FLOPs in its second step, by the formulas of torch's
    FlopCounterMode, instead of a pass of their own under it: the same figures as FlopCounterMode counts."""
    from tunecast.config.runner import apply_runner

    settings = TraceSettings.from_spec(apply_runner(RunSpec.model_validate({"model": "x", **spec})))
    counted = trace_step(config, settings, 2, 64).flops
    assert counted["matmul"] > 0 and counted["attention"] > 0
    assert {kind: counted[kind] for kind in ("matmul", "attention")} == \
        _flop_counter_mode(config, settings, 2, 64)
