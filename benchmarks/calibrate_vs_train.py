"""`tunecast calibrate` against the run it stands for: the tokens/s a short calibration measures next to the
tokens/s the full `tunecast train` of the same config then reports.

The config is the training demo (examples/tiny-lora.yaml: LoRA on a 4-layer Llama, 40 steps on the CPU). Each
round calibrates it for STEPS steps (`--steps`), then trains it to the end into a scratch output, one process
after the other on a quiet machine; the train's figure is its summary (`--json`: real tokens over the seconds
of its steps, warm-up included, as a user sees it). This VM's speed drifts by 20–30% over minutes (CPU
steal), so every round is shown and the median ratio is the result.

Run:  .venv/bin/python benchmarks/calibrate_vs_train.py [--rounds N] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_throughput_check import wait_for_quiet
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
TUNECAST = Path(sys.executable).parent / "tunecast"
CONFIG = REPO / "examples" / "tiny-lora.yaml"
DOC = REPO / "docs" / "validation" / "throughput.md"
MARK = "calibrate-vs-train"
STEPS = 20


def one_round(scratch: Path, env: dict[str, str]) -> tuple[float, float]:
    """(calibrated, trained) real tokens per second."""
    calibration = scratch / "calibration.json"
    output = scratch / "run"
    wait_for_quiet()
    subprocess.run([str(TUNECAST), "calibrate", str(CONFIG), "--steps", str(STEPS), "-o", str(calibration)],
                   env=env, check=True, capture_output=True, text=True, timeout=900)
    calibrated = json.loads(calibration.read_text())["measured"]["tokens_per_second"]
    wait_for_quiet()
    trained = subprocess.run([str(TUNECAST), "train", str(CONFIG), "--output", str(output), "--fresh", "--json"],
                             env=env, check=True, capture_output=True, text=True, timeout=1800)
    return calibrated, json.loads(trained.stdout)["tokens_per_second"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="record the table in docs/validation/throughput.md")
    args = parser.parse_args()
    lines = ["| round | calibrate (20 steps) tok/s | train (whole run) tok/s | calibrate ÷ train |",
             "|---|---:|---:|---:|"]
    ratios = []
    with tempfile.TemporaryDirectory(prefix="tunecast-calibrate-vs-train-") as name:
        scratch = Path(name)
        env = {**os.environ, "TUNECAST_CATALOG": str(scratch / "catalog"), "TOKENIZERS_PARALLELISM": "false"}
        for index in range(args.rounds):
            calibrated, trained = one_round(scratch, env)
            ratios.append(calibrated / trained)
            lines.append(f"| {index + 1} | {calibrated:,.0f} | {trained:,.0f} | {calibrated / trained:.3f} |")
            print(lines[-1], file=sys.stderr)
    median = statistics.median(ratios)
    lines += ["", f"Median ratio over {len(ratios)} rounds: **{median:.3f}** ({median - 1:+.1%})."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(DOC, MARK, f"`tunecast calibrate examples/tiny-lora.yaml --steps {STEPS}` against the full "
                      "`tunecast train` of the same config, one after the other on this 2-core CPU. Reproduce with "
                      "`.venv/bin/python benchmarks/calibrate_vs_train.py --write`.\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
