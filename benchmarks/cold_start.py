"""How long a quick `tunecast` command takes from a cold start: a fresh process, an empty cache, nothing running.

Targets (issue 30), on a quiet 2-core machine: `tunecast memory` of a catalog model served by the shipped step
templates within 1.0 s, and `tunecast --help` within 0.5 s. No background process helps: each command runs the
console script (`.venv/bin/tunecast`) in a process of its own, with an empty TUNECAST_CACHE and user catalog, and
is timed from start to exit, as a user would see it. The commands take turns, round after round, so that a burst
of load on the machine falls on all of them alike; the median and the slowest of the rounds are reported.

Beside them, in the same rounds, the floor no Python CLI goes below: the interpreter starting and exiting
(`python -c pass`), and starting plus importing typer and rich (`python -c "import typer, rich"`); each command is
also given as a multiple of that floor, which says more than seconds on a machine of another speed. One more run of
each command with `PYTHONPROFILEIMPORTTIME=1` (not timed) tells which heavy libraries it imported: none of torch,
transformers or numpy for `--help`, and no torch for an estimate a template serves. The bytecode is compiled first,
as an installed package has it (a checkout run under PYTHONDONTWRITEBYTECODE would compile tunecast's modules in
every run).

Run:  .venv/bin/python benchmarks/cold_start.py [--rounds N] [--write]
With --write, writes docs/benchmarks/cold-start.md.
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "cold-start.md"
TUNECAST = Path(sys.executable).with_name("tunecast")  # the console script of this environment
EXAMPLE = "examples/llama-3.1-8b-lora.yaml"
# (label, command line, target seconds or None)
COMMANDS: list[tuple[str, list[str], float | None]] = [
    ("`tunecast --help`", [str(TUNECAST), "--help"], 0.5),
    ("`tunecast --version`", [str(TUNECAST), "--version"], None),
    ("`tunecast memory --model meta-llama/Llama-3.1-8B --method lora`",
     [str(TUNECAST), "memory", "--model", "meta-llama/Llama-3.1-8B", "--method", "lora"], 1.0),
    ("`tunecast memory --model Qwen/Qwen3-0.6B --method lora`",
     [str(TUNECAST), "memory", "--model", "Qwen/Qwen3-0.6B", "--method", "lora"], 1.0),
    ("`tunecast memory --model mistralai/Mixtral-8x7B-v0.1 --method qlora`",
     [str(TUNECAST), "memory", "--model", "mistralai/Mixtral-8x7B-v0.1", "--method", "qlora"], 1.0),
    ("`tunecast memory --model meta-llama/Llama-3.1-70B --method lora --gpu h100-sxm`",
     [str(TUNECAST), "memory", "--model", "meta-llama/Llama-3.1-70B", "--method", "lora", "--gpu", "h100-sxm"], None),
    (f"`tunecast plan {EXAMPLE}`", [str(TUNECAST), "plan", EXAMPLE], None),
]
FLOORS: list[tuple[str, list[str]]] = [
    ("`python -c pass`", [sys.executable, "-c", "pass"]),
    ('`python -c "import typer, rich"`', [sys.executable, "-c", "import typer, rich"]),
]
HEAVY = ("torch", "transformers", "peft", "numpy", "pydantic", "yaml")


def _environment(home: Path) -> dict[str, str]:
    """An empty cache and user catalog of this run's own; no variable of the caller's that changes what runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNECAST_", "PYTHONPROFILEIMPORTTIME"))}
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=home))  # a new, empty one for every run
    env.update({"TUNECAST_CACHE": str(cache), "TUNECAST_CATALOG": str(home / "catalog"), "HF_HUB_OFFLINE": "1",
                "COLUMNS": "120"})
    return env


def _run(command: list[str], home: Path) -> float:
    """Seconds from start to exit of one fresh process; raises when it fails."""
    env = _environment(home)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    return elapsed


def _imported(command: list[str], home: Path) -> list[str]:
    """The heavy libraries (HEAVY) a run of `command` imported, from Python's own import log."""
    env = {**_environment(home), "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    names = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return [name for name in HEAVY if name in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="fresh processes of each command (default 9)")
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(REPO)}")
    options = parser.parse_args()
    compileall.compile_dir(REPO / "src" / "tunecast", quiet=1)
    load_before = os.getloadavg()[0]
    everything = [(label, command) for label, command in FLOORS] + [(label, command) for label, command, _ in COMMANDS]
    seconds: dict[str, list[float]] = {label: [] for label, _ in everything}
    with tempfile.TemporaryDirectory(prefix="tunecast-cold-") as directory:
        home = Path(directory)
        for _label, command in everything:  # once, untimed: the operating system's file cache is warm for all
            _run(command, home)
        for round_number in range(options.rounds):
            for label, command in everything:
                seconds[label].append(_run(command, home))
            print(f"round {round_number + 1} of {options.rounds}", flush=True)
        imported = {label: _imported(command, home) for label, command, _ in COMMANDS}
    load_after = os.getloadavg()[0]
    median = {label: statistics.median(values) for label, values in seconds.items()}
    bare, floor = (median[label] for label, _ in FLOORS)

    lines = [
        f"Measured with `.venv/bin/python benchmarks/cold_start.py --write` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; load average "
        f"{load_before:.2f} before, {load_after:.2f} after. Each command is the console script in a fresh process "
        f"with an empty cache and user catalog, {options.rounds} rounds taken in turn; the floor rows ran in the "
        "same rounds. No tunecast process runs between them (none is left behind: tests/integration/test_cli.py).",
        "",
        "| command | median s | slowest s | × python | × python + typer, rich | target | heavy imports |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for label, _ in FLOORS:
        lines.append(f"| {label} | {median[label]:.3f} | {max(seconds[label]):.3f} | {median[label] / bare:.1f} | "
                     f"{median[label] / floor:.1f} |  |  |")
    met = []
    for label, _, target in COMMANDS:
        verdict = ""
        if target is not None:
            ok = median[label] <= target
            met.append(ok)
            verdict = f"≤ {target:g} s: {'met' if ok else 'missed'}"
        lines.append(f"| {label} | {median[label]:.3f} | {max(seconds[label]):.3f} | {median[label] / bare:.1f} | "
                     f"{median[label] / floor:.1f} | {verdict} | {', '.join(imported[label]) or 'none'} |")
    lines += ["", f"Targets met: {sum(met)} of {len(met)} (by the median; the slowest round is shown beside it). "
                  "`memory` rows are answered from the step templates shipped with tunecast, so they trace "
                  "nothing and import no torch; the 70B row adds the limit search and suggestions of `--gpu`."]
    text = "# Cold start\n\n" + "\n".join(lines)
    print(text)
    if options.write:
        write_section(DOC, "cold-start", text)
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0 if all(met) else 1


if __name__ == "__main__":
    raise SystemExit(main())
