"""Kill `tunecast train` at 100 random moments and start it again until it is done: every result must equal an
uninterrupted run's, bit for bit. The CI test (tests/integration/test_train_resume.py) does the same with 10.

What is killed: the tiny LoRA run of tests/trainruns.py (`tiny_run`: 16 optimizer steps, dropout on, a
checkpoint every 2 steps, 2 kept), each start a fresh process forked from a warm server (tests/forkserver.py),
so that a kill is a real signal to a real process. The kill points, drawn from one `random.Random(--seed)` as
in the CI test:

- SIGKILL at a uniformly random moment between the start and the uninterrupted run's wall time (2/3 of them);
- SIGKILL by the process itself half-way through its N-th file write to the output, N uniform over the writes
  of an uninterrupted run that the fork server's hook sees (1/3 of them; the count is found by bisection, and
  the half-written file left behind names the file that was hit);
- a few SIGTERMs at a random moment: the run must save a checkpoint and exit 75.

A round is one fresh output folder: start, kill at the next kill point, start again with the same command, …
until a start exits 0 (a kill point that misses because the run ends first ends the round and is drawn again
in the next one); then its final adapter bytes and every step's loss (metrics.jsonl `train` lines) are
compared with the uninterrupted run's.

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
import itertools
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
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from docsection import write_section

from tunecast.storage.store import CheckpointStore, Storage

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the run helpers live with the tests
from tests.trainruns import ForkServer, adapter_bytes, tiny_run, train_losses  # noqa: E402

DOC = REPO / "docs" / "benchmarks" / "kill-resume.md"
IN_WRITE_SHARE = 1 / 3  # of the SIGKILLs; the rest land at a random moment
EXIT_PREEMPTED = 75
MAX_STARTS_PER_ROUND = 60  # a round not finished by then is a failure (a resume that never gets anywhere)
LOG_TAIL_LINES = 40
# One CPU thread per run. The tiny model gains nothing from a second thread, and on a shared 2-core machine
# torch's two OpenMP threads wait on each other: a step took 1.7-1.9 s with two threads against 0.13-0.26 s
# with one (measured here while other jobs ran). Every run here, the reference included, uses the same count.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
HALF_WRITTEN = re.compile(r"\.tmp-\d+$")  # what an interrupted write leaves (store.py writes, then renames)


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
    reached: int | None = None  # step reached before the kill
    lost: int | None = None  # steps past the newest verified checkpoint after the kill
    half_written: list[str] = field(default_factory=list)  # files it left half-written
    signal_to_exit_s: float | None = None

    @property
    def landed(self) -> bool:
        return (self.kind in ("timed", "in-write") and self.code == -signal.SIGKILL) or (
            self.kind == "sigterm" and self.code == EXIT_PREEMPTED)


@dataclass
class Results:
    seed: int
    server_s: float = 0.0
    cold_s: float = 0.0  # the first run, which fills the memory-estimate cache
    reference_s: float = 0.0
    setup_s: float = 0.0  # reference: fork to the first step
    step_s: float = 0.0  # reference: median optimizer step
    steps: int = 0
    files: str = ""  # what an uninterrupted run writes
    file_writes: int = 0
    hooked_writes: int = 0  # of those, the writes the fork server's kill-in-write hook counts
    calibration_s: float = 0.0
    workers: int = 1
    wall_s: float = 0.0


@dataclass
class Tally:
    """What the rounds found: one per worker, added up at the end."""

    rounds: int = 0
    equal_rounds: int = 0
    left_half_written: int = 0  # finished rounds whose output still holds a half-written file
    starts: list[Start] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    crash: str | None = None

    def add(self, other: Tally) -> None:
        self.rounds += other.rounds
        self.equal_rounds += other.equal_rounds
        self.left_half_written += other.left_half_written
        self.starts += other.starts
        self.mismatches += other.mismatches
        self.anomalies += other.anomalies
        self.crash = self.crash or other.crash


def kill_plan(chooser: random.Random, kills: int, sigterms: int) -> list[str]:
    in_write = round(kills * IN_WRITE_SHARE)
    points = ["timed"] * (kills - in_write) + ["in-write"] * in_write + ["sigterm"] * sigterms
    chooser.shuffle(points)
    return points


def describe_writes(output: Path) -> tuple[int, str]:
    """The file writes an uninterrupted run makes to its output, and what they are: config.yaml, then each set
    of files (base/, every checkpoint, final/) one file at a time with its manifest last."""
    def files_in(folder: Path) -> int:
        return len(json.loads((folder / "manifest.json").read_text())["files"]) + 1

    newest = sorted((output / "checkpoints").iterdir())[-1]
    saved = sum(1 for line in (output / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("event") == "checkpoint")
    base, each, final = files_in(output / "base"), files_in(newest), files_in(output / "final")
    return 1 + base + saved * each + final, (f"config.yaml, base/ ({base} files), {saved} checkpoints of {each} "
                                             f"files, final/ ({final} files), each set's manifest counted and "
                                             "written last")


def half_written(output: Path) -> set[str]:
    if not output.exists():
        return set()
    return {str(p.relative_to(output)) for p in output.rglob("*") if HALF_WRITTEN.search(p.name)}


def file_kind(relative: str) -> str:
    """`checkpoints/step-00000006/rng.pt.tmp-123` → `checkpoints/…/rng.pt`."""
    parts = HALF_WRITTEN.sub("", relative).split("/")
    return "/".join([parts[0], "…", parts[-1]] if parts[0] == "checkpoints" else parts)


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


def keep(folder: Path, number: int) -> Path:
    """Copy a failed round's folder out of the temporary work folder, for inspection."""
    kept = Path(tempfile.gettempdir()) / f"kill-resume-round-{number}-{os.getpid()}"
    shutil.copytree(folder, kept)
    return kept


def compare(folder: Path, reference: dict, number: int, history: list[Start]) -> str | None:
    """None when the round's result equals the reference; else what differs, with the round's starts."""
    output = folder / "out"
    problems = []
    adapter = adapter_bytes(output)
    if adapter != reference["adapter"]:
        problems.append(f"adapter_model.safetensors differs: {len(adapter):,} bytes, sha256 "
                        f"{hashlib.sha256(adapter).hexdigest()[:16]}…, against {len(reference['adapter']):,} bytes, "
                        f"{hashlib.sha256(reference['adapter']).hexdigest()[:16]}…")
    try:
        losses = train_losses(output)
    except AssertionError as error:
        problems.append(f"metrics.jsonl: {error}")
    else:
        if losses != reference["losses"]:
            steps = sorted(set(losses) | set(reference["losses"]))
            first = next(s for s in steps if losses.get(s) != reference["losses"].get(s))
            problems.append(f"losses differ from step {first}: {losses.get(first)!r} against "
                            f"{reference['losses'].get(first)!r} (steps logged: {sorted(losses)})")
    if not problems:
        return None
    starts = "; ".join(f"{s.kind} {s.at} → {s.code} (from step {s.resumes_from}, reached {s.reached})"
                       for s in history)
    return f"round {number}: {' '.join(problems)}. Starts: {starts}. Folder kept in {keep(folder, number)}"


def run_reference(server: ForkServer, work: Path, results: Results) -> dict:
    """Two uninterrupted runs: the first fills the shared cache (timed as cold), the second is the reference;
    they must be equal."""
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
        raise SystemExit("two uninterrupted runs differ: there is nothing to compare resumed runs with")
    results.cold_s, results.reference_s = cold["seconds"], reference["seconds"]
    results.steps = len(reference["losses"])
    results.file_writes, results.files = describe_writes(reference["output"])
    records = [json.loads(line) for line in (reference["output"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    results.setup_s = train[0]["elapsed_s"] - train[0]["step_seconds"]
    results.step_s = statistics.median(r["step_seconds"] for r in train)
    return reference


def count_hooked_writes(servers: list[ForkServer], work: Path, results: Results) -> int:
    """The writes of an uninterrupted run that `kill_in_write` counts: the largest N at which a fresh start is
    killed, by bisection (one probe per server at a time). Each is one of the run's file writes, which bounds it."""
    def lands(server: ForkServer, write: int) -> bool:
        folder = work / f"writes-{write}"
        folder.mkdir()
        code = server.run(["train", str(tiny_run(folder))], folder / "log.txt", kill_in_write=write)
        if code not in (0, -signal.SIGKILL):
            raise SystemExit(f"a start with kill_in_write={write} exited {code}:\n{log_tail(folder / 'log.txt')}")
        shutil.rmtree(folder)
        return code == -signal.SIGKILL

    started = time.monotonic()
    low, high = 0, results.file_writes + 1  # a start is killed at write `low` (none: trivially), not at `high`
    with ThreadPoolExecutor(len(servers)) as pool:
        while high - low > 1:
            points = sorted({low + (high - low) * (i + 1) // (len(servers) + 1) for i in range(len(servers))} - {low})
            for point, landed in zip(points, pool.map(lands, servers, points), strict=True):
                if landed:
                    low = max(low, point)
                else:
                    high = min(high, point)
    results.calibration_s = time.monotonic() - started
    if low == 0:
        raise SystemExit("no start was killed in a write: the fork server's kill_in_write hook sees no writes")
    return low


def one_start(server: ForkServer, args: list[str], log: Path, kind: str, chooser: random.Random,
              results: Results) -> tuple[int, str, float | None]:
    """Start the run and kill it as `kind` says: (exit status, when the kill was due, seconds signal → exit)."""
    if kind in ("timed", "sigterm"):
        after = chooser.uniform(0.0, results.reference_s)
        number = signal.SIGKILL if kind == "timed" else signal.SIGTERM
        code, stop_s = server.run_and_signal(args, log, after_s=after, signal_number=number)
        return code, f"{after:.2f} s", stop_s
    if kind == "in-write":
        write = chooser.randint(1, results.hooked_writes)
        return server.run(args, log, kill_in_write=write), f"write {write}", None
    return server.run(args, log), "", None


def run_round(server: ForkServer, number: int, work: Path, plan: list[str], chooser: random.Random,
              reference: dict, results: Results, tally: Tally) -> None:
    """Start, kill, start again … until a start exits 0; then compare with the reference."""
    folder = work / f"round-{number:03d}"
    folder.mkdir()
    args = ["train", str(tiny_run(folder))]
    output = folder / "out"
    history: list[Start] = []
    for count in range(1, MAX_STARTS_PER_ROUND + 1):
        kind = plan[0] if plan else "to the end"
        resumes_from, skipped = on_disk(output)
        before, partial = metrics_bytes(output), half_written(output)
        log = folder / f"log-{count:02d}.txt"
        started = time.monotonic()
        code, at, stop_s = one_start(server, args, log, kind, chooser, results)
        text = log_text(log)
        resumed = re.search(r"resumed from checkpoint step (\d+)", text)
        start = Start(number, count, kind, at, code, time.monotonic() - started, resumes_from, skipped,
                      int(resumed.group(1)) if resumed else None, "skipped:" in text)
        history.append(start)
        tally.starts.append(start)
        if start.logged_resume is not None and start.logged_resume != resumes_from:
            tally.anomalies.append(f"round {number} start {count} resumed from step {start.logged_resume}, but "
                                     f"the newest checkpoint that verifies was step {resumes_from}")
        if start.landed:
            plan.pop(0)
            start.signal_to_exit_s = stop_s
            start.half_written = sorted(half_written(output) - partial)
            start.reached = reached_step(before, metrics_bytes(output), resumes_from)
            start.lost = start.reached - on_disk(output)[0]
            if start.lost < 0:
                tally.anomalies.append(f"round {number} start {count}: a checkpoint newer than the step it "
                                         f"reached ({start.reached})")
        elif code != 0:
            tally.crash = (f"round {number}, start {count} ({kind} {at}, resuming from step {resumes_from}) "
                             f"exited {code} (folder kept in {keep(folder, number)}); log tail:\n{log_tail(log)}")
            return
        print(f"round {number} start {count}: {kind} {at} → exit {code} in {start.seconds:.1f} s; from step "
              f"{resumes_from}{f' (skipping {len(skipped)})' if skipped else ''}"
              f"{f', skipped: logged {start.logged_skipped}' if skipped and code in (0, EXIT_PREEMPTED) else ''}"
              f"{f', reached {start.reached}, lost {start.lost}' if start.landed else ''}"
              f"{f', half-written {start.half_written}' if start.half_written else ''}", flush=True)
        if code == 0:
            tally.left_half_written += bool(half_written(output))
            mismatch = compare(folder, reference, number, history)
            if mismatch is None:
                tally.equal_rounds += 1
                shutil.rmtree(folder)
            else:
                tally.mismatches.append(mismatch)
                print(f"MISMATCH {mismatch}", flush=True)
            return
    tally.crash = (f"round {number} did not finish in {MAX_STARTS_PER_ROUND} starts (folder kept in "
                     f"{keep(folder, number)}); last log:\n{log_tail(log)}")


def work_through(server: ForkServer, plan: list[str], chooser: random.Random, numbers: Iterator[int], work: Path,
                 reference: dict, results: Results, stop: threading.Event) -> Tally:
    """One worker: rounds on its own server until its share of the kill points has landed (or a start failed)."""
    tally = Tally()
    while plan and not stop.is_set():
        tally.rounds += 1
        run_round(server, next(numbers), work, plan, chooser, reference, results, tally)
        if tally.crash is not None:
            stop.set()
    return tally


def versions() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=REPO, capture_output=True, text=True,
                           check=False).stdout.strip()
    packages = ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "peft", "accelerate"))
    return (f"tunecast {version('tunecast')} (commit {commit}{', src/ with uncommitted changes' if dirty else ''}), "
            f"{packages}; Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores")


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.1f} s, max {max(values):.1f} s" if values else "–"


def listed(counts: Counter[str]) -> str:
    return ", ".join(f"`{name}` {n}" for name, n in counts.most_common())


def report(results: Results, tally: Tally, kills: int, sigterms: int) -> str:
    starts = tally.starts
    killed = [s for s in starts if s.landed and s.kind != "sigterm"]
    terms = [s for s in starts if s.landed and s.kind == "sigterm"]
    by_kind = Counter(s.kind for s in killed)
    lost = [s.lost for s in killed if s.lost is not None]
    histogram = Counter(lost)
    fell_back = [s for s in starts if s.skipped]
    ended = [s for s in fell_back if s.code in (0, EXIT_PREEMPTED)]
    silent = "; ".join(f"round {s.round} start {s.number}, {s.kind} {s.at}, exit {s.code}"
                       for s in ended if not s.logged_skipped)
    reasons = Counter(re.sub(r"[\d,]+", "N", item.split(": ", 1)[1]) for s in fell_back for item in s.skipped)
    hit = Counter(file_kind(path) for s in killed if s.kind == "in-write" for path in s.half_written)
    timed_hit = Counter(file_kind(path) for s in killed if s.kind == "timed" for path in s.half_written)
    missed = sum(1 for s in starts if s.kind != "to the end" and s.code == 0)
    unseen = results.file_writes - results.hooked_writes
    equal = not tally.mismatches and tally.crash is None and tally.equal_rounds == tally.rounds
    lines = [
        "# Kill and resume at scale",
        "",
        "`tunecast train` promises that a run killed at any moment and started again with the same command ends "
        "with exactly what an uninterrupted run gives. The CI test (`tests/integration/test_train_resume.py`) "
        "proves it with 10 kills; this benchmark repeats the proof with 100.",
        "",
        "- **What is killed**: the tiny LoRA run of `tests/trainruns.py` (`tiny_run`: a 4-layer Llama, rank 4, "
        f"dropout 0.1, {results.steps} optimizer steps of 2 × 2 sequences, an evaluation every 5 steps, a checkpoint "
        "every 2 steps, 2 kept), each start a fresh process forked from a warm server (`tests/forkserver.py`), "
        f"with one CPU thread; {results.workers} rounds at a time, each on its own server; one `TUNECAST_CACHE` "
        "folder for every run.",
        "- **How**: SIGKILL at a uniformly random moment between the start and the uninterrupted run's wall time "
        "(2/3 of the SIGKILLs); SIGKILL by the process itself half-way through its N-th file write to the output, "
        f"N uniform over the {results.hooked_writes} writes of an uninterrupted run that the fork server's "
        f"`kill_in_write` hook counts (the run makes {results.file_writes} file writes: {results.files}"
        + (f"; the hook patches `store._write_local` only, so the {unseen} files the store streams through "
           "`_copy_local` — weights, optimizer state, base/ and final/ files — are never cut by it" if unseen else "")
        + ") (1/3); "
        "and a few SIGTERMs at a random moment, which must save a checkpoint and exit 75. As in the CI test, a "
        "kill point that misses (the run ends first) ends the round and is drawn again in the next.",
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
        f"half-way through a file write) + {len(terms)} SIGTERM (each SIGTERM that came before the run's end "
        "made it save and exit 75) |",
        f"| rounds (fresh output, restarted until done) | {tally.rounds}, {len(starts)} starts ({missed} kill "
        "points missed: the run ended first) |",
        f"| every round equal to the uninterrupted run (adapter bytes and all {results.steps} losses) | "
        f"{'**yes**' if equal else '**no**'}: {tally.equal_rounds} of {tally.rounds} |",
        f"| resumes that fell back past a broken checkpoint | {len(fell_back)}; {sum(s.logged_skipped for s in ended)} "
        f"of the {len(ended)} of them that ran to their end logged `skipped:`{f' (not: {silent})' if silent else ''}; "
        "a start killed again prints no warnings |",
        f"| lost work per SIGKILL, optimizer steps | median {statistics.median(lost) if lost else '–'}, max "
        f"{max(lost) if lost else '–'} |",
        (f"| lost work per SIGTERM, optimizer steps | max {max(s.lost or 0 for s in terms)}; signal to exit at "
         f"most {max(s.signal_to_exit_s or 0 for s in terms):.2f} s |") if terms else "| lost work per SIGTERM | – |",
        f"| wall time | {minutes(results.wall_s)} |",
        "",
        "Lost work per SIGKILL (steps: kills): " + ", ".join(f"{k}: {histogram[k]}" for k in sorted(histogram)) + ".",
    ]
    if hit:
        lines += ["", f"Files the mid-write kills cut short: {listed(hit)}. Timed kills that also cut a write short: "
                  f"{sum(timed_hit.values())}{f' ({listed(timed_hit)})' if timed_hit else ''}. Finished rounds "
                  "whose output still holds a half-written `*.tmp-PID` file (left by a killed writer, never "
                  f"cleaned up): {tally.left_half_written} of {tally.rounds}."]
    if reasons:
        lines += ["", "Why the skipped folders did not verify (one per skipped folder per resume): "
                  + "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common()) + "."]
    to_end = [s.seconds for s in starts if s.code == 0]
    lines += [
        "",
        f"Time per run: an uninterrupted run takes {results.reference_s:.1f} s ({results.setup_s:.1f} s from start "
        f"to the first step, then {results.step_s:.2f} s a step, median); the first run, with an empty cache, "
        f"{results.cold_s:.1f} s; the fork server's start {results.server_s:.1f} s; counting the writes "
        f"{results.calibration_s:.0f} s. Starts killed: {spread([s.seconds for s in starts if s.landed])}; "
        f"starts that ran to the end: {spread(to_end)}.",
    ]
    if tally.anomalies:
        lines += ["", "Anomalies:", "", *[f"- {a}" for a in tally.anomalies]]
    if tally.mismatches:
        lines += ["", f"**{len(tally.mismatches)} round(s) differ.** The first: {tally.mismatches[0]}"]
    if tally.crash:
        lines += ["", "**A start failed**, and the benchmark stopped there:", "", "```", tally.crash, "```"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=20261201, help="seed of the kill points")
    parser.add_argument("--kills", type=int, default=100, help="SIGKILLs to land")
    parser.add_argument("--sigterms", type=int, default=5, help="SIGTERMs to land")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="rounds run at a time, each on its own fork server (one CPU thread a run)")
    options = parser.parse_args()
    wall = time.monotonic()
    chooser = random.Random(options.seed)
    results = Results(seed=options.seed, workers=options.workers)
    plan = kill_plan(chooser, options.kills, options.sigterms)
    # each worker its share of the kill points and its own generator, so one seed gives the same draws
    shares = [plan[i::options.workers] for i in range(options.workers)]
    choosers = [random.Random(chooser.getrandbits(64)) for _ in range(options.workers)]
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="tunecast-kill-resume-") as temporary:
        work = Path(temporary)
        os.environ["TUNECAST_CACHE"] = str(work / "cache")  # one memory-estimate cache for every run
        os.environ.update(THREADS)  # read by torch when a fork server imports it
        started = time.monotonic()
        with ThreadPoolExecutor(options.workers) as pool:
            servers = list(pool.map(lambda _: ForkServer.start(), range(options.workers)))
        results.server_s = time.monotonic() - started
        try:
            reference = run_reference(servers[0], work, results)
            results.hooked_writes = count_hooked_writes(servers, work, results)
            print(f"reference: {results.reference_s:.1f} s ({results.cold_s:.1f} s cold); {results.hooked_writes} "
                  f"of {results.file_writes} file writes seen by the hook ({results.calibration_s:.0f} s)", flush=True)
            numbers, stop = itertools.count(1), threading.Event()
            with ThreadPoolExecutor(options.workers) as pool:
                for part in pool.map(work_through, servers, shares, choosers, [numbers] * options.workers,
                                     [work] * options.workers, [reference] * options.workers,
                                     [results] * options.workers, [stop] * options.workers):
                    tally.add(part)
        finally:
            for server in servers:
                server.stop()
        results.wall_s = time.monotonic() - wall
        text = report(results, tally, options.kills, options.sigterms)
    write_section(DOC, "kill-resume", text)
    print(text)
    return 0 if tally.crash is None and not tally.mismatches and not tally.anomalies else 1


if __name__ == "__main__":
    raise SystemExit(main())
