"""Same answers before and after a change: estimate and plan documents of varied cases, byte for byte.

A change that should not change behaviour (moving modules, lazier imports) is checked here: every case runs as a
fresh `python -m tunecast … --json` process with its own empty cache and user catalog (so each estimate is made
from the shipped step templates, or traced, as a new user's first would be), once with the source of `--before`
(a git revision, unpacked with `git archive`) and once with this checkout's, and their stdout and exit status
are compared. Writes docs/benchmarks/estimate-bytecheck.md with `--write`.

    .venv/bin/python benchmarks/estimate_bytecheck.py --before cb12633 --write
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from docsection import write_section

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks" / "estimate-bytecheck.md"
LLAMA = "--model meta-llama/Llama-3.1-8B --method lora --micro-batch 1 --seq-len 2048"
# Models of every family the catalog ships, the three methods, GPUs (limits and suggestions), precisions,
# optimizers, attention, runners (their step variants and defaults), LoRA settings, several GPUs, MoE; errors too.
MEMORY = [
    LLAMA,
    "--model meta-llama/Llama-3.1-8B --method qlora --micro-batch 2 --seq-len 1024 --gpu 4090",
    "--model meta-llama/Llama-3.1-8B --method full --micro-batch 1 --seq-len 512 --gpu h100-sxm",
    "--model Qwen/Qwen3-0.6B --method full --micro-batch 4 --seq-len 1024 --gpu l4",
    "--model Qwen/Qwen3-0.6B --method lora --micro-batch 8 --seq-len 256",
    "--model Qwen/Qwen2.5-7B --method lora --micro-batch 2 --seq-len 4096 --gpu a100-80gb",
    "--model Qwen/Qwen2.5-7B --method qlora --micro-batch 1 --seq-len 2048",
    "--model mistralai/Mistral-7B-v0.1 --method lora --micro-batch 4 --seq-len 1024",
    "--model google/gemma-2-2b --method lora --micro-batch 2 --seq-len 2048",
    "--model microsoft/phi-1_5 --method lora --micro-batch 1 --seq-len 1024",
    "--model gpt2 --method full --micro-batch 8 --seq-len 512",
    "--model meta-llama/Llama-3.2-1B --method full --micro-batch 4 --seq-len 2048 --gpu 4090",
    "--model meta-llama/Llama-3.2-1B --method lora --micro-batch 16 --seq-len 512 --set lora.targets=q_proj,v_proj",
    f"{LLAMA} --set precision=fp32",
    f"{LLAMA} --set grad_checkpointing=true",
    f"{LLAMA} --set attention=eager",
    f"{LLAMA} --set optimizer=adamw-8bit",
    f"{LLAMA} --runner hf-trainer",
    "--model meta-llama/Llama-3.1-8B --method qlora --micro-batch 1 --seq-len 2048 --runner trl",
    "--model Qwen/Qwen3-0.6B --method lora --micro-batch 4 --seq-len 512 --runner axolotl",
    "--model Qwen/Qwen3-0.6B --method lora --micro-batch 2 --seq-len 1024 --runner torchtune",
    "--model meta-llama/Llama-3.1-70B --method qlora --micro-batch 1 --seq-len 2048 --gpu h100-sxm",
    "--model mistralai/Mixtral-8x7B-v0.1 --method qlora --micro-batch 1 --seq-len 1024",
    "--model meta-llama/Llama-3.1-8B --method lora --micro-batch 2 --seq-len 2048 --set lora.rank=64",
    "--model Qwen/Qwen2.5-0.5B --method full --micro-batch 2 --seq-len 1024 --set optimizer=sgd",
    f"{LLAMA} --gpus 2 --set gpus.strategy=fsdp",
    "--model microsoft/phi-2 --method lora",  # not in the catalog: the error document
    f"{LLAMA} --set lora.rank=0",  # a bad value: the error document
]
PLAN = [
    "examples/llama-3.1-8b-lora.yaml",
    "examples/tiny-lora.yaml",
    "examples/llama-3.1-8b-lora.yaml --gpu a100-80gb",
]
CASES = [["memory", *args.split(), "--json"] for args in MEMORY] + [["plan", *args.split(), "--json"] for args in PLAN]


def unpack(revision: str, into: Path) -> Path:
    """The package source of `revision` (src/tunecast, templates and catalog data included) under `into`."""
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "src/tunecast"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run(case: list[str], source: Path) -> tuple[int, bytes, float]:
    """Exit status, stdout and seconds of one case in a fresh process importing tunecast from `source`."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as catalog:
        # TUNECAST_WARM=0: revisions that had a background server must not start one
        env = {**os.environ, "PYTHONPATH": str(source), "TUNECAST_CACHE": cache, "TUNECAST_CATALOG": catalog,
               "TUNECAST_WARM": "0", "HF_HUB_OFFLINE": "1"}  # the same answers whether or not the Hub is reachable
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "tunecast", *case], cwd=ROOT, env=env, capture_output=True,
                              check=False, timeout=1800)
        return done.returncode, done.stdout, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare this checkout with")
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    args = parser.parse_args()
    before_rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    rows, same = [], 0
    with tempfile.TemporaryDirectory() as scratch:
        before_src = unpack(args.before, Path(scratch))
        for index, case in enumerate(CASES, 1):
            old, new = run(case, before_src), run(case, ROOT / "src")
            equal = old[:2] == new[:2]
            same += equal
            digest = hashlib.sha256(new[1]).hexdigest()[:12]
            line = (f"| {index} | `tunecast {' '.join(case)}` | {new[0]} | {len(new[1]):,} | {digest} | "
                    f"{'identical' if equal else f'**differs** (exit {old[0]} → {new[0]})'} |")
            rows.append(line)
            print(line, flush=True)
    summary = f"{same} of {len(CASES)} documents byte-identical"
    print(summary)
    if args.write:
        text = "\n".join([
            "# Same answers before and after: estimate and plan documents, byte for byte", "",
            f"Measured with `.venv/bin/python benchmarks/estimate_bytecheck.py --before {args.before} --write` on "
            f"{time.strftime('%Y-%m-%d')}: revision {before_rev} against this checkout ({head}). Each case is a fresh "
            "process with an empty cache and user catalog; stdout and exit status compared.", "",
            f"**{summary}.**", "",
            "| # | command | exit | bytes | sha256 (first 12) | before → after |", "|---:|---|---:|---:|---|---|",
            *rows,
        ])
        write_section(DOC, "estimate-bytecheck", text)
    sys.exit(0 if same == len(CASES) else 1)


if __name__ == "__main__":
    main()
