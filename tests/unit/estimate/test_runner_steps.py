"""Other tools' steps as the tracer runs them (`runner:`): each variant changes the traced tensors by what it does."""

from dataclasses import replace
from typing import Any, get_args

import pytest
import torch
import torch.nn.functional as F
from tests.models import tiny_llama

from tunecast.config.diffusion_runner import DIFFUSION_RUNNERS
from tunecast.config.runner import RUNNERS, apply_runner, runner_defaults
from tunecast.config.spec import Runner, RunSpec
from tunecast.estimate.profile import profile_from_trace, replay
from tunecast.estimate.tracer import ALLOC, trace_step
from tunecast.step import chunking, loss
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import build_meta_model
from tunecast.step.variants import CHUNKING_VARIANTS, OWN_LOSSES, STEP_VARIANTS, runner_notes, runner_step

BATCH, SEQ = 2, 128


def traced(config: dict[str, Any], settings: TraceSettings) -> Any:
    trace = trace_step(config, settings, BATCH, SEQ, count_flops=False)
    return trace, replay(profile_from_trace(0, trace), BATCH, SEQ, cuda=False)


def settings_of(**spec: Any) -> TraceSettings:
    return TraceSettings.from_spec(RunSpec(model="x", **spec))


def test_every_runner_of_the_config_has_a_profile_and_known_variants() -> None:
    assert (*RUNNERS, *DIFFUSION_RUNNERS) == get_args(Runner)  # a pipeline's runners: config/diffusion_runner.py
    for runner in RUNNERS.values():
        for method in ("full", "lora", "qlora"):
            for precision in ("bf16", "bf16-mixed", "fp32"):
                variants = runner_step(RunSpec(model="x", method=method, precision=precision, runner=runner.name))
                assert set(variants) <= set(STEP_VARIANTS)
                losses = [v for v in variants if v in OWN_LOSSES]
                assert len(losses) <= 1 and not (losses and "fp32-outputs" in variants)
                assert set(losses) <= set(CHUNKING_VARIANTS)
    assert runner_step(RunSpec(model="x")) == ()


def test_tunecast_settings_key_as_before_runners_existed() -> None:
    """Shipped templates and cached estimates are keyed on the settings: tunecast's own step keeps its keys."""
    plain = settings_of(method="lora")
    assert "runner_step" not in plain.fields()
    assert plain.key({}, {}) != replace(plain, runner_step=("autocast",)).key({}, {})


def test_runner_defaults_fill_only_what_the_config_left_unset() -> None:
    spec = RunSpec.model_validate({"model": "x", "method": "qlora", "runner": "hf-trainer"})
    assert runner_defaults(spec) == {"optimizer": "adamw", "grad_checkpointing": True}
    applied = apply_runner(spec)
    assert applied.grad_checkpointing is True and applied.fixed("grad_checkpointing")
    assert not applied.fixed("micro_batch") and not applied.fixed("seq_len")  # the planner still varies these
    explicit = RunSpec.model_validate({"model": "x", "method": "qlora", "runner": "hf-trainer",
                                       "grad_checkpointing": False})
    assert apply_runner(explicit).grad_checkpointing is False
    torchtune = apply_runner(RunSpec.model_validate({"model": "x", "method": "lora", "runner": "torchtune"}))
    assert torchtune.lora.fp32_adapters is False and "fp32_adapters" in torchtune.lora.model_fields_set
    assert "rank" not in torchtune.lora.model_fields_set
    single = apply_runner(RunSpec.model_validate({"model": "x", "method": "full", "runner": "torchtune"}))
    several = apply_runner(RunSpec.model_validate({"model": "x", "method": "full", "runner": "torchtune",
                                                   "gpus": {"count": 4}}))
    assert (single.optimizer, single.optimizer_in_backward) == ("paged-adamw-8bit", True)
    assert (several.optimizer, several.optimizer_in_backward) == ("adamw", False)


def test_kbit_preparation_casts_every_weight_but_the_4bit_ones_to_fp32() -> None:
    config = tiny_llama(num_hidden_layers=2)
    _, ours = traced(config, settings_of(method="qlora"))
    _, theirs = traced(config, settings_of(method="qlora", runner="hf-trainer", precision="fp32"))
    _, prepared = traced(config, replace(settings_of(method="qlora"), runner_step=("kbit-fp32",)))
    model = build_meta_model(config)
    linears = {id(m.weight) for layer in model.model.layers for m in layer.modules()
               if isinstance(m, torch.nn.Linear)}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in linears)
    grown = prepared.phases["forward"].breakdown["weights"] - ours.phases["forward"].breakdown["weights"]
    assert grown == rest * 2  # bf16 -> fp32: two more bytes each (embeddings, head, norms)
    assert runner_step(RunSpec(model="x", method="qlora", runner="hf-trainer", precision="fp32")) == \
        ("kbit-fp32", "kbit-input-dtype")
    assert theirs.phases["forward"].breakdown["weights"] > 0


def test_accelerate_output_copy_is_an_fp32_logits_tensor_of_the_forward_pass() -> None:
    config = tiny_llama(num_hidden_layers=2)
    base = replace(settings_of(method="lora"), runner_step=("autocast",))
    trace, plain = traced(config, base)
    copied_trace, copied = traced(config, replace(base, runner_step=("autocast", "fp32-outputs")))
    logits_fp32 = BATCH * SEQ * config["vocab_size"] * 4
    sizes = [e.nbytes for e in copied_trace.events if e.kind == ALLOC and e.phase == "forward"]
    assert sizes.count(logits_fp32) > [e.nbytes for e in trace.events
                                       if e.kind == ALLOC and e.phase == "forward"].count(logits_fp32)
    assert copied.phases["forward"].allocated >= plain.phases["forward"].allocated


def test_autocast_over_bf16_weights_saves_bf16_adapter_inputs() -> None:
    """peft casts a LoRA layer's input to its fp32 adapter's dtype; without autocast the fp32 copy is what the
    adapter's matmul keeps for the backward pass, under autocast a bf16 one."""
    config = tiny_llama(num_hidden_layers=2)
    _, pure = traced(config, settings_of(method="lora"))
    _, mixed = traced(config, replace(settings_of(method="lora"), runner_step=("autocast",)))
    assert mixed.phases["forward"].breakdown["activations"] < pure.phases["forward"].breakdown["activations"]


@pytest.mark.parametrize("variant", ["fused-head", "output-chunks", "fused-chunks"])
def test_losses_without_full_logits_hold_less_than_the_standard_loss(variant: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_llama(num_hidden_layers=2, vocab_size=70000)  # three TRL tiles of the vocabulary
    # unsloth's chunks hold at most 4 GiB of fp32 logits: here a quarter of this step's, so four chunks
    monkeypatch.setattr(chunking, "UNSLOTH_CHUNK_BYTES", BATCH * SEQ * config["vocab_size"] * 4 // 4)
    _, standard = traced(config, settings_of(method="lora"))
    trace, chunked = traced(config, replace(settings_of(method="lora"), runner_step=(variant,)))
    full_logits = BATCH * SEQ * config["vocab_size"] * 2
    largest = max(e.nbytes for e in trace.events if e.kind == ALLOC and e.category != "weights")
    if variant == "fused-head":
        assert largest <= min(BATCH * (SEQ - 1), chunking.TRL_TILE_TOKENS) * chunking.TRL_TILE_VOCAB * 4
    else:
        assert largest < full_logits
    peak = max(p.allocated for p in chunked.phases.values())
    assert peak < max(p.allocated for p in standard.phases.values())


def test_fused_head_loss_equals_cross_entropy_and_its_gradients() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 20, (12,))
    targets[3] = loss.IGNORE_INDEX
    # tiles of 5 tokens × 7 entries: the last of each partial
    fused = loss.FusedHeadLoss.apply(hidden, weight, targets, chunking.Chunks((5, 5, 2), (7, 7, 6), (5, 7)))
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=loss.IGNORE_INDEX, reduction="sum")
    reference.backward()
    assert float(fused.detach()) == pytest.approx(float(reference.detach()), rel=1e-6)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5) and torch.allclose(grads[1], weight.grad, atol=1e-5)


def test_compiled_cross_entropy_equals_cross_entropy_and_its_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss, "COMPILED_ROWS", 5)
    torch.manual_seed(0)
    logits = torch.randn(12, 20, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 20, (12,))
    targets[4] = loss.IGNORE_INDEX
    compiled = loss.CompiledCrossEntropy.apply(logits, targets)
    compiled.backward()
    grad = logits.grad.clone()
    logits.grad = None
    reference = F.cross_entropy(logits, targets, ignore_index=loss.IGNORE_INDEX, reduction="sum")
    reference.backward()
    assert float(compiled.detach()) == pytest.approx(float(reference.detach()), rel=1e-6)
    assert torch.allclose(grad, logits.grad, atol=1e-6)


@pytest.mark.parametrize("runner", ["hf-trainer", "torchtune"])
def test_a_compiled_loss_keeps_no_fp32_logits(runner: str) -> None:
    config = tiny_llama(num_hidden_layers=2, vocab_size=4096)
    eager = settings_of(method="lora", runner=runner)
    compiled = settings_of(method="lora", runner=runner, compile=True)
    assert "compiled-loss" in compiled.runner_step and "compiled-loss" not in eager.runner_step
    trace, held = traced(config, compiled)
    _, plain = traced(config, eager)
    fp32_logits = BATCH * SEQ * config["vocab_size"] * 4
    assert held.phases["forward"].allocated < plain.phases["forward"].allocated
    if runner == "torchtune":  # no whole logits in the loss: at most a chunk's
        assert max(e.nbytes for e in trace.events if e.kind == ALLOC and e.phase == "forward") < fp32_logits


def test_compile_needs_another_runner() -> None:
    from tunecast.config.checks import cross_field_problems

    problems = cross_field_problems(RunSpec(model="x", compile=True), lambda key: None)
    assert [p.field for p in problems if p.severity == "error"] == ["compile"]
    assert not cross_field_problems(RunSpec(model="x", compile=True, runner="torchtune"), lambda key: None)


def test_trl_on_the_cpu_traces_its_own_fallback_head() -> None:
    """Without Triton TRL's fused head folds whole tiles with fp32 temporaries: `--device cpu` traces that code
    (TRL is installed with the dev extra); a GPU estimate keeps the kernels' memory."""
    pytest.importorskip("trl.kernels.chunked_logprob")
    spec = RunSpec(model="x", method="lora", runner="trl")
    assert "fused-head" in runner_step(spec) and "fused-head-cpu" not in runner_step(spec)
    assert "fused-head-cpu" in runner_step(spec, "cpu") and "fused-head" not in runner_step(spec, "cpu")
    assert TraceSettings.from_spec(spec, device="cpu").runner_step == runner_step(spec, "cpu")
    config = tiny_llama(num_hidden_layers=2, vocab_size=40000)  # two TRL tiles of the vocabulary
    _, on_gpu = traced(config, replace(settings_of(method="lora"), runner_step=("fused-head",)))
    _, fallback = traced(config, replace(settings_of(method="lora"), runner_step=("fused-head-cpu",)))
    tile = BATCH * (SEQ - 1) * chunking.TRL_TILE_VOCAB * 4  # one fp32 tile-sized temporary
    assert (max(p.allocated for p in fallback.phases.values())
            > max(p.allocated for p in on_gpu.phases.values()) + tile)


def test_the_fallback_head_loss_is_the_cross_entropy() -> None:
    pytest.importorskip("trl.kernels.chunked_logprob")
    torch.manual_seed(0)
    hidden = torch.randn(12, 8)
    weight = torch.randn(50, 8)
    targets = torch.randint(0, 50, (12,))
    targets[3] = loss.IGNORE_INDEX
    summed = loss._trl_head_without_triton(hidden, weight, targets)
    reference = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=loss.IGNORE_INDEX, reduction="sum")
    assert float(summed) == pytest.approx(float(reference), rel=1e-5)


def test_4bit_layers_returning_their_input_dtype_make_the_residual_stream_fp32_after_kbit_preparation() -> None:
    """bitsandbytes' Linear4bit returns its input's dtype: after peft's fp32 casts (and TRL's bf16 embeddings) the
    fp32 norms feed the first layer's projections fp32, and from its attention on the residual stream is fp32, so
    every checkpointed layer but the first keeps an fp32 input: two more bytes per element."""
    layers = 3
    config = tiny_llama(num_hidden_layers=layers)
    base = replace(settings_of(method="qlora", grad_checkpointing=True),
                   runner_step=("autocast", "kbit-fp32", "kbit-bf16-head"))
    _, bf16_out = traced(config, base)
    _, input_dtype = traced(config, replace(base, runner_step=(*base.runner_step, "kbit-input-dtype")))
    grown = input_dtype.phases["forward"].breakdown["activations"] - bf16_out.phases["forward"].breakdown["activations"]
    assert grown == (layers - 1) * BATCH * SEQ * config["hidden_size"] * 2
    assert "kbit-input-dtype" in runner_step(RunSpec(model="x", method="qlora", runner="hf-trainer"))
    assert "kbit-input-dtype" not in runner_step(RunSpec(model="x", method="qlora", runner="hf-trainer",
                                                         quantization={"bits": 8}))
    said = [line for line in runner_notes(RunSpec(model="x", method="qlora", runner="hf-trainer"))
            if STEP_VARIANTS["kbit-input-dtype"] in line]
    assert len(said) == 1 and said[0].startswith("bitsandbytes"), "bitsandbytes' behaviour, not the runner's"
