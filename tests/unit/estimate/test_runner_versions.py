"""Older versions of the tools (`runner_version`, `bitsandbytes_version`, `transformers_version`): each version range
runs its own step variants and defaults, and the variants change the traced tensors by what that version's code did."""

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from tests.models import tiny_llama

from tunecast.config.checks import cross_field_problems
from tunecast.config.load import parse_set
from tunecast.config.runner import RUNNERS, apply_runner, runner_entry
from tunecast.config.spec import RunSpec
from tunecast.config.versions import VersionRange, compare, parse_version
from tunecast.estimate.profile import profile_from_trace, replay
from tunecast.estimate.tracer import ALLOC, trace_step
from tunecast.step import chunking, loss
from tunecast.step.settings import TraceSettings
from tunecast.step.shape import build_meta_model
from tunecast.step.variants import STEP_VARIANTS, runner_notes, runner_step

BATCH, SEQ = 2, 128


def traced(config: dict[str, Any], settings: TraceSettings) -> Any:
    trace = trace_step(config, settings, BATCH, SEQ, count_flops=False)
    return trace, replay(profile_from_trace(0, trace), BATCH, SEQ, cuda=False)


def spec_of(**fields: Any) -> RunSpec:
    return RunSpec.model_validate({"model": "x", **fields})


def test_versions_read_as_dotted_numbers_and_ranges_are_half_open() -> None:
    assert parse_version("0.13") == (0, 13) and parse_version("v0.43.3") == (0, 43, 3)
    assert parse_version("1.7.0rc1") == (1, 7, 0) and parse_version("2.1.0+cu121") == (2, 1, 0)
    assert parse_version("latest") is None and parse_version("") is None
    assert compare((0, 13), (0, 13, 0)) == 0 and compare((1, 10), (1, 9)) == 1
    middle = VersionRange((1, 7), (1, 15))
    assert middle.contains((1, 7)) and middle.contains((1, 14, 2)) and not middle.contains((1, 15))
    assert not middle.contains((1, 6, 9)) and VersionRange().contains((0, 1))


@pytest.mark.parametrize(("version", "variants"), [
    (None, ("fused-head", "autocast")),
    ("1.15", ("fused-head", "autocast")),
    ("1.10", ("trl-chunks", "autocast")),  # 1.10 is after 1.7, not 1.1
    ("1.7.0", ("trl-chunks", "autocast")),
    ("1.6", ("autocast", "fp32-outputs")),
    ("0.29", ("accuracy-copy", "autocast", "fp32-outputs")),
    ("0.15.2", ("autocast", "fp32-outputs", "kbit-fp32", "kbit-bf16-head", "kbit-input-dtype")),
])
def test_trl_versions_run_their_own_loss(version: str | None, variants: tuple[str, ...]) -> None:
    method = "qlora" if version == "0.15.2" else "lora"
    spec = spec_of(runner="trl", method=method, precision="bf16-mixed", runner_version=version)
    assert runner_step(spec) == variants
    assert set(variants) <= set(STEP_VARIANTS)


def test_trl_defaults_follow_the_version() -> None:
    today = apply_runner(spec_of(runner="trl", method="qlora"))
    assert (today.precision, today.grad_checkpointing, today.lora.fp32_adapters) == ("bf16-mixed", True, False)
    trl_0_23 = apply_runner(spec_of(runner="trl", method="qlora", runner_version="0.23"))
    assert (trl_0_23.precision, trl_0_23.grad_checkpointing, trl_0_23.lora.fp32_adapters) == ("bf16-mixed", True, True)
    trl_0_20 = apply_runner(spec_of(runner="trl", method="qlora", runner_version="0.20"))
    assert (trl_0_20.precision, trl_0_20.grad_checkpointing) == ("bf16-mixed", False)
    trl_0_13 = apply_runner(spec_of(runner="trl", method="lora", runner_version="0.13"))
    assert trl_0_13.precision == "fp32" and trl_0_13.fixed("precision")
    assert runner_step(trl_0_13) == ()  # no bf16=True: no autocast; the Trainer's own loss
    set_by_user = apply_runner(spec_of(runner="trl", method="lora", runner_version="0.13", precision="bf16"))
    assert set_by_user.precision == "bf16"


def test_bitsandbytes_before_0_43_2_keeps_the_4bit_layers_inputs() -> None:
    assert runner_step(spec_of(method="qlora", bitsandbytes_version="0.41.1")) == ("kbit-keeps-input",)
    assert runner_step(spec_of(method="qlora", bitsandbytes_version="0.43.2")) == ()
    assert runner_step(spec_of(method="lora", bitsandbytes_version="0.41.1")) == ()
    hf = runner_step(spec_of(method="qlora", runner="hf-trainer", precision="bf16", bitsandbytes_version="0.42"))
    assert hf == ("autocast", "fp32-outputs", "kbit-fp32", "kbit-keeps-input", "kbit-input-dtype")


def test_transformers_before_4_49_copies_the_shifted_logits_in_the_models_loss() -> None:
    fms = {"runner": "trl", "runner_version": "0.13.0", "method": "qlora", "precision": "bf16",
           "bitsandbytes_version": "0.43.3"}
    assert runner_step(spec_of(**fms, transformers_version="4.48.1")) == (
        "shifted-logits-copy", "autocast", "fp32-outputs", "kbit-fp32", "kbit-bf16-head", "kbit-input-dtype")
    assert runner_step(spec_of(**fms, transformers_version="4.46")) == runner_step(
        spec_of(**fms, transformers_version="4.48.3"))
    assert "shifted-logits-copy" not in runner_step(spec_of(**fms, transformers_version="4.49.0"))
    assert "shifted-logits-copy" not in runner_step(spec_of(**fms))
    # a step whose loss is not the model's own takes no copy: a tool's own loss, tunecast's chunks, a compiled one
    assert runner_step(spec_of(runner="trl", method="lora", transformers_version="4.48")) == ("fused-head", "autocast")
    assert "shifted-logits-copy" not in runner_step(spec_of(**fms, transformers_version="4.48", loss="chunked"))
    assert "shifted-logits-copy" not in runner_step(spec_of(runner="hf-trainer", compile=True,
                                                            transformers_version="4.48"))
    # tunecast's own step runs the transformers installed (the config checks refuse a version there)
    assert runner_step(spec_of(method="lora", transformers_version="4.48")) == ()


def test_notes_name_the_version_whose_behaviour_is_estimated() -> None:
    older = runner_notes(spec_of(runner="trl", method="lora", precision="bf16-mixed", runner_version="1.10"))
    assert older[0] == "runner TRL SFTTrainer: the step and defaults of TRL 1.7-1.14 (runner_version 1.10)"
    assert any(line.startswith("runner TRL SFTTrainer (TRL 1.7-1.14): the loss over") for line in older)
    today = runner_notes(spec_of(runner="trl", method="lora"))
    assert today[0].startswith("runner TRL SFTTrainer: the step and defaults of TRL 1.15-1.16; set runner_version")
    own = runner_notes(spec_of(method="qlora", bitsandbytes_version="0.41.1"))
    assert own == [f"bitsandbytes 0.39-0.43.1: {STEP_VARIANTS['kbit-keeps-input']}"]
    assert runner_notes(spec_of(method="qlora")) == []
    loss_notes = runner_notes(spec_of(runner="hf-trainer", transformers_version="4.48.1"))
    assert f"transformers 4.46-4.48 (transformers_version 4.48.1): {STEP_VARIANTS['shifted-logits-copy']}" in loss_notes


@pytest.mark.parametrize(("fields", "key", "message"), [
    ({"runner": "trl", "runner_version": "0.12"}, "runner_version", "TRL SFTTrainer 0.12 is not one tunecast models"),
    ({"runner": "trl", "runner_version": "newest"}, "runner_version", "'newest' is not a version"),
    ({"runner_version": "1.0"}, "runner_version", "runner is tunecast"),
    ({"runner": "torchtune", "runner_version": "0.4"}, "runner_version", "it knows 0.6 and later"),
    ({"method": "qlora", "bitsandbytes_version": "0.38"}, "bitsandbytes_version", "it knows 0.39 and later"),
    ({"transformers_version": "4.48"}, "transformers_version", "runner is tunecast"),
    ({"runner": "trl", "transformers_version": "4.45.2"}, "transformers_version", "it knows 4.46 and later"),
    ({"runner": "hf-trainer", "transformers_version": "five"}, "transformers_version", "'five' is not a version"),
])
def test_an_unknown_version_is_a_problem_naming_its_key(fields: dict[str, Any], key: str, message: str) -> None:
    problems = [p for p in cross_field_problems(spec_of(**fields), lambda _: None) if p.severity == "error"]
    assert [p.field for p in problems] == [key]
    assert message in problems[0].message and problems[0].hint


def test_known_versions_pass_the_checks() -> None:
    for runner in RUNNERS.values():
        if runner.name == "tunecast":
            continue
        for era in (runner.versions, *(e.versions for e in runner.history)):
            assert era.since is not None
            version = ".".join(map(str, era.since))
            spec = spec_of(runner=runner.name, runner_version=version)
            assert not [p for p in cross_field_problems(spec, lambda _: None) if p.severity == "error"]
            assert runner_entry(spec).name == runner.name


def test_a_version_is_text_as_written() -> None:
    assert parse_set("runner_version=1.10").value == "1.10"
    assert parse_set("bitsandbytes_version= 0.41.1").value == "0.41.1"
    assert parse_set("transformers_version=4.48.1").value == "4.48.1"
    with pytest.raises(ValidationError, match=r"must be written in quotes \('1.1'\)"):
        RunSpec.model_validate({"model": "x", "runner": "trl", "runner_version": 1.1})
    with pytest.raises(ValidationError, match=r"must be written in quotes \('4.48'\)"):
        RunSpec.model_validate({"model": "x", "runner": "trl", "transformers_version": 4.48})


def test_keeping_the_4bit_inputs_grows_each_layer_by_its_new_inputs() -> None:
    """bitsandbytes before 0.43.2 kept every 4-bit layer's input: per decoder layer those no other operation keeps,
    the attention's input (q, k and v share it), the MLP's (gate and up share it) and down's, in bf16; o_proj's
    input is a view of the attention output the attention keeps. Checkpointed, a layer keeps none of them."""
    grown = {}
    for layers in (1, 2):
        config = tiny_llama(num_hidden_layers=layers)
        base = TraceSettings.from_spec(spec_of(method="qlora"))
        _, plain = traced(config, base)
        _, kept = traced(config, replace(base, runner_step=("kbit-keeps-input",)))
        grown[layers] = kept.phases["forward"].allocated - plain.phases["forward"].allocated
        checkpointed = replace(base, grad_checkpointing=True)
        _, plain_ckpt = traced(config, checkpointed)
        _, kept_ckpt = traced(config, replace(checkpointed, runner_step=("kbit-keeps-input",)))
        assert kept_ckpt.phases["forward"].allocated == plain_ckpt.phases["forward"].allocated
    width = 2 * config["hidden_size"] + config["intermediate_size"]
    assert grown[2] - grown[1] == BATCH * SEQ * width * 2


def test_trl_0x_casts_head_and_embeddings_back_to_bf16() -> None:
    config = tiny_llama(num_hidden_layers=2)
    base = TraceSettings.from_spec(spec_of(method="qlora"))
    _, fp32 = traced(config, replace(base, runner_step=("kbit-fp32",)))
    _, back = traced(config, replace(base, runner_step=("kbit-fp32", "kbit-bf16-head")))
    model = build_meta_model(config)
    head_and_embeddings = model.lm_head.weight.numel() + model.model.embed_tokens.weight.numel()
    shrunk = fp32.phases["forward"].breakdown["weights"] - back.phases["forward"].breakdown["weights"]
    assert shrunk == head_and_embeddings * 2  # fp32 -> bf16; the norms stay fp32


def test_trl_token_accuracy_copies_the_logits_after_the_loss() -> None:
    config = tiny_llama(num_hidden_layers=2, vocab_size=4096)
    base = TraceSettings.from_spec(spec_of(method="lora", runner="trl", runner_version="1.6", precision="bf16-mixed"))
    trace, plain = traced(config, base)
    copied_trace, copied = traced(config, replace(base, runner_step=(*base.runner_step, "accuracy-copy")))
    copy = BATCH * (SEQ - 1) * config["vocab_size"] * 4  # of the fp32 logits accelerate returns

    def count(events: Any) -> int:
        return [e.nbytes for e in events if e.kind == ALLOC and e.phase == "forward"].count(copy)

    assert count(trace.events) == 0 < count(copied_trace.events)  # once a step (the trace runs two)
    assert copied.phases["forward"].allocated >= plain.phases["forward"].allocated


def test_trl_chunked_loss_holds_a_chunk_of_logits_and_the_head_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's fp32 logits at a time (with an fp32 copy of the head): less than the full logits' loss once there
    are several chunks (at a chunk's length or less it holds more: fp32 logits of every token)."""
    monkeypatch.setattr(chunking, "TRL_CHUNK_TOKENS", 32)  # eight chunks of this step's tokens
    config = tiny_llama(num_hidden_layers=2, vocab_size=8192)
    base = TraceSettings.from_spec(spec_of(method="lora"))
    _, standard = traced(config, base)
    trace, chunked = traced(config, replace(base, runner_step=("trl-chunks",)))
    largest = max(e.nbytes for e in trace.events if e.kind == ALLOC and e.category != "weights")
    assert largest == config["vocab_size"] * config["hidden_size"] * 4  # the head's fp32 copy; a chunk's logits less
    assert max(p.allocated for p in chunked.phases.values()) < max(p.allocated for p in standard.phases.values())


def test_trl_chunked_loss_is_the_cross_entropy() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 8, dtype=torch.float64)
    targets = torch.randint(0, 30, (11,))
    targets[2] = loss.IGNORE_INDEX
    total = sum(loss._trl_chunk(hidden[first:first + 4], weight, targets[first:first + 4])[0]
                for first in range(0, 11, 4))
    reference = F.cross_entropy(hidden.float() @ weight.float().t(), targets, ignore_index=loss.IGNORE_INDEX,
                                reduction="sum")
    assert float(total.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)


def test_transformers_4_46_to_4_48_hold_a_copy_of_the_shifted_logits_while_the_loss_runs() -> None:
    """ForCausalLMLoss before 4.49 (TRL 0.13's step under bf16: the model's bf16 logits, their fp32 upcast, and the
    copy). The forward pass's peak, at the loss, holds the copy's bytes exactly, less what the copy's loss does not
    hold: log-probabilities for each sequence's last position, and the labels 4.49 and later pad (int64, one
    position longer, beside their shifted copy) where 4.46-4.48 keep a shifted copy one position shorter. In the
    backward pass the three fp32 tensors of the logits' size it holds at its peak are a position per sequence
    shorter."""
    config = tiny_llama(num_hidden_layers=2, vocab_size=8192)
    base = TraceSettings.from_spec(spec_of(method="lora", runner="trl", runner_version="0.13", precision="bf16"))
    assert base.runner_step == ("autocast", "fp32-outputs")
    _, today = traced(config, base)
    _, older = traced(config, replace(base, runner_step=(*base.runner_step, "shifted-logits-copy")))
    vocab = config["vocab_size"]
    copy = BATCH * (SEQ - 1) * vocab * 4
    last_positions = BATCH * vocab * 4
    labels = BATCH * ((SEQ + 1) + SEQ - (SEQ - 1)) * 8
    grown = older.phases["forward"].allocated - today.phases["forward"].allocated
    assert grown == copy - last_positions - labels
    assert today.phases["backward"].allocated - older.phases["backward"].allocated == 3 * last_positions


def test_the_shifted_copy_loss_is_the_installed_transformers_loss() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    logits = torch.randn(2, 7, 30, dtype=torch.bfloat16)
    labels = torch.randint(0, 30, (2, 7))
    labels[0, 3] = loss.IGNORE_INDEX
    for count in (None, torch.tensor(9)):
        ours = loss.shifted_copy_loss(logits, labels, 30, num_items_in_batch=count)
        theirs = ForCausalLMLoss(logits, labels, 30, num_items_in_batch=count)
        assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
