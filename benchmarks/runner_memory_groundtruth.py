"""CPU ground truth for `--runner`: the real step of another training tool, measured as cpu_memory_groundtruth.py
measures tunecast's own.

Each case runs, in a fresh process, what a user's script for that tool would: a model built from a catalog model's
published config with random weights (`AutoModelForCausalLM.from_config`), LoRA through peft's `get_peft_model` or
TRL's `peft_config`, and two optimizer steps of the tool's own trainer (`transformers.Trainer` or TRL's
`SFTTrainer`) with `use_cpu=True`, its default optimizer (adamw_torch_fused) and gradient clipping, on a dataset of
random token ids of exactly `seq_len` tokens. The instrument is the process's peak resident memory (ru_maxrss) above
a baseline taken just before the model is built, with MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns freed
tensor memory at once; every library the trainer uses is imported (and the dataset and tokenizer made) before the
baseline, so that code and data are not counted as the step's memory. The peak is counted from the moment the model
is built (the kernel's peak is reset then): while `from_config` builds a model whose output head is tied to its
embeddings, it holds a separate head for a moment (0.5 GiB for Qwen2.5-0.5B in fp32, 0.6 GiB for Qwen3-0.6B): a
transient of how this script makes its model, over before the tool's trainer is made, and not part of the step the
estimate is about.

The prediction is `tunecast memory --device cpu --runner NAME`'s `device_total_gib`: the case's settings with the
runner's defaults applied (runners/profiles.py apply_runner), then estimated with the runner's step variants. The
table also gives the estimate of tunecast's own step at the same settings, to show what the runner's step changes.

How the run maps to tunecast settings: weights loaded in bf16 with the trainer's bf16=True are precision `bf16`
(under the runner's autocast); weights in fp32 with bf16=True are `bf16-mixed`; fp32 weights with bf16=False are
`fp32`. bf16 cases are short: an AVX2-only CPU has no native bf16 matmul.

Run:  .venv/bin/python benchmarks/runner_memory_groundtruth.py                  (all cases, one at a time)
      .venv/bin/python benchmarks/runner_memory_groundtruth.py --only CASE …     (those cases; other rows kept)
      .venv/bin/python benchmarks/runner_memory_groundtruth.py --check-estimates (estimates only, against the table)
Writes the table between the runner-groundtruth markers of docs/validation/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from docsection import write_section

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "validation" / "memory.md"
MARK = "runner-groundtruth"

# name: (runner, catalog model, RunSpec settings as a config would set them; the runner's defaults fill the rest).
CASES: dict[str, tuple[str, str, dict]] = {
    "hf-qwen2.5-0.5b-lora-fp32": ("hf-trainer", "Qwen/Qwen2.5-0.5B",
                                  {"method": "lora", "lora": {"rank": 16}, "precision": "fp32", "micro_batch": 2,
                                   "seq_len": 512}),
    "hf-qwen2.5-0.5b-lora-bf16": ("hf-trainer", "Qwen/Qwen2.5-0.5B",
                                  {"method": "lora", "lora": {"rank": 16}, "precision": "bf16", "micro_batch": 1,
                                   "seq_len": 256}),
    "hf-qwen2.5-0.5b-full-fp32": ("hf-trainer", "Qwen/Qwen2.5-0.5B",
                                  {"method": "full", "precision": "fp32", "micro_batch": 1, "seq_len": 256}),
    "hf-llama-3.2-1b-lora-fp32-ckpt": ("hf-trainer", "meta-llama/Llama-3.2-1B",
                                       {"method": "lora", "lora": {"rank": 16}, "precision": "fp32", "micro_batch": 2,
                                        "seq_len": 512, "grad_checkpointing": True}),
    "trl-qwen2.5-0.5b-lora-bf16": ("trl", "Qwen/Qwen2.5-0.5B",
                                   {"method": "lora", "lora": {"rank": 16}, "precision": "bf16", "micro_batch": 1,
                                    "seq_len": 256}),
    "trl-qwen3-0.6b-lora-defaults": ("trl", "Qwen/Qwen3-0.6B",
                                     {"method": "lora", "lora": {"rank": 16}, "micro_batch": 1, "seq_len": 256}),
    "trl-qwen2.5-0.5b-full-fp32": ("trl", "Qwen/Qwen2.5-0.5B",
                                   {"method": "full", "precision": "fp32", "micro_batch": 1, "seq_len": 256}),
}
# The keys of a run the real trainer is given, as the applied RunSpec says them.
RUN_KEYS = ("method", "precision", "grad_checkpointing", "micro_batch", "seq_len", "optimizer")


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the process's peak resident memory (VmHWM, which ru_maxrss reports) again from what is resident now
    (Linux: `echo 5 > /proc/PID/clear_refs`, proc(5))."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def child(runner: str, config: dict, run: dict, fold_rows: bool = False) -> dict:
    """Runs in a fresh process: the tool's own trainer, two steps, on a model built with random weights.
    `fold_rows` (TRL): its fused LM head's torch fallback folds each tile a few rows at a time (`_fold_by_rows`)."""
    import datasets
    import peft
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from tunecast.estimate.shape import hf_config
    from tunecast.train.setup import training_config

    if runner == "trl":
        import trl
        import trl.trainer.sft_trainer  # noqa: F401  (its imports, before the baseline)

        if fold_rows:
            _fold_by_rows()
    # What the run is made of, before the baseline: the trainer's modules, the dataset and the tokenizer.
    import transformers.trainer  # noqa: F401

    assert run["optimizer"] == "adamw", run  # TrainingArguments' default, adamw_torch_fused
    batch, seq = run["micro_batch"], run["seq_len"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (2 * batch, seq), generator=generator).tolist()
    columns = {"input_ids": ids} if runner == "trl" else {"input_ids": ids, "labels": ids,
                                                          "attention_mask": [[1] * seq for _ in ids]}
    dataset = datasets.Dataset.from_dict(columns)
    tokenizer = _tiny_tokenizer() if runner == "trl" else None
    bf16 = run["precision"] in ("bf16", "bf16-mixed")
    dtype = torch.bfloat16 if run["precision"] == "bf16" else torch.float32
    lora = None
    if run["method"] == "lora":
        adapters = run["lora"]
        lora = peft.LoraConfig(r=adapters["rank"], lora_alpha=adapters["alpha"], lora_dropout=adapters["dropout"],
                               target_modules=adapters["targets"], task_type="CAUSAL_LM")
    seen: dict[str, Any] = {}
    output_dir = tempfile.mkdtemp(prefix="runner-groundtruth-")

    baseline = _rss()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(training_config(config)), dtype=dtype)
    built = _rss() - baseline
    _reset_peak()  # from here: the loading transient of a tied head is not the step's (see the module's docstring)
    model.register_forward_pre_hook(_recorder(seen), with_kwargs=True)
    common = dict(output_dir=output_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                  max_steps=2, use_cpu=True, bf16=bf16, report_to=[], save_strategy="no", logging_strategy="no",
                  dataloader_num_workers=0)
    start = time.perf_counter()
    if runner == "trl":
        config_args = trl.SFTConfig(**common, gradient_checkpointing=run["grad_checkpointing"], max_length=seq,
                                    packing=False)
        trainer = trl.SFTTrainer(model=model, args=config_args, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=lora)
    else:
        if lora is not None:
            model = peft.get_peft_model(model, lora)
        arguments = transformers.TrainingArguments(**common, activation_checkpointing=run["grad_checkpointing"])
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=dataset)
    trainer.train()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    parameters = list(trainer.model.parameters())
    return {
        "growth_bytes": peak - baseline,
        "built_bytes": built,
        "seconds": seconds,
        "checks": {
            **seen,
            "optim": str(trainer.args.optim),
            "fused": optimizer.defaults.get("fused"),
            "max_grad_norm": trainer.args.max_grad_norm,
            "checkpointing": bool(getattr(_base(trainer.model), "is_gradient_checkpointing", False)),
            "param_dtypes": sorted({str(p.dtype) for p in parameters}),
            "trainable_dtypes": sorted({str(p.dtype) for p in parameters if p.requires_grad}),
            "trainable": sum(p.numel() for p in parameters if p.requires_grad),
            "attention": _base(trainer.model).config._attn_implementation,
        },
    }


# Rows of a logits tile that the row-wise fold handles at once (TRL's Triton kernels: one program per row).
FOLD_ROWS = 8
# Columns of the inner dimension per fp32 block product, where TRL's CUDA path multiplies bf16 with an fp32 output.
FOLD_COLUMNS = 1024


def _fold_by_rows() -> None:
    """TRL's fused LM head as its memory is on a GPU, for comparison with the estimate (which models that path).

    On a device with Triton (CUDA, XPU), trl/kernels/chunked_logprob.py folds each [4096, 32768] logits tile into
    per-token statistics with one Triton program per row, and rewrites the tile into its gradient in place; the
    gradient products accumulate in fp32 from bf16 inputs without copies (`addmm(..., out_dtype=float32)`). On the
    CPU its torch fallback (`_forward_tile`, `_backward_tile`) computes the same on the whole tile at once, each
    step a new fp32 tile-sized tensor, and `_addmm_fp32` upcasts both bf16 operands (the tile and a 32,768-row slice
    of the head) to fp32 copies. Here the same fallback functions run on a few rows at a time, and the fp32 products
    on blocks of the inner dimension: the same arithmetic, with the Triton path's memory (no tile-sized
    temporaries). Everything else of the step is TRL's as shipped."""
    import torch
    from trl.kernels import chunked_logprob as kernels

    forward_tile, backward_tile, addmm_fp32 = kernels._forward_tile, kernels._backward_tile, kernels._addmm_fp32

    def forward_rows(tile: Any, stride: int, *rest: Any, **flags: Any) -> None:
        rows, (vocab_start, n_cols) = rest[:-2], rest[-2:]  # the eight per-row tensors, then two numbers
        for first in range(0, tile.shape[0], FOLD_ROWS):
            part = slice(first, first + FOLD_ROWS)
            forward_tile(tile[part], stride, *(row[part] for row in rows), vocab_start, n_cols, **flags)

    def backward_rows(tile: Any, stride: int, *rest: Any, **flags: Any) -> None:
        rows, (vocab_start, n_cols) = rest[:-2], rest[-2:]  # the five per-row tensors, then two numbers
        for first in range(0, tile.shape[0], FOLD_ROWS):
            part = slice(first, first + FOLD_ROWS)
            backward_tile(tile[part], stride, *(row[part] for row in rows), vocab_start, n_cols, **flags)

    def addmm_blocks(acc: Any, a: Any, b: Any) -> None:
        if a.dtype == torch.float32 and b.dtype == torch.float32:  # no copies on the CPU either
            addmm_fp32(acc, a, b)
            return
        for first in range(0, a.shape[1], FOLD_COLUMNS):
            part = slice(first, first + FOLD_COLUMNS)
            acc.addmm_(a[:, part].float(), b[part].float())

    kernels._forward_tile, kernels._backward_tile, kernels._addmm_fp32 = forward_rows, backward_rows, addmm_blocks


def _recorder(seen: dict[str, Any]) -> Any:
    """A forward pre-hook noting the batch the model is given and the autocast it runs under."""
    import torch

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen["input_ids"] = list(ids.shape)
        seen["labels"] = "labels" in kwargs
        seen["fused_lm_head"] = bool(kwargs.get("fused_lm_head", False))
        seen["autocast"] = str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None

    return hook


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _tiny_tokenizer() -> Any:
    """SFTTrainer requires a tokenizer with a pad token; the dataset is already token ids, so a three-word one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def measure(runner: str, config: dict, run: dict, fold_rows: bool = False) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TUNECAST_NO_CACHE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    completed = subprocess.run([sys.executable, __file__, "--child", json.dumps([runner, config, run, fold_rows])],
                               capture_output=True, text=True, env=env, check=False)
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr[-3000:])
    return json.loads(completed.stdout.strip().splitlines()[-1])


def applied(runner: str, settings: dict) -> Any:
    """The RunSpec `tunecast memory --runner` estimates: the case's settings and the runner's defaults."""
    from tunecast.config.spec import RunSpec
    from tunecast.runners.profiles import apply_runner

    return apply_runner(RunSpec.model_validate({"model": "x", **settings, "runner": runner}))


def estimate(spec: Any, config: dict, catalog: Any) -> dict:
    from tunecast.estimate.memory import estimate_memory

    return estimate_memory(spec, config, device="cpu", gpu=None, overheads=catalog.overheads).as_dict()


def run_keys(spec: Any) -> dict:
    """What the real trainer is given, read from the applied RunSpec."""
    run = {key: getattr(spec, key) for key in RUN_KEYS}
    lora = spec.lora
    run["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                   "targets": lora.targets if isinstance(lora.targets, str) else list(lora.targets)}
    return run


def shown_settings(runner: str, settings: dict) -> str:
    """The case's settings, and in brackets what the runner's defaults set."""
    from tunecast.config.spec import RunSpec
    from tunecast.runners.profiles import runner_defaults

    from_runner = runner_defaults(RunSpec.model_validate({"model": "x", **settings, "runner": runner}))
    own = ", ".join(f"{k}={v}" for k, v in settings.items())
    return own + (f" (runner defaults: {', '.join(f'{k}={v}' for k, v in from_runner.items())})" if from_runner else "")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--only", nargs="*", help="measure these cases only; the table keeps the other rows")
    parser.add_argument("--check-estimates", action="store_true",
                        help="estimate every case of the table again (no measurement) and print what moved")
    args = parser.parse_args()
    if args.child:
        runner, config, run, fold_rows = json.loads(args.child)
        print(json.dumps(child(runner, config, run, fold_rows)))
        return 0

    from tunecast.catalog.store import load_catalog

    catalog = load_catalog(None)
    kept = _table_rows()
    if args.check_estimates:
        return _check_estimates(catalog, kept)
    rows = dict(kept)
    today = time.strftime("%Y-%m-%d")
    for name, (runner, model, settings) in CASES.items():
        if args.only is not None and name not in args.only:
            continue
        found = catalog.models.find(model)
        assert found is not None, model
        spec = applied(runner, settings)
        predicted = estimate(spec, found.data, catalog)
        own = estimate(spec.with_changes({"runner": "tunecast"}), found.data, catalog)
        measured = measure(runner, found.data, run_keys(spec))
        print(f"{name}: {json.dumps(measured['checks'])}", flush=True)
        growth = measured["growth_bytes"] / 2**30
        error = (predicted["device_total_gib"] - growth) / growth
        gpu_path = ["—", "—"]
        if runner == "trl":  # the same step with the fused head's memory as on a GPU (`_fold_by_rows`)
            folded = measure(runner, found.data, run_keys(spec), fold_rows=True)["growth_bytes"] / 2**30
            gpu_path = [f"{folded:.3f}", f"{(predicted['device_total_gib'] - folded) / folded:+.1%}"]
        rows[name] = [name, runner, model, shown_settings(runner, settings), f"{growth:.3f}",
                      f"{predicted['device_total_gib']:.3f}", f"{error:+.1%}", *gpu_path,
                      f"{own['device_total_gib']:.3f}", f"{measured['seconds']:.0f}", today]
        print(f"{name}: measured {growth:.3f} GiB, predicted {predicted['device_total_gib']:.3f} GiB ({error:+.1%}); "
              f"head as on a GPU {gpu_path[0]} GiB ({gpu_path[1]}); tunecast's own step {own['device_total_gib']:.3f} "
              "GiB", flush=True)
    ordered = [rows[name] for name in CASES if name in rows]
    import torch
    import transformers
    import trl

    lines = [
        "Measured with `.venv/bin/python benchmarks/runner_memory_groundtruth.py` (`--only CASE …` measures some "
        f"cases and keeps the other rows; each row's date is its own), {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
        f"peft {__import__('peft').__version__}, accelerate {__import__('accelerate').__version__}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in ordered]
    shipped = max((abs(float(row[6].rstrip("%"))) for row in ordered), default=0.0)
    comparable = max((abs(float((row[8] if row[8] != "—" else row[6]).rstrip("%"))) for row in ordered), default=0.0)
    lines += ["", f"Largest absolute error with `--runner`: {comparable:.1f}% against the step as it runs on a GPU (the "
              f"TRL rows with their head folded as on a GPU), {shipped:.1f}% against the CPU runs as shipped "
              "(target: every case within 5%)."]
    write_section(DOC, MARK, "\n".join(lines))
    return 0


COLUMNS = ("case", "runner", "model", "settings", "measured GiB", "predicted GiB (--runner)", "error",
           "measured, TRL's head as on a GPU, GiB", "error against it", "tunecast's own step GiB", "run s",
           "measured on")


def _table_rows() -> dict[str, list[str]]:
    """The rows of the table in the doc, by case."""
    text = DOC.read_text() if DOC.exists() else ""
    section = text.split(f"<!-- {MARK}:start -->", 1)[-1].split(f"<!-- {MARK}:end -->", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in CASES and len(cells) == len(COLUMNS):
            rows[cells[0]] = cells
    return rows


def _check_estimates(catalog: Any, kept: dict[str, list[str]]) -> int:
    """Estimate every case of the table again and print how far the predicted figure and its error moved."""
    worst = 0.0
    for name, row in kept.items():
        runner, model, settings = CASES[name]
        predicted = estimate(applied(runner, settings), catalog.models.find(model).data, catalog)["device_total_gib"]
        measured, before = float(row[4]), float(row[5])
        moved = (predicted - before) / measured * 100
        worst = max(worst, abs(moved))
        print(f"{name}: predicted {before:.3f} GiB in the table, {predicted:.3f} GiB now: error moved "
              f"{moved:+.2f} percentage points", flush=True)
    print(f"largest move: {worst:.2f} percentage points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
