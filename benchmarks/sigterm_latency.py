"""From a preemption notice to the exit of `tunecast train`: SIGTERM sent during a step of a Qwen2-shaped model.

The model is the one of benchmarks/cpu_kept_memory.py (Qwen2.5-0.5B's config cut to 4 layers, bf16 weights built
in this process), trained with LoRA in bf16 at 1 × 512 tokens: a step of several seconds on a CPU. Each try starts
`tunecast train` in a fresh process, waits for its first step's progress line, waits a second more (the second
step is then under way), sends SIGTERM and times the exit. Reported per try: the step's length, the seconds from
the signal to the exit, and the checkpoint's write (from the run's own line).

Run:  .venv/bin/python benchmarks/sigterm_latency.py [--write]     (about 3 minutes on 2 cores)
Writes the table between the sigterm-latency markers of docs/benchmarks/sigterm-latency.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_kept_memory import TINY, make_data, make_model
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "sigterm-latency.md"
MARK = "sigterm-latency"
TUNECAST = REPO / ".venv" / "bin" / "tunecast"
TRIES = 3
SETTINGS = {"method": "lora", "lora": {"rank": 16}, "precision": "bf16", "micro_batch": 1, "grad_accum": 1,
            "seq_len": 512}


def one(folder: Path, model: Path, data: Path) -> dict[str, float]:
    folder.mkdir()
    config = {"model": str(model), **SETTINGS, "max_steps": 50, "eval": {"examples": 0},
              "dataset": {"path": str(data), "tokenizer": str(TINY)}, "checkpoint": {"every_steps": 1000},
              "output": str(folder / "out")}
    (folder / "run.yaml").write_text(json.dumps(config))
    process = subprocess.Popen([str(TUNECAST), "train", str(folder / "run.yaml")], stderr=subprocess.PIPE, text=True,
                               bufsize=1)
    assert process.stderr is not None
    started = sent = None
    step_s = checkpoint_s = float("nan")
    for line in process.stderr:
        if started is None and "step 1/" in line:
            started = time.monotonic()
            time.sleep(1.0)
            sent = time.monotonic()
            os.kill(process.pid, signal.SIGTERM)
        written = re.search(r"checkpoint at step \d+ \(preempted by SIGTERM, [\d.]+ MiB in ([\d.]+) s\)", line)
        if written:
            checkpoint_s = float(written.group(1))
    code = process.wait()
    ended = time.monotonic()
    assert code == 75 and sent is not None, f"exit {code}"
    lines = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step_seconds"] for line in lines if line["kind"] == "train"]
    step_s = steps[0] if steps else step_s
    return {"step_s": step_s, "exit_s": ended - sent, "checkpoint_s": checkpoint_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"record the table in {DOC.relative_to(REPO)}")
    args = parser.parse_args()
    lines = ["| try | a step, s | SIGTERM to exit, s | of which the checkpoint, s |", "|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="tunecast-sigterm-") as scratch:
        root = Path(scratch)
        model, data = make_model(root / "model"), make_data(root / "text.jsonl")
        for number in range(1, TRIES + 1):
            measured = one(root / f"try-{number}", model, data)
            lines.append(f"| {number} | {measured['step_s']:.1f} | {measured['exit_s']:.2f} | "
                         f"{measured['checkpoint_s']:.2f} |")
            print(lines[-1], file=sys.stderr)
    text = ("Reproduce with `.venv/bin/python benchmarks/sigterm_latency.py --write` (Qwen2.5-0.5B cut to 4 layers, "
            "LoRA, bf16, 1 × 512 tokens; SIGTERM a second into the second step).\n\n" + "\n".join(lines))
    print(text)
    if args.write:
        write_section(DOC, MARK, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
