"""QLoRA on a mixture of experts: the experts stay bf16 (bitsandbytes' 4-bit conversion replaces nn.Linear modules
only, and transformers 5 keeps the experts as fused 3-D parameters; tests/unit/train/test_quantize.py checks it on
the libraries). The estimate counts them so and says it first; the plan says it as a warning."""

from __future__ import annotations

from datetime import date
from typing import Any

import pytest

from tunecast.config.load import Override, load_spec_text
from tunecast.config.spec import RunSpec
from tunecast.estimate.memory import estimate_memory
from tunecast.estimate.moe import unquantized_numel
from tunecast.plan.report import PlanRequest, make_plan

MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"


def frozen_bytes(config: dict[str, Any], unquantized: int) -> float:
    """A Mixtral QLoRA's frozen weights, term by term from its config: the attention's Linear weights in NF4 (half a
    byte), the experts and router, the embeddings and head and the norms in `unquantized` bytes each."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    attention = layers * (2 * h * h + 2 * h * kv)
    return (unquantized * unquantized_numel(config) + attention / 2 + unquantized * (2 * vocab * h)
            + unquantized * (2 * layers + 1) * h)


def test_mixtral_qlora_weights_are_bf16_experts_and_nf4_attention(catalog) -> None:  # type: ignore[no-untyped-def]
    """The frozen weights of Mixtral-8x7B QLoRA, term by term from its config: experts and router in bf16 (2 bytes),
    the attention's Linear weights in NF4 (half a byte), embeddings, head and norms in bf16."""
    config = catalog.models.find(MIXTRAL).data
    spec = RunSpec.model_validate({"model": MIXTRAL, "method": "qlora", "precision": "bf16", "micro_batch": 1,
                                   "seq_len": 512})
    estimate = estimate_memory(spec, config, device="cuda", gpu=catalog.gpus.get("h100-sxm"),
                               overheads=catalog.overheads)
    assert estimate.breakdown_gib["weights"] * 2**30 == pytest.approx(frozen_bytes(config, 2), rel=1e-6)
    assert estimate.notes[0].startswith("QLoRA leaves the experts in bf16, not NF4: 45.10 B expert and router weights")


def test_a_qlora_plan_of_a_mixture_of_experts_warns_that_the_experts_stay_bf16(catalog) -> None:  # type: ignore[no-untyped-def]
    text = (f"model: {MIXTRAL}\nmethod: qlora\nprecision: bf16\nlora: {{dropout: 0}}\nseq_len: 1024\n"
            "global_batch: 8\ndataset: {examples: 1000, mean_tokens: 500}\n")
    loaded = load_spec_text(text, [Override("gpus.gpu", "h200", "--gpu"), Override("gpus.count", 1, "--gpus")],
                            catalog)
    plan = make_plan(loaded, catalog, PlanRequest(), today=date(2026, 11, 29), cache=False)
    warnings = [w for w in plan["warnings"] if w["field"] == "method"]
    assert len(warnings) == 1
    assert warnings[0]["message"].startswith("QLoRA leaves the experts in bf16, not NF4")
    assert warnings[0]["severity"] == "warning"


def test_a_runner_whose_qlora_casts_the_experts_to_fp32_counts_them_in_fp32(catalog) -> None:  # type: ignore[no-untyped-def]
    """peft's prepare_model_for_kbit_training (the Trainer's QLoRA) casts every weight that is no Params4bit to
    fp32: the fused experts and the router as well as embeddings, head and norms. Their grouped matmul then runs in
    fp32 (the tracer's fake kernel takes it as the real ones do), and the note says why they are fp32."""
    from tunecast.config.runner import apply_runner

    config = catalog.models.find(MIXTRAL).data
    spec = apply_runner(RunSpec.model_validate({"model": MIXTRAL, "method": "qlora", "runner": "hf-trainer",
                                                "precision": "bf16", "micro_batch": 1, "seq_len": 512}))
    estimate = estimate_memory(spec, config, device="cuda", gpu=None, overheads=catalog.overheads)
    assert estimate.breakdown_gib["weights"] * 2**30 == pytest.approx(frozen_bytes(config, 4), rel=1e-6)
    assert estimate.notes[0].startswith("QLoRA leaves the experts in fp32, not NF4")
    assert "prepare_model_for_kbit_training then casts them to fp32" in estimate.notes[0]


def test_experts_built_as_linears_before_transformers_5_are_quantized(catalog) -> None:  # type: ignore[no-untyped-def]
    """transformers 4.x built Mixtral's experts and router as nn.Linear modules (one MLP per expert), which
    bitsandbytes quantizes and peft's fp32 cast leaves: with `transformers_version` 4.48.1 every decoder matrix is
    NF4 and only embeddings, head and norms are fp32."""
    from tunecast.config.runner import apply_runner
    from tunecast.estimate.moe import linear_expert_numel

    config = catalog.models.find(MIXTRAL).data
    spec = apply_runner(RunSpec.model_validate({"model": MIXTRAL, "method": "qlora", "runner": "hf-trainer",
                                                "transformers_version": "4.48.1", "precision": "bf16",
                                                "micro_batch": 1, "seq_len": 512}))
    today = spec.model_copy(update={"transformers_version": None})
    assert linear_expert_numel(config, spec) == unquantized_numel(config) > 0
    assert linear_expert_numel(config, today) == linear_expert_numel(config, None) == 0
    estimate = estimate_memory(spec, config, device="cuda", gpu=None, overheads=catalog.overheads)
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    matrices = layers * (2 * h * h + 2 * h * kv) + unquantized_numel(config)
    expected = matrices / 2 + 4 * (2 * vocab * h + (2 * layers + 1) * h)
    assert estimate.breakdown_gib["weights"] * 2**30 == pytest.approx(expected, rel=1e-6)
    assert estimate.notes[0].startswith("transformers 4.48.1 (transformers_version) built the experts and the router "
                                        "as nn.Linear modules")


def test_gpt_oss_experts_stay_fused_before_transformers_5(catalog) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss had fused 3-D experts from its first release (transformers 4.55): nothing changes for it."""
    from tunecast.estimate.moe import linear_expert_numel

    model = catalog.models.find("openai/gpt-oss-20b")
    spec = RunSpec.model_validate({"model": "openai/gpt-oss-20b", "method": "qlora", "runner": "trl",
                                   "transformers_version": "4.57.1"})
    assert model is not None and linear_expert_numel(model.data, spec) == 0
