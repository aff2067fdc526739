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
runner's defaults applied (config/runner.py apply_runner), then estimated with the runner's step variants. The
table also gives the estimate of tunecast's own step at the same settings, to show what the runner's step changes.
How a run maps to tunecast settings: weights loaded in bf16 with the trainer's bf16=True are precision `bf16` (under
the runner's autocast); weights in fp32 with bf16=True are `bf16-mixed`; fp32 weights with bf16=False are `fp32`.

TRL cases run twice: as shipped, and with its fused LM head's CPU fallback folding a few rows at a time, which is the
memory its Triton kernels have on a GPU (`_fold_by_rows`); the estimate models the GPU path.

`--live CASE …` runs a case once more under a dispatch mode that counts the bytes of live tensor storages, torch's
own accounting of the real step, and prints its peak beside the trace's (`peak_allocated_gib`): where the two agree,
a difference in resident memory is not the step's tensors. (Under a dispatch mode autograd never sums two gradients
of one tensor in place, as under the trace: see NOTES.)

bf16 cases are short: an AVX2-only CPU has no native bf16 matmul.

Run:  .venv/bin/python benchmarks/runner_memory_groundtruth.py                  (all cases, one at a time; ~25 min)
      .venv/bin/python benchmarks/runner_memory_groundtruth.py --only CASE …     (those cases; other rows kept)
      .venv/bin/python benchmarks/runner_memory_groundtruth.py --check-estimates (estimates only, against the table)
      .venv/bin/python benchmarks/runner_memory_groundtruth.py --live CASE …     (live tensors against the trace)
Writes the table between the runner-groundtruth markers of docs/validation/memory.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import weakref
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
    "hf-qwen2.5-0.5b-lora-bf16-mixed": ("hf-trainer", "Qwen/Qwen2.5-0.5B",
                                        {"method": "lora", "lora": {"rank": 16}, "precision": "bf16-mixed",
                                         "micro_batch": 1, "seq_len": 256}),
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
# Rows of a logits tile that the row-wise fold handles at once (TRL's Triton kernels: one program per row).
FOLD_ROWS = 8
# Columns of the inner dimension per fp32 block product, where TRL's CUDA path multiplies bf16 with an fp32 output.
FOLD_COLUMNS = 1024
PARAM_BYTES = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}
# Cases whose real step `--live` counted, and when: the peak of their live tensors equalled the trace's.
LIVE_CHECKED = (("hf-qwen2.5-0.5b-lora-bf16", "hf-qwen2.5-0.5b-lora-bf16-mixed", "trl-qwen2.5-0.5b-lora-bf16",
                 "trl-qwen3-0.6b-lora-defaults", "trl-qwen2.5-0.5b-full-fp32"), "2026-12-02")


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the process's peak resident memory (VmHWM, which ru_maxrss reports) again from what is resident now
    (Linux: `echo 5 > /proc/PID/clear_refs`, proc(5))."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def child(runner: str, config: dict, run: dict, fold_rows: bool = False, live: bool = False) -> dict:
    """Runs in a fresh process: the tool's own trainer, two steps, on a model built with random weights.
    `fold_rows` (TRL): its fused LM head's torch fallback folds each tile a few rows at a time (`_fold_by_rows`).
    `live`: the steps run under a dispatch mode that counts live tensor storages (`_LiveTensors`)."""
    import datasets
    import peft
    import torch
    import transformers
    import transformers.trainer
    from transformers import AutoModelForCausalLM

    from tunecast.step.setup import training_config
    from tunecast.step.shape import hf_config

    if runner == "trl":
        import trl
        import trl.trainer.sft_trainer

        if fold_rows:
            _fold_by_rows()

    # What the run is made of, before the baseline: the trainer's modules (above), the dataset and the tokenizer.
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
    _reset_peak()  # from here: the transient of building a tied head is not the step's (see the module's docstring)
    model.register_forward_pre_hook(_recorder(seen), with_kwargs=True)
    common = dict(output_dir=output_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                  max_steps=2, use_cpu=True, bf16=bf16, report_to=[], save_strategy="no", logging_strategy="no",
                  dataloader_num_workers=0)
    start = time.perf_counter()
    if runner == "trl":
        sft = trl.SFTConfig(**common, gradient_checkpointing=run["grad_checkpointing"], max_length=seq, packing=False)
        trainer = trl.SFTTrainer(model=model, args=sft, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=lora)
    else:
        if lora is not None:
            model = peft.get_peft_model(model, lora)
        arguments = transformers.TrainingArguments(**common, activation_checkpointing=run["grad_checkpointing"])
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=dataset)
    counter = _LiveTensors(trainer.model) if live else None
    with counter if counter is not None else contextlib.nullcontext():
        trainer.train()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    parameters = list(trainer.model.parameters())
    return {
        "growth_bytes": peak - baseline,
        "live_peak_bytes": counter.peak if counter is not None else None,
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


class _LiveTensors:
    """Bytes of the tensor storages alive while the trainer runs, and their peak: the model's parameters and
    buffers, and every storage an operation returns, until it is freed (a weak reference's finalizer). The
    tracer's accounting (estimate/tracer.py) on real tensors."""

    def __init__(self, model: Any) -> None:
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            self._track(tensor)

    def _track(self, tensor: Any) -> None:
        storage = tensor.untyped_storage()
        if id(storage) in self._sizes:
            return
        self._sizes[id(storage)] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, id(storage))

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __enter__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                for leaf in tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        counter._track(leaf)
                return out

        self._mode = Counting()
        self._mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


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

    def by_rows(fold: Any) -> Any:
        def rows(tile: Any, stride: int, *rest: Any, **flags: Any) -> None:
            per_row, numbers = rest[:-2], rest[-2:]  # the per-row tensors, then vocab_start and n_cols
            for first in range(0, tile.shape[0], FOLD_ROWS):
                part = slice(first, first + FOLD_ROWS)
                fold(tile[part], stride, *(tensor[part] for tensor in per_row), *numbers, **flags)

        return rows

    def addmm_blocks(acc: Any, a: Any, b: Any) -> None:
        if a.dtype == torch.float32 and b.dtype == torch.float32:  # no copies on the CPU either
            addmm_fp32(acc, a, b)
            return
        for first in range(0, a.shape[1], FOLD_COLUMNS):
            part = slice(first, first + FOLD_COLUMNS)
            acc.addmm_(a[:, part].float(), b[part].float())

    kernels._forward_tile, kernels._backward_tile = by_rows(forward_tile), by_rows(backward_tile)
    kernels._addmm_fp32 = addmm_blocks


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


def measure(runner: str, config: dict, run: dict, *, fold_rows: bool = False, live: bool = False) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TUNECAST_NO_CACHE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    arguments = json.dumps([runner, config, run, fold_rows, live])
    completed = subprocess.run([sys.executable, __file__, "--child", arguments], capture_output=True, text=True,
                               env=env, check=False)
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr[-3000:])
    return json.loads(completed.stdout.strip().splitlines()[-1])


def applied(runner: str, settings: dict) -> Any:
    """The RunSpec `tunecast memory --runner` estimates: the case's settings and the runner's defaults."""
    from tunecast.config.runner import apply_runner
    from tunecast.config.spec import RunSpec

    return apply_runner(RunSpec.model_validate({"model": "x", **settings, "runner": runner}))


def estimate(spec: Any, config: dict, catalog: Any, *, as_on_gpu: bool = False) -> dict:
    """`tunecast memory --device cpu` of `spec`; `as_on_gpu`: with the runner's step as it runs on a GPU (TRL's fused
    head as its Triton kernels hold it, `fused-head`, not its CPU fallback), still counted as CPU memory."""
    from unittest import mock

    from tunecast.estimate.memory import estimate_memory
    from tunecast.step.variants import runner_step

    def as_on(spec: Any, device: str = "cuda") -> tuple[str, ...]:
        return runner_step(spec, "cuda")

    # looked up where the trace's settings and the estimate's notes call it
    on_gpu = contextlib.ExitStack()
    if as_on_gpu:
        on_gpu.enter_context(mock.patch("tunecast.step.settings.runner_step", as_on))
        on_gpu.enter_context(mock.patch("tunecast.step.variants.runner_step", as_on))
    with on_gpu:
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
    from tunecast.config.runner import runner_defaults
    from tunecast.config.spec import RunSpec

    from_runner = runner_defaults(RunSpec.model_validate({"model": "x", **settings, "runner": runner}))
    own = ", ".join(f"{k}={v}" for k, v in settings.items())
    return own + (f" (runner defaults: {', '.join(f'{k}={v}' for k, v in from_runner.items())})" if from_runner else "")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--only", nargs="*", help="measure these cases only; the table keeps the other rows")
    parser.add_argument("--check-estimates", action="store_true",
                        help="estimate every case of the table again (no measurement) and print what moved")
    parser.add_argument("--live", nargs="+", metavar="CASE",
                        help="count the live tensors of these cases' real steps against the trace; no table")
    args = parser.parse_args()
    if args.child:
        runner, config, run, fold_rows, live = json.loads(args.child)
        print(json.dumps(child(runner, config, run, fold_rows, live)))
        return 0

    from tunecast.catalog.store import load_catalog

    catalog = load_catalog(None)
    if args.live:
        return _live(catalog, args.live)
    kept = _table_rows()
    if args.check_estimates:
        return _check_estimates(catalog, kept)
    rows = dict(kept)
    today = time.strftime("%Y-%m-%d")
    for name, (runner, model, settings) in CASES.items():
        if args.only is not None and name not in args.only:
            continue
        config = _config(catalog, model)
        spec = applied(runner, settings)
        predicted = estimate(spec, config, catalog)["device_total_gib"]
        own = estimate(spec.with_changes({"runner": "tunecast"}), config, catalog)["device_total_gib"]
        measured = measure(runner, config, run_keys(spec))
        print(f"{name}: {json.dumps(measured['checks'])}", flush=True)
        growth = measured["growth_bytes"] / 2**30
        gpu_path = ["—", "—"]
        if runner == "trl":  # the same step with the fused head's memory as on a GPU (`_fold_by_rows`)
            folded = measure(runner, config, run_keys(spec), fold_rows=True)["growth_bytes"] / 2**30
            as_on_gpu = estimate(spec, config, catalog, as_on_gpu=True)["device_total_gib"]
            gpu_path = [f"{folded:.3f}", f"{(as_on_gpu - folded) / folded:+.1%}"]
        rows[name] = [name, runner, model, shown_settings(runner, settings), f"{growth:.3f}", f"{predicted:.3f}",
                      f"{(predicted - growth) / growth:+.1%}", *gpu_path, f"{own:.3f}",
                      f"{measured['seconds']:.0f}", today]
        print(f"{name}: measured {growth:.3f} GiB, predicted {predicted:.3f} GiB ({rows[name][6]}); head as on a GPU "
              f"{gpu_path[0]} GiB ({gpu_path[1]}); tunecast's own step {own:.3f} GiB", flush=True)
    ordered = [rows[name] for name in CASES if name in rows]
    write_section(DOC, MARK, "\n".join(_document(catalog, ordered)))
    return 0


COLUMNS = ("case", "runner", "model", "settings", "measured GiB", "predicted GiB (--runner)", "error",
           "measured, TRL's head as on a GPU, GiB", "error of the estimate as on a GPU", "tunecast's own step GiB",
           "run s",
           "measured on")


def _config(catalog: Any, model: str) -> dict:
    found = catalog.models.find(model)
    assert found is not None, model
    return found.data


def _document(catalog: Any, ordered: list[list[str]]) -> list[str]:
    """The section of docs/validation/memory.md: how it was measured, the table, and what the misses are."""
    import torch
    import transformers
    import trl

    versions = (f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft "
                f"{__import__('peft').__version__}, accelerate {__import__('accelerate').__version__}")
    lines = [
        "The real step of the transformers `Trainer` and of TRL's `SFTTrainer`, as a user's script runs them (model "
        "from the published config with random weights, LoRA through peft, `use_cpu=True`, the tool's default "
        "optimizer adamw_torch_fused and gradient clipping, two steps on token ids of exactly `seq_len`), against "
        "`tunecast memory --device cpu --runner NAME` for the same settings, with the runner's defaults applied as "
        "`--runner` applies them (shown in brackets). Same instrument as section 1: resident memory above a baseline "
        "taken before the model is built, its peak counted once the model is built (the transient of building a "
        "tied head is not the step's). On the CPU TRL's fused LM head runs its torch fallback, which `--device cpu "
        "--runner trl` traces; TRL rows are measured a second time with that head folding a few rows of each logits "
        "tile at a time, the memory its Triton kernels have on a GPU, against the estimate of the step as on a GPU "
        "(what `--runner trl` traces for a GPU).",
        "",
        "Measured with `.venv/bin/python benchmarks/runner_memory_groundtruth.py` (`--only CASE …` measures some "
        f"cases and keeps the other rows; each row's date is its own), {platform.machine()}, {os.cpu_count()} cores, "
        f"{versions}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in ordered]
    shipped = max((abs(float(row[6].rstrip("%"))) for row in ordered), default=0.0)
    gpu_like = max((abs(float((row[8] if row[8] != "—" else row[6]).rstrip("%"))) for row in ordered), default=0.0)
    lines += ["", f"Largest absolute error: {shipped:.1f}% against the runs as shipped (target: every case within 5%); "
              f"{gpu_like:.1f}% with the TRL rows' head and estimate as on a GPU.", ""]
    return lines + _notes(catalog, ordered)


def _notes(catalog: Any, ordered: list[list[str]]) -> list[str]:
    """What explains the rows that miss, with figures computed from the table and the models' configs."""
    folded = [row for row in ordered if row[7] != "—"]
    tied = {row[0]: _tied_gradient_gib(catalog, row[0]) for row in folded}
    tied = {name: copy for name, copy in tied.items() if copy}
    notes = []
    if folded:
        extra = ", ".join(f"{float(row[4]) - float(row[7]):+.3f} GiB ({row[0]})" for row in folded)
        others = [abs(float(row[8].rstrip("%"))) for row in folded]
        notes.append(
            "* **TRL's fused LM head on the CPU** (trl/kernels/chunked_logprob.py) runs a torch fallback where a GPU "
            "runs Triton kernels: it folds each logits tile of up to 4,096 tokens × 32,768 entries into per-token "
            "statistics with whole-tile fp32 temporaries (the logits upcast, their exponentials, the top-1 mask; in "
            "the backward pass the softmax, the target mask and the gradient, about eight tile-sized tensors at "
            "once), and upcasts both bf16 operands of each gradient product to fp32 copies (a 32,768-row slice of "
            "the head among them). The Triton kernels work one row at a time and rewrite the tile in place. "
            "`--device cpu` traces TRL's fallback itself (`fused-head-cpu`); a GPU estimate traces the kernels' "
            f"memory (`fused-head`). The fallback's cost at these lengths, as measured: {extra}. With the fallback "
            f"folding {FOLD_ROWS} rows at a time (the same functions, the same results) the estimate as on a GPU is "
            f"within {max(others, default=0.0):.1f}% of the TRL rows.")
    for row in folded:
        if row[0] not in tied:
            continue
        runner, model, settings = CASES[row[0]]
        config = _config(catalog, model)
        width = PARAM_BYTES[applied(runner, settings).precision]
        copy = tied[row[0]]
        notes.append(
            f"* **{row[0]}: the tied head's gradient.** {model} ties its output head to its embeddings, so one "
            "parameter receives two gradients, the fused head's (early in the backward pass) and the embeddings' "
            "(at its end), which autograd sums before accumulating (torch/csrc/autograd/input_buffer.cpp). On real "
            "tensors it adds the second into the first in place when the first is a dense tensor nothing else "
            "holds, as the fused head's freshly made gradient is; under any dispatch mode, and on fake tensors, it "
            "adds out of place. The tracer sums such gradients in place, as real tensors do (estimate/tracer.py, "
            "`_sums_in_place`); counted under a dispatch mode (`--live`) the real step holds a third copy at the very "
            f"end of the backward pass, {copy:.3f} GiB ({config['vocab_size']:,} × {config['hidden_size']:,} × "
            f"{width} bytes), above the trace. The standard loss's head gradient (`F.linear`'s backward, a "
            "transposed view) is summed out of place on real tensors too, and traced so (measured on a tied "
            "embedding of 100,000 × 1,024: three copies at the peak, as traced).")
    from tunecast.catalog.overheads import overhead_bytes

    framework = overhead_bytes(catalog.overheads, "cpu_framework", "*") / 2**30
    residue = [float(row[4]) - (float(row[5]) - framework) for row in ordered]
    checked, on = LIVE_CHECKED
    notes.append(
        "* **What remains is not tensors.** `--live` counted the live tensors of the real step of "
        f"{', '.join(checked)} ({on}; TRL's head, and its estimate, as on a GPU): the peak equalled the trace's "
        "(`peak_allocated_gib`) "
        f"to 0.001 GiB in each{' (' + ', '.join(tied) + ': plus the copy above)' if tied else ''}. Resident memory "
        "beyond the traced tensors (each row's measurement less the estimate's tensors) is "
        f"{min(residue, default=0.0):.3f}-"
        f"{max(residue, default=0.0):.3f} GiB across the rows, against the {framework:.3f} GiB `cpu_framework` "
        "overhead the estimate adds (calibrated on tunecast's own step, section 1): the positive errors are that "
        "CPU-only constant, not the runner's step.")
    return notes


def _tied_gradient_gib(catalog: Any, name: str) -> float:
    """For a full fine-tune of a model whose head is tied to its embeddings, the size of that weight's gradient
    (GiB); otherwise 0."""
    runner, model, settings = CASES[name]
    config = _config(catalog, model)
    if settings.get("method") != "full" or not config.get("tie_word_embeddings"):
        return 0.0
    return config["vocab_size"] * config["hidden_size"] * PARAM_BYTES[applied(runner, settings).precision] / 2**30


def _live(catalog: Any, names: list[str]) -> int:
    """Each case's real step counted by its live tensors (torch's own accounting), against the trace."""
    for name in names:
        runner, model, settings = CASES[name]
        config = _config(catalog, model)
        spec = applied(runner, settings)
        traced = estimate(spec, config, catalog, as_on_gpu=runner == "trl")["peak_allocated_gib"]
        measured = measure(runner, config, run_keys(spec), fold_rows=runner == "trl", live=True)
        live = measured["live_peak_bytes"] / 2**30
        print(f"{name}: live tensors at the peak {live:.3f} GiB, traced {traced:.3f} GiB ({traced - live:+.3f}); "
              f"resident growth under the counting {measured['growth_bytes'] / 2**30:.3f} GiB", flush=True)
    return 0


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
        predicted = estimate(applied(runner, settings), _config(catalog, model), catalog)["device_total_gib"]
        measured, before = float(row[4]), float(row[5])
        moved = (predicted - before) / measured * 100
        worst = max(worst, abs(moved))
        print(f"{name}: predicted {before:.3f} GiB in the table, {predicted:.3f} GiB now: error moved "
              f"{moved:+.2f} percentage points", flush=True)
    print(f"largest move: {worst:.2f} percentage points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
