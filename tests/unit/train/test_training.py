"""The runner's parts on the tiny bundled model: packing, the schedule, every method and optimizer, what a
finished run leaves, data errors, and the batch shape chosen from the memory estimate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tests.trainruns import ALPACA, NO_EVAL, TINY_MODEL, tiny_run

from tunecast.data.packing import IGNORE_INDEX, Tokenized, pack
from tunecast.step.shape import hf_config
from tunecast.train.batches import Unit, collate
from tunecast.train.optim import lr_factor


@pytest.fixture(autouse=True)
def shared_profiles(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory estimates of the tiny model are the same in every test: trace once a session."""
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))


def tiny_model(attention: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hf_config(json.loads((TINY_MODEL / "config.json").read_text()))
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_batch_has_the_loss_of_its_examples_apart(attention: str) -> None:
    """Packed examples do not attend to each other: the summed token loss of a pack equals the sum of each
    example's own loss, computed in a batch of its own."""
    from tunecast.step.forward import forward_loss

    model = tiny_model(attention)
    generator = torch.Generator().manual_seed(1)
    examples = [Tokenized(torch.randint(4, 1000, (n,), generator=generator).tolist(), [i > 2 for i in range(n)])
                for n in (23, 9, 31)]
    packs = pack(examples, 128, seed=0)
    assert len(packs) == 1 and sorted(packs[0].seq_lengths) == [9, 23, 31]

    packed = collate([Unit(packs[0].input_ids, packs[0].labels, packs[0].position_ids)], pad_id=3)
    one = torch.ones(())
    together = forward_loss(model, packed.input_ids, packed.labels, precision="fp32", chunked_loss=False,
                            position_ids=packed.position_ids, num_items=one)
    apart = 0.0
    for example in examples:
        labels = [t if m else IGNORE_INDEX for t, m in zip(example.ids, example.mask, strict=True)]
        alone = collate([Unit(example.ids, labels, None)], pad_id=3)
        apart += float(forward_loss(model, alone.input_ids, alone.labels, precision="fp32", chunked_loss=False,
                                    num_items=one))
    assert packed.trained_tokens == sum(sum(e.mask[1:]) for e in examples)
    assert float(together) == pytest.approx(apart, rel=1e-5)
    # without the position ids the examples would see each other, and the loss would differ
    leaking = forward_loss(model, packed.input_ids, packed.labels, precision="fp32", chunked_loss=False, num_items=one)
    assert float(leaking) != pytest.approx(apart, rel=1e-5)


def test_padded_batch_loss_equals_unpadded() -> None:
    from tunecast.step.forward import forward_loss

    model = tiny_model("sdpa")
    short, long = list(range(10, 20)), list(range(30, 60))
    batch = collate([Unit(short, short, None), Unit(long, long, None)], pad_id=3)
    assert batch.attention_mask is not None and batch.padded_tokens == 60 and batch.tokens == 40
    one = torch.ones(())
    together = forward_loss(model, batch.input_ids, batch.labels, precision="fp32", chunked_loss=False,
                            attention_mask=batch.attention_mask, num_items=one)
    apart = sum(float(forward_loss(model, torch.tensor([ids]), torch.tensor([ids]), precision="fp32",
                                   chunked_loss=False, num_items=one)) for ids in (short, long))
    assert float(together) == pytest.approx(apart, rel=1e-5)


def test_schedules_follow_transformers() -> None:
    from transformers.optimization import get_scheduler

    parameter = torch.nn.Parameter(torch.zeros(1))
    for name in ("linear", "cosine", "constant", "constant_with_warmup"):
        optimizer = torch.optim.SGD([parameter], lr=1.0)
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=3, num_training_steps=20)
        for step in range(20):
            ours = lr_factor(name, step, warmup=3, total=20)
            assert ours == pytest.approx(scheduler.get_last_lr()[0], abs=1e-12), (name, step)
            optimizer.step()
            scheduler.step()


def _train(cli, config: Path) -> dict:  # type: ignore[no-untyped-def]
    """Train to the end; the memory check (and its trace of each new setting) is tested on its own below."""
    result = cli("train", str(config), "--json", "--no-memory-check")
    assert result.code == 0, result.stderr[-3000:]
    return result.json()


@pytest.mark.parametrize(("method", "optimizer", "extra"), [
    ("full", "adamw", {}),
    ("full", "adamw-foreach", {}),
    ("lora", "sgd", {}),
    ("lora", "adafactor", {}),
    ("lora", "adamw-8bit", {}),
    ("lora", "paged-adamw", {}),
    ("lora", "paged-adamw-8bit", {}),
    ("lora", "adamw", {"optimizer_in_backward": True, "grad_accum": 1, "max_grad_norm": 0.0}),
    ("lora", "adamw", {"grad_checkpointing": True, "loss": "chunked", "packing": True}),
    ("lora", "adamw", {"precision": "bf16-mixed"}),
    ("qlora", "adamw", {"precision": "bf16"}),
    # an 8-bit base: bitsandbytes 0.50 trains Linear8bitLt on a CPU (MatMul8bitFp), and the step-2 checkpoint holds
    # the adapters without the frozen layers' SCB keys (train/state.py _tensor_keys_only)
    ("qlora", "adamw", {"precision": "bf16", "quantization.bits": 8}),
])
def test_every_method_and_optimizer_trains(cli, tmp_path: Path, method: str, optimizer: str, extra: dict) -> None:  # type: ignore[no-untyped-def]
    config = tiny_run(tmp_path, method=method, optimizer=optimizer, max_steps=2, **NO_EVAL, **extra)
    document = _train(cli, config)
    assert document["finished"] and document["steps"] == 2
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in train] == [1, 2]
    assert all(math.isfinite(line["loss"]) and line["tokens"] > 0 for line in train)
    final = tmp_path / "out" / "final"
    assert (final / ("model.safetensors" if method == "full" else "adapter_model.safetensors")).exists()


def test_final_adapter_loads_with_peft_and_generates_and_merges(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tiny_run(tmp_path, max_steps=3, **NO_EVAL, **{"lora.dropout": 0.0})
    _train(cli, config)
    final = tmp_path / "out" / "final"
    card = (final / "README.md").read_text()
    assert "3 optimizer steps" in card and "alpaca.jsonl" in card
    model = AutoPeftModelForCausalLM.from_pretrained(str(final))
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    prompt = tokenizer("### Instruction:\nName a colour.", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 5
    adapted = model(**prompt).logits

    merged = cli("merge", str(tmp_path / "out"), "--json")
    assert merged.code == 0, merged.stderr
    plain = AutoModelForCausalLM.from_pretrained(merged.json()["output"])
    assert torch.allclose(plain(**prompt).logits, adapted, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "base"))
    assert isinstance(model, PeftModel) and not torch.allclose(base(**prompt).logits, adapted, atol=1e-4)


def test_qlora_merge_dequantizes(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tiny_run(tmp_path, method="qlora", precision="bf16", max_steps=1, **NO_EVAL)
    _train(cli, config)
    merged = cli("merge", str(tmp_path / "out"), "--json")
    assert merged.code == 0, merged.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged.json()["output"])
    assert all(type(m).__name__ != "Linear4bit" for m in model.modules())


def test_bad_rows_stop_the_run_or_are_skipped(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data.jsonl"
    rows = ALPACA.read_text().splitlines()
    data.write_text("\n".join([rows[0], '{"instruction": 5, "output": "x"}', *rows[1:]]) + "\n")
    config = tiny_run(tmp_path, max_steps=1, **NO_EVAL, **{"dataset.path": str(data)})
    stopped = cli("train", str(config))
    assert stopped.code == 2
    assert "line 2" in stopped.stderr and "instruction" in stopped.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()
    skipped = cli("train", str(config), "--skip-invalid", "--json")
    assert skipped.code == 0, skipped.stderr
    assert any("1 invalid row" in w["message"] for w in skipped.json()["warnings"])


def test_micro_batch_auto_takes_the_largest_that_fits(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tiny_run(tmp_path, micro_batch="auto", grad_accum=None, global_batch=8, max_steps=1,
                      **NO_EVAL)
    result = cli("train", str(config))
    assert result.code == 0, result.stderr
    text = " ".join(result.stderr.split())
    assert "micro_batch 8 × grad_accum 1" in text and "all 8 sequences of a step fit" in text
    start = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["micro_batch"] == 8 and start["grad_accum"] == 1


def test_a_run_that_cannot_fit_stops_before_the_first_step(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import tunecast.train.session as session

    monkeypatch.setattr(session, "free_memory_gib", lambda kind: 0.01)
    config = tiny_run(tmp_path, max_steps=1)
    result = cli("train", str(config))
    assert result.code == 2
    text = " ".join(result.stderr.split())
    assert "does not fit the CPU" in text and "micro_batch: auto" in text
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_training_needs_a_dataset_file(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tiny_run(tmp_path, dataset={"examples": 100, "mean_tokens": 50})
    result = cli("train", str(config))
    assert result.code == 2
    assert "dataset.path" in result.stderr


def test_fp8_needs_an_fp8_gpu(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = cli("train", str(tiny_run(tmp_path, precision="fp8", max_steps=1)), "--no-memory-check")
    assert result.code == 2
    assert "precision" in result.stderr and "FP8" in result.stderr


def test_lora_dropout_on_an_moe_model_applies_where_peft_can_apply_it() -> None:
    """peft adapts the 3-D expert weights of `all-linear` as parameters, which take no dropout (it refuses
    `lora_dropout` there): the adapters of Linear layers get the dropout, the experts' none, and the model
    builds."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    from transformers import AutoModelForCausalLM

    from tunecast.step.settings import AdapterSettings
    from tunecast.step.setup import apply_adapters

    config = hf_config({"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
                        "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                        "vocab_size": 64})
    model = apply_adapters(AutoModelForCausalLM.from_config(config), AdapterSettings(8, 8, 0.05, "all-linear",
                                                                                      False, ()))
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    wrapped = [m for m in layers if isinstance(m, ParamWrapper)]
    assert wrapped and len(wrapped) < len(layers)
    for layer in layers:
        dropout = layer.lora_dropout["default"]
        if isinstance(layer, ParamWrapper):
            assert isinstance(dropout, torch.nn.Identity)
        else:
            assert isinstance(dropout, torch.nn.Dropout) and dropout.p == 0.05
    tokens = torch.randint(0, 64, (2, 5))
    model(input_ids=tokens, labels=tokens).loss.backward()


def test_held_out_examples_are_counted_as_examples_with_packing(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With packing the 16 held-out examples fill fewer packed sequences: the run counts examples."""
    config = tiny_run(tmp_path, packing=True, max_steps=2, **{"eval.examples": 16, "eval.every_steps": 2})
    result = cli("train", str(config), "--no-memory-check")
    assert result.code == 0, result.stderr[-3000:]
    assert "16 held out" in " ".join(result.stderr.split())
    evals = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert [e["examples"] for e in evals] == [16]
