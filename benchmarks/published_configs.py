"""Every published example config in tests/data/runners/published read with `--from`: `tunecast plan` and `tunecast
memory`, each a fresh process, offline, with an empty cache.

Target (issue 31): offline, at least 9 in 10 of the supervised fine-tuning examples of axolotl, LLaMA-Factory, TRL
and torchtune plan within 10 s each; the others are refused cleanly, and only for a stage that is not supervised
fine-tuning (DPO, KTO, PPO, a reward model, distillation) or a multimodal model. "Refused cleanly" is exit status 2,
an error message of one line and no traceback; a traceback, any other failing exit status or a command still running
after the time limit fails badly.

Each file runs three commands: `plan --from TOOL FILE --json` as a user would type it; the same plan with the
dataset's size declared (`--set dataset.examples=… --set dataset.mean_tokens=…`), which tells a refusal for want of
the dataset's size (a dataset on the Hub, offline) from any other; and `memory --from TOOL FILE --json`. What each
file trains and where it comes from is the table of tests/data/runners/published/README.md. Rows run in turn, one
process at a time.

Run:  .venv/bin/python benchmarks/published_configs.py [--limit SECONDS] [--only SUBSTRING]
Writes docs/benchmarks/published-configs.md (not with --only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "tests" / "data" / "runners" / "published"
DOC = REPO / "docs" / "benchmarks" / "published-configs.md"
DATASET = ["--set", "dataset.examples=20000", "--set", "dataset.mean_tokens=600"]
TARGET_S = 10.0
ALLOWED = ("dpo", "kto", "ppo", "reward model", "distillation")  # stages tunecast may refuse; and multimodal models
NO_SIZE = "the plan needs the dataset's size"
TRACE_WORDS = ("tracing the", "building the step template")


@dataclass(frozen=True)
class Source:
    file: str  # relative to PUBLISHED; its first folder is the tool `--from` names
    trains: str
    repository: str
    path: str
    commit: str


@dataclass(frozen=True)
class Outcome:
    kind: str  # "answered", "refused" or "failed"
    seconds: float | None  # None: stopped at the time limit
    line: str  # the refusal or failure, one line; the answer's gist when answered
    traced: bool = False  # its stderr announced a trace or a template build

    def within(self, limit: float) -> bool:
        return self.kind == "answered" and self.seconds is not None and self.seconds <= limit


def sources() -> list[Source]:
    """The README's table, one row per file (`| file | trains | repository | path | commit | licence |`)."""
    rows = []
    for line in (PUBLISHED / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].endswith((".yml", ".yaml")):
            rows.append(Source(*cells[:5]))
    return rows


def run(command: list[str], limit: float, home: Path) -> Outcome:
    """`tunecast COMMAND` in a fresh process with an empty cache and catalog folder, offline, from the repository."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNECAST_", "HF_"))}
    env.update({"TUNECAST_CACHE": tempfile.mkdtemp(prefix="cache-", dir=home),
                "TUNECAST_CATALOG": str(home / "catalog"), "XDG_CACHE_HOME": tempfile.mkdtemp(dir=home),
                "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")})
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "tunecast", *command], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired as stopped:
        said = stopped.stderr.decode() if isinstance(stopped.stderr, bytes) else (stopped.stderr or "")
        return Outcome("failed", None, f"still running after {limit:g} s", any(w in said for w in TRACE_WORDS))
    seconds = time.perf_counter() - start
    traced = any(word in done.stderr for word in TRACE_WORDS)
    if "Traceback (most recent call last)" in done.stderr:
        last = done.stderr.strip().splitlines()[-1]
        return Outcome("failed", seconds, f"exit {done.returncode}, traceback: {last}", traced)
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        answer = {}
    if done.returncode == 0:
        if "device_total_gib" in answer:
            return Outcome("answered", seconds, f"{answer['device_total_gib']:.2f} GiB", traced)
        return Outcome("answered", seconds, f"{len(answer.get('options', []))} options", traced)
    error = answer.get("error") or {}
    # A config error's message only counts its problems ("FILE (read as TOOL): 1 problem"): the problems say what.
    problems = [f"{p['field']}: {p['message']}" for p in error.get("problems") or [] if p["severity"] == "error"]
    message = "; ".join(problems) or error.get("message") or _first_error(done.stderr)
    if done.returncode == 2 and len(problems) <= 1 and "\n" not in message.strip():
        return Outcome("refused", seconds, message.strip(), traced)
    return Outcome("failed", seconds, f"exit {done.returncode}: " + " ⏎ ".join(message.strip().splitlines()), traced)


def _first_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return next((line.removeprefix("error: ") for line in lines if line.startswith("error:")), "\n".join(lines[:2]))


def _cell(outcome: Outcome, limit: float) -> str:
    seconds = f"> {limit:g}" if outcome.seconds is None else f"{outcome.seconds:.2f}"
    return f"{outcome.kind} | {seconds}{' traced' if outcome.traced else ''}"


def _text(line: str) -> str:
    """A message as a table cell: the copy's own path shortened, pipes escaped."""
    line = re.sub(r"tests/data/runners/published/", "", line)
    return line.replace("|", "\\|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a command is stopped (default 60)")
    parser.add_argument("--only", default="", help="only the files whose path holds this text (nothing is written)")
    options = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows: list[str] = []
    sft: list[tuple[Source, Outcome, Outcome]] = []  # supervised fine-tuning of a text model: (source, plan, sized)
    not_refused: list[str] = []  # a stage tunecast does not estimate, answered
    other: list[str] = []  # refused for another reason than the stage, the model's modality or the dataset's size
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tunecast-published-") as directory:
        home = Path(directory)
        for source in sources():
            if options.only not in source.file:
                continue
            tool = source.file.split("/")[0]
            path = str((PUBLISHED / source.file).relative_to(REPO))
            plan = run(["plan", "--from", tool, path, "--json"], options.limit, home)
            sized = run(["plan", "--from", tool, path, "--json", *DATASET], options.limit, home)
            memory = run(["memory", "--from", tool, path, "--json"], options.limit, home)
            outcomes = (plan, sized, memory)
            stage, multimodal = source.trains.split(",")[0], "multimodal" in source.trains
            if stage in ("sft", "pt") and not multimodal:
                sft.append((source, plan, sized))
            if stage in ALLOWED and any(o.kind == "answered" for o in outcomes):
                not_refused.append(f"`{source.file}` ({stage})")
            lines = list(dict.fromkeys(_text(o.line) for o in outcomes if o.kind != "answered"))
            if any(o.kind == "failed" for o in outcomes):
                failed.append(f"`{source.file}`: " + " / ".join(_text(o.line) for o in outcomes if o.kind == "failed"))
            elif stage not in ALLOWED and not multimodal:
                reasons = [line for line in lines if not line.startswith(NO_SIZE)]
                other += [f"`{source.file}`: {line}" for line in reasons]
            rows.append(f"| {tool} | `{source.file.split('/', 1)[1]}` | `{source.path}` | {source.trains} | "
                        f"{_cell(plan, options.limit)} | {_cell(sized, options.limit)} | "
                        f"{_cell(memory, options.limit)} | {' / '.join(lines) or '—'} |")
            print(rows[-1], flush=True)
    load_after = os.getloadavg()[0]
    met = sum(plan.within(TARGET_S) for _, plan, _ in sft)
    met_sized = sum(sized.within(TARGET_S) for _, _, sized in sft)
    answered_sized = sum(sized.kind == "answered" for _, _, sized in sft)
    no_size = sum(plan.line.startswith(NO_SIZE) for _, plan, _ in sft)
    commits = sorted({f"{s.repository} `{s.commit[:12]}`" for s in sources()})
    lines = [
        "# Published example configs read with `--from`",
        "",
        f"Written by `benchmarks/published_configs.py` on {time.strftime('%Y-%m-%d')}: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; load average {load_before:.2f} before, "
        f"{load_after:.2f} after. Every file of `tests/data/runners/published/` (copied unmodified from "
        f"{', '.join(commits)}; its README names each file's source), each command a fresh process with an empty "
        f"cache, offline (`HF_HUB_OFFLINE=1`), stopped after {options.limit:g} s. `plan` is "
        "`tunecast plan --from TOOL FILE --json` as typed; `plan, size given` adds "
        f"`{' '.join(DATASET)}`; `memory` is `tunecast memory --from TOOL FILE --json`. answered: exit 0 with an "
        "answer; refused: exit 2, a one-line message, no traceback; failed: anything else. \"traced\": the command "
        "traced a step or built a step template (no shipped template served it). The last column is each distinct "
        "refusal or failure.",
        "",
        "| tool | file | source path | trains | `plan` | s | `plan`, size given | s | `memory` | s | refusal |",
        "|---|---|---|---|---|---:|---|---:|---|---:|---|",
        *rows,
        "",
        "## Summary",
        "",
        f"- Supervised fine-tuning (or continued pre-training) of a text model, planned within {TARGET_S:g} s as "
        f"typed: **{met} of {len(sft)}** (target: 9 in 10). {no_size} of them are refused because the dataset is "
        "on the Hub and its size cannot be known offline.",
        f"- The same with the dataset's size given: {met_sized} of {len(sft)} within {TARGET_S:g} s; "
        f"{answered_sized} of {len(sft)} answered at all.",
        f"- A stage that is not supervised fine-tuning, answered instead of refused: {len(not_refused)}"
        + (" (" + ", ".join(not_refused) + ")." if not_refused else "."),
        "- Refused for a reason other than the stage, a multimodal model or the dataset's size: "
        f"{len(other)}" + (":" if other else "."),
        *[f"  - {item}" for item in other],
        f"- Failed badly (a traceback, another exit status, or still running after {options.limit:g} s): "
        f"{len(failed)}" + (":" if failed else "."),
        *[f"  - {item}" for item in failed],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not options.only:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0 if met * 10 >= 9 * len(sft) and not (not_refused or other or failed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
