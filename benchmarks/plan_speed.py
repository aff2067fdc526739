"""How long `tunecast plan` takes over the whole catalog: cold (nothing cached: shipped templates, or traces),
warm (profiles and replays cached, the plan itself computed afresh), and repeated (the plan cached).

Target (issue 11): a 70B model over the whole catalog in under 15 s cold on a 2-core CPU. Each run is a fresh
`tunecast` process, timed from start to exit, as a user would see it, and says whether torch was imported (a plan
served by shipped templates imports none, cold or warm).

Run:  .venv/bin/python benchmarks/plan_speed.py
Writes docs/benchmarks/plan-speed.md.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from clitiming import timed
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "plan-speed.md"
DATASET = ["--set", "dataset.examples=50000", "--set", "dataset.mean_tokens=600"]
CASES = [
    ("meta-llama/Llama-3.1-70B", ["--method", "qlora", "--seq-len", "2048", "--global-batch", "16", *DATASET]),
    ("meta-llama/Llama-3.1-70B", ["--method", "lora", "--seq-len", "2048", "--global-batch", "16",
                                  "--set", "plan.allow=fsdp", *DATASET]),
    ("meta-llama/Llama-3.1-8B", ["--method", "lora", "--seq-len", "2048", "--global-batch", "16", *DATASET]),
]


def main() -> int:
    rows = []
    for model, flags in CASES:
        args = ["plan", "--model", model, *flags, "--json"]
        with tempfile.TemporaryDirectory() as cache:
            cold, torch_cold, stdout = timed(args, cache, '"options"')
            document = json.loads(stdout)
            shutil.rmtree(Path(cache) / "plans")  # keep the traced profiles, drop the plan
            warm, torch_warm, _ = timed(args, cache, '"options"')
            repeated, _, _ = timed(args, cache, '"options"')
        options = document["options"]
        fitting = {(o["gpu"], o["gpu_count"]) for o in options if o["fits"]}
        configurations = {(o["gpu"], o["gpu_count"]) for o in options}
        priced = sum(1 for o in options if o["total_usd"] is not None)
        rows.append((model, " ".join(flags[:-len(DATASET)]), len(configurations), len(fitting), priced,
                     cold, warm, repeated, torch_warm, torch_cold))
        print(f"{model} {' '.join(flags)}: cold {cold:.1f} s (torch {torch_cold}), warm {warm:.2f} s, cached "
              f"{repeated:.2f} s, torch imported warm: {torch_warm}", flush=True)
    lines = [
        f"Measured with `.venv/bin/python benchmarks/plan_speed.py` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. Each figure is one "
        "fresh `tunecast plan … --json` process, start to exit, over every GPU of the catalog and 1, 2, 4 and 8 "
        "GPUs, priced on every offer (on-demand and spot); dataset declared as 50,000 examples of 600 tokens.",
        "",
        "| model | flags | GPU × count tried | that fit | priced options | cold s (empty cache) | torch imported "
        "cold (traced) | warm s (profiles cached) | plan cached s | torch imported warm |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    lines += [f"| {m} | `{f}` | {tried} | {fit} | {priced} | {cold:.1f} | {'yes' if torch_cold else 'no'} | "
              f"{warm:.2f} | {cached:.2f} | {'yes' if torch_warm else 'no'} |"
              for m, f, tried, fit, priced, cold, warm, cached, torch_warm, torch_cold in rows]
    slowest_cold = max(r[5] for r in rows if "70B" in r[0])
    lines += ["", f"Slowest cold plan of a 70B model: {slowest_cold:.1f} s (target < 15 s); slowest warm: "
                  f"{max(r[6] for r in rows):.2f} s."]
    write_section(DOC, "plan-speed", "# Plan speed\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
