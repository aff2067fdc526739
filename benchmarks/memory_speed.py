"""How long `tunecast memory` takes, cold (nothing cached: traces) and warm (profiles cached: no torch).

Targets: under 60 s cold and under 2 s warm on a 2-core CPU for any catalog model up to 405B parameters.
Each run is a fresh `tunecast` process, timed from start to exit, as a user would see it. The warm run
also checks that torch was not imported.

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
MODELS = ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B", "mistralai/Mixtral-8x7B-v0.1", "meta-llama/Llama-3.1-70B",
          "Qwen/Qwen3-235B-A22B", "meta-llama/Llama-3.1-405B"]
ARGS = ["--method", "lora", "--micro-batch", "1", "--seq-len", "2048", "--json"]


def main() -> int:
    rows = []
    for model in MODELS:
        for gpu in ([], ["--gpu", "h100-sxm"]):
            with tempfile.TemporaryDirectory() as cache:
                args = ["memory", "--model", model, *ARGS, *gpu]
                cold, _, _ = timed(args, cache, '"peak_phase"')
                warm, torch_imported, _ = timed(args, cache, '"peak_phase"')
            rows.append((model, "with --gpu h100-sxm (limits, suggestions)" if gpu else "estimate", cold, warm,
                         torch_imported))
            print(f"{model} {'fit' if gpu else 'estimate'}: cold {cold:.1f} s, warm {warm:.2f} s, "
                  f"torch imported warm: {torch_imported}", flush=True)
    lines = [
        f"Measured with `.venv/bin/python benchmarks/memory_speed.py` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. Each figure is one "
        "fresh `tunecast memory` process, start to exit; `--method lora --micro-batch 1 --seq-len 2048`.",
        "",
        "| model | command | cold s (traces) | warm s (cached) | torch imported when warm |",
        "|---|---|---:|---:|---|",
    ]
    lines += [f"| {m} | {kind} | {cold:.1f} | {warm:.2f} | {'yes' if torch_imported else 'no'} |"
              for m, kind, cold, warm, torch_imported in rows]
    slowest_cold = max(r[2] for r in rows)
    slowest_warm = max(r[3] for r in rows)
    lines += ["", f"Slowest cold: {slowest_cold:.1f} s (target < 60 s); slowest warm: {slowest_warm:.2f} s "
                  "(target < 2 s)."]
    write_section(DOC, "memory-speed", "# Memory estimate speed\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
