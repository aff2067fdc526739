"""How long a cold estimate takes for each runner people train with: `tunecast memory --runner R` and `tunecast plan`.

Targets (issue 31), on a quiet 2-core machine, every command a fresh process with an empty cache and no background
server: `tunecast memory` of each runner × {Llama-3.1-8B, Qwen2.5-7B, Mistral-7B, Qwen3-30B-A3B, gemma-2-9b} ×
{LoRA, QLoRA, full} × {`--gpu` given, not given} within 5 s; `tunecast plan` of each runner over the whole GPU
catalog within 10 s; a local config.json of a catalog family at a width and depth no catalog model has within 10 s.

Each row says whether the command traced (its stderr named a trace or a template build) and how it was served.
A command still running at the time limit is stopped and reported as such ("> N s"): that is the answer's time as a
user meets it. Rows run in turn, one process at a time.

Run:  .venv/bin/python benchmarks/runner_speed.py [--runners R ...] [--limit SECONDS] [--write]
With --write, writes docs/benchmarks/runner-speed.md (the section of the runners measured).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from coldrun import cell, run_cold
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "runner-speed.md"
TUNECAST = Path(sys.executable).with_name("tunecast")
RUNNERS = ("hf-trainer", "trl", "axolotl", "llamafactory", "unsloth", "torchtune")
MODELS = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B", "mistralai/Mistral-7B-v0.1", "Qwen/Qwen3-30B-A3B",
          "google/gemma-2-9b")
METHODS = ("lora", "qlora", "full")
GPU = "a100-80gb"
DATASET = ["--set", "dataset.examples=20000", "--set", "dataset.mean_tokens=600"]
# A Llama-family config at a width and depth no catalog model has (a template of its structure serves it).
NEW_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
             "intermediate_size": 8448, "num_hidden_layers": 22, "num_attention_heads": 24, "num_key_value_heads": 8,
             "vocab_size": 100352, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
TRACE_WORDS = ("tracing the", "building the step template")


def _run(command: list[str], limit: float, home: Path) -> tuple[float | None, bool, str]:
    """(seconds, or None when stopped at `limit`; whether it traced; the device total or the error)."""
    run = run_cold(command, limit, home, TRACE_WORDS)
    answer = run.answer
    if answer is None:
        return run.seconds, run.traced, run.problem or ""
    if "device_total_gib" in answer:
        return run.seconds, run.traced, f"{answer['device_total_gib']:.2f} GiB"
    return run.seconds, run.traced, f"{len(answer.get('options', []))} options"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", nargs="*", choices=RUNNERS, default=list(RUNNERS))
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a command is stopped (default 60)")
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(REPO)}")
    options = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows: list[str] = []
    met = total = 0
    with tempfile.TemporaryDirectory(prefix="tunecast-runners-") as directory:
        home = Path(directory)
        local = home / "new-shape" / "config.json"
        local.parent.mkdir()
        local.write_text(json.dumps(NEW_SHAPE))
        for runner in options.runners:
            cases = [(model, method, gpu) for model, method, gpu in itertools.product(MODELS, METHODS, (False, True))]
            cases += [(str(local.parent), method, gpu) for method, gpu in itertools.product(METHODS, (False, True))]
            for model, method, gpu in cases:
                command = [str(TUNECAST), "memory", "--runner", runner, "--model", model, "--method", method, "--json"]
                command += ["--gpu", GPU] if gpu else []
                seconds, traced, answer = _run(command, options.limit, home)
                target = 10.0 if model == str(local.parent) else 5.0
                ok = seconds is not None and seconds <= target and not answer.startswith("exit")
                met, total = met + ok, total + 1
                name = "local config.json (new width and depth)" if model == str(local.parent) else model
                rows.append(f"| {runner} | {name} | {method} | {'yes' if gpu else 'no'} | "
                            f"{cell(seconds, options.limit)} | {'traced' if traced else 'template'} | {answer} | "
                            f"{'met' if ok else 'missed'} |")
                print(rows[-1], flush=True)
            command = [str(TUNECAST), "plan", "--model", MODELS[0], "--method", "lora", "--runner", runner, "--json",
                       *DATASET]
            seconds, traced, answer = _run(command, options.limit, home)
            ok = seconds is not None and seconds <= 10.0 and not answer.startswith("exit")
            met, total = met + ok, total + 1
            rows.append(f"| {runner} | `plan` {MODELS[0]}, every GPU of the catalog | lora | — | "
                        f"{cell(seconds, options.limit)} | {'traced' if traced else 'template'} | {answer} | "
                        f"{'met' if ok else 'missed'} |")
            print(rows[-1], flush=True)
    load_after = os.getloadavg()[0]
    lines = [
        f"Measured with `.venv/bin/python benchmarks/runner_speed.py --runners {' '.join(options.runners)} --write` on "
        f"{time.strftime('%Y-%m-%d')}: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average {load_before:.2f} before, {load_after:.2f} after. Each row is "
        f"the console script in a fresh process with an empty cache (`--json`; `--gpu {GPU}` where the row says "
        f"so); stopped after {options.limit:g} s. Target: 5 s for `memory` of a catalog model, 10 s for a local "
        "config and for `plan`.",
        "",
        "| runner | model | method | `--gpu` | seconds | served by | answer | target |",
        "|---|---|---|---|---:|---|---|---|",
        *rows,
        "",
        f"Targets met: {met} of {total}.",
    ]
    text = "## " + ", ".join(options.runners) + "\n\n" + "\n".join(lines)
    print(text)
    if options.write:
        if not DOC.exists():
            DOC.parent.mkdir(parents=True, exist_ok=True)
            DOC.write_text("# Cold estimates by runner\n\nWritten by `benchmarks/runner_speed.py`; one section per "
                           "set of runners measured together.\n")
        write_section(DOC, "runners-" + "-".join(options.runners), text)
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0 if met == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
