"""Per-rank memory of FSDP2 on the CPU: each of two gloo processes' resident growth over two real training steps
of a real architecture (random weights, published config), against `tunecast memory --device cpu --gpus 2
--strategy fsdp`.

The method of cpu_memory_groundtruth.py (glibc returns freed memory at once, MALLOC_MMAP_THRESHOLD_=65536;
growth above the resident memory just before the model is built), run through `tunecast train --gpus 2`; each
rank's peak is counted from after its model is sharded (every rank builds the whole model first), and every
rank's figures are in the run's metrics (`rss_before_model_gib_ranks`, `peak_rss_gib_ranks`).

Run:  .venv/bin/python benchmarks/fsdp_rank_memory.py     (about 6 minutes on 2 cores)
Writes docs/benchmarks/fsdp-rank-memory.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration.test_train_memory import long_texts  # noqa: E402
from tests.trainruns import TINY_MODEL  # noqa: E402

from tunecast.catalog.store import load_catalog  # noqa: E402
from tunecast.config.spec import RunSpec  # noqa: E402
from tunecast.estimate.memory import estimate_memory  # noqa: E402

CASES = {
    "GPT-2, LoRA r16, fp32, 2 × 512": ("openai-community/gpt2", {"method": "lora", "lora": {"rank": 16},
                                                                "precision": "fp32", "micro_batch": 2,
                                                                "seq_len": 512}),
    "GPT-2, full, fp32, 2 × 512": ("openai-community/gpt2", {"method": "full", "precision": "fp32",
                                                            "micro_batch": 2, "seq_len": 512}),
    "Qwen2.5-0.5B, LoRA r16, fp32, 1 × 256": ("Qwen/Qwen2.5-0.5B", {"method": "lora", "lora": {"rank": 16},
                                                                    "precision": "fp32", "micro_batch": 1,
                                                                    "seq_len": 256}),
    # the root unit (a tied 152k embedding) is a quarter of the weights: its gradients stay whole through the backward
    "Qwen2.5-0.5B, full, fp32, 1 × 256": ("Qwen/Qwen2.5-0.5B", {"method": "full", "precision": "fp32",
                                                                "micro_batch": 1, "seq_len": 256}),
    "GPT-2, full, fp32, checkpointing, 2 × 512": ("openai-community/gpt2", {"method": "full", "precision": "fp32",
                                                                            "micro_batch": 2, "seq_len": 512,
                                                                            "grad_checkpointing": True}),
}
OUT = REPO / "docs" / "benchmarks" / "fsdp-rank-memory.md"


def measure(model: str, settings: dict, folder: Path) -> tuple[float, list[float]]:
    catalog = load_catalog(None)
    data = folder / "text.jsonl"
    long_texts(data, 16)
    config = {"model": str(catalog.models.find(model).path), "random_weights": True, **settings, "max_steps": 2,
              "dataset": {"path": str(data), "tokenizer": str(TINY_MODEL)}, "checkpoint": {"every_steps": 100},
              "output": str(folder / "out"), "gpus": {"count": 2, "strategy": "fsdp"}}
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    predicted = estimate_memory(RunSpec.model_validate(config), catalog.models.find(model).data, device="cpu",
                                gpu=None, overheads=catalog.overheads, exact_shape=True).device_total_gib
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-m", "tunecast", "train", str(folder / "run.yaml"), "--no-memory-check"],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    lines = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    start = next(line for line in lines if line.get("event") == "start")
    measured = [max(line["peak_rss_gib_ranks"][rank] for line in lines if line["kind"] == "train") - baseline
                for rank, baseline in enumerate(start["rss_before_model_gib_ranks"])]
    return predicted, measured


def main() -> int:
    rows = []
    for name, (model, settings) in CASES.items():
        with tempfile.TemporaryDirectory(prefix="tunecast-fsdp-memory-") as scratch:
            predicted, measured = measure(model, settings, Path(scratch))
        errors = [predicted / m - 1 for m in measured]
        rows.append(f"| {name} | {predicted:.3f} | {measured[0]:.3f} | {measured[1]:.3f} | "
                    + " / ".join(f"{e:+.1%}" for e in errors) + " |")
        print(rows[-1], flush=True)
    import torch

    OUT.write_text("\n".join([
        "# FSDP2 per-rank memory on the CPU", "",
        "Written by `.venv/bin/python benchmarks/fsdp_rank_memory.py` (method in its docstring): two gloo processes, "
        "each rank's resident growth over two training steps, against `tunecast memory --device cpu --gpus 2 "
        "--strategy fsdp`.", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}.",
        "", "| run | predicted GiB | rank 0 GiB | rank 1 GiB | error (rank 0 / rank 1) |", "|---|---|---|---|---|",
        *rows, "",
        "The estimate counts each rank's shards, the root unit (embeddings, final norm, head) gathered for the "
        "whole forward and backward pass, two decoder layers gathered (the one computed and the one prefetched), "
        "a layer's gradients before their reduce-scatter (its adapters' for LoRA), and in full fine-tuning the root's "
        "gradients whole until the backward pass ends (FSDP2 reduce-scatters them in its final callback); a backward "
        "peak with no activation left is the end of the backward pass, where only the root is gathered "
        "(estimate/memory.py, `_apply_strategy`).", ""]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
