"""On a CUDA GPU: `tunecast train` against transformers `Trainer` + peft on a real model shape — tokens per
second, MFU, and the measured peak memory next to `tunecast memory`'s prediction.

What runs. The shape of MODEL from the bundled catalog config, random weights (each process draws them from
SEED), beside the demo tokenizer of examples/tiny-model (byte-level BPE, 1,024 tokens: every id is below the
model's vocabulary). Every example is exactly SEQ_LEN tokens (random words, truncated). Both frameworks get the
same settings: bf16 weights without autocast, AdamW (torch's fused kernel), learning rate, linear schedule without
warm-up, clipping at 1.0, micro-batch MICRO_BATCH × no accumulation, no checkpointing, SDPA attention, `use_cache`
off. Two cases: LoRA rank 16 (alpha 32) on every linear layer, adapters in fp32 (peft's default in both), and a
full fine-tune. The Trainer is given tunecast's own token ids for the same file (as benchmarks/train_speed.py
does, whose settings and helpers this reuses). Each run is a fresh process; per case the frameworks alternate
A B, B A, … ; every case gets its first pair of runs before any case gets a second.

Timing. tunecast: per step, `elapsed_s` between consecutive `train` lines of metrics.jsonl (wall time, all
included; each step ends with a CUDA synchronize). Trainer: a callback that synchronizes CUDA at on_step_end,
from one on_step_end to the next. The first SKIP steps (allocator growth, kernel autotuning) are not counted; a
figure is the median, over the other steps of all runs, of tokens ÷ wall seconds. A tunecast run is stopped
(SIGKILL) once its last step's line is written: the end-of-run checkpoint and `final/` are not what is timed.

MFU = tokens/s × FLOPs per token ÷ the card's dense bf16 peak (`bf16_tflops` of the catalog's gpus.csv, with its
source). FLOPs per token are the throughput model's count, not 6·N: the matmul and attention FLOPs of one
forward and backward pass that `tunecast memory` traced for this very run (its profile cache), extrapolated to the
model's depth, ÷ the tokens of a micro-batch. Causal attention is counted at half the square; a LoRA step has no
weight-gradient matmul for the frozen weights, so its count is about 4·N (plus the adapters), not 6·N. The
optimizer step is not counted. `tunecast plan`'s tokens/s for the same run (plan/throughput.py `step_time`) is
shown beside the measurement.

Memory. `tunecast memory RUN.yaml --gpu GPU --json`, run before training (its trace is cached, so the training
processes' own memory check reads it), against the `peak_allocated_gib` / `peak_reserved_gib` of tunecast's last
metrics line (torch.cuda.max_memory_allocated / max_memory_reserved since the process started). The Trainer's
max_memory_allocated is shown too.

Time. Predictions first (one process per case, in parallel), then the runs; a run starts only while the longest
run so far still fits before --budget-s (from the script's start), and every child has a timeout, so the
script ends within about --budget-s + one run.

Run on a CUDA machine (no internet needed; bitsandbytes not needed):
    python benchmarks/gpu_train_check.py --gpu h200 --out results.json        (about 6 minutes; prints)
    python benchmarks/gpu_train_check.py --from-json results.json --write     (records it in the docs)
    python benchmarks/gpu_train_check.py --device cpu --smoke                 (exercises it all on a CPU)
--write replaces the section "GPU: training speed and memory" of docs/validation/throughput.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml
from docsection import write_section
from gpu_memory_check import cell
from train_speed import CHILD_ENV, LEARNING_RATE, LORA, SEED, TINY, _records, _version

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
DOC = REPO / "docs" / "validation" / "throughput.md"
MARK = "gpu-train"

MODEL = "meta-llama/Llama-3.2-1B"
SEQ_LEN = 2048
MICRO_BATCH = 4
STEPS = 20
SKIP = 5  # warm-up steps left out of every figure
REPEATS = 2  # runs of each framework per case
CASES = ("lora", "full")
BUDGET_S = 330.0  # no run starts that would end after this (the longest run so far as its length)
CHILD_TIMEOUT_S = 150.0
PREDICT_TIMEOUT_S = 180.0
# --smoke: the demo model itself, short sequences, a few steps, one thread per process
SMOKE = {"seq_len": 128, "micro_batch": 2, "steps": 6, "skip": 2, "repeats": 1}


# --- model, data and run configs --------------------------------------------------------------------------


def make_model(folder: Path, config: dict[str, Any]) -> Path:
    """`config` as config.json (no weights: random ones from the seed) beside the demo tokenizer."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for path in TINY.iterdir():
        if path.name != "config.json":
            shutil.copy(path, folder / path.name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder


def make_data(path: Path, examples: int, seq_len: int) -> Path:
    """A `text` JSONL file of random words, every text longer than `seq_len` tokens (so exactly that, truncated)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    rng = random.Random(SEED)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    lines = []
    for _ in range(examples):
        text = ""
        while len(tokenizer.encode(text).ids) < seq_len + 8:
            text += " " + " ".join(rng.choice(words) for _ in range(seq_len // 2))
        lines.append(json.dumps({"text": text.strip()}) + "\n")
    path.write_text("".join(lines))
    return path


def tunecast_config(folder: Path, model: Path, data: Path, method: str, setup: dict[str, Any]) -> Path:
    config: dict[str, Any] = {
        "model": str(model), "random_weights": True, "method": method, "precision": "bf16", "optimizer": "adamw",
        "micro_batch": setup["micro_batch"], "grad_accum": 1, "seq_len": setup["seq_len"],
        "grad_checkpointing": False, "learning_rate": LEARNING_RATE, "schedule": "linear", "warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": SEED, "max_steps": setup["steps"], "packing": False,
        "dataset": {"path": str(data), "format": "text"}, "output": str(folder / "out"),
        "checkpoint": {"every_steps": 1_000_000},
    }
    if method == "lora":
        config["lora"] = LORA
    folder.mkdir(parents=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# --- predictions: `tunecast memory`, and the FLOPs of the step it traced -----------------------------------


def predict(configs: dict[str, Path], gpu: str, env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """`tunecast memory --json` of every case, in parallel; then, from the trace it cached, FLOPs per token and
    `tunecast plan`'s tokens/s."""
    from tunecast.catalog.store import load_catalog
    from tunecast.config.load import load_spec
    from tunecast.estimate.profiles import cached_profiles
    from tunecast.plan.throughput import step_time
    from tunecast.step.settings import TraceSettings

    processes = {case: subprocess.Popen([sys.executable, "-m", "tunecast", "memory", str(path), "--gpu", gpu, "--json"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for case, path in configs.items()}
    catalog = load_catalog(None)
    os.environ["TUNECAST_CACHE"] = env["TUNECAST_CACHE"]  # where cached_profiles looks, in this process
    predictions: dict[str, dict[str, Any]] = {}
    for case, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=PREDICT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            predictions[case] = {"error": f"tunecast memory took over {PREDICT_TIMEOUT_S:.0f} s"}
            continue
        if process.returncode != 0:
            predictions[case] = {"error": f"tunecast memory exited {process.returncode}: {stderr.strip()[-500:]}"}
            continue
        memory = json.loads(stdout)
        loaded = load_spec(configs[case], [], catalog)
        spec = loaded.spec
        batch, seq = int(spec.micro_batch), spec.seq_len
        pair = cached_profiles(loaded.model.data, TraceSettings.from_spec(spec), batch, seq)
        if pair is None:
            raise RuntimeError(f"{case}: no cached trace after `tunecast memory` in {env['TUNECAST_CACHE']}")
        planned = step_time(spec, pair, catalog.gpus.get(gpu), catalog.throughput, micro_batch=batch, seq=seq,
                            grad_accum=1, gpu_count=1, grad_checkpointing=False)
        predictions[case] = {"memory": memory, "flops_per_token": flops_per_token(pair, batch, seq),
                             "plan_tokens_per_s": planned.tokens_per_step / planned.total_s}
    return predictions


def flops_per_token(pair: Any, batch: int, seq: int) -> float:
    """The traced step's matmul and attention FLOPs (forward and backward) ÷ its tokens, linear in depth between
    the two traced depths (every decoder layer does the same work), as plan/throughput.py extrapolates them."""

    def traced(profile: Any) -> float:
        flops = profile.flops_at(batch, seq)
        return flops.get("matmul", 0.0) + flops.get("attention", 0.0)

    shallow, deeper = traced(pair.shallow), traced(pair.deeper)
    depths = pair.shallow.layers, pair.deeper.layers
    step = deeper if depths[0] == depths[1] else shallow + (deeper - shallow) * (pair.layers - depths[0]) / (
        depths[1] - depths[0])
    return step / (batch * seq)


# --- the runs (a fresh process each) -------------------------------------------------------------------------


def run_tunecast(config: Path, steps: int, env: dict[str, str]) -> dict[str, Any]:
    """`tunecast train`, stopped once its last step's metrics line is written."""
    output = config.parent / "out"
    with open(config.parent / "stderr.txt", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "tunecast", "train", str(config)],
                                   stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            if sum(record["kind"] == "train" for record in _records(output)) >= steps:
                break
            time.sleep(0.2)
        finished = process.poll() is not None
        if not finished:
            process.kill()
        process.wait()
    records = _records(output)
    train = [record for record in records if record["kind"] == "train"]
    shutil.rmtree(output, ignore_errors=True)  # a full run's base weights and checkpoint: gigabytes
    if len(train) < steps:
        reason = f"exited {process.returncode}" if finished else f"timed out after {CHILD_TIMEOUT_S:.0f} s"
        raise RuntimeError(f"tunecast train {reason} after {len(train)} of {steps} steps: "
                           f"{(config.parent / 'stderr.txt').read_text()[-1500:]}")
    start = next(record for record in records if record.get("event") == "start")
    wall = [train[0]["step_seconds"]] + [b["elapsed_s"] - a["elapsed_s"] for a, b in pairwise(train)]
    return {"tokens": [record["tokens"] for record in train], "wall_s": wall, "device": start["device"],
            "peak_allocated_gib": train[-1].get("peak_allocated_gib"),
            "peak_reserved_gib": train[-1].get("peak_reserved_gib")}


def run_trainer(job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    try:
        completed = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True,
                                   text=True, env=env, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"Trainer timed out after {CHILD_TIMEOUT_S:.0f} s") from None
    if completed.returncode != 0:
        raise RuntimeError(f"Trainer exited {completed.returncode}: {completed.stderr[-1500:]}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    ends = result.pop("ends")
    result["wall_s"] = [ends[0] - result.pop("first_begin")] + [b - a for a, b in pairwise(ends)]
    return result


def trainer_child(job: dict[str, Any]) -> dict[str, Any]:
    """transformers Trainer (+ peft LoRA) with the settings tunecast_config writes, on tunecast's token ids."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from tunecast.data.tokens import load_tokenizer
    from tunecast.train.batches import load_train_data
    from tunecast.train.model import pad_id

    seq_len, micro_batch, cuda = job["seq_len"], job["micro_batch"], job["device"] == "cuda"
    counter = load_tokenizer(job["model"])
    units = load_train_data(job["data"], counter, layout="text", train_on="auto", seq_len=seq_len, packing=False,
                            eval_examples=0, seed=SEED, skip_invalid=False, pad_id=pad_id(counter)).units
    lengths = {len(unit.input_ids) for unit in units}
    assert lengths == {seq_len}, f"examples are not all {seq_len} tokens: {sorted(lengths)[:5]}"
    config = AutoConfig.from_pretrained(job["model"])
    config.use_cache = False  # as tunecast runs the model: no KV cache in a training forward
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if job["method"] == "lora":
        model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                                 lora_dropout=LORA["dropout"], target_modules=LORA["targets"],
                                                 task_type="CAUSAL_LM"))
    begins: list[float] = []
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            begins.append(time.monotonic())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if cuda:
                torch.cuda.synchronize()  # as tunecast's loop does at the end of every step
            ends.append(time.monotonic())

    arguments = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="gpu-train-check-"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=1, max_steps=job["steps"], learning_rate=LEARNING_RATE, lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused", seed=SEED, data_seed=SEED,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=not cuda, dataloader_num_workers=0, bf16=False, fp16=False, gradient_checkpointing=False)
    dataset = [{"input_ids": unit.input_ids, "labels": unit.input_ids} for unit in units]
    Trainer(model=model, args=arguments, train_dataset=dataset, data_collator=default_data_collator,
            callbacks=[Clock()]).train()
    return {"tokens": [micro_batch * seq_len] * len(ends), "first_begin": begins[0], "ends": ends,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tunecast.catalog.store import load_catalog

    began = time.monotonic()
    catalog = load_catalog(None)
    gpu = catalog.gpus.get(args.gpu)
    if args.smoke:
        setup = {"model": "examples/tiny-model", **SMOKE}
        model_config = json.loads((TINY / "config.json").read_text())
    else:
        setup = {"model": MODEL, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "steps": STEPS, "skip": SKIP,
                 "repeats": args.repeats}
        model_config = catalog.models.find(MODEL).data  # type: ignore[union-attr]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke, "device": args.device, "setup": setup,
        "gpu": {"slug": gpu.slug, "name": gpu.name, "bf16_tflops": gpu.bf16_tflops, "source": gpu.source},
        "versions": {name: _version(name) for name in ("torch", "transformers", "peft", "accelerate")},
        "cases": {case: {"runs": {"tunecast": [], "Trainer": []}, "errors": []} for case in CASES}}
    with tempfile.TemporaryDirectory(prefix="gpu-train-check-") as temporary:
        root = Path(temporary)
        env = {**os.environ, **CHILD_ENV, "TUNECAST_CACHE": str(root / "cache"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
        if args.device == "cpu":
            env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        model = make_model(root / "model", model_config)
        data = make_data(root / "data.jsonl", setup["steps"] * setup["micro_batch"], setup["seq_len"])
        configs = {case: tunecast_config(root / f"config-{case}", model, data, case, setup) for case in CASES}
        for case, prediction in predict(configs, gpu.slug, env).items():
            results["cases"][case]["prediction"] = prediction
        print(f"predictions took {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)

        longest = 0.0
        for repeat in range(setup["repeats"]):
            for case in CASES:
                order = ["tunecast", "Trainer"] if repeat % 2 == 0 else ["Trainer", "tunecast"]
                for framework in order:
                    if time.monotonic() + longest > began + args.budget_s:
                        results["cases"][case]["errors"].append(f"{framework} run {repeat + 1} skipped: budget")
                        continue
                    started = time.monotonic()
                    try:
                        if framework == "tunecast":
                            config = tunecast_config(root / f"run-{case}-{repeat}", model, data, case, setup)
                            run = run_tunecast(config, setup["steps"], env)
                        else:
                            run = run_trainer({"model": str(model), "data": str(data), "method": case,
                                               "seq_len": setup["seq_len"], "micro_batch": setup["micro_batch"],
                                               "steps": setup["steps"], "device": args.device}, env)
                    except RuntimeError as error:
                        results["cases"][case]["errors"].append(f"{framework} run {repeat + 1}: {error}")
                        print(f"{case} {framework} #{repeat + 1} failed: {error}", file=sys.stderr, flush=True)
                        continue
                    run["process_s"] = time.monotonic() - started
                    longest = max(longest, run["process_s"])
                    results["cases"][case]["runs"][framework].append(run)
                    print(f"{case} {framework} #{repeat + 1}: {median_rate([run], setup['skip']):,.0f} tok/s, "
                          f"process {run['process_s']:.0f} s", file=sys.stderr, flush=True)
    results["total_s"] = time.monotonic() - began
    return results


# --- the report ----------------------------------------------------------------------------------------------


def median_rate(runs: list[dict[str, Any]], skip: int) -> float:
    """Median over the steps after `skip` of all `runs` of tokens ÷ wall seconds (nan without runs)."""
    rates = [t / w for run in runs for t, w in list(zip(run["tokens"], run["wall_s"], strict=True))[skip:]]
    return statistics.median(rates) if rates else float("nan")


def report(results: dict[str, Any]) -> str:
    setup, gpu = results["setup"], results["gpu"]
    skip = setup["skip"]
    peak_flops = gpu["bf16_tflops"] * 1e12
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items() if version)
    devices = sorted({run["device"] for case in results["cases"].values() for run in case["runs"]["tunecast"]})
    rows = ["| case | tunecast tok/s (per run) | Trainer tok/s (per run) | tunecast ÷ Trainer | MFU tunecast | "
            "MFU Trainer | GFLOP per token | `tunecast plan` tok/s (÷ measured) | allocated GiB measured / predicted "
            "| reserved GiB measured / predicted | Trainer allocated GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    notes = []
    for case, found in results["cases"].items():
        runs, prediction = found["runs"], found.get("prediction", {})
        notes += [f"{case}: {error}" for error in found["errors"]]
        if "error" in prediction:
            notes.append(f"{case}: prediction failed: {prediction['error']}")
        rate = {name: median_rate(group, skip) for name, group in runs.items()}
        per_run = {name: ", ".join(f"{median_rate([run], skip):,.0f}" for run in group) for name, group in runs.items()}
        flops = prediction.get("flops_per_token", float("nan"))
        planned = prediction.get("plan_tokens_per_s", float("nan"))
        memory = prediction.get("memory", {})
        measured = runs["tunecast"]

        def worst(key: str, group: list[dict[str, Any]] = measured) -> float:
            values = [run[key] for run in group if run.get(key) is not None]
            return max(values) * 2**30 if values else 0.0

        trainer_peak = worst("peak_allocated_gib", runs["Trainer"]) / 2**30
        trainer_cell = f"{trainer_peak:.2f}" if trainer_peak else "—"
        rows.append(
            f"| {case} | {rate['tunecast']:,.0f} ({per_run['tunecast']}) | {rate['Trainer']:,.0f} "
            f"({per_run['Trainer']}) | **{rate['tunecast'] / rate['Trainer']:.2f}×** | "
            f"{rate['tunecast'] * flops / peak_flops:.1%} | {rate['Trainer'] * flops / peak_flops:.1%} | "
            f"{flops / 1e9:.2f} | {planned:,.0f} ({planned / rate['tunecast']:.2f}) | "
            f"{cell(worst('peak_allocated_gib'), memory.get('peak_allocated_gib', float('nan')))} | "
            f"{cell(worst('peak_reserved_gib'), memory.get('peak_reserved_gib', float('nan')))} | "
            f"{trainer_cell} |")
    source = "its config" if results["smoke"] else "the bundled config"
    what = (f"the shape of `{setup['model']}` ({source}), random weights (seed {SEED}), token ids from the demo "
            "tokenizer (1,024 tokens)")
    lines = [
        "## GPU: training speed and memory",
        "",
        *(["**Smoke run on the CPU: these figures exercise the script; they are not GPU measurements.**", ""]
          if results["smoke"] else []),
        f"Measured with `python benchmarks/gpu_train_check.py --gpu {gpu['slug']}` on {results['date']}: "
        f"{', '.join(devices) or results['device']}, {versions}. The script took {results['total_s'] / 60:.1f} min.",
        "",
        f"Model: {what}; every sequence {setup['seq_len']} tokens, micro-batch {setup['micro_batch']}, no "
        f"accumulation; bf16 weights without autocast, fused AdamW (learning rate {LEARNING_RATE:g}), linear "
        f"schedule, clipping 1.0, no checkpointing, SDPA. lora: rank {LORA['rank']} (alpha {LORA['alpha']}) on "
        f"every linear layer, fp32 adapters (peft's default); full: every weight. {setup['steps']} optimizer steps "
        f"per run, the first {skip} not counted; runs of each framework alternating, each a fresh process. How each "
        "figure is taken is described at the top of `benchmarks/gpu_train_check.py`.",
        "",
        *rows,
        "",
        f"tok/s: the median over the counted steps of all runs of tokens ÷ wall seconds per step. MFU: tok/s × "
        f"the FLOPs per token `tunecast memory` traced for the run (matmuls and causal attention, forward and "
        f"backward; a LoRA step has no weight gradients for frozen weights) ÷ {gpu['bf16_tflops']:g} TFLOPS, the "
        f"dense bf16 peak of {gpu['name']} in the catalog ({gpu['source']}). Memory: tunecast's peak over the "
        "run (torch.cuda.max_memory_allocated / max_memory_reserved) / `tunecast memory --gpu` for the same config "
        "(error of the prediction: + is over).",
    ]
    if notes:  # one line each: a child's stderr tail, whitespace folded
        lines += ["", "Not measured:", "", *[f"- {' '.join(note.split())[:400]}" for note in notes]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h200", help="catalog slug of the GPU this runs on (its peak for MFU)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--smoke", action="store_true", help="the demo model, a few short steps (for a CPU)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"runs per framework and case (default {REPEATS})")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"start no run that would end after this many seconds (default {BUDGET_S:g})")
    parser.add_argument("--out", type=Path, help="also write every measurement to this JSON file")
    parser.add_argument("--from-json", type=Path, help="report a JSON file written by --out instead of measuring")
    parser.add_argument("--write", action="store_true", help=f"replace the section in {DOC.relative_to(REPO)}")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(trainer_child(json.loads(args.child))))
        return 0
    results = json.loads(args.from_json.read_text()) if args.from_json else measure(args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    text = report(results)
    print(text)
    if args.write:
        if results["smoke"] or results["device"] != "cuda":
            print("not written: a smoke or CPU run is no GPU measurement", file=sys.stderr)
            return 1
        write_section(DOC, MARK, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
