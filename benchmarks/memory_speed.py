"""How long `tunecast memory` takes, cold (nothing cached) and warm (the same model and settings cached).

Targets (issue 11), on a 2-core CPU: cold (empty cache) under 5 s for every catalog model up to 70B dense and
for the MoE models, under 15 s for 405B; warm under 0.5 s at any micro-batch and length; with --gpu (limits and
suggestions) at most 2 s more. Each run is a fresh `tunecast` process, timed from start to exit, as a user
would see it; each run says whether torch was imported (a cold run served by a shipped template imports none).
Warm is the slowest of three runs at other shapes (micro-batch 1 × 2048 again, 1 × 512, 4 × 4096), each the
median of three. The bytecode is compiled first, as an installed package has it (a checkout run under
PYTHONDONTWRITEBYTECODE would compile tunecast's modules in every run). A second table times cold estimates of
one model in settings other than the shipped templates' (rank, method, targets, precision, attention).

Run:  .venv/bin/python benchmarks/memory_speed.py
Writes docs/benchmarks/memory-speed.md.
"""

from __future__ import annotations

import compileall
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from clitiming import timed
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "memory-speed.md"
# Templated families (shipped templates) and one family still traced (gpt_oss), to show both.
MODELS = ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B", "mistralai/Mixtral-8x7B-v0.1", "meta-llama/Llama-3.1-70B",
          "Qwen/Qwen3-235B-A22B", "meta-llama/Llama-3.1-405B", "google/gemma-2-9b", "openai/gpt-oss-20b"]
SHAPE = ["--micro-batch", "1", "--seq-len", "2048"]
WARM_SHAPES = [SHAPE, ["--micro-batch", "1", "--seq-len", "512"], ["--micro-batch", "4", "--seq-len", "4096"]]
ARGS = ["--method", "lora", "--json"]
# Settings a user changes, on one model: (label, flags). The first three are served by shipped templates.
VARIATIONS = [
    ("LoRA rank 64", ["--method", "lora", "--lora-rank", "64"]),
    ("QLoRA", ["--method", "qlora"]),
    ("full fine-tuning", ["--method", "full"]),
    ("LoRA on q_proj,k_proj,v_proj,o_proj", ["--method", "lora", "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]),
    ("precision fp32", ["--method", "lora", "--precision", "fp32"]),
    ("eager attention", ["--method", "lora", "--attention", "eager"]),
]
VARIED = "meta-llama/Llama-3.1-8B"


def _warm(args: list[str], cache: str) -> tuple[float, bool]:
    """The slowest shape's median of three warm runs, and whether any of them imported torch."""
    slowest, torch_imported = 0.0, False
    for shape in WARM_SHAPES:
        runs = [timed([*args, *shape], cache, '"peak_phase"') for _ in range(3)]
        slowest = max(slowest, statistics.median(seconds for seconds, _, _ in runs))
        torch_imported |= any(imported for _, imported, _ in runs)
    return slowest, torch_imported


def main() -> int:
    compileall.compile_dir(REPO / "src" / "tunecast", quiet=1)
    rows = []
    for model in MODELS:
        cold_estimate = 0.0
        for gpu in ([], ["--gpu", "h100-sxm"]):
            with tempfile.TemporaryDirectory() as cache:
                args = ["memory", "--model", model, *ARGS, *gpu]
                cold, cold_torch, _ = timed([*args, *SHAPE], cache, '"peak_phase"')
                warm, torch_imported = _warm(args, cache)
            cold_estimate = cold if not gpu else cold_estimate
            rows.append((model, "with --gpu h100-sxm (limits, suggestions)" if gpu else "estimate", cold, warm,
                         torch_imported, cold_torch, cold - cold_estimate if gpu else None))
            print(f"{model} {'fit' if gpu else 'estimate'}: cold {cold:.1f} s (torch {cold_torch}), warm {warm:.2f} s, "
                  f"torch imported warm: {torch_imported}", flush=True)
    varied = []
    for label, flags in VARIATIONS:
        with tempfile.TemporaryDirectory() as cache:
            cold, cold_torch, _ = timed(["memory", "--model", VARIED, *flags, *SHAPE, "--json"], cache, '"peak_phase"')
        varied.append((label, cold, cold_torch))
        print(f"{VARIED} {label}: cold {cold:.1f} s (torch {cold_torch})", flush=True)
    lines = [
        f"Measured with `.venv/bin/python benchmarks/memory_speed.py` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. Each figure is a "
        "fresh `tunecast memory` process, start to exit; `--method lora`, cold at micro-batch 1 × 2048 tokens, "
        "warm the slowest of 1 × 2048, 1 × 512 and 4 × 4096 (median of three runs each).",
        "",
        "| model | command | cold s | torch imported cold (traced) | --gpu adds s | warm s (cached) "
        "| torch imported warm |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    lines += [f"| {m} | {kind} | {cold:.1f} | {'yes' if cold_torch else 'no'} | "
              f"{'' if extra is None else f'{extra:.1f}'} | {warm:.2f} | {'yes' if torch_imported else 'no'} |"
              for m, kind, cold, warm, torch_imported, cold_torch, extra in rows]
    estimates = [r for r in rows if r[6] is None]
    cold_ok = sum(1 for r in estimates if r[2] < (15 if "405B" in r[0] else 5))
    gpu_ok = sum(1 for r in rows if r[6] is not None and r[6] <= 2)
    warm_ok = sum(1 for r in rows if r[3] < 0.5)
    lines += ["", f"Cold estimate within target (5 s; 15 s for 405B): {cold_ok} of {len(estimates)}; --gpu adding at "
                  f"most 2 s: {gpu_ok} of {len(rows) - len(estimates)}; warm under 0.5 s: {warm_ok} of {len(rows)}, "
                  f"slowest {max(r[3] for r in rows):.2f} s.",
              "", f"Cold `tunecast memory --model {VARIED}` (micro-batch 1 × 2048) in other settings:", "",
              "| settings | cold s | torch imported (traced) |", "|---|---:|---|"]
    lines += [f"| {label} | {cold:.1f} | {'yes' if torch else 'no'} |" for label, cold, torch in varied]
    write_section(DOC, "memory-speed", "# Memory estimate speed\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
