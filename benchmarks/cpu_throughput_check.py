"""The throughput model on this CPU: `tunecast plan --gpu local` (after `tunecast probe`) against what `tunecast
train` then measures, for full, LoRA and QLoRA runs of real architectures at micro-batches 1–8 and lengths
128–1024, padded and packed.

What runs. The device is probed once (`tunecast probe`, into a scratch catalog). Each case is a published
model config from the bundled catalog with random weights — shrunk to a few layers where the whole model
would take minutes a step on two cores (every layer is alike, so a shallower model keeps each layer's shapes,
its head and its vocabulary) — trained by `tunecast train` for WARMUP + MEASURED steps on generated text
tokenized by the demo tokenizer (examples/tiny-model, 1,024 tokens). Padded cases draw example lengths
evenly between a sixteenth of the sequence length and all of it; packed cases pack them. The dataset holds
exactly the examples the run trains on, so the steps measured see the padding the plan averages over.

Measured: real (non-padding) tokens ÷ the seconds of the steps after the warm-up, from metrics.jsonl.
Predicted: `tunecast plan RUN --gpu local --json`'s tokens/s, with the run's micro-batch and checkpointing
fixed. Runs go one at a time, after waiting for the machine to be quiet: two processes sharing two cores
slow each other several-fold.

Run:  .venv/bin/python benchmarks/cpu_throughput_check.py            (about 30 minutes on 2 cores)
      .venv/bin/python benchmarks/cpu_throughput_check.py --quick    (three cases)
      .venv/bin/python benchmarks/cpu_throughput_check.py --tiny     (the shipped demo and 8 variations, 5 minutes)
      --only LABEL[,LABEL] picks cases; --write records the table in docs/validation/throughput.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
TUNECAST = Path(sys.executable).parent / "tunecast"
TOKENIZER = REPO / "examples" / "tiny-model"
DOC = REPO / "docs" / "validation" / "throughput.md"
MARK = "cpu-throughput"
WARMUP = 3
MEASURED = 6
ENV = {"MKL_DYNAMIC": "FALSE", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
WORDS = ["alpha", "river", "stone", "quiet", "number", "garden", "silver", "window", "planet", "morning",
         "yellow", "market", "forest", "engine", "bridge", "letter", "shadow", "circle", "winter", "object"]
LORA = {"rank": 16, "alpha": 32, "dropout": 0.05, "targets": "all-linear"}


@dataclass(frozen=True)
class Case:
    label: str
    model: str
    layers: int | None  # shrunk to this many layers; None keeps the published depth
    settings: dict[str, Any]


CASES = [
    Case("gpt2-lora-mb1-128-padded", "openai-community/gpt2", None,
         {"method": "lora", "lora": LORA, "micro_batch": 1, "seq_len": 128, "packing": False}),
    Case("gpt2-full-mb4-256-packed", "openai-community/gpt2", 6,
         {"method": "full", "micro_batch": 4, "seq_len": 256, "packing": True}),
    Case("gpt2-lora-mb8-512-padded", "openai-community/gpt2", 4,
         {"method": "lora", "lora": LORA, "micro_batch": 8, "seq_len": 512, "packing": False}),
    Case("qwen2.5-0.5b-lora-mb2-512-padded", "Qwen/Qwen2.5-0.5B", 4,
         {"method": "lora", "lora": LORA, "micro_batch": 2, "seq_len": 512, "packing": False}),
    Case("qwen2.5-0.5b-full-mb1-1024-packed", "Qwen/Qwen2.5-0.5B", 2,
         {"method": "full", "micro_batch": 1, "seq_len": 1024, "packing": True}),
    Case("qwen3-0.6b-qlora-mb2-256-padded", "Qwen/Qwen3-0.6B", 4,
         {"method": "qlora", "lora": LORA, "micro_batch": 2, "seq_len": 256, "packing": False}),
    Case("llama-3.2-1b-lora-mb4-256-packed", "meta-llama/Llama-3.2-1B", 2,
         {"method": "lora", "lora": LORA, "micro_batch": 4, "seq_len": 256, "packing": True}),
    Case("llama-3.2-1b-full-mb2-128-padded", "meta-llama/Llama-3.2-1B", 2,
         {"method": "full", "micro_batch": 2, "seq_len": 128, "packing": False}),
    Case("tinyllama-qlora-mb1-512-packed", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 2,
         {"method": "qlora", "lora": LORA, "micro_batch": 1, "seq_len": 512, "packing": True}),
    Case("qwen3-0.6b-lora-mb8-256-packed", "Qwen/Qwen3-0.6B", 2,
         {"method": "lora", "lora": LORA, "micro_batch": 8, "seq_len": 256, "packing": True}),
]
QUICK = ("gpt2-lora-mb1-128-padded", "qwen2.5-0.5b-lora-mb2-512-padded", "llama-3.2-1b-full-mb2-128-padded")
# The shipped demo (examples/tiny-lora.yaml: a 4-layer, 128-wide Llama, LoRA, micro-batch 4 × 2, its 40 sample
# examples) and its variations, as a new user tries them: every operation of its step is small, so its time is the
# operations' own cost, not their arithmetic (issue 29). Each is `tunecast train` of the example with `--set`s.
TINY_EXAMPLE = REPO / "examples" / "tiny-lora.yaml"
TINY_CASES: dict[str, tuple[str, ...]] = {
    "tiny-lora": (),
    "tiny-full": ("method=full",),
    "tiny-lora-packed": ("packing=true",),
    "tiny-full-packed": ("method=full", "packing=true"),
    "tiny-lora-mb2": ("micro_batch=2", "grad_accum=4"),
    "tiny-lora-mb8": ("micro_batch=8", "grad_accum=1"),
    "tiny-full-mb8": ("method=full", "micro_batch=8", "grad_accum=1"),
    "tiny-lora-seq128": ("seq_len=128",),
    "tiny-lora-mb8-seq128-packed": ("micro_batch=8", "grad_accum=1", "seq_len=128", "packing=true"),
}
TINY_DOC = REPO / "docs" / "calibrate.md"
TINY_MARK = "tiny-throughput"


def shrunk_config(name: str, layers: int | None, folder: Path) -> Path:
    from tunecast.catalog.store import load_catalog

    entry = load_catalog(None).models.find(name)
    assert entry is not None, name
    config = json.loads(entry.path.read_text())
    if layers is not None:
        key = "n_layer" if "n_layer" in config else "num_hidden_layers"
        config[key] = layers
        for listed in ("layer_types",):  # per-layer lists follow the depth
            if isinstance(config.get(listed), list):
                config[listed] = config[listed][:layers]
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def make_data(path: Path, examples: int, seq_len: int, seed: int) -> None:
    """Text of lengths spread evenly from seq_len/16 to seq_len tokens (about one token a word here)."""
    chooser = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(examples):
            words = chooser.randint(max(2, seq_len // 16), seq_len)
            handle.write(json.dumps({"text": " ".join(chooser.choice(WORDS) for _ in range(words))}) + "\n")


def _busy_share(seconds: float = 1.0) -> float:
    """The share of all cores' time spent busy over the next `seconds` (/proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # all, idle + iowait
    total, idle = sample()
    time.sleep(seconds)
    total_after, idle_after = sample()
    return 1.0 - (idle_after - idle) / max(1, total_after - total)


def wait_for_quiet(limit_s: float = 60.0) -> None:
    """Until the other processes leave the cores idle (under 10% busy for three seconds in a row), at most
    `limit_s`; says so on stderr when the machine stays busy, since every figure measured then is too slow."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    busy = 1.0
    while time.monotonic() < deadline and quiet < 3:
        busy = _busy_share()
        quiet = quiet + 1 if busy < 0.10 else 0
    if quiet < 3:
        print(f"warning: the cores are still {busy:.0%} busy after {limit_s:.0f} s; measuring anyway "
              "(stop the other processes for figures that mean something)", file=sys.stderr)


# Memory a virtual machine's guest has never used since it booted faults in through the hypervisor: measured
# on this VM on 2026-12-01, 20 minutes after boot, at 0.45 GiB/s, against 2.3–3.6 GiB/s once the guest had touched
# it. A run whose resident memory reaches past what the guest has used (the large-vocabulary cases) then pays
# that on every fresh page it allocates, and runs up to twice as slowly as the same run an hour later. So the
# benchmark first touches most of the free memory once, as a machine that has been up a while has.
TOUCH_SHARE = 0.8


def touch_free_memory() -> float:
    """Write to TOUCH_SHARE of the available memory once, in a process of its own; returns the seconds taken."""
    with open("/proc/meminfo") as handle:
        available_kib = next(int(line.split()[1]) for line in handle if line.startswith("MemAvailable:"))
    chunks = int(available_kib * TOUCH_SHARE) // (1 << 20)  # GiB
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch\n"
                    f"kept = [torch.ones(1 << 28) for _ in range({chunks})]"], check=True, timeout=900)
    return time.monotonic() - started


def qlora_precision(scratch: Path) -> str:
    """QLoRA computes in bf16 where the probe found bf16 matmuls at least a quarter as fast as fp32 ones, else in
    fp32: a CPU without native bf16 (the AMD EPYC VM of 2026-12-01) runs bf16 products through a fallback
    50–400× slower than fp32, and one step of a 4-layer model took 12 minutes."""
    with (scratch / "catalog" / "device_measurements.csv").open() as handle:
        rows = [row for row in csv.DictReader(handle) if row["quantity"] == "matmul"]
    best = {dtype: max(float(r["value"]) for r in rows if r["dtype"] == dtype) for dtype in ("fp32", "bf16")}
    return "bf16" if best["bf16"] >= best["fp32"] / 4 else "fp32"


def run_case(case: Case, scratch: Path, env: dict[str, str], reuse: bool = False) -> dict[str, Any]:
    folder = scratch / case.label
    metrics = folder / "out" / "metrics.jsonl"
    if reuse and metrics.is_file():  # a kept run: predict again, measure nothing
        return _compare(case, folder, env, started=None)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    model = shrunk_config(case.model, case.layers, folder)
    steps = WARMUP + MEASURED
    micro_batch = case.settings["micro_batch"]
    data = folder / "data.jsonl"
    examples = steps * micro_batch * (1 if not case.settings["packing"] else 3)
    make_data(data, examples, case.settings["seq_len"], seed=len(case.label))
    precision = "fp32" if case.settings["method"] != "qlora" else qlora_precision(scratch)
    run = {"model": str(model), "random_weights": True, **case.settings, "precision": precision, "optimizer": "adamw",
           "grad_accum": 1,
           "grad_checkpointing": False, "max_steps": steps,
           "dataset": {"path": str(data), "tokenizer": str(TOKENIZER)}, "eval": {"examples": 0},
           "checkpoint": {"every_steps": 100_000}, "output": str(folder / "out")}
    config = folder / "run.yaml"
    config.write_text(json.dumps(run))
    wait_for_quiet()
    started = time.monotonic()
    trained = subprocess.run([str(TUNECAST), "train", str(config), "--no-memory-check"], env=env,
                             capture_output=True, text=True, timeout=1800)
    if trained.returncode != 0:
        return {"label": case.label, "error": trained.stderr.strip().splitlines()[-1]}
    return _compare(case, folder, env, started)


def _compare(case: Case, folder: Path, env: dict[str, str], started: float | None) -> dict[str, Any]:
    """The plan's tokens/s for the case's run against what its metrics measured."""
    config = folder / "run.yaml"
    planned = subprocess.run([str(TUNECAST), "plan", str(config), "--gpu", "local", "--json"], env=env,
                             capture_output=True, text=True, timeout=900)
    if planned.returncode != 0:
        return {"label": case.label, "error": planned.stderr.strip().splitlines()[-1]}
    option = json.loads(planned.stdout)["options"][0]
    records = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if r["kind"] == "train"][WARMUP:]
    seconds = sum(r["step_seconds"] for r in steps_done)
    measured = sum(r["tokens"] for r in steps_done) / seconds
    return {"label": case.label, "model": case.model, "layers": case.layers, **case.settings,
            "precision": json.loads(config.read_text())["precision"],
            "measured": measured, "predicted": option["tokens_per_second"],
            "padding": sum(r["padded_tokens"] for r in steps_done) / sum(r["tokens"] for r in steps_done),
            "optimizer_share": sum(r.get("optimizer_seconds", 0.0) for r in steps_done) / seconds,
            "wall_s": time.monotonic() - started if started is not None else None}


def run_tiny(label: str, scratch: Path, env: dict[str, str]) -> dict[str, Any]:
    """The demo example with the case's `--set`s: `tunecast train` it, then `tunecast plan --gpu local` it. The
    measured speed is the run's real tokens over its steps' seconds, as `tunecast train` reports it at the end, less
    the warm-up steps calibrate's own rule leaves out (train/steady.py): a packed epoch of the demo is one full
    step and one short one, and only the run's whole time says what both cost together. The median step's speed and
    its 95% interval are shown beside it."""
    from tunecast.plan.calibrate import measurement

    sets = [item for value in TINY_CASES[label] for item in ("--set", value)]
    output = scratch / label
    if output.exists():
        shutil.rmtree(output)
    wait_for_quiet()
    trained = subprocess.run([str(TUNECAST), "train", str(TINY_EXAMPLE), *sets, "--output", str(output)], env=env,
                             capture_output=True, text=True, timeout=1800)
    if trained.returncode != 0:
        return {"label": label, "error": trained.stderr.strip().splitlines()[-1]}
    planned = subprocess.run([str(TUNECAST), "plan", str(TINY_EXAMPLE), *sets, "--gpu", "local", "--json"], env=env,
                             capture_output=True, text=True, timeout=900)
    if planned.returncode != 0:
        return {"label": label, "error": planned.stderr.strip().splitlines()[-1]}
    option = json.loads(planned.stdout)["options"][0]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steady = measurement([r for r in records if r["kind"] == "train"])
    return {"label": label, "settings": ", ".join(TINY_CASES[label]) or "as shipped",
            "measured": steady["mean_tokens_per_second"], "median": steady["tokens_per_second"],
            "relative_ci": steady["relative_ci"],
            "whole": sum(r["tokens"] for r in records if r["kind"] == "train")
            / sum(r["step_seconds"] for r in records if r["kind"] == "train"),
            "predicted": option["tokens_per_second"], "micro_batch": option["micro_batch"],
            "grad_accum": option["grad_accum"]}


def tiny_table(results: list[dict[str, Any]], device: str) -> str:
    lines = [f"Device: {device}.", "",
             "| case | `--set` | micro-batch × accumulation | train tok/s, all steps | train tok/s after warm-up "
             "| median step (±95% CI) | predicted tok/s | error |", "|---|---|---|---:|---:|---:|---:|---:|"]
    errors = []
    for r in results:
        if "error" in r:
            lines.append(f"| `{r['label']}` | — | — | failed: {r['error']} | | | | | |")
            continue
        error = r["predicted"] / r["measured"] - 1
        errors.append(error)
        lines.append(f"| `{r['label']}` | {r['settings']} | {r['micro_batch']} × {r['grad_accum']} | "
                     f"{r['whole']:,.0f} | {r['measured']:,.0f} | {r['median']:,.0f} (±{r['relative_ci']:.0%}) | "
                     f"{r['predicted']:,.0f} | {error:+.0%} |")
    if errors:
        lines += ["", f"Within ±25%: **{sum(abs(e) <= 0.25 for e in errors)} of {len(errors)}**; median absolute "
                  f"error {statistics.median(abs(e) for e in errors):.0%} (largest {max(abs(e) for e in errors):.0%}; "
                  f"median signed {statistics.median(errors):+.0%})."]
    return "\n".join(lines)


def table(results: list[dict[str, Any]], device: str) -> str:
    lines = [f"Device: {device}.", "",
             "| case | model (layers) | method, precision | micro-batch × length | data | measured tok/s "
             "| predicted tok/s | error |", "|---|---|---|---|---|---:|---:|---:|"]
    errors = []
    for r in results:
        if "error" in r:
            lines.append(f"| `{r['label']}` | — | — | — | — | failed: {r['error']} | | |")
            continue
        error = r["predicted"] / r["measured"] - 1
        errors.append(error)
        layers = f" ({r['layers']})" if r["layers"] else ""
        lines.append(f"| `{r['label']}` | {r['model'].split('/')[-1]}{layers} | {r['method']} {r['precision']} | "
                     f"{r['micro_batch']} × {r['seq_len']} | {'packed' if r['packing'] else 'padded'} "
                     f"(×{r['padding']:.2f}) | {r['measured']:,.0f} | {r['predicted']:,.0f} | {error:+.0%} |")
    if errors:
        median = statistics.median(abs(e) for e in errors)
        lines += ["", f"Median absolute error over {len(errors)} runs: **{median:.0%}**"
                  f" (largest {max(abs(e) for e in errors):.0%}; median signed {statistics.median(errors):+.0%})."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three cases")
    parser.add_argument("--tiny", action="store_true",
                        help="the shipped demo example and its variations instead (table in docs/calibrate.md)")
    parser.add_argument("--threads", type=int,
                        help="torch's threads for the probe and every run (OMP_NUM_THREADS); default: torch's own")
    parser.add_argument("--only", help="comma-separated case labels")
    parser.add_argument("--write", action="store_true", help="record the table in docs/validation/throughput.md")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (runs, metrics, the probe)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --keep: predict again for the runs already there, without training them again "
                             "(and with the probe there, if any): to check a change of the model")
    args = parser.parse_args()
    chosen = [c for c in CASES if (not args.quick or c.label in QUICK)
              and (not args.only or c.label in args.only.split(","))]
    with tempfile.TemporaryDirectory(prefix="tunecast-cpu-throughput-") as scratch_name:
        scratch = Path(scratch_name) if args.keep is None else args.keep
        scratch.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **ENV, "TUNECAST_CATALOG": str(scratch / "catalog"),
               "TUNECAST_CACHE": os.environ.get("TUNECAST_CACHE", str(scratch / "cache"))}
        if args.threads:
            env.update({"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
        if args.tiny:  # the demo as a new user runs it: MKL choosing its threads by the size of each product
            env.pop("MKL_DYNAMIC", None)
        reuse = args.reuse and args.keep is not None
        if not reuse and not args.tiny:  # the demo's runs stay within memory the machine has used already
            print(f"touched the free memory once in {touch_free_memory():.0f} s", file=sys.stderr)
        if reuse and (scratch / "catalog" / "devices.csv").is_file():
            with (scratch / "catalog" / "devices.csv").open() as handle:
                device = next(csv.DictReader(handle))["name"]
        else:
            wait_for_quiet()
            probed = subprocess.run([str(TUNECAST), "probe", "--json"], env=env, capture_output=True, text=True,
                                    timeout=300, check=True)
            device = json.loads(probed.stdout)["device"]["name"]
        print(f"probed {device}", file=sys.stderr)
        if args.tiny:
            tiny = [run_tiny(label, scratch, env) for label in TINY_CASES
                    if not args.only or label in args.only.split(",")]
            threads = f", {args.threads} thread(s)" if args.threads else ""
            text = tiny_table(tiny, device + threads)
            print(text)
            if args.write:
                flags = f" --threads {args.threads}" if args.threads else ""
                how = f"Reproduce with `.venv/bin/python benchmarks/cpu_throughput_check.py --tiny{flags} --write`."
                write_section(TINY_DOC, TINY_MARK, how + "\n\n" + text)
            return 0
        results = []
        for case in chosen:
            result = run_case(case, scratch, env, reuse)
            results.append(result)
            shown = (f"{result['measured']:,.0f} measured, {result['predicted']:,.0f} predicted "
                     f"({result['predicted'] / result['measured'] - 1:+.0%})" if "error" not in result
                     else result["error"])
            print(f"{case.label}: {shown}", file=sys.stderr)
    text = table(results, device)
    print(text)
    if args.write:
        how = ("Reproduce with `.venv/bin/python benchmarks/cpu_throughput_check.py --write`."
               + (" This table's runs were trained earlier the same day and predicted again with the final model and "
                  "a fresh probe (`--keep DIR --reuse`)." if args.reuse else ""))
        write_section(DOC, MARK, how + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
