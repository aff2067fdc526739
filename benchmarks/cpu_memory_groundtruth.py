"""CPU ground truth for the memory estimator: real training steps measured by an independent instrument.

Each case builds a real architecture from its published config with random weights, runs two real
training steps on the CPU (the trainer's own step: tunecast.train), and measures how far the process's
resident memory grows above a baseline taken just before the model is built. glibc is told to return
freed memory at once (MALLOC_MMAP_THRESHOLD_=65536), so resident memory follows live memory. The
estimate is `tunecast memory --device cpu`'s `device_total_gib` for the same run.

`--calibrate` measures the framework's own overhead on a tiny model (tensors of a few MB), which is the
`cpu_framework` row of catalog/data/overheads.csv; the validation cases are separate from it.

Mixture-of-experts cases (SHRUNK) keep their published config but only its first few decoder layers (the
published expert count, width and top-k, hidden size and vocabulary), so that a model of 30B-120B parameters
fits a few GiB of RAM. transformers runs their experts through its default `grouped_mm` kernel on the CPU, as
the trace does. They are slow where the CPU lacks native bf16 (an AVX2-only CPU multiplies bf16 matrices in the
backward pass at about 0.2 GFLOP/s, single-threaded): 5-10 min each there, a few seconds with AVX512-BF16.

Run:  .venv/bin/python benchmarks/cpu_memory_groundtruth.py            (all cases; an hour on an AVX2-only CPU)
      .venv/bin/python benchmarks/cpu_memory_groundtruth.py --only CASE …   (those cases; other rows kept)
      .venv/bin/python benchmarks/cpu_memory_groundtruth.py --check-estimates   (estimates only, against the table)
      .venv/bin/python benchmarks/cpu_memory_groundtruth.py --calibrate
Writes the table between the cpu-groundtruth markers of docs/validation/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "validation" / "memory.md"
MARK = "cpu-groundtruth"

# name: (catalog model, RunSpec settings). Real architectures, 0.5B-1.5B, full and LoRA, with and without
# checkpointing, four vocabularies (151,936 / 128,256 / 32,000 / 50,257).
_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
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
    # Mixture-of-experts, LoRA on attention (the experts are 3-D parameters peft's Linear targets never match),
    # shrunk in depth by SHRUNK: 128 experts top-8 of width 768; 8 experts top-2 of width 14,336; 32 experts top-4
    # with biases and a clamped SwiGLU, one sliding-window and one full-attention layer, in eager attention
    # (transformers has no SDPA path for gpt-oss's attention sinks, and would pick eager itself). Lengths are
    # short because bf16 expert matmuls are slow on a CPU without native bf16 (see above).
    "qwen3-30b-a3b-2l-lora-attn": ("Qwen/Qwen3-30B-A3B", {"method": "lora", "lora": {"rank": 16, "targets": _ATTENTION},
                                                         "micro_batch": 1, "seq_len": 128}),
    "mixtral-8x7b-1l-lora-attn": ("mistralai/Mixtral-8x7B-v0.1", {"method": "lora",
                                                                  "lora": {"rank": 16, "targets": _ATTENTION},
                                                                  "micro_batch": 1, "seq_len": 32}),
    "gpt-oss-20b-2l-lora-attn": ("openai/gpt-oss-20b", {"method": "lora", "lora": {"rank": 16, "targets": _ATTENTION},
                                                       "micro_batch": 1, "seq_len": 64, "attention": "eager"}),
}
# Decoder layers kept of a case's published config (tunecast.step.shape.shallow_config_data: per-layer lists
# such as gpt-oss's `layer_types` are cut to match). Weights in bf16: Qwen3-30B-A3B 2 layers 3.5 GiB (the experts
# 2.25 of it), Mixtral-8x7B 1 layer 3.2 GiB (experts 2.6), gpt-oss-20b 2 layers 5.2 GiB (experts 3.0).
SHRUNK: dict[str, int] = {"qwen3-30b-a3b-2l-lora-attn": 2, "mixtral-8x7b-1l-lora-attn": 1,
                          "gpt-oss-20b-2l-lora-attn": 2}
CALIBRATION = ("calibration-tiny", {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 1024}, {"method": "full", "micro_batch": 1, "seq_len": 128})


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(config: dict, settings: dict) -> dict:
    """Runs in a fresh process: build the model with random weights, two training steps, measure."""
    import realstep
    import torch

    from tunecast.step.forward import forward_backward

    baseline = rss()
    spec, model, optimizer = realstep.build(config, settings)
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


def measure(config: Any, settings: dict, script: str = __file__) -> dict:
    """`script --child [config, settings]` in a fresh process whose glibc returns freed memory at once; its result."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TUNECAST_NO_CACHE": "1"}
    completed = subprocess.run([sys.executable, script, "--child", json.dumps([config, settings])],
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
    parser.add_argument("--only", nargs="*", help="measure these cases only; the table keeps the other rows")
    parser.add_argument("--check-estimates", action="store_true",
                        help="estimate every case of the table again (no measurement) and print what moved")
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
    kept = _table_rows()
    if args.check_estimates:
        return _check_estimates(catalog, kept)
    rows = dict(kept)
    today = time.strftime("%Y-%m-%d")
    for name, (model, settings) in CASES.items():
        if args.only and name not in args.only:
            continue
        config, shown_model = _case_config(catalog, name, model)
        measured = measure(config, settings)
        predicted = estimate(config, settings)
        growth = measured["growth_bytes"] / 2**30
        error = (predicted["device_total_gib"] - growth) / growth
        shown = ", ".join(f"{k}={v}" for k, v in settings.items())
        rows[name] = [name, shown_model, shown, f"{growth:.3f}", f"{predicted['device_total_gib']:.3f}",
                      f"{error:+.1%}", f"{predicted['peak_allocated_gib']:.3f}", predicted["peak_phase"], today]
        print(f"{name}: measured {growth:.3f} GiB, predicted {predicted['device_total_gib']:.3f} GiB "
              f"({error:+.1%})", flush=True)
    write_table(DOC, MARK, "cpu_memory_groundtruth.py", f"torch {__import__('torch').__version__}",
                [rows[name] for name in CASES if name in rows], COLUMNS)
    return 0


def write_table(doc: Path, mark: str, script: str, versions: str, ordered: list[list[str]],
                columns: tuple[str, ...]) -> None:
    """The ground-truth table of `ordered` rows (COLUMNS' layout: the error sixth) between `mark`'s markers of `doc`,
    with how it was measured and its largest error."""
    lines = [
        f"Measured with `.venv/bin/python benchmarks/{script}` (`--only CASE …` measures some cases "
        f"and keeps the other rows; each row's date is its own), {platform.machine()}, {os.cpu_count()} cores, "
        f"{versions}.",
        "",
        "| " + " | ".join(columns) + " |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in ordered]
    worst = max(abs(float(row[5].rstrip("%"))) for row in ordered) if ordered else 0.0
    lines += ["", f"Largest absolute error: {worst:.1f}% (target: every case within 5%)."]
    write_section(doc, mark, "\n".join(lines))


COLUMNS = ("case", "model", "settings", "measured GiB", "predicted GiB", "error", "live tensors GiB", "peak phase",
           "measured on")


def _case_config(catalog: Any, name: str, model: str) -> tuple[dict, str]:
    """A case's config (shrunk where SHRUNK says) and the model as the table shows it."""
    found = catalog.models.find(model)
    assert found is not None, model
    if name not in SHRUNK:
        return found.data, model
    from tunecast.step.shape import shallow_config_data

    layers = SHRUNK[name]
    return shallow_config_data(found.data, layers), f"{model} ({layers} layer{'s' if layers > 1 else ''})"


def _table_rows() -> dict[str, list[str]]:
    return table_rows(DOC, MARK, CASES, COLUMNS)


def table_rows(doc: Path, mark: str, cases: Any, columns: tuple[str, ...]) -> dict[str, list[str]]:
    """The rows of `mark`'s table in `doc`, by case (one of `cases`); a row of a table without dates takes the
    table's date."""
    text = doc.read_text() if doc.exists() else ""
    section = text.split(f"<!-- {mark}:start -->", 1)[-1].split(f"<!-- {mark}:end -->", 1)[0]
    dated = re.search(r" on (\d{4}-\d{2}-\d{2})", section)
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in cases:
            rows[cells[0]] = cells if len(cells) == len(columns) else [*cells, dated.group(1) if dated else "?"]
    return rows


def _check_estimates(catalog: Any, kept: dict[str, list[str]]) -> int:
    """Estimate every case of the table again and print how far the predicted figure and its error moved."""
    worst = 0.0
    for name, row in kept.items():
        model, settings = CASES[name]
        config, _ = _case_config(catalog, name, model)
        predicted = estimate(config, settings)["device_total_gib"]
        measured, before = float(row[3]), float(row[4])
        moved = (predicted - before) / measured * 100
        worst = max(worst, abs(moved))
        print(f"{name}: predicted {before:.3f} GiB in the table, {predicted:.3f} GiB now: error moved "
              f"{moved:+.2f} percentage points", flush=True)
    print(f"largest move: {worst:.2f} percentage points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
