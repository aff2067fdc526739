"""Per-rank model states of DeepSpeed ZeRO-1/2/3 on two CPU ranks (gloo), against tunecast's estimate (the
zero1/zero2/zero3 strategies, estimate/deepspeed.py) and DeepSpeed's own estimators of model states
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`).

The model is the catalog's Llama-3.2-1B shrunk by four (hidden 512, 8 heads and 2 key-value heads of 64, intermediate
2048, 4 layers) with a vocabulary of 8,192 (embeddings tied, as there: 19.4M parameters), written to a scratch folder
as a config.json that both sides read. Each case trains it for two steps, micro-batch 2 × 128 tokens, bf16, AdamW, with
a reduce bucket of 5e5 elements so that the bucket shows beside the states; deepspeed_rank_worker.py
runs the ranks in DeepSpeed's own environment and says what is measured and when (tensor storages, not resident
memory). tunecast's figures are the per-phase categories of its step (`_traced_step` in estimate/memory.py, the path
`estimate_memory` takes, which reports the peak phase only): weights + trainable_weights + gradients + optimizer +
quantization of the backward phase against the end of the backward pass, of the optimizer phase against the most held
inside DeepSpeed's step, and its host memory against what DeepSpeed places on the CPU with offload_optimizer.

Run:  .venv/bin/python benchmarks/deepspeed_rank_memory.py     (about 3 minutes on 2 cores; DeepSpeed builds its C++
      ops the first time, about 3 minutes more)
Needs: make .venv-deepspeed
Writes docs/benchmarks/deepspeed-rank-memory.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DS_VENV = REPO / ".venv-deepspeed"
WORKER = REPO / "benchmarks" / "deepspeed_rank_worker.py"
OUT = REPO / "docs" / "benchmarks" / "deepspeed-rank-memory.md"
sys.path.insert(0, str(REPO / "src"))

from tunecast.catalog.store import load_catalog  # noqa: E402
from tunecast.config.spec import RunSpec  # noqa: E402
from tunecast.estimate.deepspeed import model_sizes  # noqa: E402
from tunecast.estimate.memory import StepMemory, _traced_step  # noqa: E402
from tunecast.estimate.profiles import get_profiles  # noqa: E402
from tunecast.step.settings import TraceSettings  # noqa: E402

BASE_MODEL = "meta-llama/Llama-3.2-1B"
SHRUNK = {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2,
          "num_hidden_layers": 4, "vocab_size": 8192, "bos_token_id": 1, "eos_token_id": 2}
MICRO_BATCH, SEQ_LEN, RANKS = 2, 128, 2
REDUCE_BUCKET = 500_000  # elements
LORA_RANK = 16
STATES = ("weights", "trainable_weights", "gradients", "optimizer", "quantization")


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    offload: bool = False
    method: str = "full"
    persistence: int = 100_000  # stage3_param_persistence_threshold, DeepSpeed's default
    prefetch: int = 50_000_000  # stage3_prefetch_bucket_size, DeepSpeed's default
    reuse: int = 1_000_000_000  # stage3_max_reuse_distance, DeepSpeed's default


CASES = (
    Case("ZeRO-1", 1), Case("ZeRO-1, offload", 1, offload=True),
    Case("ZeRO-2", 2), Case("ZeRO-2, offload", 2, offload=True),
    Case("ZeRO-3", 3), Case("ZeRO-3, offload", 3, offload=True),
    Case("ZeRO-3, persistence 0", 3, persistence=0), Case("ZeRO-3, persistence 0, offload", 3, offload=True,
                                                          persistence=0),
    Case("ZeRO-2, LoRA r16", 2, method="lora"), Case("ZeRO-3, LoRA r16", 3, method="lora"),
    # Which of DeepSpeed's settings keep weights gathered beyond tunecast's term (a module and the prefetched weights):
    # the prefetch bucket the Trainer's `auto` sets (0.9·h²) without the reuse distance, then neither
    Case("ZeRO-3, persistence 0, prefetch 0.9·h², reuse distance 0", 3, persistence=0,
         prefetch=int(0.9 * SHRUNK["hidden_size"] ** 2), reuse=0),
    Case("ZeRO-3, persistence 0, prefetch 0, reuse distance 0", 3, persistence=0, prefetch=0, reuse=0),
)


def shrunk_config(folder: Path) -> dict[str, Any]:
    data = {**load_catalog(None).models.find(BASE_MODEL).data, **SHRUNK}
    (folder / "config.json").write_text(json.dumps(data, indent=1))
    return data


def measure(case: Case, model: Path, out: Path) -> list[dict[str, Any]]:
    """The worker's two ranks, in DeepSpeed's environment; one JSON document per rank."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(DS_VENV / "torch-extensions")}  # its JIT-built ops, apart from other venvs'
    command = [str(DS_VENV / "bin" / "torchrun"), "--standalone", f"--nproc_per_node={RANKS}", str(WORKER),
               "--model", str(model), "--stage", str(case.stage), "--method", case.method,
               "--persistence", str(case.persistence), "--reduce-bucket", str(REDUCE_BUCKET),
               "--prefetch-bucket", str(case.prefetch), "--max-reuse-distance", str(case.reuse),
               "--lora-rank", str(LORA_RANK), "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN),
               "--out", str(out), *(["--offload"] if case.offload else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{case.name}: the DeepSpeed run failed\n{done.stderr[-4000:]}")
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda rank: rank["rank"])


def spec_of(case: Case, model: Path, strategy: str | None = None) -> RunSpec:
    return RunSpec.model_validate({
        "model": str(model), "runner": "hf-trainer", "method": case.method,
        "lora": {"rank": LORA_RANK, "alpha": LORA_RANK, "targets": "all-linear"}, "precision": "bf16-mixed",
        "optimizer": "adamw", "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN,
        "gpus": {"count": RANKS, "strategy": strategy or f"zero{case.stage}",
                 "offload": "optimizer" if case.offload else "none",
                 "deepspeed": {"reduce_bucket_size": REDUCE_BUCKET,
                               "stage3_prefetch_bucket_size": case.prefetch,
                               "stage3_param_persistence_threshold": case.persistence,
                               "stage3_max_reuse_distance": case.reuse}}})


def traced(spec: RunSpec, data: dict[str, Any]) -> StepMemory:
    settings = TraceSettings.from_spec(spec, device="cpu")
    pair = get_profiles(data, settings, MICRO_BATCH, SEQ_LEN, exact=True)
    return _traced_step(pair, spec, MICRO_BATCH, SEQ_LEN, cuda=False, workspace=0,
                        checkpointing=settings.grad_checkpointing, sizes=model_sizes(data))


def predicted(case: Case, model: Path, data: dict[str, Any]) -> dict[str, Any]:
    """tunecast's model states per phase (device), its host memory, and at ZeRO-3 its gathered weights: the forward
    phase's temporaries above ZeRO-2's (the same trace without gathering)."""
    step = traced(spec_of(case, model), data)
    states = {phase: {c: step.phases[phase].breakdown[c] for c in STATES} for phase in ("backward", "optimizer")}
    gathered = 0.0
    if case.stage == 3:
        plain = traced(spec_of(case, model, strategy="zero2"), data)
        gathered = step.phases["forward"].breakdown["temporaries"] - plain.phases["forward"].breakdown["temporaries"]
    return {"states": states, "host": step.host_bytes, "gathered": gathered}


def moment(rank: dict[str, Any], phase: str) -> dict[str, Any]:
    """The measurement of `phase` with the most bytes held (gathered weights apart: tunecast counts them as
    temporaries)."""
    candidates = [m for m in rank["moments"] if m["phase"] == phase]
    return max(candidates, key=lambda m: sum(v for k, v in m["bytes"].items() if k != "gathered"))


def held(m: dict[str, Any], side: str | None = None) -> int:
    """Model-state bytes of a measurement, on one side or both (without the gathered weights)."""
    if side is None:
        return sum(v for k, v in m["bytes"].items() if k != "gathered")
    gathered = m["bytes"].get("gathered", 0) if side == "device" else 0
    return m["sides"][side] - gathered


def mb(value: float) -> str:
    return f"{value / 1e6:,.3f}"


def pair_of(values: list[float], fmt: Any = mb) -> str:
    """One figure where the ranks agree, else rank 0 / rank 1."""
    shown = [fmt(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def error(estimate: float, measured: list[float]) -> str:
    return pair_of([estimate / m - 1 if m else float("nan") for m in measured], lambda e: f"{e:+.1%}")


def estimator_figures(rank: dict[str, Any], offload: bool) -> tuple[float, float] | None:
    """DeepSpeed's estimate per rank: (GPU bytes, CPU bytes: its per-node figure over the ranks, with its 1.5 buffer
    factor), CPU 0 without offload (its CPU figure there is for loading a checkpoint, not for training)."""
    estimate = rank["estimator"]
    if estimate is None:
        return None
    return float(estimate["gpu_bytes"]), estimate["cpu_bytes_per_node"] / RANKS if offload else 0.0


def rows_for(case: Case, ranks: list[dict[str, Any]], ours: dict[str, Any]) -> dict[str, list[str]]:
    """The document's rows for one case: summary, categories, sides."""
    step = [moment(r, "optimizer") for r in ranks]
    backward = [moment(r, "backward") for r in ranks]
    ours_step = sum(ours["states"]["optimizer"].values())
    ours_backward = sum(ours["states"]["backward"].values())
    total_step = [float(held(m)) for m in step]
    total_backward = [float(held(m)) for m in backward]
    estimate = estimator_figures(ranks[0], case.offload)
    ds = ("—", "—") if estimate is None else (mb(sum(estimate)), error(sum(estimate), total_step))
    summary = (f"| {case.name} | {pair_of(total_backward)} | {mb(ours_backward + ours['host'])} | "
               f"{error(ours_backward + ours['host'], total_backward)} | {pair_of(total_step)} | "
               f"{mb(ours_step + ours['host'])} | {error(ours_step + ours['host'], total_step)} | {ds[0]} | {ds[1]} |")

    def category(m: dict[str, Any], *names: str) -> float:
        return float(sum(m["bytes"].get(n, 0) for n in names))

    t = ours["states"]["optimizer"]
    categories = (
        f"| {case.name} | {pair_of([category(m, 'weights16') for m in step])} | "
        f"{mb(t['weights'] + t['trainable_weights'] + t['quantization'])} | "
        f"{pair_of([category(m, 'master', 'states') for m in step])} | {mb(t['optimizer'])} | "
        f"{pair_of([category(m, 'grads16', 'flat16') for m in step])} | "
        f"{pair_of([category(m, 'grads32') for m in step])} | "
        f"{pair_of([category(m, 'bucket') for m in step])} | {mb(t['gradients'])} | "
        f"{pair_of([category(m, 'offload') for m in step])} | {pair_of([category(m, 'other') for m in step])} | "
        f"{mb(ours['host'])} |")
    sides = []
    if case.offload:
        for label, measured, phase in (("end of backward", backward, "backward"), ("inside step", step, "optimizer")):
            device = [float(held(m, "device")) for m in measured]
            host = [float(held(m, "host")) for m in measured]
            ours_device = sum(ours["states"][phase].values())
            gpu, cpu = estimate if estimate is not None else (None, None)
            ds_device = "—" if gpu is None or phase != "optimizer" else f"{mb(gpu)} ({error(gpu, device)})"
            ds_host = "—" if cpu is None or phase != "optimizer" else f"{mb(cpu)} ({error(cpu, host)})"
            sides.append(f"| {case.name} | {label} | {pair_of(device)} | {mb(ours_device)} | "
                         f"{error(ours_device, device)} | {ds_device} | {pair_of(host)} | {mb(ours['host'])} | "
                         f"{error(ours['host'], host)} | {ds_host} |")
    gathered = []
    if case.stage == 3:
        forward_peak = [float(r["gathered_forward_peak"]) for r in ranks]
        at_end = [float(m["bytes"].get("gathered", 0)) for m in backward]
        gathered.append(f"| {case.name} | {pair_of(forward_peak)} | {pair_of(at_end)} | {mb(ours['gathered'])} | "
                        f"{error(ours['gathered'], forward_peak)} |")
    return {"summary": [summary], "categories": [categories], "sides": sides, "gathered": gathered}


def details(case: Case, ranks: list[dict[str, Any]]) -> str:
    """What each rank held, by DeepSpeed's attribute, at the two moments compared (for the record)."""
    parts = []
    for r in ranks:
        for phase in ("backward", "optimizer"):
            m = moment(r, phase)
            named = ", ".join(f"{k} {v:,}" for k, v in m["names"].items())
            parts.append(f"rank {r['rank']}, {phase} ({m['point']}): {named}")
    buckets = ranks[0]["bucket_allocations"]
    allocated = f"{len(buckets)} × {buckets[0]['bytes']:,} B ({buckets[0]['dtype']})" if buckets else "none"
    return (f"- **{case.name}** — reduce buckets allocated on rank 0 over the two steps: {allocated}; "
            f"overlap_comm {ranks[0]['overlap_comm']}; inner optimizer {ranks[0]['inner_optimizer']}; losses "
            f"{ranks[0]['losses']} / {ranks[1]['losses']}.\n  " + "\n  ".join(parts))


def main() -> int:
    if not (DS_VENV / "bin" / "torchrun").exists():
        raise SystemExit(f"DeepSpeed's environment is missing: run `make .venv-deepspeed` in {REPO} (a venv of its "
                         "own, with the same torch as .venv and DeepSpeed 0.19.8)")
    started = time.perf_counter()
    rows: dict[str, list[str]] = {"summary": [], "categories": [], "sides": [], "gathered": []}
    notes: list[str] = []
    seconds: list[float] = []
    versions: dict[str, str] = {}
    params = 0
    with tempfile.TemporaryDirectory(prefix="tunecast-deepspeed-memory-") as scratch:
        model = Path(scratch) / "model"
        model.mkdir()
        data = shrunk_config(model)
        for index, case in enumerate(CASES):
            began = time.perf_counter()
            ranks = measure(case, model, Path(scratch) / f"case-{index}.jsonl")
            seconds.append(time.perf_counter() - began)
            ours = predicted(case, model, data)
            versions = ranks[0]["versions"]
            params = params or (ranks[0]["estimator"] or {}).get("params", 0)
            for key, lines in rows_for(case, ranks, ours).items():
                rows[key] += lines
            notes.append(details(case, ranks))
            print(rows["summary"][-1], f"({seconds[-1]:.0f} s)", flush=True)
    total = time.perf_counter() - started
    OUT.write_text(document(rows, notes, versions, params, seconds, total))
    print(f"wrote {OUT.relative_to(REPO)} in {total:.0f} s", flush=True)
    return 0


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=REPO, capture_output=True, text=True).stdout
    return done.stdout.strip() + (" with src/ changed" if dirty.strip() else "")


def document(rows: dict[str, list[str]], notes: list[str], versions: dict[str, str], params: int,
             seconds: list[float], total: float) -> str:
    import torch

    return "\n".join([
        "# DeepSpeed ZeRO per-rank memory on the CPU", "",
        "Written by `.venv/bin/python benchmarks/deepspeed_rank_memory.py` (after `make .venv-deepspeed`; method in "
        "its docstring and in `benchmarks/deepspeed_rank_worker.py`'s): two gloo ranks of DeepSpeed train the "
        f"catalog's Llama-3.2-1B shrunk by four ({params:,} parameters, embeddings tied) for two steps, micro-batch "
        f"{MICRO_BATCH} × {SEQ_LEN}, bf16, AdamW, `reduce_bucket_size` {REDUCE_BUCKET:,}; each rank's model states are "
        "counted tensor by tensor on the second step. tunecast: the same run as a RunSpec (runner hf-trainer, "
        "precision bf16-mixed, gpus.count 2, the strategy, gpus.offload, gpus.deepspeed) through `_traced_step`.", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores. DeepSpeed "
        f"{versions.get('deepspeed')}, torch {versions.get('torch')} and transformers {versions.get('transformers')} "
        f"(DeepSpeed's venv); tunecast's side torch {torch.__version__}. DeepSpeed runs took "
        f"{sum(seconds):.0f} s ({min(seconds):.0f}–{max(seconds):.0f} s each), the whole benchmark {total:.0f} s; "
        f"tunecast at {commit()}.", "",
        "## Model states per rank, MB (10^6 bytes)", "",
        "Both sides of an offload case added (on a GPU machine DeepSpeed's host side is CPU memory; on this CPU it is "
        "the one RAM). Where the ranks differ: rank 0 / rank 1. DeepSpeed's estimator: its GPU figure, plus with "
        "offload its CPU figure (per node, with its 1.5 buffer factor) over the 2 ranks; ZeRO-1 by ZeRO-2's "
        "function (DeepSpeed has none for ZeRO-1); none for LoRA (its functions take every parameter as trained).", "",
        "| case | end of backward, measured | tunecast (backward) | error | inside step, measured | "
        "tunecast (optimizer) | error | DeepSpeed's estimator | error |",
        "|---|---|---|---|---|---|---|---|---|", *rows["summary"], "",
        "## Inside the step, by category, MB", "",
        "Measured: 16-bit weights; fp32 master and AdamW's states; 16-bit gradient partition (and at ZeRO-1/2 its "
        "flattened copy, cast to fp32); fp32 gradient partition; reduce bucket; offload staging buffers; other "
        "(scalars). tunecast: weights + trainable_weights + quantization; optimizer (master and states); gradients "
        "(both partitions and the bucket); host.", "",
        "| case | 16-bit weights | tunecast | master + states | tunecast optimizer | grads 16-bit | grads fp32 | "
        "bucket | tunecast gradients | offload buffers | other | tunecast host |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows["categories"], "",
        "## Offload: GPU side and CPU side, MB", "",
        "Each measured tensor is put where DeepSpeed allocates it on a GPU machine (its `self.device`, the CPU with "
        "offload_optimizer: the master, the states, the fp32 gradients, the 16-bit CPU copy of the partition, "
        "`temp_grad_buffer_for_cpu_offload`, and at ZeRO-3 the 16-bit gradient partition).", "",
        "| case | moment | device, measured | tunecast | error | DeepSpeed's GPU (error) | host, measured | "
        "tunecast host | error | DeepSpeed's CPU per rank (error) |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows["sides"], "",
        "## ZeRO-3: weights gathered whole, MB", "",
        "Measured: the most non-persistent weights gathered at once in the forward pass (as each module starts) and "
        "at the end of the backward pass. tunecast counts them as temporaries of the forward and backward phases "
        "(shown: its forward temporaries above the same trace at ZeRO-2's).", "",
        "| case | forward peak, measured | end of backward | tunecast | error (forward) |", "|---|---|---|---|---|",
        *rows["gathered"], "",
        "## DeepSpeed's own buffers, and what is left (DeepSpeed 0.19.8's code)", "", *WHY, "",
        "## What each rank held, by DeepSpeed attribute (bytes)", "", *notes, ""])


# The terms behind the differences in the tables, each with the lines of DeepSpeed 0.19.8 (deepspeed/runtime/) that
# allocate it; the tables show how large each is here.
WHY = (
    "What tunecast counts of DeepSpeed's own buffers (estimate/deepspeed.py), each found on these ranks first:",
    "- **ZeRO-1 holds the 16-bit gradients of other ranks' weights through the backward pass** when a weight has more "
    "elements than `reduce_bucket_size`: such a gradient bypasses the bucket and keeps its own storage "
    "(zero/stage_1_and_2.py:1443-1447), and stage 1 clears only the gradients it copied into its partition "
    "(:2271-2273; ZeRO-2 clears the others' at :2262-2270); they are freed at the step (:3103). With the 5e5 bucket "
    "here that is most of the model; with DeepSpeed's default 5e8 only weights above 5e8 elements (Llama-3.1-8B's "
    "128k × 4096 embeddings and head), with the Trainer's `auto` (h²) also the MLP matrices. Counted from the "
    "model's weight shapes.",
    "- **ZeRO-1/2's step flattens the 16-bit gradient partition and casts the copy to fp32** "
    "(zero/stage_1_and_2.py:3117-3119): for that moment the partition, its flat copy and the fp32 gradient coexist, "
    "2Ψ/N more than the moment after, and than DeepSpeed's own 2Ψ + 18Ψ/N. Counted in the optimizer phase.",
    "- **Offload staging buffers of ZeRO-1/2**: `temp_grad_buffer_for_gpu_offload` on the GPU and "
    "`temp_grad_buffer_for_cpu_offload` on the CPU, each the largest weight's elements in 16 bits "
    "(zero/stage_1_and_2.py:653-661, the largest from :626-635), held for the run. Counted on both sides.",
    "- **ZeRO-3 leaves LoRA's adapters in fp32**: peft makes them fp32 over a bf16 model, and DeepSpeed casts "
    "parameters to 16 bits only for models not built under zero.Init (engine.py:1857-1862), so each adapter is a "
    "4-byte partition plus, being persistent, a 4-byte whole copy gathered for the passes; their gradient partition "
    "is 16-bit. Counted so (ZeRO-1/2 cast them).",
    "- **ZeRO-3 keeps far more weights gathered than a module and one prefetch**, from the second step (once it has "
    "a trace): a weight the trace uses again within `stage3_max_reuse_distance` elements is kept (:653-662; default "
    "1e9, config.py:251), under `stage3_max_live_parameters`. tunecast counts a module, the prefetch bucket and the "
    "reuse distance, bounded by the live parameters and the model.",
    "",
    "What it does not count:",
    "- **ZeRO-1/2's gradient partition holds whole weights**: `grads_in_partition` is sized by the weights that start "
    "or end in the partition (zero/stage_1_and_2.py:2184-2192), so the rank whose partition a weight straddles holds "
    "all of that weight's gradient (rank 0 here: one 1M-element MLP matrix, +2.1 MB, 1%).",
    "- **ZeRO-3 keeps frozen weights up to `stage3_param_persistence_threshold` elements whole** "
    "(zero/parameter_offload.py:317-329, `ds_numel <= param_threshold`), beside their partition: here the key and "
    "value projections (512 × 128) and the norms (−0.7% at the end of the backward pass; −3.5% with LoRA). A real "
    "model's are norms and biases: small.",
    "- **The prefetcher's passed-over weights**: weights the prefetcher passes over while they are gathered are "
    "marked with the step of their next use and not released (zero/partitioned_param_coordinator.py:457-476 and "
    ":642-651); with the reuse distance at 0 and a prefetch bucket, that still keeps most of this small model "
    "gathered (the table's 0.9·h² row), where tunecast counts a module and the bucket.",
    "- **DeepSpeed's estimators**: ZeRO-2's is the moment after the flat copy, exact but for the straddling weight "
    "(and with offload, the staging buffers); its CPU figure multiplies by 1.5 (`additional_buffer_factor`). "
    "ZeRO-3's counts 18Ψ/N, leaving out the 16-bit gradient partition (zero/stage3.py:789-791, 2Ψ/N) and the reduce "
    "bucket, and adds 4 × the largest layer's elements in their place.",
)


if __name__ == "__main__":
    raise SystemExit(main())
