"""What keeping freed memory on a CPU buys (train/host_memory.py): the runner's training step with glibc's own
allocator against the same step with freed blocks kept for reuse, side by side on this machine.

Each mode runs in a fresh process: a published model config with random weights (shrunk to a few layers), the
runner's model setup, optimizer and forward/backward (tunecast.train), WARMUP steps left out and MEASURED
steps timed. Reported per mode: the median step, the page faults of a measured step (in GB of 4 KiB pages),
and the peak resident memory grown since before the model was built. The ratio glibc ÷ kept is the speed-up.

Run:  .venv/bin/python benchmarks/cpu_freed_memory.py [--write]     (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from docsection import write_section

from tunecast.train.host_memory import untuned_environment

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "cpu-freed-memory.md"
MARK = "cpu-freed-memory"
WARMUP = 2
MEASURED = 5
CASES = {
    "llama-3.2-1b-full-mb2-128": ("meta-llama/Llama-3.2-1B", 2, {"method": "full", "micro_batch": 2,
                                                                 "seq_len": 128}),
    "qwen2.5-0.5b-lora-mb2-512": ("Qwen/Qwen2.5-0.5B", 2, {"method": "lora", "lora": {"rank": 16},
                                                           "micro_batch": 2, "seq_len": 512}),
}


def child(case: str, keep: bool) -> dict:
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.step.forward import forward_backward
    from tunecast.step.settings import TraceSettings
    from tunecast.step.setup import make_optimizer, param_dtype, prepare_for_training, training_config
    from tunecast.step.shape import hf_config, shallow_config_data
    from tunecast.train.host_memory import keep_freed_memory
    from tunecast.train.session import resident_gib

    name, layers, settings = CASES[case]
    spec = RunSpec.model_validate({"model": name, "precision": "fp32", **settings})
    data = shallow_config_data(load_catalog(None).models.find(name).data, layers)
    kept = keep_freed_memory() if keep else False
    torch.manual_seed(0)
    baseline = resident_gib()
    trace = TraceSettings.from_spec(spec)
    model = AutoModelForCausalLM.from_config(hf_config(training_config(data)), dtype=param_dtype(spec.precision),
                                             attn_implementation=trace.attention)
    model = prepare_for_training(model, trace)
    optimizer = make_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, data["vocab_size"], (spec.micro_batch, spec.seq_len))
    seconds, faults = [], []
    for _ in range(WARMUP + MEASURED):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        forward_backward(model, ids, ids, precision=spec.precision, chunked_loss=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"kept": kept, "step_s": statistics.median(seconds[WARMUP:]),
            "faulted_gb": statistics.median(faults[WARMUP:]) * os.sysconf("SC_PAGE_SIZE") / 1e9,
            "growth_gib": peak - baseline}


def measure(case: str, keep: bool) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", case, "--keep" if keep else "--glibc"],
                          env={**untuned_environment(), "MKL_DYNAMIC": "FALSE"}, capture_output=True, text=True,
                          timeout=1200, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"record the table in {DOC.relative_to(REPO)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--glibc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.keep)))
        return 0
    lines = ["| case (layers) | glibc's allocator: step s | faulted GB/step | resident growth GiB "
             "| freed memory kept: step s | faulted GB/step | resident growth GiB | speed-up | memory |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case, (_, layers, _settings) in CASES.items():
        glibc, kept = measure(case, keep=False), measure(case, keep=True)
        assert kept["kept"], "glibc did not take the setting"
        lines.append(f"| `{case}` ({layers}) | {glibc['step_s']:.2f} | {glibc['faulted_gb']:.2f} | "
                     f"{glibc['growth_gib']:.2f} | {kept['step_s']:.2f} | {kept['faulted_gb']:.2f} | "
                     f"{kept['growth_gib']:.2f} | ×{glibc['step_s'] / kept['step_s']:.2f} | "
                     f"{kept['growth_gib'] / glibc['growth_gib'] - 1:+.0%} |")
        print(lines[-1], file=sys.stderr)
    text = ("Reproduce with `.venv/bin/python benchmarks/cpu_freed_memory.py --write` (fp32, random weights, "
            f"median of {MEASURED} steps after {WARMUP} of warm-up; one fresh process per mode).\n\n"
            + "\n".join(lines))
    print(text)
    if args.write:
        write_section(DOC, MARK, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
