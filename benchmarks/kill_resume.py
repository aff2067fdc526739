"""Kill `tunecast train` at 100 random moments and start it again until it is done: every result must equal an
uninterrupted run's, bit for bit. The CI test (tests/integration/test_train_resume.py) does the same with 10.

What is killed: the tiny LoRA run of tests/trainruns.py (`tiny_run`: 16 optimizer steps, dropout on, a
checkpoint every 2 steps, 2 kept), each start a fresh process forked from a warm server (tests/forkserver.py),
so that a kill is a real signal to a real process. The kill points, drawn from one `random.Random(--seed)`:

- SIGKILL at a uniformly random moment between the start and the reference run's wall time (2/3 of them);
- SIGKILL by the process itself half-way through its N-th file write to the output, N uniform over the writes
  an uninterrupted run makes: config.yaml, base/, every checkpoint file and manifest, final/ (1/3 of them);
- a few SIGTERMs at a random moment: the run must save a checkpoint and exit 75.

A round is one fresh output folder: start, kill at the next kill point, start again with the same command, …
until a start exits 0; then its final adapter bytes and every step's loss (metrics.jsonl `train` lines) are
compared with the reference run's. A kill point that misses (the run ends first) is drawn again later.

Measured at each kill, from what is on disk before the next start:
- the step the killed process reached: the last `train` line (or checkpoint / preempted event) after its own
  start or resume event in metrics.jsonl, read before the next start cuts that file back;
- the step the next start resumes from: the newest checkpoint that verifies, by the runner's own rule
  (`CheckpointStore.newest_valid`), checked against that start's "resumed from checkpoint step N" line;
- lost work = reached − resumed from, in optimizer steps;
- a fall-back: newer checkpoint folders that do not verify (a write cut short), which the next start skips and
  reports in a "skipped:" warning.

Run:  .venv/bin/python benchmarks/kill_resume.py [--seed 20261201] [--kills 100] [--sigterms 5]
Writes docs/benchmarks/kill-resume.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from docsection import write_section

from tunecast.train.store import CheckpointStore, Storage

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the run helpers live with the tests
from tests.trainruns import ForkServer, adapter_bytes, tiny_run, train_losses  # noqa: E402

DOC = REPO / "docs" / "benchmarks" / "kill-resume.md"
IN_WRITE_SHARE = 1 / 3  # of the SIGKILLs; the rest land at a random moment
MAX_STARTS_PER_ROUND = 60  # a round that has not finished by then is a failure (a resume that never gets on)
LOG_TAIL_LINES = 40


@dataclass
class Start:
    """One start of `tunecast train` in a round, and what it left."""

    round: int
    number: int
    kind: str  # "timed", "in-write", "sigterm" or "to the end"
    at: str  # when the kill was due: "7.31 s" or "write 23"
    code: int  # exit status, or minus the signal number that killed it
    seconds: float  # request to exit
    resumes_from: int  # newest verified checkpoint when it started (0: none)
    skipped: list[str]  # newer checkpoint folders that did not verify then, each with why
    logged_resume: int | None  # N of its "resumed from checkpoint step N" line
    logged_skipped: bool  # a "skipped:" warning in its log
    log: Path
    reached: int | None = None  # step reached before the kill
    lost: int | None = None  # steps past the newest verified checkpoint after the kill
    signal_to_exit_s: float | None = None

    @property
    def landed(self) -> bool:
        return (self.kind in ("timed", "in-write") and self.code == -signal.SIGKILL) or (
            self.kind == "sigterm" and self.code == 75)


@dataclass
class Results:
    seed: int
    reference_s: float = 0.0
    cold_s: float = 0.0
    server_s: float = 0.0
    writes: int = 0
    steps: int = 0
    setup_s: float = 0.0
    step_s: float = 0.0
    rounds: int = 0
    equal_rounds: int = 0
    starts: list[Start] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # details of the first, then one line each
    crash: str | None = None
    anomalies: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def kill_plan(chooser: random.Random, kills: int, sigterms: int) -> list[str]:
    in_write = round(kills * IN_WRITE_SHARE)
    points = ["timed"] * (kills - in_write) + ["in-write"] * in_write + ["sigterm"] * sigterms
    chooser.shuffle(points)
    return points


def run_writes(output: Path) -> int:
    """File writes an uninterrupted run makes to its output: config.yaml, then each set of files (base/, every
    checkpoint, final/) one file at a time with its manifest last."""
    def files_in(folder: Path) -> int:
        return len(json.loads((folder / "manifest.json").read_text())["files"]) + 1

    checkpoints = sorted((output / "checkpoints").iterdir())
    saved = sum(1 for line in (output / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("event") == "checkpoint")
    return 1 + files_in(output / "base") + saved * files_in(checkpoints[-1]) + files_in(output / "final")


def on_disk(output: Path) -> tuple[int, list[str]]:
    """The step a start would resume from now, and the newer folders it would skip (with why)."""
    found, skipped = CheckpointStore(Storage(str(output))).newest_valid()
    return (found.step if found is not None else 0), [f"{bad.name}: {bad.reason}" for bad in skipped]


def metrics_bytes(output: Path) -> bytes:
    path = output / "metrics.jsonl"
    return path.read_bytes() if path.exists() else b""


def reached_step(before: bytes, after: bytes, resumes_from: int) -> int:
    """The step a killed start reached. Its lines follow its own start/resume event; a log left as it was means
    it was killed before it opened the log (it had done nothing)."""
    if after == before:
        return resumes_from
    reached = resumes_from
    for line in after.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill
        if record.get("event") in ("start", "resume"):
            reached = record["step"]
        elif record.get("kind") == "train" or record.get("event") in ("checkpoint", "preempted"):
            reached = max(reached, record["step"])
    return reached


def log_text(log: Path) -> str:
    return " ".join(log.read_text(errors="replace").split()) if log.exists() else ""


def log_tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-LOG_TAIL_LINES:])


def compare(output: Path, reference: dict, number: int, history: list[Start]) -> str | None:
    """None when the round's result equals the reference; else what differs, with the round's starts."""
    problems = []
    adapter = adapter_bytes(output)
    if adapter != reference["adapter"]:
        problems.append(f"adapter_model.safetensors differs: {len(adapter):,} bytes sha256 "
                        f"{hashlib.sha256(adapter).hexdigest()[:16]} vs reference {len(reference['adapter']):,} "
                        f"bytes {hashlib.sha256(reference['adapter']).hexdigest()[:16]}")
    try:
        losses = train_losses(output)
    except AssertionError as error:
        problems.append(f"metrics.jsonl: {error}")
    else:
        if losses != reference["losses"]:
            steps = sorted(set(losses) | set(reference["losses"]))
            first = next(s for s in steps if losses.get(s) != reference["losses"].get(s))
            problems.append(f"losses differ from step {first}: {losses.get(first)!r} vs reference "
                            f"{reference['losses'].get(first)!r} (steps logged: {sorted(losses)})")
    if not problems:
        return None
    starts = "; ".join(f"{s.kind} {s.at} → {s.code} (from step {s.resumes_from}, reached {s.reached})"
                       for s in history)
    kept = Path(tempfile.gettempdir()) / f"kill-resume-round-{number}-{os.getpid()}"
    shutil.copytree(output.parent, kept)
    return f"round {number}: " + " ".join(problems) + f". Starts: {starts}. Round's folder kept in {kept}"


def run_reference(server: ForkServer, work: Path, results: Results) -> dict:
    """Two uninterrupted runs: the first fills the shared cache (and is timed as cold), the second is the
    reference; they must be equal."""
    runs = []
    for name in ("cold", "reference"):
        folder = work / name
        folder.mkdir()
        started = time.monotonic()
        code = server.run(["train", str(tiny_run(folder))], folder / "log.txt")
        seconds = time.monotonic() - started
        if code != 0:
            raise SystemExit(f"the uninterrupted run exited {code}:\n{log_tail(folder / 'log.txt')}")
        runs.append({"adapter": adapter_bytes(folder / "out"), "losses": train_losses(folder / "out"),
                     "seconds": seconds, "output": folder / "out"})
    cold, reference = runs
    if (cold["adapter"], cold["losses"]) != (reference["adapter"], reference["losses"]):
        raise SystemExit("two uninterrupted runs differ: nothing to compare resumed runs with")
    results.cold_s, results.reference_s = cold["seconds"], reference["seconds"]
    results.writes = run_writes(reference["output"])
    results.steps = len(reference["losses"])
    records = [json.loads(line) for line in (reference["output"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    results.setup_s = train[0]["elapsed_s"] - train[0]["step_seconds"]
    results.step_s = statistics.median(r["step_seconds"] for r in train)
    return reference


def one_start(server: ForkServer, args: list[str], log: Path, kind: str, chooser: random.Random,
              results: Results) -> tuple[int, str, float | None]:
    """Start the run and kill it as `kind` says: (exit status, when the kill was due, seconds signal → exit)."""
    if kind in ("timed", "sigterm"):
        after = chooser.uniform(0.0, results.reference_s)
        number = signal.SIGKILL if kind == "timed" else signal.SIGTERM
        code, stop_s = server.run_and_signal(args, log, after_s=after, signal_number=number)
        return code, f"{after:.2f} s", stop_s
    if kind == "in-write":
        write = chooser.randint(1, results.writes)
        return server.run(args, log, kill_in_write=write), f"write {write}", None
    return server.run(args, log), "", None


def run_round(server: ForkServer, number: int, work: Path, plan: list[str], chooser: random.Random,
              reference: dict, results: Results) -> None:
    folder = work / f"round-{number:03d}"
    folder.mkdir()
    args = ["train", str(tiny_run(folder))]
    output = folder / "out"
    history: list[Start] = []
    for count in range(1, MAX_STARTS_PER_ROUND + 1):
        kind = plan[0] if plan else "to the end"
        resumes_from, skipped = on_disk(output)
        before = metrics_bytes(output)
        log = folder / f"log-{count:02d}.txt"
        started = time.monotonic()
        code, at, stop_s = one_start(server, args, log, kind, chooser, results)
        text = log_text(log)
        resumed = re.search(r"resumed from checkpoint step (\d+)", text)
        start = Start(number, count, kind, at, code, time.monotonic() - started, resumes_from, skipped,
                      int(resumed.group(1)) if resumed else None, "skipped:" in text, log)
        history.append(start)
        results.starts.append(start)
        if start.logged_resume is not None and start.logged_resume != resumes_from:
            results.anomalies.append(f"round {number} start {count} resumed from step {start.logged_resume}, but "
                                     f"the newest checkpoint that verifies was step {resumes_from}")
        if start.landed:
            plan.pop(0)
            start.signal_to_exit_s = stop_s
            start.reached = reached_step(before, metrics_bytes(output), resumes_from)
            start.lost = start.reached - on_disk(output)[0]
            if start.lost < 0:
                results.anomalies.append(f"round {number} start {count}: a checkpoint newer than the step reached "
                                         f"({start.reached})")
        elif code != 0:
            kept = Path(tempfile.gettempdir()) / f"kill-resume-round-{number}-{os.getpid()}"
            shutil.copytree(folder, kept)
            results.crash = (f"round {number}, start {count} ({kind} {at}, resuming from step {resumes_from}) "
                             f"exited {code} (folder kept in {kept}); log tail:\n{log_tail(log)}")
            return
        print(f"round {number} start {count}: {kind} {at} → exit {code} in {start.seconds:.1f} s; from step "
              f"{resumes_from}{' (skipped ' + str(len(skipped)) + ')' if skipped else ''}"
              f"{f', reached {start.reached}, lost {start.lost}' if start.landed else ''}", flush=True)
        if code == 0:
            mismatch = compare(output, reference, number, history)
            if mismatch is None:
                results.equal_rounds += 1
                shutil.rmtree(folder)
            else:
                results.mismatches.append(mismatch)
                print(f"MISMATCH {mismatch}", flush=True)
            return
    results.crash = f"round {number} did not finish in {MAX_STARTS_PER_ROUND} starts; last log:\n{log_tail(log)}"


def versions() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    packages = ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "peft", "accelerate"))
    return (f"tunecast {version('tunecast')} (commit {commit}), {packages}; Python {platform.python_version()}, "
            f"{platform.machine()}, {os.cpu_count()} cores")


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def report(results: Results, kills: int, sigterms: int) -> str:
    starts = results.starts
    killed = [s for s in starts if s.landed and s.kind != "sigterm"]
    terms = [s for s in starts if s.landed and s.kind == "sigterm"]
    by_kind = Counter(s.kind for s in killed)
    lost = [s.lost for s in killed if s.lost is not None]
    fell_back = [s for s in starts if s.skipped]
    ended = [s for s in fell_back if s.code in (0, 75)]
    reasons = Counter(re.sub(r"[\d,]+", "N", item.split(": ", 1)[1]) for s in fell_back for item in s.skipped)
    to_end = [s.seconds for s in starts if s.code == 0]
    histogram = Counter(lost)
    verdict = ("**yes**" if results.equal_rounds == results.rounds and not results.mismatches and not results.crash
               else "**no**")
    lines = [
        "# Kill and resume at scale",
        "",
        "`tunecast train` promises that a run killed at any moment and started again with the same command ends "
        "with exactly what an uninterrupted run gives. The CI test (`tests/integration/test_train_resume.py`) "
        "proves it with 10 kills; this benchmark repeats the proof with 100.",
        "",
        "- **What is killed**: the tiny LoRA run of `tests/trainruns.py` (`tiny_run`: a 4-layer Llama, rank 4, "
        "dropout 0.1, 16 optimizer steps of 2 × 2 sequences, an evaluation every 5 steps, a checkpoint every 2 "
        "steps, 2 kept), each start a fresh process forked from a warm server (`tests/forkserver.py`).",
        f"- **How**: SIGKILL at a uniformly random moment between the start and the uninterrupted run's wall time "
        f"(2/3 of the SIGKILLs); SIGKILL by the process itself half-way through its N-th file write to the "
        f"output, N uniform over the {results.writes} writes an uninterrupted run makes — config, base weights, "
        "8 checkpoints of 6 files and a manifest, `final/` (1/3); and a few SIGTERMs at a random moment, which "
        "must save a checkpoint and exit 75. A kill point that misses (the run ends first) is drawn again.",
        "- **What is compared**: each round starts a fresh output and restarts the same command after every kill "
        "until it exits 0; then `final/adapter_model.safetensors` must equal the uninterrupted run's byte for "
        "byte, and the loss of every step (`metrics.jsonl` `train` lines) must be the same float.",
        "- **Lost work** per kill: the step the killed process had reached (its last `train` line) minus the "
        "step the next start resumes from (the newest checkpoint that verifies on disk, checked against the "
        "start's \"resumed from checkpoint step N\" line). A **fall-back** is a start that found newer "
        "checkpoint folders that do not verify (a write cut short) and skipped them.",
        "",
        f"Command: `.venv/bin/python benchmarks/kill_resume.py` (seed {results.seed}, {kills} SIGKILLs, "
        f"{sigterms} SIGTERMs). Measured on {time.strftime('%Y-%m-%d', time.gmtime())}: {versions()}.",
        "",
        "| | |",
        "|---|---|",
        f"| kills landed | {len(killed)} SIGKILL ({by_kind['timed']} at a random moment, {by_kind['in-write']} "
        f"half-way through a file write) + {len(terms)} SIGTERM (all exited 75) |",
        f"| rounds (fresh output, restarted until done) | {results.rounds}, {len(starts)} starts |",
        f"| every round equal to the uninterrupted run (adapter bytes and all {results.steps} "
        f"losses) | {verdict}: {results.equal_rounds} of {results.rounds} |",
        f"| resumes that fell back past a broken checkpoint | {len(fell_back)} "
        f"({sum(s.logged_skipped for s in ended)} of the {len(ended)} that ran to their end logged `skipped:`; "
        "a start killed again never prints its warnings) |",
        f"| lost work per SIGKILL, optimizer steps | median {statistics.median(lost) if lost else '–'}, max "
        f"{max(lost) if lost else '–'} (checkpoint every 2 steps) |",
        f"| lost work per SIGTERM | max {max((s.lost or 0) for s in terms) if terms else '–'} steps; signal to "
        f"exit at most {max((s.signal_to_exit_s or 0) for s in terms):.2f} s |" if terms else
        "| lost work per SIGTERM | – |",
        f"| wall time | {minutes(results.wall_s)} |",
        "",
        "Lost work per SIGKILL (steps: kills): " + ", ".join(f"{k}: {histogram[k]}" for k in sorted(histogram))
        + ".",
    ]
    if reasons:
        lines += ["", "Why the skipped folders did not verify (per resume): "
                  + "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common()) + "."]
    lines += [
        "",
        f"Time per run: an uninterrupted run takes {results.reference_s:.1f} s ({results.setup_s:.1f} s from fork to "
        f"the first step, then {results.step_s:.2f} s a step, median); the first run, with an empty "
        f"`TUNECAST_CACHE`, {results.cold_s:.1f} s; the fork server's start {results.server_s:.1f} s. Starts that "
        f"ran to the end took median {statistics.median(to_end):.1f} s, max {max(to_end):.1f} s."
        if to_end else "",
    ]
    if results.anomalies:
        lines += ["", "Anomalies:", "", *[f"- {a}" for a in results.anomalies]]
    if results.mismatches:
        lines += ["", f"**{len(results.mismatches)} round(s) differ.** First: {results.mismatches[0]}"]
    if results.crash:
        lines += ["", "**A start failed** (the benchmark stopped there):", "", "```", results.crash, "```"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--kills", type=int, default=100, help="SIGKILLs to land")
    parser.add_argument("--sigterms", type=int, default=5, help="SIGTERMs to land")
    options = parser.parse_args()
    wall = time.monotonic()
    chooser = random.Random(options.seed)
    results = Results(seed=options.seed)
    plan = kill_plan(chooser, options.kills, options.sigterms)
    with tempfile.TemporaryDirectory(prefix="tunecast-kill-resume-") as temporary:
        work = Path(temporary)
        os.environ["TUNECAST_CACHE"] = str(work / "cache")  # one memory-estimate cache for every run
        started = time.monotonic()
        server = ForkServer.start()
        results.server_s = time.monotonic() - started
        try:
            reference = run_reference(server, work, results)
            print(f"reference: {results.reference_s:.1f} s ({results.cold_s:.1f} s cold), {results.writes} writes",
                  flush=True)
            while plan and results.crash is None:
                results.rounds += 1
                run_round(server, results.rounds, work, plan, chooser, reference, results)
        finally:
            server.stop()
        results.wall_s = time.monotonic() - wall
        text = report(results, options.kills, options.sigterms)
    write_section(DOC, "kill-resume", text)
    print(text)
    return 0 if results.crash is None and not results.mismatches and not results.anomalies else 1


if __name__ == "__main__":
    raise SystemExit(main())
