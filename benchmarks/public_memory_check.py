"""tunecast's memory estimate against public measurements, with accelerate's estimator side by side.

Reads benchmarks/data/memory-measured.csv (a copy of shared/reference/memory-measured.csv). Every row
whose method and optimizer a RunSpec can express is estimated; the others are listed with the reason.
A row measured as out-of-memory is checked against the card's usable memory instead.

A second table takes every row measured with a tool tunecast has a runner for (`framework`, FRAMEWORK_RUNNERS) and
estimates it as that tool runs it (`runner:`), beside tunecast's own step. Flags a row leaves unknown are the
runner's defaults; where the source says its figures come from the tool's published recipes without stating the
flags, the recipe config of that model, method and GPU count (tests/data/runners/published/) is read with
`--from` and given the row's batch and length.

Run:  .venv/bin/python benchmarks/public_memory_check.py
Writes the table between the public-measurements markers of docs/validation/memory.md.
"""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path
from typing import Any

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data" / "memory-measured.csv"
DOC = REPO / "docs" / "validation" / "memory.md"
MARK = "public-measurements"
RUNNER_MARK = "public-runners"

UNIT_BYTES = {"GB": 1e9, "GiB": 2**30, "MB": 1e6}
PRECISION = {"bf16-true": "bf16", "bf16": "bf16"}
# Module names of "q,v" in each architecture.
SHORT_TARGETS = {"q": "q_proj", "v": "v_proj", "k": "k_proj", "o": "o_proj"}


def versions_of(row: dict[str, str]) -> dict[str, str]:
    """The tool and library versions a row states (`versions`: "trl 0.13.0; bitsandbytes 0.43.3; …"), by name."""
    named = (part.strip().split() for part in row.get("versions", "").split(";") if part.strip())
    return {words[0].lower(): words[1] for words in named if len(words) == 2}


def version_settings(row: dict[str, str], runner: str | None) -> dict[str, Any]:
    """The settings a row's versions and quantization state: the runner's version (`runner_version`, when tunecast
    has a runner for its tool) and the transformers it ran on (`transformers_version`, whose loss that runner takes;
    tunecast's own step runs the transformers installed), the bitsandbytes a QLoRA row ran, and whether its NF4
    constants were quantized again (`nf4` without, `nf4-dq` with: litgpt's bnb.nf4 and bnb.nf4-dq)."""
    versions = versions_of(row)
    settings: dict[str, Any] = {}
    if runner is not None and row["framework"].lower() in versions:
        settings["runner_version"] = versions[row["framework"].lower()]
    if runner is not None and "transformers" in versions:
        settings["transformers_version"] = versions["transformers"]
    if row["method"] == "qlora" and "bitsandbytes" in versions:
        settings["bitsandbytes_version"] = versions["bitsandbytes"]
    return settings


def lora_settings(row: dict[str, str]) -> dict[str, Any]:
    """The adapter settings a row states, beyond rank and targets: dropout, and double quantization for QLoRA."""
    settings: dict[str, Any] = {}
    if row.get("lora_dropout"):
        settings["dropout"] = float(row["lora_dropout"])
    if row["method"] == "qlora" and row["quant"] in ("nf4", "nf4-dq"):
        settings["double_quant"] = row["quant"] == "nf4-dq"
    return settings


def spec_for(row: dict[str, str]) -> tuple[dict[str, Any] | None, str | None]:
    """RunSpec settings for a row, or the reason it cannot be expressed."""
    if row["optimizer"] in ("unknown", ""):
        return None, "optimizer not stated (torchtune's table does not give per-row flags)" if row[
            "optimizer"] == "unknown" else "weights only, no training step"
    if row["grad_checkpointing"] == "unknown":
        return None, "checkpointing not stated"
    settings: dict[str, Any] = {
        "method": row["method"], "precision": PRECISION.get(row["precision"], row["precision"]),
        "optimizer": row["optimizer"], "micro_batch": int(row["micro_batch"]), "seq_len": int(row["seq_len"]),
        "grad_checkpointing": row["grad_checkpointing"] == "yes",
        "gpus": {"gpu": row["gpu"], "count": int(row["gpus"])},
    }
    if row["method"] in ("lora", "qlora"):
        targets = [SHORT_TARGETS.get(t.strip(), t.strip()) for t in row["lora_targets"].split(",")]
        settings["lora"] = {"rank": int(row["lora_rank"]), "targets": targets, "alpha": 16, **lora_settings(row)}
    settings.update(version_settings(row, None))
    return settings, None


# The runner that estimates each framework's step; frameworks without one are listed in the second table's notes.
FRAMEWORK_RUNNERS = {"torchtune": "torchtune", "trl": "trl", "hf-trainer": "hf-trainer", "transformers": "hf-trainer",
                     "transformers-trainer": "hf-trainer", "axolotl": "axolotl", "unsloth": "unsloth",
                     "llamafactory": "llamafactory", "llama-factory": "llamafactory",
                     # peft's method_comparison drives transformers' model and its loss from a loop of its own: the
                     # step the hf-trainer profile traces; the row states its optimizer and checkpointing
                     "peft+transformers": "hf-trainer"}
# torchtune's README table was measured with its published recipes: "all the below numbers are provided for batch
# size 2 (without gradient accumulation), a dataset packed to sequence length 2048, and torch compile enabled".
RECIPES = {("torchtune", "meta-llama/Llama-3.1-8B", "lora", 1): "8B_lora_single_device.yaml",
           ("torchtune", "meta-llama/Llama-3.1-8B", "qlora", 1): "8B_qlora_single_device.yaml",
           ("torchtune", "meta-llama/Llama-3.1-8B", "full", 1): "8B_full_single_device.yaml",
           ("torchtune", "meta-llama/Llama-3.1-70B", "lora", 8): "70B_lora.yaml"}
PUBLISHED = REPO / "tests" / "data" / "runners" / "published"


def runner_config(row: dict[str, str], runner: str) -> tuple[dict[str, Any] | None, str]:
    """The tunecast config of a row as its tool ran it, and how it was made; None when it cannot be made."""
    recipe = RECIPES.get((runner, row["model"], row["method"], int(row["gpus"])))
    flags_unknown = "unknown" in (row["optimizer"], row["grad_checkpointing"]) or (
        row["method"] != "full" and not row["lora_rank"])
    if flags_unknown and recipe is not None:
        from tunecast.runners.imported import read_config

        config = read_config(runner, PUBLISHED / runner / recipe).config
        config.update(model=row["model"], micro_batch=int(row["micro_batch"]), seq_len=int(row["seq_len"]),
                      compile=True)
        config["gpus"] = {**config.get("gpus", {}), "gpu": row["gpu"], "count": int(row["gpus"])}
        if int(row["gpus"]) > 1:
            config["gpus"].setdefault("strategy", "fsdp")
        return config, f"{runner}'s published {recipe} at the row's batch and length, compiled"
    if flags_unknown and (row["method"] != "full" and not row["lora_rank"]):
        return None, "LoRA rank not stated and no published recipe of this model and method"
    config: dict[str, Any] = {
        "model": row["model"], "runner": runner, "method": row["method"],
        "precision": PRECISION.get(row["precision"], row["precision"]), "micro_batch": int(row["micro_batch"]),
        "seq_len": int(row["seq_len"]), "gpus": {"gpu": row["gpu"], "count": int(row["gpus"])}}
    if row["optimizer"] not in ("unknown", ""):
        config["optimizer"] = row["optimizer"]
    if row["grad_checkpointing"] not in ("unknown", ""):
        config["grad_checkpointing"] = row["grad_checkpointing"] == "yes"
    if row["method"] in ("lora", "qlora"):
        targets = [SHORT_TARGETS.get(t.strip(), t.strip()) for t in row["lora_targets"].split(",") if t.strip()]
        config["lora"] = {"rank": int(row["lora_rank"]), **({"targets": targets} if targets else {}),
                          **lora_settings(row)}
    if "torch.compile" in row["notes"]:
        config["compile"] = True
    if "flash-attn" in row["notes"]:
        config["attention"] = "flash"
    config.update(version_settings(row, runner))
    unknown = [flag for flag in ("optimizer", "grad_checkpointing") if row[flag] in ("unknown", "")]
    stated = [f"{key} {value}" for key, value in version_settings(row, runner).items()]
    return config, "the row's settings" + (f"; {', '.join(unknown)}: the runner's default" if unknown else "") + (
        f"; {', '.join(stated)}" if stated else "")


def runner_rows(rows: list[dict[str, str]], catalog: Any, own: dict[str, dict[str, Any]],
                skipped: dict[str, str]) -> tuple[list[str], list[str]]:
    """The second table: every row measured with a tool other than tunecast, estimated as that tool runs it where
    tunecast has a runner for it, else as tunecast's own step (`own`: the first table's rows, by id; `skipped`: the
    reasons of those it left out)."""
    from tunecast.config.runner import apply_runner
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.memory import estimate_memory

    lines = ["| row | framework | runner | configured from | measured GiB | as the runner runs it | error | "
             "tunecast's own step | error |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    notes: list[str] = []
    errors: dict[str, float] = {}
    profiled: list[float] = []
    for row in rows:
        if row["framework"] in ("bitsandbytes",):  # a measurement of weights, not of a tool's step
            continue
        runner = FRAMEWORK_RUNNERS.get(row["framework"].lower())
        if row["measured"] in ("OOM", "") or row["method"] not in ("full", "lora", "qlora"):
            continue
        if runner is None:
            compared = own.get(row["id"])
            if compared is None or compared["error"] is None:
                notes.append(f"- {row['id']}: {row['framework']} — {skipped.get(row['id'], 'not compared')}")
                continue
            errors[row["id"]] = abs(compared["error"])
            lines.append(f"| {row['id']} | {row['framework']} | none: tunecast's own step | the row's settings | "
                         f"{compared['measured']:.2f} | — | — | {compared['predicted_gib']:.2f} | "
                         f"{compared['error']:+.1%} |")
            continue
        model = catalog.models.find(row["model"])
        config, how = runner_config(row, runner)
        if config is None or model is None:
            notes.append(f"- {row['id']}: {how if config is None else 'no published config.json in the catalog'}")
            continue
        gpu = catalog.gpus.get(row["gpu"])
        spec = apply_runner(RunSpec.model_validate(config))
        plain = RunSpec.model_validate({**spec.model_dump(), "runner": "tunecast", "runner_version": None,
                                        "transformers_version": None})
        reserved = row["metric"].startswith("max_memory_reserved")
        figures = []
        for each in (spec, plain):
            estimate = estimate_memory(each, model.data, device="cuda", gpu=gpu, overheads=catalog.overheads)
            figures.append(estimate.on_device(gpu.usable_memory_gib)[0] if reserved else estimate.peak_allocated_gib)
        measured = float(row["measured"]) * UNIT_BYTES[row["unit"]] / 2**30
        error, own_error = ((f - measured) / measured for f in figures)
        errors[row["id"]] = abs(error)
        profiled.append(abs(error))
        lines.append(f"| {row['id']} | {row['framework']} | {runner} | {how} | {measured:.2f} | {figures[0]:.2f} | "
                     f"{error:+.1%} | {figures[1]:.2f} | {own_error:+.1%} |")
        print(f"{row['id']} as {runner}: measured {measured:.2f} GiB, predicted {figures[0]:.2f} ({error:+.0%})",
              flush=True)
    if not errors:
        return [*lines, "", "No row was measured with another tool."], notes
    summary = (f"Median absolute error of these rows: {statistics.median(errors.values()):.1%} over {len(errors)} "
               "row(s) (target: at most 10%)"
               + (f"; of the {len(profiled)} estimated with their tool's runner: {statistics.median(profiled):.1%}."
                  if profiled else "."))
    return [*lines, "", summary], notes


def accelerate_says(config: dict[str, Any], precision: str) -> float:
    """What `accelerate estimate-memory` prints as "Training using Adam" for this model, in GiB."""
    import torch
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    from tunecast.step.shape import build_meta_model

    model = build_meta_model(config, dtype=torch.float32)
    total, _ = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total, "bfloat16" if precision.startswith("bf16") else "float32")
    return max(usage.values()) / 2**30


def main() -> int:
    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.memory import estimate_memory

    catalog = load_catalog(None)
    rows = list(csv.DictReader(DATA.open()))
    compared, skipped = [], []
    for row in rows:
        settings, reason = spec_for(row)
        model = catalog.models.find(row["model"])
        if model is None and reason is None:
            reason = "no published config.json of this model in the catalog"
        if settings is None or model is None:
            skipped.append((row["id"], reason))
            continue
        spec = RunSpec.model_validate({"model": row["model"], **settings})
        gpu = catalog.gpus.get(row["gpu"])
        estimate = estimate_memory(spec, model.data, device="cuda", gpu=gpu, overheads=catalog.overheads)
        reserved = row["metric"].startswith("max_memory_reserved")
        # reserved on the row's card: at the edge the cache grows to the card and is released there (on_device)
        predicted_gib = estimate.on_device(gpu.usable_memory_gib)[0] if reserved else estimate.peak_allocated_gib
        accelerate_gib = accelerate_says(model.data, spec.precision)
        if row["measured"] == "OOM":
            compared.append({"id": row["id"], "metric": row["metric"], "measured": None, "unit": row["unit"],
                             "predicted_gib": estimate.device_total_gib, "capacity": gpu.usable_memory_gib,
                             "accelerate_gib": accelerate_gib, "error": None})
            continue
        measured_gib = float(row["measured"]) * UNIT_BYTES[row["unit"]] / 2**30
        compared.append({"id": row["id"], "metric": row["metric"], "measured": measured_gib, "unit": row["unit"],
                         "predicted_gib": predicted_gib, "accelerate_gib": accelerate_gib,
                         "error": (predicted_gib - measured_gib) / measured_gib,
                         "accelerate_error": (accelerate_gib - measured_gib) / measured_gib})
        print(f"{row['id']}: measured {measured_gib:.2f} GiB, tunecast {predicted_gib:.2f} "
              f"({compared[-1]['error']:+.0%}), accelerate {accelerate_gib:.2f}", flush=True)

    errors = [abs(r["error"]) for r in compared if r["error"] is not None]
    accelerate_errors = [abs(r["accelerate_error"]) for r in compared if r["error"] is not None]
    lines = [
        f"Run with `.venv/bin/python benchmarks/public_memory_check.py` on {time.strftime('%Y-%m-%d')}. "
        f"{len(compared)} of {len(rows)} rows compared, {len(skipped)} skipped.",
        "",
        "| row | metric | measured GiB | tunecast GiB | error | accelerate GiB | accelerate error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in compared:
        if r["measured"] is None:
            verdict = "does not fit ✓" if r["predicted_gib"] > r["capacity"] else "fits ✗"
            lines.append(f"| {r['id']} | {r['metric']} | OOM | {r['predicted_gib']:.2f} (device, > "
                         f"{r['capacity']:.2f} usable: {verdict}) | — | {r['accelerate_gib']:.2f} | — |")
            continue
        lines.append(f"| {r['id']} | {r['metric']} | {r['measured']:.2f} | {r['predicted_gib']:.2f} | "
                     f"{r['error']:+.1%} | {r['accelerate_gib']:.2f} | {r['accelerate_error']:+.1%} |")
    lines += ["", f"Median absolute error: tunecast {statistics.median(errors):.1%}, accelerate "
                  f"{statistics.median(accelerate_errors):.1%} (target: tunecast at most 15%).", "",
              "Skipped rows:", ""]
    lines += [f"- {row_id}: {reason}" for row_id, reason in skipped]
    write_section(DOC, MARK, "\n".join(lines))
    table, notes = runner_rows(rows, catalog, {r["id"]: r for r in compared}, dict(skipped))
    unprofiled = sorted({r["framework"] for r in rows if r["framework"] != "bitsandbytes"
                         and r["framework"].lower() not in FRAMEWORK_RUNNERS})
    write_section(DOC, RUNNER_MARK, "\n".join([
        f"Run with `.venv/bin/python benchmarks/public_memory_check.py` on {time.strftime('%Y-%m-%d')}: every row "
        "measured with another tool, that tool named; estimated as it runs it (`--runner`) where tunecast has a "
        "runner for it, beside tunecast's own step"
        + (f"; those of tools it has none for ({', '.join(unprofiled)}) as tunecast's own step."
           if unprofiled else "."),
        "", *table,
        *(["", "Rows not compared:", "", *notes] if notes else [])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
