"""The same run as each tool runs it: `tunecast memory --runner R` for every runner, side by side.

Llama 3.1 8B, micro-batch 2 × 2,048 tokens on an RTX 4090, LoRA (rank 16, every linear layer) and QLoRA, each
runner with its own defaults for what the config leaves unset (docs/runners.md). Figures are the estimate's
`device_total_gib` (what nvidia-smi would show) and the settings the runner chose.

Run:  .venv/bin/python benchmarks/runner_comparison.py     (about 10 minutes cold on 2 cores: new step templates)
Writes the table between the runner-comparison markers of docs/runners.md.
"""

from __future__ import annotations

import time

from docsection import write_section

from tunecast.catalog.store import load_catalog
from tunecast.config.runner import RUNNERS, apply_runner
from tunecast.config.spec import RunSpec
from tunecast.estimate.memory import estimate_memory

MODEL, GPU = "meta-llama/Llama-3.1-8B", "rtx-4090"
BASE = {"model": MODEL, "lora": {"rank": 16, "alpha": 32, "targets": "all-linear"}, "micro_batch": 2,
        "seq_len": 2048, "gpus": {"gpu": GPU}}


def main() -> int:
    from pathlib import Path

    catalog = load_catalog(None)
    model, gpu = catalog.models.find(MODEL), catalog.gpus.get(GPU)
    lines = [f"Run with `.venv/bin/python benchmarks/runner_comparison.py` on {time.strftime('%Y-%m-%d')}: {MODEL}, "
             f"micro-batch 2 × 2,048 tokens, LoRA r16 on every linear layer, on one {GPU} "
             f"({gpu.usable_memory_gib:.1f} GiB usable); each runner's defaults for what the config leaves unset.",
             "", "| runner | method | precision | optimizer | checkpointing | device GiB | fits |",
             "|---|---|---|---|---|---:|---|"]
    for method in ("lora", "qlora"):
        for name in RUNNERS:
            spec = apply_runner(RunSpec.model_validate({**BASE, "method": method, "runner": name}))
            estimate = estimate_memory(spec, model.data, device="cuda", gpu=gpu, overheads=catalog.overheads)
            fits = "yes" if estimate.device_total_gib <= gpu.usable_memory_gib else "no"
            lines.append(f"| {name} | {method} | {spec.precision} | {spec.optimizer} | "
                         f"{'on' if spec.grad_checkpointing else 'off'} | {estimate.device_total_gib:.2f} | {fits} |")
            print(lines[-1], flush=True)
    write_section(Path(__file__).resolve().parent.parent / "docs" / "runners.md", "runner-comparison",
                  "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
