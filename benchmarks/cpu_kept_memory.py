"""The memory check of a CPU run against what `tunecast train` really grows by, with freed memory kept (the
runner's default on a CPU) and returned (glibc's own allocator), on a Qwen2-shaped model with real weights.

The model is Qwen2.5-0.5B's published config cut to a few decoder layers (its 151,936-token vocabulary and width
kept), built in this process from the config, with random weights saved as a bf16 `model.safetensors` beside the
demo tokenizer (examples/tiny-model). Each case runs `tunecast train` for STEPS steps in a fresh process: once
as a user runs it (freed memory kept), once with MALLOC_MMAP_THRESHOLD_=65536 (resident memory follows live
memory). Reported: the live estimate (`tunecast memory --device cpu`), the share a step allocates and frees (the
live peak less weights, trainable weights and optimizer states), the run's resident growth over its steps (peak
resident memory above what it held before the model was loaded, from metrics.jsonl), the kept mode's growth above
the live estimate as a share of that transient memory, and the check's own prediction (the start event's
`predicted_memory_gib`, with the allocator mode it chose).

Run:  .venv/bin/python benchmarks/cpu_kept_memory.py [--write]     (about 10 minutes on 2 cores)
Writes the table between the cpu-kept-memory markers of docs/benchmarks/cpu-kept-memory.md.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from docsection import write_section

from tunecast.train.host_memory import untuned_environment

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "cpu-kept-memory.md"
MARK = "cpu-kept-memory"
TUNECAST = REPO / ".venv" / "bin" / "tunecast"
TINY = REPO / "examples" / "tiny-model"
LAYERS = 4
STEPS = 6  # the kept heap's high-water mark settles within about six steps
CASES: dict[str, dict[str, Any]] = {
    "bf16 LoRA, 1 × 512": {"method": "lora", "lora": {"rank": 16}, "precision": "bf16", "micro_batch": 1,
                           "seq_len": 512},
    "fp32 LoRA, 2 × 512": {"method": "lora", "lora": {"rank": 16}, "precision": "fp32", "micro_batch": 2,
                           "seq_len": 512},
    "bf16 full, 1 × 256": {"method": "full", "precision": "bf16", "micro_batch": 1, "seq_len": 256},
    "fp32 LoRA, 1 × 128": {"method": "lora", "lora": {"rank": 16}, "precision": "fp32", "micro_batch": 1,
                           "seq_len": 128},
}


def make_model(folder: Path) -> Path:
    """Qwen2.5-0.5B cut to LAYERS layers, random bf16 weights saved as model.safetensors, the demo tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunecast.catalog.store import load_catalog

    config = dict(load_catalog(None).models.find("Qwen/Qwen2.5-0.5B").data)
    config["num_hidden_layers"] = LAYERS
    config.pop("layer_types", None)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.bfloat16).save_pretrained(
        str(folder))
    for path in TINY.iterdir():
        if path.name != "config.json":
            shutil.copy(path, folder / path.name)
    return folder


def make_data(path: Path) -> Path:
    """Texts longer than any seq_len here: every sequence full, as the estimate assumes."""
    chooser = random.Random(0)
    words = ["alpha", "river", "stone", "quiet", "number", "garden", "silver", "window", "planet", "morning"]
    path.write_text("".join(json.dumps({"text": " ".join(chooser.choice(words) for _ in range(700))}) + "\n"
                            for _ in range(64)))
    return path


def estimate(model: Path, settings: dict[str, Any]) -> dict[str, Any]:
    flags = ["--method", settings["method"], "--precision", settings["precision"], "--micro-batch",
             str(settings["micro_batch"]), "--seq-len", str(settings["seq_len"])]
    if settings["method"] == "lora":
        flags += ["--lora-rank", str(settings["lora"]["rank"])]
    done = subprocess.run([str(TUNECAST), "memory", "--model", str(model), *flags, "--device", "cpu", "--json"],
                          capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout))


def train(folder: Path, model: Path, data: Path, settings: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    folder.mkdir()
    out = folder / "out"
    config = {"model": str(model), **settings, "max_steps": STEPS, "eval": {"examples": 0},
              "dataset": {"path": str(data), "tokenizer": str(TINY)}, "checkpoint": {"every_steps": 1000},
              "output": str(out)}
    (folder / "run.yaml").write_text(json.dumps(config))
    subprocess.run([str(TUNECAST), "train", str(folder / "run.yaml")], env={**untuned_environment(), **env},
                   capture_output=True, text=True, check=True, timeout=3600)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(line for line in lines if line.get("event") == "start")
    peak = max(line["peak_rss_gib"] for line in lines if line["kind"] == "train")
    return {"growth_gib": peak - start["rss_before_model_gib"], "predicted_gib": start["predicted_memory_gib"],
            "kept": start["keeps_freed_memory"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"record the table in {DOC.relative_to(REPO)}")
    args = parser.parse_args()
    lines = ["| case | live estimate GiB | step's transient GiB | growth, freed memory returned | growth, kept "
             "| kept above the estimate ÷ transient | the check predicts (mode) | covered |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory(prefix="tunecast-kept-memory-") as scratch:
        root = Path(scratch)
        model, data = make_model(root / "model"), make_data(root / "text.jsonl")
        for number, (case, settings) in enumerate(CASES.items()):
            live = estimate(model, settings)
            breakdown = live["breakdown_gib"]
            state = sum(breakdown[key] for key in ("weights", "trainable_weights", "optimizer", "quantization"))
            transient = live["device_total_gib"] - state
            returned = train(root / f"{number}-returned", model, data, settings, {"MALLOC_MMAP_THRESHOLD_": "65536"})
            kept = train(root / f"{number}-kept", model, data, settings, {})
            share = (kept["growth_gib"] - live["device_total_gib"]) / transient
            mode = "kept" if kept["kept"] else "returned"
            covered = "yes" if kept["predicted_gib"] >= kept["growth_gib"] else "**no**"
            lines.append(f"| {case} | {live['device_total_gib']:.2f} | {transient:.2f} | {returned['growth_gib']:.2f} "
                         f"| {kept['growth_gib']:.2f} | {share:.2f} | {kept['predicted_gib']:.2f} ({mode}) | "
                         f"{covered} |")
            print(lines[-1], file=sys.stderr)
    text = (f"Reproduce with `.venv/bin/python benchmarks/cpu_kept_memory.py --write` (Qwen2.5-0.5B cut to {LAYERS} "
            f"layers, bf16 weights file; {STEPS} steps per run, one fresh process per run).\n\n" + "\n".join(lines))
    print(text)
    if args.write:
        write_section(DOC, MARK, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
