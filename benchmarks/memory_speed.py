"""How long `tunecast memory` takes, cold (nothing cached: traces) and warm (profiles cached: no torch).

Targets (issue 11), on a 2-core CPU: cold (empty cache) under 5 s for every catalog model up to 70B dense and
for the MoE models, under 15 s for 405B; warm under 0.5 s; with --gpu (limits and suggestions) at most 2 s
more. Each run is a fresh `tunecast` process, timed from start to exit, as a user would see it; each run
says whether torch was imported (a cold run served by a shipped template imports none).

Run:  .venv/bin/python benchmarks/memory_speed.py
Writes docs/benchmarks/memory-speed.md.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

from clitiming import timed
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "memory-speed.md"
# Templated families (shipped templates) and two families still traced (gemma2, gpt_oss), to show both.
MODELS = ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B", "mistralai/Mixtral-8x7B-v0.1", "meta-llama/Llama-3.1-70B",
          "Qwen/Qwen3-235B-A22B", "meta-llama/Llama-3.1-405B", "google/gemma-2-9b", "openai/gpt-oss-20b"]
ARGS = ["--method", "lora", "--micro-batch", "1", "--seq-len", "2048", "--json"]


def main() -> int:
    rows = []
    for model in MODELS:
        for gpu in ([], ["--gpu", "h100-sxm"]):
            with tempfile.TemporaryDirectory() as cache:
                args = ["memory", "--model", model, *ARGS, *gpu]
                cold, cold_torch, _ = timed(args, cache, '"peak_phase"')
                warm, torch_imported, _ = timed(args, cache, '"peak_phase"')
            rows.append((model, "with --gpu h100-sxm (limits, suggestions)" if gpu else "estimate", cold, warm,
                         torch_imported, cold_torch))
            print(f"{model} {'fit' if gpu else 'estimate'}: cold {cold:.1f} s (torch {cold_torch}), warm {warm:.2f} s, "
                  f"torch imported warm: {torch_imported}", flush=True)
    lines = [
        f"Measured with `.venv/bin/python benchmarks/memory_speed.py` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. Each figure is one "
        "fresh `tunecast memory` process, start to exit; `--method lora --micro-batch 1 --seq-len 2048`.",
        "",
        "| model | command | cold s | torch imported cold (traced) | warm s (cached) | torch imported warm |",
        "|---|---|---:|---|---:|---|",
    ]
    lines += [f"| {m} | {kind} | {cold:.1f} | {'yes' if cold_torch else 'no'} | {warm:.2f} | "
              f"{'yes' if torch_imported else 'no'} |"
              for m, kind, cold, warm, torch_imported, cold_torch in rows]
    cold_ok = sum(1 for r in rows if r[2] < (15 if "405B" in r[0] else 5) + (2 if "--gpu" in r[1] else 0))
    lines += ["", f"Cold within target (5 s; 15 s for 405B; 2 s more with --gpu): {cold_ok} of {len(rows)}; "
                  f"slowest warm: {max(r[3] for r in rows):.2f} s (target < 0.5 s)."]
    write_section(DOC, "memory-speed", "# Memory estimate speed\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
