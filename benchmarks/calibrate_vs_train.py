"""`tunecast calibrate` against the run it stands for: what one calibration says the whole `tunecast train` of the
same config will do, next to what that train then does — try by try, since a user makes one try.

The config is the training demo (examples/tiny-lora.yaml: LoRA on a 4-layer Llama, 40 steps on the CPU). Each
try is independent: a fresh user catalog and an empty cache, `tunecast calibrate CONFIG` with its defaults (it
measures until its speed is steady or its time budget runs out), then `tunecast train CONFIG` to the end into a
scratch output, each in a fresh process, one after the other, each after waiting for the cores to be idle.

Compared, per try:

* tokens/s: calibrate's projection of the whole run (`whole_run.tokens_per_second`: the run's real tokens over
  its steps' seconds, warm-up included) against train's own figure (its `--json` summary: the same quantity);
* training time: calibrate's `whole_run` hours (steps, evaluations, checkpoints) against the run's step seconds
  and evaluation seconds (metrics.jsonl) and checkpoint writes (train's log);
* the steady speed: calibrate's median tokens/s against the median of train's own steps after the same warm-up
  rule (train/steady.py), both with their 95% intervals: the same rule applied to both;
* the noise floor: the same `tunecast train` run once more, and its tokens/s against the first's.

Run:  .venv/bin/python benchmarks/calibrate_vs_train.py [--tries N] [--write]      (about 1.5 min a try)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu_throughput_check import wait_for_quiet
from docsection import write_section

from tunecast.plan.calibrate import measurement

REPO = Path(__file__).resolve().parent.parent
TUNECAST = Path(sys.executable).parent / "tunecast"
CONFIG = REPO / "examples" / "tiny-lora.yaml"
DOC = REPO / "docs" / "validation" / "throughput.md"
MARK = "calibrate-vs-train"
TOLERANCE = 0.10
CHECKPOINT_LINE = re.compile(r"checkpoint at step \d+ \(.*?, [\d.]+ MiB in ([\d.]+) s\)")


def train_figures(output: Path, log: str) -> dict[str, Any]:
    """What the train run measured: its steps' and evaluations' seconds (metrics.jsonl), its checkpoint writes
    (its log), and the steady speed of its steps by calibrate's own rule."""
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    steps_s = sum(r["step_seconds"] for r in steps)
    eval_s = sum(r["seconds"] for r in records if r["kind"] == "eval")
    checkpoint_s = sum(float(seconds) for seconds in CHECKPOINT_LINE.findall(log))
    steady = measurement(steps)
    return {"tokens_per_second": sum(r["tokens"] for r in steps) / steps_s, "steps": len(steps),
            "hours": (steps_s + eval_s + checkpoint_s) / 3600, "median": steady["tokens_per_second"],
            "relative_ci": steady["relative_ci"]}


def one_try(scratch: Path) -> dict[str, Any]:
    """A fresh catalog and cache, `tunecast calibrate`, then `tunecast train`."""
    env = {**os.environ, "TUNECAST_CATALOG": str(scratch / "catalog"), "TUNECAST_CACHE": str(scratch / "cache"),
           "TOKENIZERS_PARALLELISM": "false"}
    calibration = scratch / "calibration.json"
    output = scratch / "run"
    wait_for_quiet()
    started = time.monotonic()
    subprocess.run([str(TUNECAST), "calibrate", str(CONFIG), "-o", str(calibration)],
                   env=env, check=True, capture_output=True, text=True, timeout=900)
    calibrate_s = time.monotonic() - started
    document = json.loads(calibration.read_text())
    wait_for_quiet()
    trained = subprocess.run([str(TUNECAST), "train", str(CONFIG), "--output", str(output), "--fresh", "--json"],
                             env=env, check=True, capture_output=True, text=True, timeout=1800)
    summary = json.loads(trained.stdout)
    figures = train_figures(output, trained.stderr)
    assert abs(figures["tokens_per_second"] / summary["tokens_per_second"] - 1) < 1e-3, "train's own figure"
    # the same train once more: how far two runs of one command land apart on this machine (the noise floor that
    # no calibration can beat)
    wait_for_quiet()
    again = subprocess.run([str(TUNECAST), "train", str(CONFIG), "--output", str(scratch / "again"), "--fresh",
                            "--json"], env=env, check=True, capture_output=True, text=True, timeout=1800)
    measured, whole = document["measured"], document["whole_run"]
    return {"calibrate_s": calibrate_s, "measured": measured, "whole": whole, "train": figures,
            "again": json.loads(again.stdout)["tokens_per_second"]}


def table(tries: list[dict[str, Any]]) -> str:
    lines = ["| try | calibrate: steps, stop, ±CI | calibrate: whole run tok/s | train tok/s | ratio "
             "| calibrate: whole run time | train time | ratio | calibrate median tok/s | train median tok/s "
             "| the same train again tok/s | again ÷ train |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for index, one in enumerate(tries, start=1):
        measured, whole, train = one["measured"], one["whole"], one["train"]
        speed = whole["tokens_per_second"] / train["tokens_per_second"]
        hours = whole["hours"] / train["hours"]
        stop = "steady" if measured["stable"] else "not steady"
        lines.append(
            f"| {index} | {measured['steps_measured']} (+{measured['warmup_steps_excluded']} warm-up), {stop}, "
            f"±{measured['relative_ci']:.1%} | {whole['tokens_per_second']:,.0f} | {train['tokens_per_second']:,.0f} "
            f"| {speed:.3f} | {whole['hours'] * 3600:.1f} s | {train['hours'] * 3600:.1f} s | {hours:.3f} "
            f"| {measured['tokens_per_second']:,.0f} | {train['median']:,.0f} (±{train['relative_ci']:.1%}) "
            f"| {one['again']:,.0f} | {one['again'] / train['tokens_per_second']:.3f} |")
    speeds = [one["whole"]["tokens_per_second"] / one["train"]["tokens_per_second"] for one in tries]
    times = [one["whole"]["hours"] / one["train"]["hours"] for one in tries]
    within = sum(abs(s - 1) <= TOLERANCE for s in speeds)
    agains = [one["again"] / one["train"]["tokens_per_second"] for one in tries]
    lines += ["", f"Tokens/s: **{within} of {len(tries)} tries within ±{TOLERANCE:.0%}** (ratios "
              f"{min(speeds):.3f}–{max(speeds):.3f}, median {statistics.median(speeds):.3f}); training time: "
              f"{sum(abs(t - 1) <= TOLERANCE for t in times)} of {len(tries)} within ±{TOLERANCE:.0%} (ratios "
              f"{min(times):.3f}–{max(times):.3f}). Calibrate took {min(o['calibrate_s'] for o in tries):.0f}–"
              f"{max(o['calibrate_s'] for o in tries):.0f} s a try, the device probe included.",
              "", f"The same train run twice: {sum(abs(a - 1) <= TOLERANCE for a in agains)} of {len(tries)} pairs "
              f"within ±{TOLERANCE:.0%} of each other (ratios {min(agains):.3f}–{max(agains):.3f}): the machine's own "
              "noise between two runs of one command, which bounds how close any calibration can come."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="record the table in docs/validation/throughput.md")
    args = parser.parse_args()
    tries = []
    for index in range(args.tries):
        with tempfile.TemporaryDirectory(prefix="tunecast-calibrate-vs-train-") as name:
            tries.append(one_try(Path(name)))
        one = tries[-1]
        print(f"try {index + 1}: calibrate {one['whole']['tokens_per_second']:,.0f} tok/s "
              f"({'steady' if one['measured']['stable'] else 'not steady'}), train "
              f"{one['train']['tokens_per_second']:,.0f} tok/s", file=sys.stderr)
    text = table(tries)
    print(text)
    if args.write:
        write_section(DOC, MARK, "`tunecast calibrate examples/tiny-lora.yaml` (its defaults), then the whole "
                      "`tunecast train` of the same config, in fresh processes with an empty cache and catalog each "
                      "try, on this 2-core CPU. Reproduce with `.venv/bin/python benchmarks/calibrate_vs_train.py "
                      "--write`.\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
