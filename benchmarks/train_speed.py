"""Training speed: `tunecast train` against transformers `Trainer` (+ peft LoRA) and TRL `SFTTrainer`, on the
same model, data and settings; what checkpoints cost; how long a preempted run takes to train again.

What runs. One model for everything: the demo Llama of examples/tiny-model widened to MODEL (random weights
from the seed, the demo's byte-level BPE tokenizer of 1,024 tokens), LoRA rank 16 on every linear layer, fp32,
AdamW (torch's fused kernel in all three), a linear schedule without warm-up, gradient clipping at 1.0,
micro-batch 4 × no accumulation, sequences of 256 tokens, the same seed. Each run is a fresh process, one at
a time, all with the same thread count; 1 and 2 run REPEATS times per framework, frameworks alternating, 3 and 4
CHECKPOINT_REPEATS times.

1. Fixed-length data (every example exactly SEQ_LEN tokens: generated text longer than that, truncated):
   tunecast vs Trainer vs SFTTrainer (when TRL is installed). Target: tunecast ≥ 1.0× Trainer.
2. Variable-length data (lengths spread evenly from SEQ_LEN/16 to SEQ_LEN tokens): tunecast with
   `packing: true` vs a Trainer that pads each batch to its longest (DataCollatorForSeq2Seq, random sampler,
   no length grouping). Counted: real (non-padding) tokens. Target: ≥ 1.3×.
3. Checkpoints: tunecast with its automatic interval (checkpoint.every_steps and every_minutes unset) until
   an interval checkpoint has been written, vs the fixed-length runs of 1 (checkpoint.every_steps larger than
   the run). The write time is read off metrics.jsonl: the next step starts when the write ends.
4. Resume: the run of 3 gets SIGTERM (it saves and exits 75); then the same command again, timed from its
   launch to the first new `train` line of metrics.jsonl.

Same work. The Trainer gets tunecast's own token ids for the same file; SFTTrainer tokenizes the text itself
(every example checked to be SEQ_LEN tokens). Both get `use_cache` off, as tunecast runs the model (otherwise
transformers builds a KV cache in every training forward), `optim="adamw_torch_fused"`, and no checkpoints.

Timing. tunecast: from metrics.jsonl, `elapsed_s` between consecutive train lines (wall time per step, all
included) and `step_seconds` (forward, backward, clipping, optimizer step). Trainer/SFTTrainer: a
TrainerCallback, on_step_end to on_step_end (wall) and on_step_begin to on_step_end (the same part of the
step). The first SKIP steps are warm-up and not counted; a figure is the median over the other steps of all
runs of real tokens ÷ wall seconds. Other processes on a shared machine slow a run several-fold (two threads
that wait for each other lose a whole time slice when either is descheduled), so a sampler reads /proc/stat
and the run's own CPU time every SAMPLE_S: a step is clean when other processes used under CLEAN_CORES of the
cores the run leaves free, and figures are over clean steps when each side has MIN_CLEAN of them. Before each
run the benchmark waits (up to QUIET_WAIT_S) for the machine to be quiet.

Run:  .venv/bin/python benchmarks/train_speed.py            (about 10 minutes on 2 cores)
      .venv/bin/python benchmarks/train_speed.py --quick    (smoke test: one repeat, fewer steps; prints)
      --raw FILE keeps every step's figures; --threads N runs every framework with N torch threads.
Writes docs/benchmarks/train-speed.md.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml
from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks" / "train-speed.md"
MARK = "train-speed"
TINY = REPO / "examples" / "tiny-model"
TUNECAST = Path(sys.executable).parent / "tunecast"

# The demo model widened until a step's matmuls dominate the Python around them (~13 GFLOP per step).
MODEL = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2}
SEQ_LEN = 256
MICRO_BATCH = 4
STEPS = 20
SKIP = 3  # warm-up steps left out of every figure
REPEATS = 3  # runs of each framework in 1 and 2
CHECKPOINT_REPEATS = 2  # runs of 3 and 4
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": "all-linear"}
LEARNING_RATE = 1e-4
SEED = 0
DEFAULT_CHECKPOINT_LIMIT_S = 150.0  # the automatic interval is at least a minute; stop waiting after this
QUIET_CORES = 0.3  # before each run, wait (up to QUIET_WAIT_S) until other processes use less than this
QUIET_WAIT_S = 20.0
CLEAN_CORES = 0.15  # a step is clean when other processes used less than this beyond the cores left free
SAMPLE_S = 0.05
MIN_CLEAN = 6  # clean steps a framework needs before its figure is taken from clean steps only
CORES = os.cpu_count() or 1
CHILD_ENV = {"MKL_DYNAMIC": "FALSE", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


@dataclass
class Run:
    """One training process: per optimizer step, real tokens, tokens computed, seconds, and the CPU other
    processes on the machine took during the step."""

    label: str
    tokens: list[int]
    padded_tokens: list[int]
    wall_s: list[float]  # from the previous step's end to this step's end (the first: its own compute)
    compute_s: list[float]  # forward, backward, clipping, optimizer step
    cpu_s: list[float]  # CPU seconds the process used over the wall span (all threads)
    other_cores: list[float]  # CPU seconds of other processes during the step ÷ its wall seconds
    run_other_cores: float  # the same over the whole process
    clean_below: float  # a step is clean when other processes used fewer cores than this

    def steady(self, clean: bool = False) -> list[int]:
        """The steps after warm-up; `clean`: only those during which other processes stayed under clean_below."""
        return [i for i in range(SKIP, len(self.tokens)) if not clean or self.other_cores[i] < self.clean_below]

    def rates(self, clean: bool = False, seconds: str = "wall_s") -> list[float]:
        """Real tokens per second of each steady step: per wall, compute-only or CPU second."""
        spent = getattr(self, seconds)
        return [self.tokens[i] / spent[i] for i in self.steady(clean)]

    @property
    def tokens_per_s(self) -> float:
        """Median over the steady steps of real tokens ÷ wall seconds."""
        return statistics.median(self.rates())

    @property
    def padding_share(self) -> float:
        steps = self.steady()
        return 1 - sum(self.tokens[i] for i in steps) / sum(self.padded_tokens[i] for i in steps)


# --- the load other processes put on the machine --------------------------------------------------------


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of process `pid`, its threads and waited-for children (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as handle:
        text = handle.read()
    fields = text[text.rindex(")") + 2:].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Every SAMPLE_S while a run lasts: the machine's busy CPU seconds and the run's own, so that the CPU
    other processes took can be told for any span; and, given a metrics file, when each line appeared."""

    def __init__(self, pid: int, metrics: Path | None = None) -> None:
        self.pid, self.metrics = pid, metrics
        self.samples: list[tuple[float, float, float]] = []  # (monotonic s, machine busy s, run's own s)
        self.arrivals: list[float] = []  # monotonic s at which each metrics line was first seen
        self._stop = threading.Event()
        self._own = 0.0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        seen = 0
        while not self._stop.is_set():
            now = time.monotonic()
            with contextlib.suppress(OSError, ValueError):  # once it has exited, its last reading stands
                self._own = _process_cpu_s(self.pid)
            self.samples.append((now, _busy_cpu_s(), self._own))
            if self.metrics is not None and self.metrics.exists():
                lines = self.metrics.read_bytes().count(b"\n")
                self.arrivals += [now] * max(0, lines - seen)
                seen = max(seen, lines)
            self._stop.wait(SAMPLE_S)

    def stop(self) -> Sampler:
        self._stop.set()
        self._thread.join()
        return self

    def _at(self, moment: float, column: int) -> float:
        """A sampled column (1: machine busy s, 2: the run's own s) at `moment`, interpolated."""
        times = [sample[0] for sample in self.samples]
        after = bisect.bisect_right(times, moment)
        if after == 0:
            return self.samples[0][column]
        if after == len(times):
            return self.samples[-1][column]
        before, later = self.samples[after - 1], self.samples[after]
        return before[column] + (later[column] - before[column]) * (moment - before[0]) / (later[0] - before[0])

    def own_cpu_s(self, start: float, end: float) -> float:
        """CPU seconds the run itself (all its threads) used from `start` to `end`."""
        return self._at(end, 2) - self._at(start, 2)

    def other_cores(self, start: float, end: float) -> float:
        """Cores other processes kept busy from `start` to `end`."""
        busy = self._at(end, 1) - self._at(start, 1)
        return max(0.0, (busy - self.own_cpu_s(start, end)) / (end - start)) if end > start else float("nan")

    def whole(self) -> float:
        return self.other_cores(self.samples[0][0], self.samples[-1][0])


def wait_for_quiet(limit_s: float = QUIET_WAIT_S) -> float:
    """Wait until other processes use less than QUIET_CORES (sampled over a second), at most `limit_s`;
    returns the seconds waited."""
    started = time.monotonic()
    while True:
        busy = _busy_cpu_s()
        time.sleep(1.0)
        if _busy_cpu_s() - busy < QUIET_CORES or time.monotonic() - started > limit_s:
            return time.monotonic() - started


# --- model and data -------------------------------------------------------------------------------------


def make_model(folder: Path) -> Path:
    """The demo model's config widened to MODEL, beside the demo tokenizer."""
    folder.mkdir(parents=True)
    config = json.loads((TINY / "config.json").read_text()) | MODEL
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for path in TINY.iterdir():
        if path.name != "config.json":
            shutil.copy(path, folder / path.name)
    return folder


def make_data(folder: Path, examples_fixed: int, examples_variable: int) -> tuple[Path, Path]:
    """Two `text` JSONL files of random words: every text longer than SEQ_LEN tokens (fixed, once truncated),
    and texts whose lengths spread evenly over SEQ_LEN/16 … SEQ_LEN tokens (variable)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    rng = random.Random(SEED)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]

    def text_of(tokens: int) -> str:
        chosen: list[str] = []
        while len(tokenizer.encode(" ".join(chosen)).ids) < tokens:
            chosen += [rng.choice(words) for _ in range(2)]
        return " ".join(chosen)

    fixed, variable = folder / "fixed.jsonl", folder / "variable.jsonl"
    fixed.write_text("".join(json.dumps({"text": text_of(SEQ_LEN + 8)}) + "\n" for _ in range(examples_fixed)))
    variable.write_text("".join(json.dumps({"text": text_of(rng.randint(SEQ_LEN // 16, SEQ_LEN - 1))}) + "\n"
                                for _ in range(examples_variable)))
    return fixed, variable


# --- tunecast --------------------------------------------------------------------------------------------


def tunecast_config(folder: Path, model: Path, data: Path, *, steps: int, packing: bool = False,
                    checkpoint: dict[str, Any] | None = None) -> Path:
    config: dict[str, Any] = {
        "model": str(model), "random_weights": True, "method": "lora", "lora": LORA, "precision": "fp32",
        "optimizer": "adamw",
        "micro_batch": MICRO_BATCH, "grad_accum": 1, "seq_len": SEQ_LEN, "learning_rate": LEARNING_RATE,
        "schedule": "linear", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": SEED,
        "max_steps": steps, "packing": packing, "dataset": {"path": str(data), "format": "text"},
        "output": str(folder / "out"),
    }
    if checkpoint is not None:
        config["checkpoint"] = checkpoint
    folder.mkdir(parents=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _records(output: Path) -> list[dict[str, Any]]:
    path = output / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def clean_below(env: dict[str, str]) -> float:
    """Other processes' load under which a step counts as clean: the cores the run's threads leave free, and
    CLEAN_CORES more."""
    return max(0, CORES - int(env["OMP_NUM_THREADS"])) + CLEAN_CORES


def _tunecast_run(label: str, records: list[dict[str, Any]], sampler: Sampler, clean_below: float) -> Run:
    """A run from its metrics.jsonl (one process's lines, in order) and the sampler that watched it."""
    lines = [i for i, r in enumerate(records) if r["kind"] == "train"]
    train = [records[i] for i in lines]
    # `elapsed_s` counts from tunecast's start; on the monotonic clock that start is where lines arrived soonest
    start = min(sampler.arrivals[i] - records[i]["elapsed_s"] for i in lines if i < len(sampler.arrivals))
    ends = [start + r["elapsed_s"] for r in train]
    wall = [train[0]["step_seconds"]] + [b - a for a, b in pairwise(ends)]
    spans = [(end - seconds, end) for end, seconds in zip(ends, wall, strict=True)]
    return Run(label, [r["tokens"] for r in train], [r["padded_tokens"] for r in train], wall,
               [r["step_seconds"] for r in train], [sampler.own_cpu_s(*span) for span in spans],
               [sampler.other_cores(*span) for span in spans], sampler.whole(), clean_below)


def run_tunecast(label: str, config: Path, env: dict[str, str]) -> Run:
    output = config.parent / "out"
    with open(config.parent / "stderr.txt", "w") as stderr:
        process = subprocess.Popen([str(TUNECAST), "train", str(config)], stdout=subprocess.DEVNULL, stderr=stderr,
                                   env=env)
        sampler = Sampler(process.pid, output / "metrics.jsonl")
        code = process.wait()
        sampler.stop()
    if code != 0:
        raise RuntimeError(f"tunecast train {config} exited {code}:\n"
                           f"{(config.parent / 'stderr.txt').read_text()[-3000:]}")
    return _tunecast_run(label, _records(output), sampler, clean_below(env))


def run_default_checkpoint(config: Path, env: dict[str, str], after: int) -> tuple[Run, dict[str, Any]]:
    """Train with the automatic checkpoint interval until an interval checkpoint and `after` more steps (or
    DEFAULT_CHECKPOINT_LIMIT_S), then SIGTERM: the run saves and exits 75."""
    output = config.parent / "out"
    with open(config.parent / "stderr.txt", "w") as stderr:
        process = subprocess.Popen([str(TUNECAST), "train", str(config)], stdout=subprocess.DEVNULL, stderr=stderr,
                                   env=env)
        sampler = Sampler(process.pid, output / "metrics.jsonl")
        first_step_at = None
        while process.poll() is None:
            time.sleep(0.2)
            records = _records(output)
            train = [r for r in records if r["kind"] == "train"]
            if train and first_step_at is None:
                first_step_at = time.monotonic()
            saved = [r["step"] for r in records if r.get("event") == "checkpoint" and r["reason"] == "interval"]
            if (saved and train[-1]["step"] >= saved[0] + after) or (
                    first_step_at is not None and time.monotonic() - first_step_at > DEFAULT_CHECKPOINT_LIMIT_S):
                process.send_signal(signal.SIGTERM)
                break
        code = process.wait()
        sampler.stop()
    if code != 75:
        raise RuntimeError(f"tunecast train {config} exited {code}, not 75 after SIGTERM: "
                           f"{(config.parent / 'stderr.txt').read_text()[-3000:]}")
    records = _records(output)
    run = _tunecast_run("tunecast, automatic checkpoints", records, sampler, clean_below(env))
    start = next(r for r in records if r.get("event") == "start")
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    writes, waited = [], []
    for event in (r for r in records if r.get("event") == "checkpoint" and r["reason"] == "interval"):
        following = train.get(event["step"] + 1)
        if following is not None:  # the next step starts when the write (and that step's collation) ends
            writes.append(following["elapsed_s"] - following["step_seconds"] - event["elapsed_s"])
            waited.append(event["step"])  # that step's index in the run: its wall time includes the write
    reported = [line for line in (config.parent / "stderr.txt").read_text().splitlines()
                if line.startswith("checkpoint at step") and "(interval" in line]
    return run, {"policy": start["checkpoint_policy"], "writes_s": writes, "waited": waited, "reported": reported,
                 "steps": len(run.tokens), "wall_s": sum(run.wall_s)}


def time_resume(config: Path, env: dict[str, str]) -> dict[str, float]:
    """Launch the same command again: seconds to its `resume` event and to its first new train line."""
    output = config.parent / "out"
    launched = time.monotonic()
    process = subprocess.Popen([str(TUNECAST), "train", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    sampler = Sampler(process.pid)
    resumed_at = first_step_at = None
    step_s = float("nan")
    while process.poll() is None and first_step_at is None:
        time.sleep(0.02)
        records = _records(output)
        marks = [i for i, r in enumerate(records) if r.get("event") == "resume"]
        if not marks:
            continue
        if resumed_at is None:
            resumed_at = time.monotonic()
        new = [r for r in records[marks[-1]:] if r["kind"] == "train"]
        if new:
            first_step_at = time.monotonic()
            step_s = new[0]["step_seconds"]
    process.send_signal(signal.SIGTERM)
    code = process.wait()
    sampler.stop()
    if first_step_at is None or resumed_at is None or code != 75:
        raise RuntimeError(f"the resumed run of {config} exited {code} before a new step")
    return {"to_first_step_s": first_step_at - launched, "to_resume_event_s": resumed_at - launched,
            "first_step_s": step_s, "other_cores": sampler.other_cores(launched, first_step_at)}


# --- Trainer and SFTTrainer (in a fresh process each) ----------------------------------------------------


def run_child(label: str, kind: str, model: Path, data: Path, steps: int, env: dict[str, str]) -> Run:
    args = json.dumps({"kind": kind, "model": str(model), "data": str(data), "steps": steps})
    process = subprocess.Popen([sys.executable, __file__, "--child", args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    sampler = Sampler(process.pid)
    stdout, stderr = process.communicate()
    sampler.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{label} exited {process.returncode}:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    ends, begins = result["ends"], result["begins"]
    compute = [end - begin for begin, end in zip(begins, ends, strict=True)]
    wall = [compute[0]] + [b - a for a, b in pairwise(ends)]
    spans = [(end - seconds, end) for end, seconds in zip(ends, wall, strict=True)]
    return Run(label, result["tokens"], result["padded_tokens"], wall, compute,
               [sampler.own_cpu_s(*span) for span in spans], [sampler.other_cores(*span) for span in spans],
               sampler.whole(), clean_below(env))


def child(kind: str, model_dir: str, data: str, steps: int) -> dict[str, Any]:
    """Trainer (`trainer`) or SFTTrainer (`trl`) with LoRA, the settings tunecast_config writes, timed."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False  # tunecast passes use_cache=False: no KV cache is built in a training forward
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    lora = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["targets"], task_type="CAUSAL_LM")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    begins: list[float] = []
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            begins.append(time.monotonic())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.monotonic())

    common = dict(output_dir=tempfile.mkdtemp(prefix="train-speed-"), per_device_train_batch_size=MICRO_BATCH,
                  gradient_accumulation_steps=1, max_steps=steps, learning_rate=LEARNING_RATE,
                  lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                  optim="adamw_torch_fused", seed=SEED, data_seed=SEED, logging_steps=1, save_strategy="no",
                  eval_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
                  train_sampling_strategy="random", bf16=False, fp16=False, gradient_checkpointing=False)
    if kind == "trl":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, args=SFTConfig(**common, max_length=SEQ_LEN, packing=False,
                                                         dataset_text_field="text"),
                             train_dataset=Dataset.from_json(data), processing_class=tokenizer, peft_config=lora,
                             callbacks=[Clock()])
        lengths = {len(ids) for ids in trainer.train_dataset["input_ids"]}
        assert lengths == {SEQ_LEN}, f"SFTTrainer's examples are not all {SEQ_LEN} tokens: {sorted(lengths)[:5]}"
        trainer.train()
        tokens = [MICRO_BATCH * SEQ_LEN] * len(ends)
        return {"tokens": tokens, "padded_tokens": tokens, "begins": begins, "ends": ends}

    from peft import get_peft_model
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from tunecast.data.tokens import load_tokenizer
    from tunecast.train.batches import load_train_data

    units = load_train_data(data, load_tokenizer(model_dir), layout="text", train_on="auto", seq_len=SEQ_LEN,
                            packing=False, eval_examples=0, seed=SEED, skip_invalid=False,
                            pad_id=tokenizer.pad_token_id).units
    dataset = Dataset.from_dict({"input_ids": [u.input_ids for u in units], "labels": [u.labels for u in units]})
    pad = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    real: list[int] = []
    padded: list[int] = []

    def collate(features: list[dict[str, Any]]) -> Any:
        # batches are collated in the order they are trained (no workers), so the n-th call is step n's
        real.append(sum(len(f["input_ids"]) for f in features))
        padded.append(len(features) * max(len(f["input_ids"]) for f in features))
        return pad(features)

    trainer = Trainer(model=get_peft_model(model, lora), args=TrainingArguments(**common), train_dataset=dataset,
                      data_collator=collate, callbacks=[Clock()])
    trainer.train()
    return {"tokens": real[:len(ends)], "padded_tokens": padded[:len(ends)], "begins": begins, "ends": ends}


# --- the benchmark ---------------------------------------------------------------------------------------


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _alternate(jobs: list[tuple[str, Any]], repeats: int) -> dict[str, list[Run]]:
    """Run each job `repeats` times, round-robin, each after the machine is quiet."""
    runs: dict[str, list[Run]] = {name: [] for name, _ in jobs}
    for repeat in range(repeats):
        for name, job in jobs:
            waited = wait_for_quiet()
            run = job(repeat)
            runs[name].append(run)
            clean = run.rates(clean=True)
            print(f"{name} #{repeat + 1}: {run.tokens_per_s:,.0f} tok/s (median, wall), clean steps "
                  f"{len(clean)}/{len(run.steady())}: {statistics.median(clean) if clean else float('nan'):,.0f} "
                  f"tok/s; padding {run.padding_share:.0%}; other processes {run.run_other_cores:.2f} cores; "
                  f"waited {waited:.0f} s for quiet", flush=True)
    return runs


@dataclass(frozen=True)
class Summary:
    """A framework's runs together: medians over the steady steps of all its runs."""

    tokens_per_s: float  # clean steps when there are MIN_CLEAN of them, else all steps
    clean_steps: int
    all_steps: int
    all_tokens_per_s: float
    compute_tokens_per_s: float
    cpu_tokens_per_s: float  # real tokens per CPU second of the process (all steady steps)
    padding_share: float
    per_run: list[float]
    other_cores: list[float]

    @property
    def clean(self) -> bool:
        return self.clean_steps >= MIN_CLEAN

    @classmethod
    def of(cls, runs: list[Run]) -> Summary:
        clean = [rate for run in runs for rate in run.rates(clean=True)]
        every = [rate for run in runs for rate in run.rates()]
        use_clean = len(clean) >= MIN_CLEAN
        compute = [rate for run in runs for rate in run.rates(clean=use_clean, seconds="compute_s")]
        cpu = [rate for run in runs for rate in run.rates(seconds="cpu_s")]
        return cls(statistics.median(clean if use_clean else every), len(clean), len(every),
                   statistics.median(every), statistics.median(compute), statistics.median(cpu),
                   statistics.median(run.padding_share for run in runs), [run.tokens_per_s for run in runs],
                   [run.run_other_cores for run in runs])


def _rows(runs: dict[str, list[Run]], baseline: str) -> tuple[list[str], float]:
    """The table of one comparison, and the first framework's ratio to `baseline`."""
    summaries = {name: Summary.of(group) for name, group in runs.items()}
    both_clean = all(summary.clean for summary in summaries.values())
    base = summaries[baseline].tokens_per_s if both_clean else summaries[baseline].all_tokens_per_s
    lines = [f"| | real tok/s, median over {'clean' if both_clean else 'all'} steps | clean steps | all steps: "
             "median tok/s (per run) | compute-only tok/s | tok per CPU-s | padding | other processes, cores "
             f"(per run) | × {baseline} |", "|---|---:|---:|---|---:|---:|---:|---|---:|"]
    ratio = float("nan")
    for name, summary in summaries.items():
        value = summary.tokens_per_s if both_clean else summary.all_tokens_per_s
        if math.isnan(ratio):
            ratio = value / base
        lines.append(f"| {name} | {value:,.0f} | {summary.clean_steps} of {summary.all_steps} | "
                     f"{summary.all_tokens_per_s:,.0f} ({', '.join(f'{v:,.0f}' for v in summary.per_run)}) | "
                     f"{summary.compute_tokens_per_s:,.0f} | {summary.cpu_tokens_per_s:,.0f} | "
                     f"{summary.padding_share:.0%} | "
                     f"{', '.join(f'{v:.2f}' for v in summary.other_cores)} | {value / base:.2f}× |")
    if not both_clean:
        lines += ["", f"Fewer than {MIN_CLEAN} clean steps on one side: the figures are over all steps, other "
                      "processes' load included."]
    return lines, ratio


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--raw", type=Path, help="also write every run's per-step figures to this JSON file")
    parser.add_argument("--threads", type=int, default=CORES, help=f"torch threads of every run (default {CORES})")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat, fewer steps; print the report instead of writing the doc")
    args = parser.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(child(job["kind"], job["model"], job["data"], job["steps"])))
        return 0

    steps = 8 if args.quick else STEPS
    repeats = 1 if args.quick else REPEATS
    has_trl = _version("trl") is not None
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="train-speed-") as temporary:
        root = Path(temporary)
        env = {**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               "TUNECAST_CACHE": str(root / "cache")}
        model = make_model(root / "model")
        fixed, variable = make_data(root, examples_fixed=steps * MICRO_BATCH + 8, examples_variable=steps * 12)
        count = iter(range(10_000))

        def tunecast(data: Path, **settings: Any) -> Any:
            return lambda _: run_tunecast("tunecast", tunecast_config(root / f"run-{next(count)}", model, data,
                                                                       steps=steps, **settings), env)

        print("1. fixed-length data", flush=True)
        fixed_jobs = [("tunecast", tunecast(fixed, checkpoint={"every_steps": 1_000_000})),
                      ("Trainer", lambda _: run_child("Trainer", "trainer", model, fixed, steps, env))]
        if has_trl:
            fixed_jobs.append(("SFTTrainer", lambda _: run_child("SFTTrainer", "trl", model, fixed, steps, env)))
        fixed_runs = _alternate(fixed_jobs, repeats)

        print("2. variable-length data", flush=True)
        variable_runs = _alternate([
            ("tunecast, packing", tunecast(variable, packing=True, checkpoint={"every_steps": 1_000_000})),
            ("Trainer, padding", lambda _: run_child("Trainer", "trainer", model, variable, steps, env)),
        ], repeats)

        print("3, 4. automatic checkpoints, then SIGTERM and resume", flush=True)
        checkpoint_runs: list[tuple[Run, dict[str, Any]]] = []
        resumes: list[dict[str, float]] = []
        for _ in range(1 if args.quick else CHECKPOINT_REPEATS):
            wait_for_quiet()
            config = tunecast_config(root / f"run-{next(count)}", model, fixed, steps=100_000)
            run, info = run_default_checkpoint(config, env, after=2 if args.quick else 5)
            checkpoint_runs.append((run, info))
            print(f"automatic checkpoints: {info['policy']}; {info['steps']} steps, writes {info['writes_s']} "
                  f"({info['reported']}), other processes {run.run_other_cores:.2f} cores", flush=True)
            wait_for_quiet()
            resumes.append(time_resume(config, env))
            print(f"resume: {resumes[-1]}", flush=True)
    total_s = time.monotonic() - began
    print(f"benchmark took {total_s / 60:.1f} min", flush=True)
    if args.raw:
        args.raw.write_text(json.dumps({
            "fixed": {name: [asdict(run) for run in group] for name, group in fixed_runs.items()},
            "variable": {name: [asdict(run) for run in group] for name, group in variable_runs.items()},
            "checkpoint": [{"run": asdict(run), **info} for run, info in checkpoint_runs], "resume": resumes}))
    text = report(fixed_runs, variable_runs, checkpoint_runs, resumes, total_s, args.threads)
    if args.quick:
        print(text)
    else:
        write_section(DOC, MARK, text)
    return 0


def report(fixed_runs: dict[str, list[Run]], variable_runs: dict[str, list[Run]],
           checkpoint_runs: list[tuple[Run, dict[str, Any]]], resumes: list[dict[str, float]], total_s: float,
           threads: int) -> str:
    versions = ", ".join(f"{name} {_version(name)}" for name in ("torch", "transformers", "peft", "accelerate", "trl")
                         if _version(name))
    fixed_table, fixed_ratio = _rows(fixed_runs, "Trainer")
    variable_table, variable_ratio = _rows(variable_runs, "Trainer, padding")
    writes = [w for _, info in checkpoint_runs for w in info["writes_s"]]
    share = [sum(info["writes_s"]) / info["wall_s"] for _, info in checkpoint_runs]

    def mean_step(run: Run, waited: list[int]) -> float:
        """Mean wall seconds per step over the clean steps and every step that waited for a write."""
        steps = sorted(set(run.steady(clean=True)) | {i for i in waited if i >= SKIP})
        return statistics.mean(run.wall_s[i] for i in steps) if steps else float("nan")

    on = [mean_step(run, info["waited"]) for run, info in checkpoint_runs]
    off = [mean_step(run, []) for run in fixed_runs["tunecast"]]
    lines = [
        f"Measured with `.venv/bin/python benchmarks/train_speed.py` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {CORES} cores, {threads} torch thread(s) in every run (OMP_NUM_THREADS), "
        f"Python {platform.python_version()}, {versions}. The whole benchmark took {total_s / 60:.1f} min.",
        "",
        f"Model: the demo Llama widened to hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, "
        f"intermediate {MODEL['intermediate_size']}, vocabulary 1,024, random weights (seed {SEED}); LoRA rank "
        f"{LORA['rank']} (alpha {LORA['alpha']}) on every linear layer; fp32; fused AdamW, learning rate "
        f"{LEARNING_RATE:g}, linear schedule, clipping 1.0; micro-batch {MICRO_BATCH}, no accumulation, seq_len "
        f"{SEQ_LEN}; {len(fixed_runs['tunecast'][0].tokens)} optimizer steps per run, the first {SKIP} not "
        f"counted; {len(fixed_runs['tunecast'])} runs of each, alternating, each a fresh process.",
        "",
        "tok/s: real (non-padding) tokens per second, per step tokens ÷ wall seconds from the previous step's end "
        "(compute-only: forward, backward, clipping and optimizer step alone), the median over the steps of all "
        "runs. Clean steps: steps during which other processes on the machine used under "
        f"{clean_below({'OMP_NUM_THREADS': str(threads)}):.2f} cores (sampled every 50 ms); the figures are over "
        "clean steps when each side has at least "
        f"{MIN_CLEAN}. 'Other processes' is that load over each whole run.",
        "",
        "### 1. Fixed-length data (every example exactly seq_len tokens)",
        "",
        *fixed_table,
        "",
        f"tunecast ÷ Trainer: **{fixed_ratio:.2f}×** (target ≥ 1.0×: {'met' if fixed_ratio >= 1.0 else 'missed'}).",
        "",
        f"### 2. Variable-length data ({SEQ_LEN // 16}–{SEQ_LEN} tokens, evenly spread): packing vs padding",
        "",
        *variable_table,
        "",
        f"tunecast (packing) ÷ Trainer (padding to the longest of each batch): **{variable_ratio:.2f}×** "
        f"(target ≥ 1.3×: {'met' if variable_ratio >= 1.3 else 'missed'}).",
        "",
        "### 3. Checkpoint overhead (automatic interval vs none)",
        "",
        f"Automatic interval: {checkpoint_runs[0][1]['policy']}. Each run trained until one interval checkpoint "
        f"had been written and a few steps more ({', '.join(str(i['steps']) for _, i in checkpoint_runs)} steps); "
        "checkpoints off: the tunecast runs of 1.",
        "",
        "| | per run | median |",
        "|---|---|---:|",
        f"| checkpoint write, s (next step's start − the checkpoint event, from metrics.jsonl) | "
        f"{', '.join(f'{w:.3f}' for w in writes) or 'none written'} | "
        f"{statistics.median(writes) if writes else float('nan'):.3f} |",
        f"| **overhead: writes ÷ training wall time** | {', '.join(f'{s:.2%}' for s in share)} | "
        f"**{statistics.median(share):.2%}** |",
    ]
    lines += [f"| mean wall s per step (clean steps, and the steps that waited for a write): automatic checkpoints | "
              f"{', '.join(f'{v:.3f}' for v in on)} | {statistics.median(on):.3f} |",
              f"| the same, checkpoints off | {', '.join(f'{v:.3f}' for v in off)} | {statistics.median(off):.3f} |",
              f"| A/B difference, % of step time (noise included) | | "
              f"{statistics.median(on) / statistics.median(off) - 1:+.1%} |"]
    lines += [
        "",
        "tunecast's own report of each write (stderr): "
        + "; ".join(line for _, info in checkpoint_runs for line in info["reported"]) + ".",
        "",
        "### 4. Time to resume after SIGTERM (exit 75), the same command again",
        "",
        "| | per run | median |",
        "|---|---|---:|",
    ]
    for key, label in (("to_first_step_s", "**launch → first new train line in metrics.jsonl, s**"),
                       ("to_resume_event_s", "launch → `resume` event (set-up done, checkpoint restored), s"),
                       ("first_step_s", "the first new step itself (its step_seconds), s"),
                       ("other_cores", "other processes meanwhile, cores")):
        values = [resume[key] for resume in resumes]
        lines.append(f"| {label} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} |")
    return "# Training speed\n\n" + INTRO + "\n" + "\n".join(lines)


INTRO = """\
`tunecast train` side by side with transformers' `Trainer` + peft LoRA (and TRL's `SFTTrainer`) on the same
model, data and settings, on the CPU; what checkpoints cost; how long a preempted run takes to train again.
How each figure is taken is described at the top of `benchmarks/train_speed.py`. Rerun with
`.venv/bin/python benchmarks/train_speed.py` (about 10 minutes on 2 cores; `--quick` for a smoke test that
writes nothing).
"""


if __name__ == "__main__":
    raise SystemExit(main())
