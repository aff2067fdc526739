"""CPU ground truth for the memory estimator: real training steps measured by an independent instrument.

Each case builds a real architecture from its published config with random weights, runs two real
training steps on the CPU (the trainer's own step: tunecast.train), and measures how far the process's
resident memory grows above a baseline taken just before the model is built. glibc is told to return
freed memory at once (MALLOC_MMAP_THRESHOLD_=65536), so resident memory follows live memory. The
estimate is `tunecast memory --device cpu`'s `device_total_gib` for the same run.

`--calibrate` measures the framework's own overhead on a tiny model (tensors of a few MB), which is the
`cpu_framework` row of catalog/data/overheads.csv; the validation cases are separate from it.

Run:  .venv/bin/python benchmarks/cpu_memory_groundtruth.py            (all cases, ~15 min on 2 cores)
      .venv/bin/python benchmarks/cpu_memory_groundtruth.py --calibrate
Writes the table between the cpu-groundtruth markers of docs/validation/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "validation" / "memory.md"
MARK = "cpu-groundtruth"

# name: (catalog model, RunSpec settings). Real architectures, 0.5B-1.5B, full and LoRA, with and without
# checkpointing, four vocabularies (151,936 / 128,256 / 32,000 / 50,257).
CASES: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5b-full": ("Qwen/Qwen2.5-0.5B", {"method": "full", "micro_batch": 1, "seq_len": 512}),
    "qwen3-0.6b-lora": ("Qwen/Qwen3-0.6B", {"method": "lora", "lora": {"rank": 16}, "micro_batch": 1,
                                            "seq_len": 1024}),
    "llama-3.2-1b-lora-ckpt": ("meta-llama/Llama-3.2-1B", {"method": "lora", "lora": {"rank": 16}, "micro_batch": 2,
                                                           "seq_len": 1024, "grad_checkpointing": True}),
    "tinyllama-1.1b-full-ckpt": ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", {"method": "full", "micro_batch": 1,
                                                                       "seq_len": 512, "grad_checkpointing": True}),
    "qwen2.5-1.5b-lora-qv": ("Qwen/Qwen2.5-1.5B", {"method": "lora",
                                                   "lora": {"rank": 8, "targets": ["q_proj", "v_proj"]},
                                                   "micro_batch": 2, "seq_len": 512}),
    "gpt2-large-full": ("openai-community/gpt2-large", {"method": "full", "micro_batch": 1, "seq_len": 512}),
}
CALIBRATION = ("calibration-tiny", {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 1024}, {"method": "full", "micro_batch": 1, "seq_len": 128})


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(config: dict, settings: dict) -> dict:
    """Runs in a fresh process: build the model with random weights, two training steps, measure."""
    import torch

    from tunecast.config.spec import RunSpec
    from tunecast.estimate.settings import TraceSettings
    from tunecast.estimate.shape import hf_config
    from tunecast.train.setup import make_optimizer, param_dtype, prepare_for_training, training_config
    from tunecast.train.step import forward_backward

    spec = RunSpec.model_validate({"model": "x", **settings})
    trace = TraceSettings.from_spec(spec)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    baseline = _rss()
    model = AutoModelForCausalLM.from_config(hf_config(training_config(config)), dtype=param_dtype(spec.precision),
                                             attn_implementation=trace.attention)
    model = prepare_for_training(model, trace)
    optimizer = make_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, config["vocab_size"], (spec.micro_batch, spec.seq_len))
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        forward_backward(model, ids, ids, precision=spec.precision, chunked_loss=spec.loss == "chunked")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"growth_bytes": peak - baseline, "step_seconds": seconds}


def measure(config: dict, settings: dict) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TUNECAST_NO_CACHE": "1"}
    completed = subprocess.run([sys.executable, __file__, "--child", json.dumps([config, settings])],
                               capture_output=True, text=True, env=env, check=False)
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr[-3000:])
    return json.loads(completed.stdout.strip().splitlines()[-1])


def estimate(config: dict, settings: dict) -> dict:
    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.memory import estimate_memory

    spec = RunSpec.model_validate({"model": "x", **settings})
    result = estimate_memory(spec, config, device="cpu", gpu=None, overheads=load_catalog(None).overheads)
    return result.as_dict()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    if args.child:
        config, settings = json.loads(args.child)
        print(json.dumps(child(config, settings)))
        return 0
    if args.calibrate:
        name, config, settings = CALIBRATION
        measured = measure(config, settings)
        live = estimate(config, settings)["peak_allocated_gib"]
        overhead = measured["growth_bytes"] / 2**30 - live
        print(f"{name}: resident growth {measured['growth_bytes'] / 2**30:.3f} GiB, live tensors {live:.4f} GiB, "
              f"framework overhead {overhead:.3f} GiB")
        return 0

    from tunecast.catalog.store import load_catalog

    catalog = load_catalog(None)
    rows = []
    for name, (model, settings) in CASES.items():
        if args.only and name not in args.only:
            continue
        found = catalog.models.find(model)
        assert found is not None, model
        measured = measure(found.data, settings)
        predicted = estimate(found.data, settings)
        growth = measured["growth_bytes"] / 2**30
        error = (predicted["device_total_gib"] - growth) / growth
        rows.append((name, model, settings, growth, predicted, error, measured["step_seconds"]))
        print(f"{name}: measured {growth:.3f} GiB, predicted {predicted['device_total_gib']:.3f} GiB "
              f"({error:+.1%})", flush=True)

    lines = [
        f"Measured with `.venv/bin/python benchmarks/cpu_memory_groundtruth.py` on {time.strftime('%Y-%m-%d')}, "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {__import__('torch').__version__}.",
        "",
        "| case | model | settings | measured GiB | predicted GiB | error | live tensors GiB | peak phase |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for name, model, settings, growth, predicted, error, _ in rows:
        shown = ", ".join(f"{k}={v}" for k, v in settings.items())
        lines.append(f"| {name} | {model} | {shown} | {growth:.3f} | {predicted['device_total_gib']:.3f} | "
                     f"{error:+.1%} | {predicted['peak_allocated_gib']:.3f} | {predicted['peak_phase']} |")
    worst = max(abs(row[5]) for row in rows) if rows else 0.0
    lines += ["", f"Largest absolute error: {worst:.1%} (target: every case within 5%)."]
    if not args.only:
        write_section(DOC, MARK, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
