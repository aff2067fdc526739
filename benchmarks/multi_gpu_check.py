"""tunecast's multi-GPU predictions against public measurements (issue 32).

Reads benchmarks/data/multi-gpu-measured.csv: public runs on 2 to 8 GPUs, each with the engine, sharding and batch
shape it ran with, its measured memory per GPU (with the counter that measured it) and tokens per second per GPU,
and a `split` column fixed before any prediction was made (benchmarks/data/README.md says how). Every row goes
through tunecast's own API as `tunecast memory` and `tunecast plan` run it: `load_spec` validates the RunSpec,
`estimate_memory` gives the memory per GPU and the fit on the row's card, and `Planner.configure` the step on the
row's GPU count and strategy (the same trace, fit check, roofline and collectives as `tunecast plan`).

* memory: like with like — a peak-reserved figure against `peak_reserved_gib`, a peak-allocated one against
  `peak_allocated_gib`, nvidia-smi against `device_total_gib` (reserved plus the CUDA context); a figure whose
  counter the source does not state is read as what a GPU monitor shows, nvidia-smi's. A run at the edge on its
  card is compared with the card's memory (`MemoryEstimate.on_device`: the cache grows to it and is released there);
* tokens/s per GPU: the planner's real tokens per second over the row's GPU count, with the communication it
  leaves exposed (`exposed_comm_s`) and the link it assumed;
* fit: what `tunecast memory --gpu` says on the row's card (fits, at the edge, does not fit), for runs that ran and
  for runs that ran out of memory.

Rows a RunSpec refuses are listed with the refusal. What tunecast's own loop does not train but other tools do (QLoRA
sharded over GPUs, DeepSpeed) validates with a warning and is estimated as tunecast's step run so, as `tunecast memory`
and `tunecast plan` estimate it.

Run:  .venv/bin/python benchmarks/multi_gpu_check.py   [--only dev|heldout] [--dry-run]
Writes the tables between the multi-gpu markers of docs/validation/multi-gpu.md (not with --dry-run).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data" / "multi-gpu-measured.csv"
NOT_EXPRESSIBLE = REPO / "benchmarks" / "data" / "multi-gpu-not-expressible.csv"
DOC = REPO / "docs" / "validation" / "multi-gpu.md"
MARK = "multi-gpu"

# The acceptance of issue 32: medians over held-out runs.
MEMORY_TARGET = 0.15
TOKENS_TARGET = 0.25
SIGNED_TARGET = 0.15
# Declared examples for the planner's workload: enough steps that the run's start and end weigh nothing.
EXAMPLES_PER_GLOBAL_BATCH = 200
# A counter over the whole script whose peak is the checkpoint's loading, not the training step: litgpt's FSDP
# LoRA (Oct 2023) loads the full checkpoint into the sharded model under FSDP's full-state-dict context, which gathers
# every 16-bit weight beside the shards (Lightning Fabric's FSDPStrategy.load_checkpoint). tunecast estimates the
# training step; such rows are compared with that loading (`load_peak_gib`) and left out of the memory summary.
LOADING_COUNTER = "allocated-with-load"
# A row taking longer than this to predict is named in the doc as slow.
SLOW_S = 30.0


def strategy_for(row: dict[str, str]) -> str:
    """The RunSpec strategy of a row's engine: DeepSpeed ZeRO stage n is "zero{n}"; FSDP1's FULL_SHARD and FSDP2 are
    "fsdp", its SHARD_GRAD_OP "fsdp-grad-op"; NO_SHARD (every GPU a full replica) and DDP are "ddp"."""
    if row["engine"] == "deepspeed":
        return f"zero{row['zero_stage']}"
    if row["engine"] == "ddp" or row["sharding"] == "NO_SHARD":
        return "ddp"
    if row["sharding"] == "SHARD_GRAD_OP":
        return "fsdp-grad-op"
    return "fsdp"


def settings_for(row: dict[str, str], strategy: str) -> dict[str, Any]:
    """The RunSpec keys of one measured run (dotted, as `--set` takes them)."""
    count, micro_batch = int(row["gpu_count"]), int(row["micro_batch"])
    grad_accum = int(row["grad_accum"] or 1)  # unstated: one micro-batch per step (the notes say where)
    seq = int(row["seq_len"])
    global_batch = micro_batch * grad_accum * count
    settings: dict[str, Any] = {
        "model": row["model"], "method": row["method"], "precision": row["precision"], "optimizer": row["optimizer"],
        "micro_batch": micro_batch, "global_batch": global_batch, "seq_len": seq,
        "grad_checkpointing": row["grad_checkpointing"] == "yes", "attention": row["attention"],
        "compile": row["compile"] == "yes", "activation_offload": row["activation_offload"] == "yes",
        "gpus.gpu": row["gpu"], "gpus.count": count, "gpus.strategy": strategy, "gpus.offload": row["offload"],
        "packing": row["packed"] == "yes", "dataset.examples": global_batch * EXAMPLES_PER_GLOBAL_BATCH,
        # packed rows are full sequences; the others are predicted for memory only, at their longest sequence
        "dataset.mean_tokens": seq, "dataset.length_spread": 0.0,
        "plan.memory_margin": 0.0,  # the run was measured: no safety margin in the planner's fit check
        "runner": row["runner"],
    }
    if row["deepspeed"]:  # the zero_optimization buffer settings of the run's DeepSpeed JSON
        settings.update({f"gpus.deepspeed.{key}": value for key, value in json.loads(row["deepspeed"]).items()})
    for key in ("runner_version", "transformers_version"):
        if row[key]:
            settings[key] = row[key]
    if row["method"] == "qlora" and row["bitsandbytes_version"]:
        settings["bitsandbytes_version"] = row["bitsandbytes_version"]
    if row["method"] != "full":
        targets = row["lora_targets"]
        settings.update({"lora.rank": int(row["lora_rank"]), "lora.alpha": int(row["lora_alpha"]),
                         "lora.targets": targets if targets == "all-linear" else targets.split(";"),
                         "lora.fp32_adapters": row["fp32_adapters"] == "yes"})
        if row["lora_dropout"]:
            settings["lora.dropout"] = float(row["lora_dropout"])
    return settings


@dataclass
class Result:
    row: dict[str, str]
    strategy: str
    engine: str  # what tunecast ran the strategy as
    memory_gib: float | None = None  # predicted, the row's own counter
    allocated_gib: float | None = None
    verdict: str = ""  # fits / at the edge / does not fit, on the row's card
    tokens: float | None = None  # predicted tokens/s per GPU
    step_s: float | None = None
    exposed_comm_s: float | None = None
    link: str = ""
    note: str = ""
    memory_note: str = ""
    seconds: float = 0.0
    load_peak_gib: float | None = None  # LOADING_COUNTER rows: every 16-bit weight gathered beside the shards

    def error(self, metric: str) -> float | None:
        measured = {"memory": self.row["memory_gib"], "allocated": self.row["allocated_gib"],
                    "tokens": self.row["tokens_per_s_per_gpu"]}[metric]
        predicted = {"memory": self.memory_gib, "allocated": self.allocated_gib, "tokens": self.tokens}[metric]
        if not measured or predicted is None or self.row["ran"] != "yes":
            return None  # a run that ran out of memory is a fit check: its figure is where it failed
        if metric == "memory" and self.row["memory_counter"] == LOADING_COUNTER:
            return None  # the checkpoint's loading, not the step: compared in its own column (load_peak_gib)
        return (predicted - float(measured)) / float(measured)


@dataclass
class Checked:
    results: list[Result] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (row id, why)


def _problems(error: Any) -> str:
    return "; ".join(f"{p.field}: {p.message}" for p in error.problems if p.severity == "error")


def _memory_counter(estimate: Any, counter: str, gpu: Any) -> float:
    """The figure of the estimate that the row's counter measured, on the row's card (at the edge the cache grows to
    the card's memory and is released there: `MemoryEstimate.on_device`)."""
    reserved, device_total = estimate.on_device(gpu.usable_memory_gib)
    if counter == "reserved":
        return reserved
    if counter in ("allocated", LOADING_COUNTER):
        return estimate.peak_allocated_gib
    # nvidia-smi, or unstated: what a GPU monitor shows, reserved plus the CUDA context
    return device_total


def _verdict(estimate: Any, gpu: Any) -> str:
    """What `tunecast memory --gpu` says (estimate/fit.py): fits, at the edge (only once the allocator releases its
    cache), or does not fit."""
    if estimate.device_total_gib <= gpu.usable_memory_gib:
        return "fits"
    if estimate.least_device_total_gib <= gpu.usable_memory_gib:
        return "at the edge"
    return "does not fit"


def _loaded(settings: dict[str, Any], catalog: Any) -> Any:
    from tunecast.config.load import Override, load_spec

    return load_spec(None, [Override(key, value, "benchmark") for key, value in settings.items()], catalog)


def predict(row: dict[str, str], catalog: Any) -> Result | str:
    """One row's predictions, or why it cannot be expressed."""
    from tunecast.config.spec import STRATEGY_ENGINES
    from tunecast.errors import TunecastError
    from tunecast.estimate.memory import estimate_memory
    from tunecast.plan.planner import Planner
    from tunecast.plan.workload import workload_for

    if catalog.gpus.find(row["gpu"]) is None:
        return f"GPU {row['gpu']!r} is not in the catalog"
    strategy = strategy_for(row)
    settings = settings_for(row, strategy)
    result = Result(row, strategy, STRATEGY_ENGINES[strategy])
    try:
        loaded = _loaded(settings, catalog)
    except TunecastError as error:
        return f"the RunSpec refuses it: {_problems(error)}"
    gpu = loaded.gpu
    estimate = estimate_memory(loaded.spec, loaded.model.data, device="cuda", gpu=gpu, overheads=catalog.overheads)
    result.memory_gib = _memory_counter(estimate, row["memory_counter"], gpu)
    result.allocated_gib = estimate.peak_allocated_gib
    result.verdict = _verdict(estimate, gpu)
    if row["memory_counter"] == LOADING_COUNTER and loaded.model.params:
        result.load_peak_gib = 2 * loaded.model.params * (1 + 1 / int(row["gpu_count"])) / 2**30
    parts = ", ".join(f"{key} {value:.1f}" for key, value in estimate.breakdown_gib.items() if abs(value) >= 0.05)
    result.memory_note = (f"peak in {estimate.peak_phase}: {parts}; allocated {estimate.peak_allocated_gib:.1f}, "
                          f"reserved {estimate.peak_reserved_gib:.1f}, device {estimate.device_total_gib:.1f} GiB"
                          + "".join(f"; {note}" for note in estimate.notes))
    if row["packed"] != "yes":  # no tokens/s measured; the planner's unpacked workload would need the lengths
        return result
    planner = Planner(loaded, catalog, workload_for(loaded, catalog))
    configured = planner.configure(gpu, int(row["gpu_count"]))
    if isinstance(configured, str):
        # The step time does not depend on the card's memory: predict it on the same card with room to spare.
        roomy = gpu.model_copy(update={"memory_gib": 1e4, "usable_memory_gib": 1e4})
        configured = Planner(loaded, catalog, workload_for(loaded, catalog)).configure(roomy, int(row["gpu_count"]))
    if isinstance(configured, str):
        result.note = configured
        return result
    step = configured.step
    result.tokens = configured.tokens_per_second / int(row["gpu_count"])
    result.step_s, result.exposed_comm_s = step.total_s, step.communication_s
    result.link = step.link.name if step.link is not None else ""
    result.note = (f"step {step.total_s:.2f} s: compute {step.compute_s:.2f}, dequantize {step.dequantize_s:.2f}, "
                   f"dispatch {step.dispatch_s:.2f}, optimizer {step.optimizer_s:.2f}, offload {step.offload_s:.2f}")
    return result


def check(only: str | None) -> Checked:
    from tunecast.catalog.store import load_catalog

    catalog = load_catalog(None)
    checked = Checked()
    with DATA.open() as handle:
        for row in csv.DictReader(handle):
            if only is not None and row["split"] != only:
                continue
            started = time.perf_counter()
            outcome = predict(row, catalog)
            if isinstance(outcome, str):
                checked.skipped.append((row["id"], outcome))
                print(f"{row['id']}: not predicted: {outcome}", file=sys.stderr)
                continue
            outcome.seconds = time.perf_counter() - started
            checked.results.append(outcome)
            print(f"{row['id']}: {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
    return checked


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.0%}"


def _num(value: str | float | None, digits: int = 1) -> str:
    if value in (None, ""):
        return "—"
    return f"{float(value):,.{digits}f}"


def _what(row: dict[str, str]) -> str:
    method = row["method"] if row["method"] == "full" else f"{row['method']} r{row['lora_rank']}"
    engine = " ".join(part for part in (row["engine"], row["sharding"],
                                        f"ZeRO-{row['zero_stage']}" if row["zero_stage"] else "") if part)
    offload = "" if row["offload"] == "none" else f" + offload {row['offload']}"
    return (f"{row['model'].split('/')[-1]} {method}, {row['gpu_count']}×{row['gpu']}, {engine}{offload}, "
            f"mb {row['micro_batch']} × {row['seq_len']}")


def _fit_cell(result: Result) -> str:
    """The verdict, marked right (✓) or wrong (✗) where the run says: it ran out of memory, or it ran and is called
    "does not fit"."""
    if result.row["ran"] == "failed":
        return result.verdict + (" ✓" if result.verdict == "does not fit" else " ✗")
    return result.verdict + (" ✗" if result.verdict == "does not fit" else "")


def table(results: list[Result]) -> list[str]:
    lines = ["| row | split | run | as | memory: counter | measured GiB | predicted GiB | error | "
             "allocated: measured | predicted | error | fit | tokens/s/GPU measured | predicted | error | "
             "exposed comm s | link |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in results:
        row = r.row
        measured_memory = _num(row["memory_gib"], 2)
        if row["ran"] == "failed":
            measured_memory = f"OOM ({measured_memory} at failure)" if row["memory_gib"] else "OOM"
        compared = row["memory_counter"] or row["ran"] == "failed"
        timed = bool(row["tokens_per_s_per_gpu"])
        cells = [
            f"`{row['id']}`", row["split"], _what(row), f"{r.strategy} ({r.engine})", row["memory_counter"] or "—",
            measured_memory, _num(r.memory_gib, 2) if compared else "—", _pct(r.error("memory")),
            _num(row["allocated_gib"], 2), _num(r.allocated_gib, 2) if row["allocated_gib"] else "—",
            _pct(r.error("allocated")), _fit_cell(r), _num(row["tokens_per_s_per_gpu"]),
            _num(r.tokens) if timed else "—", _pct(r.error("tokens")), _num(r.exposed_comm_s, 2) if timed else "—",
            r.link or "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(results: list[Result]) -> list[str]:
    lines = ["| split | metric | rows | median abs error | median signed error | within target | acceptance |",
             "|---|---|---:|---:|---:|---:|---|"]
    targets = {"memory": MEMORY_TARGET, "allocated": MEMORY_TARGET, "tokens": TOKENS_TARGET}
    labels = {"memory": "memory per GPU (each row's counter)", "allocated": "peak allocated (second counter)",
              "tokens": "tokens/s per GPU"}
    present = [split for split in ("dev", "heldout") if any(r.row["split"] == split for r in results)]
    for split in [*present, "all"] if len(present) > 1 else present:
        chosen = [r for r in results if split in ("all", r.row["split"])]
        for metric in ("memory", "allocated", "tokens"):
            errors = [e for e in (r.error(metric) for r in chosen) if e is not None]
            if not errors:
                continue
            absolute = statistics.median(abs(e) for e in errors)
            signed = statistics.median(errors)
            within = sum(abs(e) <= targets[metric] for e in errors)
            met = absolute <= targets[metric] and abs(signed) <= SIGNED_TARGET
            rule = f"≤{targets[metric]:.0%}, signed within ±{SIGNED_TARGET:.0%}"
            lines.append(f"| {split} | {labels[metric]} | {len(errors)} | {absolute:.1%} | {signed:+.1%} | "
                         f"{within} of {len(errors)} within {targets[metric]:.0%} | "
                         f"{'met' if met else 'not met'} ({rule}) |")
    return lines


def fit_lines(results: list[Result]) -> list[str]:
    """"Does not fit" on runs that ran (the acceptance: never, when the measured peak is below the card's memory)
    and the verdicts on runs that ran out of memory. Rows whose card is unknown are no fit check."""
    lines = []
    for split in ("dev", "heldout"):
        chosen = [r for r in results if r.row["split"] == split and "not a fit check" not in r.row["gpu_assumed"]]
        ran = [r for r in chosen if r.row["ran"] == "yes"]
        wrong = [r for r in ran if r.verdict == "does not fit"]
        edge = [r for r in ran if r.verdict == "at the edge"]
        failed = [r for r in chosen if r.row["ran"] == "failed"]
        if not chosen:
            continue
        caught = [r for r in failed if r.verdict == "does not fit"]
        named = ", ".join(f"`{r.row['id']}`" for r in wrong)
        lines.append(f"- {split}: {len(wrong)} of {len(ran)} runs that ran are called \"does not fit\""
                     + (f" ({named})" if wrong else "")
                     + f"; {len(edge)} \"at the edge\"; {len(caught)} of {len(failed)} runs that ran out of memory "
                       "are called \"does not fit\".")
    return lines


def render(checked: Checked, elapsed: float) -> str:
    validated = checked.results
    slow = [f"`{r.row['id']}` {r.seconds:.0f} s" for r in checked.results if r.seconds > SLOW_S]
    lines = [f"Run with `.venv/bin/python benchmarks/multi_gpu_check.py` on {time.strftime('%Y-%m-%d')} in "
             f"{elapsed / 60:.1f} minutes; slow rows (over {SLOW_S:.0f} s): {', '.join(slow) or 'none'}.", "",
             "### Summary: what tunecast answers today", "", *summary(validated), "", "Fit verdicts:", "",
             *fit_lines(validated), "", "### Every row tunecast predicts", "", *table(validated)]
    loading = [r for r in checked.results if r.load_peak_gib is not None and r.row["memory_gib"]]
    if loading:
        lines += ["", "### Counters that hold the checkpoint's loading", "",
                  "These runs' figure is litgpt's max_memory_allocated over the whole script, whose peak is the "
                  "loading: the full checkpoint loaded under FSDP's full-state-dict context gathers every 16-bit "
                  "weight beside the shards, 2Ψ(1 + 1/N) bytes for Ψ parameters over N GPUs. They are left out of the "
                  "memory summary (tunecast estimates the training step, whose peak is below it here) and compared "
                  "with that loading:", "",
                  "| row | measured GiB | 2Ψ(1 + 1/N) GiB | error | training step predicted GiB |",
                  "|---|---:|---:|---:|---:|"]
        for r in loading:
            measured = float(r.row["memory_gib"])
            lines.append(f"| `{r.row['id']}` | {measured:.2f} | {r.load_peak_gib:.2f} | "
                         f"{_pct((r.load_peak_gib - measured) / measured)} | {_num(r.memory_gib, 2)} |")
    lines += ["", "### Not predicted", ""]
    lines += [f"- `{row_id}`: {why}" for row_id, why in checked.skipped]
    with NOT_EXPRESSIBLE.open() as handle:
        lines += [f"- research rows {row['research_rows']} ({row['source']}, {row['what']}): {row['reason']}"
                  for row in csv.DictReader(handle)]
    notes = [f"- `{r.row['id']}`: {r.memory_note}" + (f". {r.note}" if r.note else "") for r in checked.results]
    if notes:
        lines += ["", "### Memory at the peak and step times", "", *notes]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("dev", "heldout"), help="only the rows of this split")
    parser.add_argument("--dry-run", action="store_true", help="print the tables without writing the doc")
    args = parser.parse_args()
    started = time.perf_counter()
    checked = check(args.only)
    text = render(checked, time.perf_counter() - started)
    print(text)
    if not args.dry_run:
        if args.only is not None:
            text = f"Only the {args.only} rows (`--only {args.only}`).\n\n" + text
        write_section(DOC, MARK, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
