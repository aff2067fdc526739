"""`tunecast memory` end to end on catalog models (traced for real on fake tensors)."""

from __future__ import annotations

import json
import shutil

import pytest
from tests.conftest import PYTHON, run_subprocess
from tests.models import shallow_gemma

from tunecast.catalog.store import load_catalog
from tunecast.estimate import profiles

ACCEPTANCE = ["memory", "--model", "meta-llama/Llama-3.1-8B", "--method", "lora", "--lora-rank", "16",
              "--lora-targets", "all-linear", "--micro-batch", "1", "--seq-len", "2048", "--precision", "bf16",
              "--optimizer", "adamw", "--no-grad-checkpointing"]
TOP_LEVEL = {"peak_allocated_gib", "peak_reserved_gib", "device_total_gib", "peak_phase", "host_ram_gib",
             "breakdown_gib", "schema_version"}
BREAKDOWN = {"weights", "trainable_weights", "gradients", "optimizer", "activations", "temporaries", "quantization",
             "overhead"}


pytestmark = pytest.mark.usefixtures("profile_cache")


def test_the_acceptance_command_prints_the_documented_json(cli) -> None:
    result = cli(*ACCEPTANCE, "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert set(document) >= TOP_LEVEL and set(document["breakdown_gib"]) == BREAKDOWN
    assert document["peak_phase"] in ("forward", "backward", "optimizer")
    assert document["peak_allocated_gib"] <= document["peak_reserved_gib"] <= document["device_total_gib"]
    assert document["peak_allocated_gib"] <= document["least_reserved_gib"] <= document["peak_reserved_gib"]
    assert document["least_device_total_gib"] <= document["device_total_gib"]
    assert sum(document["breakdown_gib"].values()) == pytest.approx(document["device_total_gib"], abs=0.01)
    # bf16 weights of 8,030,261,248 parameters
    assert document["breakdown_gib"]["weights"] == pytest.approx(8_030_261_248 * 2 / 2**30, abs=0.01)
    # 32 layers × 2048 tokens × the per-layer figure measured on real steps (0.5636 GiB)
    assert document["breakdown_gib"]["activations"] == pytest.approx(32 * 0.5636, rel=0.01)


def test_a_config_file_of_any_name_gives_the_same_estimate(cli, tmp_path) -> None:
    path = tmp_path / "my llama settings.json"
    shutil.copy(load_catalog(None).models.config_path("meta-llama/Llama-3.1-8B"), path)
    by_name = cli(*ACCEPTANCE, "--json").json()
    by_file = cli(*[str(path) if a == "meta-llama/Llama-3.1-8B" else a for a in ACCEPTANCE], "--json").json()
    by_name.pop("model"), by_file.pop("model")
    by_name.pop("params"), by_file.pop("params")
    assert by_name == by_file


def test_a_run_that_does_not_fit_says_by_how_much_and_what_to_change(cli) -> None:
    result = cli(*ACCEPTANCE, "--gpu", "rtx-4090", "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert document["gpu"] == "rtx-4090" and document["fits"] is False
    assert document["headroom_gib"] == pytest.approx(23.99 - document["device_total_gib"], abs=0.01)
    assert document["max_micro_batch"] == 0 and 0 < document["max_seq_len"] < 2048
    suggestions = document["suggestions"]
    assert any(s["fits"] for s in suggestions)
    assert all(s["settings"] for s in suggestions)
    assert all(s["device_total_gib"] > 0 for s in suggestions if s["estimated"])
    # no shipped template covers these two: listed without a figure rather than traced (--trace-suggestions)
    untraced = {"compute the loss in chunks", "step the optimizer in the backward pass (grad_accum 1)"}
    assert {s["change"] for s in suggestions if not s["estimated"]} <= untraced
    assert all(s["device_total_gib"] is None and s["fits"] is None for s in suggestions if not s["estimated"])
    changes = {s["change"] for s in suggestions}
    assert "turn on gradient checkpointing" in changes and "use QLoRA (4-bit NF4 base weights)" in changes
    human = cli(*ACCEPTANCE, "--gpu", "rtx-4090")
    assert "does not fit" in human.stdout and "GiB over" in human.stdout and "What would make it fit" in human.stdout
    if not all(s["estimated"] for s in suggestions):
        assert "--trace-suggestions" in human.stdout


def test_checkpointing_auto_turns_on_only_when_needed(cli) -> None:
    auto = [a for a in ACCEPTANCE if a != "--no-grad-checkpointing"] + ["--set", "grad_checkpointing=auto"]
    on_h200 = cli(*auto, "--gpu", "h200", "--json").json()
    on_4090 = cli(*auto, "--gpu", "rtx-4090", "--json").json()
    assert on_h200["grad_checkpointing"] is False and on_4090["grad_checkpointing"] is True
    assert on_4090["fits"] is True


def test_cpu_device(cli) -> None:
    result = cli("memory", "--model", "Qwen/Qwen3-0.6B", "--micro-batch", "1", "--seq-len", "256", "--device", "cpu",
                 "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert document["device"] == "cpu" and document["peak_reserved_gib"] == document["peak_allocated_gib"]
    bad = cli("memory", "--model", "Qwen/Qwen3-0.6B", "--device", "cpu", "--gpu", "h100")
    assert bad.code == 2 and "--gpu needs --device cuda" in bad.stderr


def test_a_cached_estimate_does_not_import_torch(cli, shared_cache) -> None:
    assert cli(*ACCEPTANCE, "--json").code == 0  # warm the cache
    script = ("import sys, json\nfrom tunecast.cli import main\n"
              "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "sys.stderr.write('HEAVY=' + json.dumps(sorted(m for m in ('torch', 'transformers', 'peft') "
              "if m in sys.modules)))\n")
    result = run_subprocess(PYTHON, "-c", script, *ACCEPTANCE, "--json", env={"TUNECAST_CACHE": str(shared_cache)})
    assert 'HEAVY=[]' in result.stderr, result.stderr[-2000:]
    assert json.loads(result.stdout)["peak_phase"]


def test_a_cold_estimate_says_what_it_traces_and_rebuilds_a_damaged_entry(cli, tmp_path, monkeypatch) -> None:
    """Progress of each trace on stderr (stdout stays one JSON document); a damaged cache entry is traced
    again with a warning, to the same answer."""
    monkeypatch.setenv("TUNECAST_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 512,
                                  "n_positions": 1024}))
    args = ["memory", "--model", str(config), "--method", "full", "--micro-batch", "2", "--seq-len", "64", "--json"]
    templated = cli(*args)
    assert templated.code == 0, templated.stderr
    assert "building the step template of this model's structure (full, micro-batch 2 and more): trace 1 of 2" \
        in templated.stderr
    gemma = tmp_path / "gemma.json"  # a type no template reads: traced
    gemma.write_text(json.dumps(shallow_gemma()))
    args[2] = str(gemma)
    cold = cli(*args)
    assert cold.code == 0, cold.stderr
    assert "tracing the training step: 2 layers at micro-batch" in cold.stderr and "(trace 1 of 5)" in cold.stderr
    entries = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert entries
    for entry in entries:  # cut short, as a full disk would leave a file written in place
        entry.write_text(entry.read_text()[:100])
    monkeypatch.setattr(profiles, "_READ", {})  # as a new process would: read from disk
    again = cli(*args)
    assert again.code == 0, again.stderr
    assert "warning:" in again.stderr and "damaged" in again.stderr and "(trace 5 of 5)" in again.stderr
    assert again.json() == cold.json()
    warm = cli(*args)
    assert "trac" not in warm.stderr and warm.json() == cold.json()


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_mixture_of_experts_in_float32_weights_is_estimated_with_4_byte_experts(cli, tmp_path, precision) -> None:
    """fp32, and mixed precision's fp32 master weights, run the experts' grouped matmul in fp32, as the real kernels
    do: the estimate answers and counts every frozen weight in 4 bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = {"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
            "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32768, "max_position_embeddings": 2048}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**data)).parameters())
    result = cli("memory", "--model", str(config), "--method", "lora", "--precision", precision,
                 "--seq-len", "512", "--json")
    assert result.code == 0, result.stderr
    assert result.json()["breakdown_gib"]["weights"] == pytest.approx(4 * params / 2**30, abs=0.001)  # 0.36 GiB


def test_check_is_a_pre_flight_gate_that_exits_3_when_the_run_does_not_fit(cli) -> None:
    fits = cli(*ACCEPTANCE, "--gpu", "a100-80gb", "--check")
    assert fits.code == 0, fits.stderr
    assert "does not fit" not in fits.stderr
    over = cli(*ACCEPTANCE, "--gpu", "rtx-4090", "--check", "--json")
    assert over.code == 3
    assert over.json()["fits"] is False  # the document is printed whole before the verdict
    assert "does not fit:" in over.stderr and "over the 23.99 GiB usable on rtx-4090" in over.stderr
    without = cli(*ACCEPTANCE, "--gpu", "rtx-4090")  # no gate asked: a verdict, not a status
    assert without.code == 0


def test_check_without_a_gpu_is_a_user_error(cli) -> None:
    result = cli(*ACCEPTANCE, "--check")
    assert result.code == 2
    assert "--check needs a GPU" in result.stderr and "--gpu" in result.stderr
