"""`tunecast data` on a 1 GB JSONL file: peak resident memory and rows per second.

Generates a 1 GB alpaca-style JSONL file (deterministic), runs `tunecast data` on it in a fresh process,
and reads the process's peak resident set size (ru_maxrss of the child). Target: under 1 GiB. Also times
exact counting with a real tokenizer (a BPE trained here) on a 20 MB slice, since a tokenizer is slower than
the estimate.

Run:  .venv/bin/python benchmarks/data_streaming.py [--gb 1.0]
Writes docs/benchmarks/data-streaming.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "data-streaming.md"
SENTENCE = ("the model learns a small adapter for each layer while the base weights stay frozen and the "
            "optimizer keeps two states per trainable value so memory grows with what is trained")
WORDS = SENTENCE.split(" ")


def generate(path: Path, target_bytes: int) -> int:
    rng = random.Random(7)
    rows = 0
    with path.open("w") as handle:
        while handle.tell() < target_bytes:
            words = [rng.choice(WORDS) for _ in range(rng.randint(40, 400))]
            record = {"instruction": " ".join(words[:20]), "input": "", "output": " ".join(words[20:])}
            handle.write(json.dumps(record) + "\n")
            rows += 1
    return rows


# Runs the CLI, then reports the process's own peak resident set size on stderr.
PROBE = ("import resource, sys\nfrom tunecast.cli import main\ntry:\n    main(sys.argv[1:])\n"
         "except SystemExit as done:\n    code = done.code\n"
         "sys.stderr.write('\\nPEAK_RSS_KIB=%d\\n' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
         "sys.exit(code)\n")


def run(args: list[str]) -> tuple[float, int, dict]:
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", PROBE, *args, "--json"], capture_output=True, text=True,
                               check=False)
    elapsed = time.perf_counter() - start
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr[-2000:])
    peak = int(completed.stderr.rsplit("PEAK_RSS_KIB=", 1)[1].split()[0]) * 1024
    return elapsed, peak, json.loads(completed.stdout)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        big = Path(folder) / "big.jsonl"
        rows = generate(big, int(options.gb * 1e9))
        size = big.stat().st_size
        elapsed, peak, document = run(["data", str(big), "--seq-len", "2048"])
        assert document["examples"] == rows
        print(f"{size / 1e9:.2f} GB, {rows:,} rows: {elapsed:.1f} s ({rows / elapsed:,.0f} rows/s), "
              f"peak RSS {peak / 2**30:.3f} GiB", flush=True)

        sys.path.insert(0, str(REPO))
        from tests.unit.data.test_tokens import train_bpe  # the same BPE the tests train

        tokenizer = train_bpe()
        tokenizer.save(str(Path(folder) / "tokenizer.json"))
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
        small = Path(folder) / "slice.jsonl"
        with big.open() as source, small.open("w") as target:
            while target.tell() < 20e6:
                target.write(source.readline())
        slice_rows = sum(1 for _ in small.open())
        exact_elapsed, exact_peak, _ = run(["data", str(small), "--tokenizer", str(Path(folder) / "tokenizer.json")])
        print(f"tokenizer on {slice_rows:,} rows: {exact_elapsed:.1f} s ({slice_rows / exact_elapsed:,.0f} rows/s)",
              flush=True)

    lines = [
        "# Dataset statistics on a large file",
        "",
        f"Measured with `.venv/bin/python benchmarks/data_streaming.py` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. Peak memory is the "
        "`tunecast data` process's peak resident set size (ru_maxrss), imports included.",
        "",
        "| file | rows | counted by | time | rows/s | peak RSS |",
        "|---|---:|---|---:|---:|---:|",
        f"| {size / 1e9:.2f} GB alpaca JSONL | {rows:,} | estimate (characters per token) | {elapsed:.1f} s | "
        f"{rows / elapsed:,.0f} | {peak / 2**30:.3f} GiB |",
        f"| 20 MB slice of it | {slice_rows:,} | a BPE tokenizer (tokenizers) | {exact_elapsed:.1f} s | "
        f"{slice_rows / exact_elapsed:,.0f} | {exact_peak / 2**30:.3f} GiB |",
        "",
        "Memory stays flat with file size: rows are streamed, and only two 4-byte lengths per example are kept "
        "(for percentiles, padding and packing). Target: under 1 GiB for the 1 GB file.",
    ]
    write_section(DOC, "data-streaming", "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
