"""How long a cold estimate of a catalog diffusion pipeline takes: `tunecast memory` and `tunecast plan`.

Targets (issue 34: those of the language models, issue 31), on a quiet 2-core machine, every command a fresh process
with an empty cache and no background server: `tunecast memory` of each catalog pipeline × {LoRA, full} × {`--gpu`
given, not given} within 5 s, and `tunecast plan` of each pipeline's LoRA over the whole GPU catalog within 10 s. A
further row per pipeline asks at a rank, micro-batch and resolution no profile was fitted at (LoRA rank 32, 3 images
of 768×512 px). A diffusion runner's own defaults (`--runner kohya`) are not among the shipped settings: their
profiles are fitted on first use (docs/diffusion.md), and they are not timed here.

Each row says whether the command traced (its stderr announced a trace) or was served by the shipped profiles
(scripts/build_diffusion_profiles.py). A command still running at the time limit is stopped and reported as such
("> N s"). Rows run in turn, one process at a time.

Run:  .venv/bin/python benchmarks/diffusion_cold.py [--pipelines NAME ...] [--limit SECONDS] [--write]
With --write, writes docs/benchmarks/diffusion-speed.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from coldrun import cell, run_cold
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "diffusion-speed.md"
TUNECAST = Path(sys.executable).with_name("tunecast")
GPU = "rtx-4090"


def _pipelines() -> list[str]:
    from tunecast.catalog.diffusion import bundled_pipelines

    return bundled_pipelines()


def _run(command: list[str], limit: float, home: Path) -> tuple[float | None, bool, str]:
    """(seconds, or None when stopped at `limit`; whether it traced; the device total, or the options, or the error)."""
    run = run_cold(command, limit, home, ("tracing",))
    answer = run.answer
    if answer is None:
        return run.seconds, run.traced, run.problem or ""
    if "device_total_gib" in answer:
        limits = f", ≤ {answer['max_micro_batch']} images, ≤ {answer['max_resolution']} px" \
            if "max_micro_batch" in answer else ""
        return run.seconds, run.traced, f"{answer['device_total_gib']:.2f} GiB{limits}"
    return run.seconds, run.traced, f"{len(answer.get('options', []))} options"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", nargs="*", help="catalog pipelines (default: all)")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a command is stopped (default 60)")
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(REPO)}")
    options = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows: list[str] = []
    met = total = 0
    with tempfile.TemporaryDirectory(prefix="tunecast-diffusion-cold-") as directory:
        home = Path(directory)
        for name in options.pipelines or _pipelines():
            memory = [str(TUNECAST), "memory", "--model", name, "--micro-batch", "1", "--json"]
            cases: list[tuple[str, list[str], float]] = [
                (f"{method}{', --gpu' if gpu else ''}", [*memory, "--method", method, *(["--gpu", GPU] if gpu else [])],
                 5.0) for method in ("lora", "full") for gpu in (False, True)]
            cases.append(("lora r32, 3 × 768×512 px, --gpu", [str(TUNECAST), "memory", "--model", name, "--json",
                                                              "--lora-rank", "32", "--micro-batch", "3",
                                                              "--resolution", "768x512", "--gpu", GPU], 5.0))
            cases.append(("`plan` lora, every GPU of the catalog",
                          [str(TUNECAST), "plan", "--model", name, "--json", "--set", "diffusion.images=500",
                           "--epochs", "10", "--micro-batch", "4"], 10.0))
            for label, command, target in cases:
                seconds, traced, answer = _run(command, options.limit, home)
                ok = seconds is not None and seconds <= target and not answer.startswith("exit")
                met, total = met + ok, total + 1
                rows.append(f"| {name} | {label} | {cell(seconds, options.limit)} | "
                            f"{'traced' if traced else 'shipped profiles'} | {answer} | "
                            f"{'met' if ok else 'missed'} ({target:g} s) |")
                print(rows[-1], flush=True)
    load_after = os.getloadavg()[0]
    lines = [
        f"Measured with `.venv/bin/python benchmarks/diffusion_cold.py --write` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; load average "
        f"{load_before:.2f} before, {load_after:.2f} after. Each row is the console script in a fresh process with "
        f"an empty cache (`--json`, micro-batch 1 at the pipeline's own resolution unless the row says; `--gpu {GPU}` "
        f"where it says so); stopped after {options.limit:g} s.",
        "",
        "| pipeline | run | seconds | served by | answer | target |",
        "|---|---|---:|---|---|---|",
        *rows,
        "",
        f"Targets met: {met} of {total}.",
    ]
    text = "\n".join(lines)
    print(text)
    if options.write:
        if not DOC.exists():
            DOC.parent.mkdir(parents=True, exist_ok=True)
            DOC.write_text("# Cold estimates of diffusion pipelines\n\nWritten by `benchmarks/diffusion_cold.py`.\n")
        write_section(DOC, "diffusion-cold", text)
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0 if met == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
