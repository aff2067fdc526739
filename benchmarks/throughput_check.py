"""tunecast's throughput model against public measurements.

Reads benchmarks/data/throughput-measured.csv (a copy of shared/reference/throughput-measured.csv). Every row
the model can express is predicted through the planner itself (`Planner.configure`: the same traced step,
fit check and roofline as `tunecast plan`), with the micro-batch, global batch, GPU count and sharding the
measured run used; the others are listed with the reason.

* tokens/s rows: predicted tokens per second per GPU against the measured figure;
* QLoRA/LoRA time ratios: the predicted step time of QLoRA over LoRA on the same card and shape.

Run:  .venv/bin/python benchmarks/throughput_check.py   [--only frameworks|peft] [--dry-run]
Writes the table between the throughput markers of docs/validation/throughput.md.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data" / "throughput-measured.csv"
DOC = REPO / "docs" / "validation" / "throughput.md"
MARK = "throughput"

# How each measured run was set up, from its source (the NeMo performance summary's fine-tuning table and
# litgpt's resource tables), where the CSV does not carry it.
NEMO_GLOBAL_BATCH = 32  # NeMo 24.09 fine-tuning rows: global batch 32, micro-batch 1, packed 4096-token sequences
# NeMo shards optimizer states across data-parallel ranks (its distributed optimizer): FSDP2's grad-op mode is the
# closest strategy a RunSpec names. The 70B model does not fit a GPU whole: NeMo splits it with tensor and pipeline
# parallelism, which tunecast does not model; FSDP is the sharding a transformers user would run.
NEMO_STRATEGY = {"full": "fsdp-grad-op", "lora": "ddp"}
LARGE_MODEL_PARAMS = 30e9
# Both frameworks keep LoRA adapters in the model's dtype (bf16), not in fp32 as peft does by default.
FP32_ADAPTERS = False
# litgpt's resource tables (Oct 2023): LoRA rank 8 on q and v, micro-batch 1, Alpaca examples unpadded, the
# longest 1,304 tokens (memory-measured.csv); LoRA with AdamW, QLoRA with paged AdamW.
LITGPT_LORA = {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}
LITGPT_LONGEST = 1304
LITGPT_OPTIMIZER = {"lora": "adamw", "qlora": "paged-adamw"}
# Mean tokens of an Alpaca example with its prompt template (an assumption: the tables state only the longest
# sample); the ratio is shown at half and twice this length too.
ALPACA_MEAN_TOKENS = 200


@dataclass
class Row:
    id: str
    what: str
    predicted: float | None
    measured: float
    note: str

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else (self.predicted - self.measured) / self.measured


def _configure(catalog: Any, settings: dict[str, Any], gpu_slug: str, count: int, gpu: Any = None) -> Any:
    from tunecast.config.load import Override, load_spec
    from tunecast.plan.planner import Planner
    from tunecast.plan.workload import workload_for

    overrides = [Override(key, value, "benchmark") for key, value in settings.items()]
    loaded = load_spec(None, overrides, catalog)
    planner = Planner(loaded, catalog, workload_for(loaded, catalog))
    configured = planner.configure(gpu or catalog.gpus.get(gpu_slug), count)
    return configured


def _tokens_row(catalog: Any, row: dict[str, str]) -> Row:
    params = catalog.models.find(row["model"]).params if catalog.models.find(row["model"]) else 0
    count = int(row["gpus"])
    seq = int(row["seq_len"])
    strategy = NEMO_STRATEGY[row["method"]] if params < LARGE_MODEL_PARAMS else "fsdp"
    settings = {"model": row["model"], "method": row["method"], "precision": row["precision"], "micro_batch": 1,
                "global_batch": NEMO_GLOBAL_BATCH, "seq_len": seq, "packing": True, "gpus.count": count,
                "gpus.gpu": row["gpu"], "gpus.strategy": strategy, "dataset.examples": 100_000,
                "dataset.mean_tokens": seq, "optimizer": "adamw", "lora.fp32_adapters": FP32_ADAPTERS,
                "plan.memory_margin": 0.0}
    configured = _configure(catalog, settings, row["gpu"], count)  # the planner decides on checkpointing
    if isinstance(configured, str):
        return Row(row["id"], f"{row['model'].split('/')[-1]} {row['method']} {row['precision']} "
                   f"{count}×{row['gpu']}", None, float(row["measured"]), configured)
    per_gpu = configured.tokens_per_second / count
    step = configured.step
    note = (f"{strategy}, micro-batch 1 × {configured.grad_accum}, checkpointing "
            f"{'on' if configured.grad_checkpointing else 'off'}; step {step.total_s:.2f} s "
            f"(compute {step.compute_s:.2f}, communication {step.communication_s:.2f}, "
            f"dispatch {step.dispatch_s:.2f}, optimizer {step.optimizer_s:.3f})")
    if row["method"] == "lora":  # what a default peft run (fp32 adapters) would do instead
        default = _configure(catalog, {**settings, "lora.fp32_adapters": True}, row["gpu"], count)
        if not isinstance(default, str):
            fp32 = default.tokens_per_second / count
            note += (f"; with peft's default fp32 adapters: {fp32:,.0f} "
                     f"({(fp32 - float(row['measured'])) / float(row['measured']):+.0%})")
    return Row(row["id"], f"{row['model'].split('/')[-1]} {row['method']} {row['precision']} {count}×{row['gpu']}, "
               f"{seq} packed, tokens/s per GPU", per_gpu, float(row["measured"]), note)


def _ratio(catalog: Any, row: dict[str, str], mean_tokens: int) -> tuple[float, Any, Any] | str:
    times = {}
    configured = {}
    for method in ("lora", "qlora"):
        # the run was measured, so it fits: no safety margin for the fit check
        settings = {"model": row["model"], "method": method, "precision": "bf16", "micro_batch": 1,
                    "global_batch": 1, "seq_len": LITGPT_LONGEST, "lora.rank": LITGPT_LORA["rank"],
                    "lora.alpha": LITGPT_LORA["alpha"], "lora.targets": LITGPT_LORA["targets"],
                    "lora.fp32_adapters": FP32_ADAPTERS, "optimizer": LITGPT_OPTIMIZER[method],
                    "dataset.examples": 2000, "dataset.mean_tokens": mean_tokens, "gpus.count": 1,
                    "gpus.gpu": row["gpu"], "grad_checkpointing": False, "plan.memory_margin": 0.0}
        result = _configure(catalog, settings, row["gpu"], 1)
        if isinstance(result, str):
            return f"{method}: {result}"
        configured[method] = result
        times[method] = result.step.total_s
    return times["qlora"] / times["lora"], configured["lora"], configured["qlora"]


def _ratio_row(catalog: Any, row: dict[str, str]) -> Row:
    what = f"{row['model'].split('/')[-1]} QLoRA ÷ LoRA step time, 1×{row['gpu']}, micro-batch 1"
    central = _ratio(catalog, row, ALPACA_MEAN_TOKENS)
    if isinstance(central, str):
        return Row(row["id"], what, None, float(row["measured"]), central)
    ratio, lora, qlora = central
    spread = []
    for tokens in (ALPACA_MEAN_TOKENS // 2, ALPACA_MEAN_TOKENS * 2):
        other = _ratio(catalog, row, tokens)
        spread.append(f"{other[0]:.2f} at {tokens} tokens" if not isinstance(other, str) else other)
    waiting = (f"{lora.step.dispatch_s * 1e3:.0f} ms waiting for kernel dispatch" if lora.step.dispatch_s
               else "not dispatch-bound")
    note = (f"{ALPACA_MEAN_TOKENS}-token examples: LoRA {lora.step.total_s * 1e3:.0f} ms ({waiting}), "
            f"QLoRA {qlora.step.total_s * 1e3:.0f} ms "
            f"(dequantization {qlora.step.dequantize_s * 1e3:.0f} ms); "
            + ", ".join(spread))
    return Row(row["id"], what, ratio, float(row["measured"]), note)


PEFT_DATA = REPO / "benchmarks" / "data" / "throughput-peft-measured.csv"
PEFT_MARK = "throughput-peft"
# How the runs' settings map onto a RunSpec. "flash" attention is traced as SDPA (neither keeps a seq × seq
# matrix); fp16 runs are mixed precision unless the notes say pure fp16 (half-precision weights and states
# without autocast: tunecast's pure bf16, the same bytes and speed); a padding-free micro-batch is one packed
# row of its examples; length-bucketed batches are declared with no length spread (next to no padding).
PEFT_PRECISION = {"bf16": "bf16", "fp16": "fp16-mixed"}
# The optimizer each run's loop really steps: torch.optim.AdamW without `fused` or `foreach`, and transformers'
# `adamw_torch`, run torch's multi-tensor (foreach) AdamW on a GPU; `adamw_torch_fused` the fused kernel.
PEFT_OPTIMIZER = (("adamw_torch_fused", "adamw"), ("paged_adamw_32bit", "paged-adamw"),
                  ("paged_adamw_8bit", "paged-adamw-8bit"), ("adamw_torch", "adamw-foreach"),
                  ("torch.optim.adamw", "adamw-foreach"))


def _peft_optimizer(text: str) -> str:
    lowered = text.lower()
    return next((name for prefix, name in PEFT_OPTIMIZER if lowered.startswith(prefix)), "adamw")
PEFT_UNITS = ("tokens_per_second_real", "tokens_per_second")


def _peft_settings(row: dict[str, str]) -> dict[str, Any] | str:
    """The RunSpec keys of one transformers + peft measurement, or why it cannot be expressed."""
    if row["unit"] not in PEFT_UNITS:
        return f"unit {row['unit']!r}: the source gives no token count to turn it into tokens/s"
    method = row["method"]
    precision = PEFT_PRECISION.get(row["precision"].split(";")[0].strip(), "bf16")
    if method in ("qlora",) or row["precision"].startswith("nf4") or "pure fp16" in row["notes"]:
        precision = "bf16"  # half-precision weights and states without autocast: tunecast's pure bf16
    packed = row["packed"].startswith("yes")
    seq = int(row["seq_len"])
    micro_batch = int(row["micro_batch"])
    mean = float(row["mean_tokens"]) if row["mean_tokens"][:1].isdigit() else seq
    if "padding-free" in row["packed"]:
        # the micro-batch's examples flattened into one row without attention across them: one packed
        # sequence of micro_batch × mean tokens
        micro_batch, seq = 1, round(micro_batch * mean)
    settings: dict[str, Any] = {
        "model": row["model"], "method": "lora" if method == "dora" else method, "precision": precision,
        "micro_batch": micro_batch, "grad_accum": int(row["grad_accum"] or 1), "seq_len": seq,
        "packing": packed, "grad_checkpointing": row["grad_checkpointing"].startswith("yes"),
        "optimizer": _peft_optimizer(row["optimizer"]), "gpus.count": 1, "gpus.gpu": row["gpu"],
        "plan.memory_margin": 0.0,
        "attention": "eager" if row["attention"].startswith("eager") else "sdpa",
        "dataset.examples": 100_000,
        "dataset.mean_tokens": min(mean, seq),
    }
    if "length-bucketed" in row["notes"]:
        settings["dataset.length_spread"] = 0.0  # batches of near-equal lengths: next to no padding
    if method != "full":
        targets = [t.strip() for t in row["lora_targets"].split(";") if t.strip()]
        settings.update({"lora.rank": int(row["lora_rank"]), "lora.alpha": 2 * int(row["lora_rank"]),
                         "lora.targets": targets if targets and targets != ["all-linear"] else "all-linear",
                         "lora.dora": method == "dora"})
    return settings


def check_peft() -> tuple[list[Row], list[tuple[str, str]]]:
    """tokens/s of transformers + peft runs on one GPU against the planner's prediction for the same run."""
    from tunecast.catalog.store import load_catalog

    catalog = load_catalog(None)
    rows: list[Row] = []
    skipped: list[tuple[str, str]] = []
    with PEFT_DATA.open() as handle:
        for row in csv.DictReader(handle):
            settings = _peft_settings(row)
            if isinstance(settings, str):
                skipped.append((row["id"], settings))
                continue
            if catalog.models.find(row["model"]) is None:
                skipped.append((row["id"], f"{row['model']} is not in the model catalog"))
                continue
            started = time.perf_counter()
            configured = _configure(catalog, settings, row["gpu"], 1)
            what = (f"{row['model'].split('/')[-1]} {row['method']} {row['gpu']}, micro-batch {settings['micro_batch']}"
                    f" × {settings['seq_len']} {'packed' if settings['packing'] else 'padded'}")
            unfit = ""
            if isinstance(configured, str):
                # The run did fit the card it was measured on. The step time does not depend on the card's
                # memory, so predict it on the same card with room to spare, and say what the estimate was.
                unfit = f"; tunecast's memory estimate says it does not fit ({configured})"
                roomy = catalog.gpus.get(row["gpu"]).model_copy(update={"memory_gib": 1e4,
                                                                        "usable_memory_gib": 1e4})
                configured = _configure(catalog, settings, row["gpu"], 1, gpu=roomy)
            if isinstance(configured, str):
                rows.append(Row(row["id"], what, None, float(row["measured"]), configured))
                continue
            step = configured.step
            note = (f"step {step.total_s:.3f} s (compute {step.compute_s:.3f}, dispatch {step.dispatch_s:.3f}, "
                    f"optimizer {step.optimizer_s:.3f}, dequantize {step.dequantize_s:.3f}){unfit}")
            rows.append(Row(row["id"], what, configured.tokens_per_second, float(row["measured"]), note))
            print(f"{row['id']}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return rows, skipped


def peft_summary(rows: list[Row]) -> str:
    """Median errors over every row, and over LoRA, DoRA and full fine-tuning apart from QLoRA (whose runs here
    used bitsandbytes 0.43 and, for some, peft's fp32 upcast of every non-quantized weight: another runner's
    step, issue 14)."""
    lines = []
    qlora = [row for row in rows if " qlora " in row.what]
    others = [row for row in rows if row not in qlora]
    for label, chosen in (("all rows", rows), ("LoRA, DoRA and full fine-tuning", others), ("QLoRA", qlora)):
        errors = [row.error for row in chosen if row.error is not None]
        if not errors:
            continue
        within = sum(abs(error) <= 0.25 for error in errors)
        lines.append(f"- {label}: median signed error **{statistics.median(errors):+.1%}**, median absolute "
                     f"{statistics.median(abs(e) for e in errors):.1%}, {within} of {len(errors)} within 25%.")
    return "\n".join(lines)


def check() -> tuple[list[Row], list[tuple[str, str]]]:
    from tunecast.catalog.store import load_catalog

    catalog = load_catalog(None)
    rows: list[Row] = []
    skipped: list[tuple[str, str]] = []
    with DATA.open() as handle:
        for row in csv.DictReader(handle):
            started = time.perf_counter()
            if row["unit"] == "tflops":
                skipped.append((row["id"], "a matmul ceiling: it is a catalog input (matmul_efficiency of "
                                "gpus.csv), so comparing with it would prove nothing"))
                continue
            if row["unit"] == "tokens_per_second_per_gpu":
                rows.append(_tokens_row(catalog, row))
            elif row["unit"] == "ratio" and row["method"] == "qlora/lora time ratio":
                rows.append(_ratio_row(catalog, row))
            else:
                skipped.append((row["id"], f"unit {row['unit']!r} not modelled"))
                continue
            print(f"{row['id']}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return rows, skipped


def render(rows: list[Row], skipped: list[tuple[str, str]]) -> str:
    lines = ["| row | what | predicted | measured | error | how the prediction was made |",
             "|---|---|---:|---:|---:|---|"]
    for row in rows:
        fmt = "{:,.0f}" if row.measured > 10 else "{:.2f}"
        predicted = fmt.format(row.predicted) if row.predicted is not None else "does not fit"
        error = f"{row.error:+.0%}" if row.error is not None else "—"
        lines.append(f"| `{row.id}` | {row.what} | {predicted} | {fmt.format(row.measured)} | {error} | {row.note} |")
    errors = [abs(row.error) for row in rows if row.error is not None]
    lines.append("")
    lines.append(f"Median absolute error over {len(errors)} rows: **{statistics.median(errors):.1%}** "
                 f"(largest {max(errors):.0%}).")
    lines.append("")
    lines.append("Skipped:")
    lines.append("")
    for row_id, reason in skipped:
        lines.append(f"- `{row_id}`: {reason}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("frameworks", "peft"), help="one of the two tables")
    parser.add_argument("--dry-run", action="store_true", help="print the tables, write nothing")
    args = parser.parse_args()
    if args.only != "peft":
        rows, skipped = check()
        text = render(rows, skipped)
        if not args.dry_run:
            write_section(DOC, MARK, text)
        print(text)
    if args.only == "frameworks":
        return
    rows, skipped = check_peft()
    text = render(rows, skipped)
    text += "\n\n" + peft_summary(rows)
    if not args.dry_run:
        write_section(DOC, PEFT_MARK, text)
    print(text)


if __name__ == "__main__":
    main()
