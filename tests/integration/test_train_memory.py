"""What `tunecast memory --device cpu` predicts is what `tunecast train` uses: the runner's resident-memory
growth over two training steps of real architectures (random weights) is within 5% of the estimate.

The method of benchmarks/cpu_memory_groundtruth.py: glibc returns freed memory at once
(MALLOC_MMAP_THRESHOLD_=65536, which also stops the runner keeping freed memory), the run reports its resident
memory just before the model is built (`rss_before_model_gib` in the start event) and its peak (`peak_rss_gib`);
the difference is compared with the estimate's `device_total_gib` ("resident growth").
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.conftest import run_subprocess
from tests.trainruns import TINY_MODEL

from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.estimate.memory import estimate_memory

# Two real architectures small enough for CI: GPT-2 (124 M, full fine-tune: weights, gradients and AdamW
# states all in play) and Qwen2.5-0.5B (LoRA on every linear layer, a 151,936-token vocabulary). Both fp32:
# bf16 matmuls on a CPU without native bf16 (an AMD EPYC VM) run 50–400× slower, and two bf16 steps of GPT-2
# took over 5 minutes there.
CASES = {
    "gpt2-full-fp32": ("openai-community/gpt2", {"method": "full", "precision": "fp32", "micro_batch": 2,
                                                 "seq_len": 512}),
    "qwen2.5-0.5b-lora-fp32": ("Qwen/Qwen2.5-0.5B", {"method": "lora", "lora": {"rank": 16}, "precision": "fp32",
                                                      "micro_batch": 1, "seq_len": 256}),
}


def long_texts(path: Path, rows: int) -> None:
    """Texts longer than any seq_len used here, so every sequence is full (no padding), as the estimate."""
    chooser = random.Random(0)
    words = ["alpha", "river", "stone", "quiet", "number", "garden", "silver", "window", "planet", "morning"]
    with path.open("w") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"text": " ".join(chooser.choice(words) for _ in range(700))}) + "\n")


@pytest.mark.parametrize("case", sorted(CASES))
def test_runner_memory_matches_the_estimate(case: str, tmp_path: Path, shared_cache: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model, settings = CASES[case]
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))
    data = tmp_path / "text.jsonl"
    long_texts(data, 8)
    config = {"model": str(load_catalog(None).models.find(model).path), "random_weights": True, **settings,
              "max_steps": 2, "dataset": {"path": str(data), "tokenizer": str(TINY_MODEL)},
              "checkpoint": {"every_steps": 100}, "output": str(tmp_path / "out")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    # `tunecast memory --device cpu`'s figure, traced at this one shape only (the command sweeps shapes too)
    spec = RunSpec.model_validate(config)
    catalog = load_catalog(None)
    predicted = estimate_memory(spec, catalog.models.find(model).data, device="cpu", gpu=None,
                                overheads=catalog.overheads, exact_shape=True).device_total_gib

    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "TUNECAST_CACHE": str(shared_cache)}
    done = run_subprocess(sys.executable, "-m", "tunecast", "train", str(path), "--no-memory-check", env=env)
    assert done.code == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    start = next(line for line in lines if line.get("event") == "start")
    assert start["keeps_freed_memory"] is False  # the user's malloc tuning is kept (train/host_memory.py)
    baseline = start["rss_before_model_gib"]
    peak = max(line["peak_rss_gib"] for line in lines if line["kind"] == "train")
    measured = peak - baseline
    print(f"{case}: measured {measured:.3f} GiB, predicted {predicted:.3f} GiB ({predicted / measured - 1:+.1%})")
    assert measured == pytest.approx(predicted, rel=0.05), f"measured {measured:.3f} GiB, predicted {predicted:.3f}"


def test_each_fsdp2_rank_uses_what_the_estimate_says(tmp_path: Path, shared_cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two FSDP2 processes (gloo) of GPT-2 with LoRA: each rank's resident growth over its training steps is within
    10% of `tunecast memory --device cpu --gpus 2 --strategy fsdp`. The peak is counted from after the model was
    sharded (each rank builds the whole model first; train/host_memory.py reset_peak_rss)."""
    model = "openai-community/gpt2"
    monkeypatch.setenv("TUNECAST_CACHE", str(shared_cache))
    data = tmp_path / "text.jsonl"
    long_texts(data, 16)
    catalog = load_catalog(None)
    config = {"model": str(catalog.models.find(model).path), "random_weights": True, "method": "lora",
              "lora": {"rank": 16},
              "precision": "fp32", "micro_batch": 2, "seq_len": 512, "max_steps": 2,
              "dataset": {"path": str(data), "tokenizer": str(TINY_MODEL)}, "checkpoint": {"every_steps": 100},
              "gpus": {"count": 2, "strategy": "fsdp"}, "output": str(tmp_path / "out")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    predicted = estimate_memory(RunSpec.model_validate(config), catalog.models.find(model).data, device="cpu",
                                gpu=None, overheads=catalog.overheads, exact_shape=True).device_total_gib
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "TUNECAST_CACHE": str(shared_cache)}
    done = run_subprocess(sys.executable, "-m", "tunecast", "train", str(path), "--no-memory-check", env=env)
    assert done.code == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    start = next(line for line in lines if line.get("event") == "start")
    for rank, baseline in enumerate(start["rss_before_model_gib_ranks"]):
        measured = max(line["peak_rss_gib_ranks"][rank] for line in lines if line["kind"] == "train") - baseline
        print(f"rank {rank}: measured {measured:.3f} GiB, predicted {predicted:.3f} GiB ({predicted / measured - 1:+.1%})")
        assert measured == pytest.approx(predicted, rel=0.10), f"rank {rank}: {measured:.3f} GiB measured"


def test_the_check_covers_what_a_run_grows_by_with_freed_memory_kept(tmp_path: Path, shared_cache: Path) -> None:
    """As a user runs it (glibc keeps freed memory; train/host_memory.py): a Qwen2-shaped model loaded from a bf16
    weights file and trained in fp32, so that the weights are converted as they load. The check's prediction (the
    start event's `predicted_memory_gib`) is not below the process's growth over six steps, by which the kept
    heap has settled (benchmarks/cpu_kept_memory.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunecast.train.host_memory import untuned_environment

    config = dict(load_catalog(None).models.find("Qwen/Qwen2.5-0.5B").data)
    config["num_hidden_layers"] = 2
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.bfloat16).save_pretrained(
        str(folder))
    data = tmp_path / "text.jsonl"
    long_texts(data, 8)
    run = {"model": str(folder), "method": "lora", "lora": {"rank": 16}, "precision": "fp32", "micro_batch": 1,
           "seq_len": 128, "max_steps": 6, "dataset": {"path": str(data), "tokenizer": str(TINY_MODEL)},
           "eval": {"examples": 0}, "checkpoint": {"every_steps": 100}, "output": str(tmp_path / "out")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    env = {**untuned_environment(), "TUNECAST_CACHE": str(shared_cache)}
    done = subprocess.run([sys.executable, "-m", "tunecast", "train", str(path)], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    start = next(line for line in lines if line.get("event") == "start")
    assert start["keeps_freed_memory"] is True
    grown = max(line["peak_rss_gib"] for line in lines if line["kind"] == "train") - start["rss_before_model_gib"]
    predicted = start["predicted_memory_gib"]
    print(f"grew {grown:.3f} GiB, predicted {predicted:.3f} GiB ({predicted / grown - 1:+.0%})")
    assert grown <= predicted <= 2 * grown
    said = " ".join(done.stderr.split())
    assert "of freed memory kept for speed, loading" in said
