"""One DeepSpeed ZeRO run on the CPU: two gloo ranks train a model for two steps, and each rank writes the bytes of
its model states, by category, at the end of the second backward pass and inside the second optimizer step.

Run by deepspeed_rank_memory.py in DeepSpeed's own environment (`make .venv-deepspeed`), never by tunecast:

    DS_ACCELERATOR=cpu .venv-deepspeed/bin/torchrun --standalone --nproc_per_node=2 \
        benchmarks/deepspeed_rank_worker.py --model DIR --stage 2 [--offload] [--method lora] --out ranks.jsonl

What is measured: the distinct tensor storages DeepSpeed's ZeRO optimizer and the model hold (a view counts as the
storage it views, once), not resident memory: torch.empty reserves a bucket's pages without touching them, and on a
CPU the offloaded states share the one RAM with the rest. Each storage is put in one category, the first of:

* bucket: the reduce (IPG) buckets (`ipg_buckets`; stage_1_and_2.py `setup_buckets`, stage3.py
  `_setup_for_real_optimizer`), and the gradients that are views into them;
* weights16: the 16-bit weights (stage 1/2 `bit16_groups_flat` and the frozen weights; stage 3 each weight's
  partition `ds_tensor`, and the weights under `stage3_param_persistence_threshold` elements, kept whole);
* gathered: stage 3's other weights gathered whole at the moment (the layer being computed, the prefetched ones);
* master: the fp32 partition the optimizer steps (`single_partition_of_fp32_groups`, `fp32_partitioned_groups_flat`);
* grads32: its `.grad`, the fp32 gradient partition;
* states: the inner optimizer's state tensors (AdamW's two moments);
* grads16: the 16-bit gradient partitions (`grads_in_partition`, `averaged_gradients`, `grad_partitions_flat_buffer`,
  the weights' `.grad`);
* flat16: the flattened copy of the 16-bit gradient partition that stage 1/2's step casts to fp32;
* offload: the staging buffers of the CPU offload (`param_buffer_of_bit16_for_cpu_offload_groups`,
  `temp_grad_buffer_for_cpu_offload`, `temp_grad_buffer_for_gpu_offload`);
* other: any other storage an attribute of the ZeRO optimizer holds, by attribute name (so that nothing is missed).

Each storage is also put on a side, as DeepSpeed places it on a GPU machine: `host` where DeepSpeed allocates it on
the offload device (`self.device`, "cpu" with `offload_optimizer`), `device` otherwise.

The moments, on the second step (the optimizer's states exist): the end of the backward pass, where every gradient is
reduced and the bucket still held (stage 1/2: just before `_release_ipg_buffers`; stage 3: after
`independent_gradient_partition_epilogue`); right after `backward` returns; inside `step`, at every call of
stage 1/2's `free_grad_in_param_list` (the second is the moment its fp32 gradient and its 16-bit partition
coexist; with the flattened copy, made and freed just before and seen by wrapping `flatten`, added as one more moment)
and of the inner optimizer's `step`. At stage 3 also the most weights gathered at once in the forward pass
(as each module starts). And DeepSpeed's own estimators of model states for the same model.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

# Attributes of the ZeRO optimizer by category (stage 1/2 and stage 3 names together).
WEIGHTS16 = ("bit16_groups_flat", "fp16_partitioned_groups_flat")
MASTER = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
GRADS16 = ("grads_in_partition", "averaged_gradients", "grad_partitions_flat_buffer", "accumulated_grads_in_cpu")
OFFLOAD = ("param_buffer_of_bit16_for_cpu_offload_groups", "temp_grad_buffer_for_cpu_offload",
           "temp_grad_buffer_for_gpu_offload")
# What DeepSpeed allocates on `self.device` (the CPU with offload_optimizer); grads16 there at stage 3 only
# (stage3.py `grad_partitions_flat_buffer`, device=self.device).
HOST_WHEN_OFFLOADED = ("master", "grads32", "states", "param_buffer_of_bit16_for_cpu_offload_groups",
                       "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu")


def tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in a value of lists, tuples and dicts, with each tensor's `.grad`."""
    if isinstance(value, torch.Tensor):
        yield value
        if value.grad is not None:
            yield value.grad
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)


class Census:
    """Distinct storages by category, side and name, the first claim winning."""

    def __init__(self, offloaded: bool, stage: int) -> None:
        self.offloaded, self.stage = offloaded, stage
        self.seen: set[int] = set()
        self.rows: list[tuple[str, str, str, int]] = []  # (category, side, name, bytes)

    def claim(self, category: str, name: str, tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.device.type == "meta":  # shapes only (round_robin_bit16_meta): no memory
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if not size or key in self.seen:
                continue
            self.seen.add(key)
            host = self.offloaded and (category in HOST_WHEN_OFFLOADED or name in HOST_WHEN_OFFLOADED
                                       or (category == "grads16" and self.stage == 3))
            self.rows.append((category, "host" if host else "device", name, size))

    def totals(self) -> dict[str, Any]:
        by_category: dict[str, int] = {}
        by_side = {"device": 0, "host": 0}
        by_name: dict[str, int] = {}
        for category, side, name, size in self.rows:
            by_category[category] = by_category.get(category, 0) + size
            by_side[side] += size
            by_name[f"{category}:{name}"] = by_name.get(f"{category}:{name}", 0) + size
        return {"bytes": by_category, "sides": by_side, "names": by_name}


def census(engine: Any, offloaded: bool, stage: int) -> dict[str, Any]:
    """The model states of this rank now, by category (see the module's docstring)."""
    zero = engine.optimizer
    attrs = vars(zero)
    counted = Census(offloaded, stage)
    params = list(engine.module.parameters())
    buckets = [t for bucket in zero.ipg_buckets.values() for t in tensors_in(bucket.buffer)]
    counted.claim("bucket", "ipg_buckets", buckets)
    for name in WEIGHTS16:
        counted.claim("weights16", name, [t for t in attrs.get(name) or [] if t is not None])
    counted.claim("weights16", "ds_tensor", [p.ds_tensor for p in params if hasattr(p, "ds_tensor")])
    # ZeRO-3 keeps parameters under the persistence threshold whole; the others are whole only while gathered
    counted.claim("weights16", "parameters", [p.data for p in params if getattr(p, "ds_persist", True)])
    counted.claim("gathered", "parameters", [p.data for p in params])
    masters = [t for name in MASTER for t in attrs.get(name) or []]
    counted.claim("master", "master", masters)
    counted.claim("grads32", "master.grad", [m.grad for m in masters if m.grad is not None])
    counted.claim("states", "optimizer.state", [t for state in zero.optimizer.state.values() for t in state.values()
                                                if isinstance(t, torch.Tensor) and t.numel() > 1])
    for name in GRADS16:
        counted.claim("grads16", name, tensors_in(attrs.get(name)))
    counted.claim("grads16", "param.grad", [g for p in params for g in (p.grad, getattr(p, "grad_accum", None))
                                           if g is not None])
    for name in OFFLOAD:
        counted.claim("offload", name, tensors_in(attrs.get(name)))
    for name, value in attrs.items():
        if name != "optimizer":
            counted.claim("other", name, tensors_in(value))
    return counted.totals()


def before(owner: Any, method: str, probe: Callable[[str], None]) -> None:
    """Call `probe(method)` before every call of `owner.method`."""
    original = getattr(owner, method)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        probe(method)
        return original(*args, **kwargs)

    setattr(owner, method, wrapped)


def after(owner: Any, method: str, probe: Callable[[str], None]) -> None:
    """Call `probe(method)` after every call of `owner.method`."""
    original = getattr(owner, method)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        probe(method)
        return result

    setattr(owner, method, wrapped)


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """What the Trainer's DeepSpeed integration passes for this run (AdamW, bf16, clipping at 1.0)."""
    zero: dict[str, Any] = {"stage": args.stage, "reduce_bucket_size": args.reduce_bucket}
    if args.stage == 3:
        zero.update(stage3_param_persistence_threshold=args.persistence,
                    stage3_prefetch_bucket_size=args.prefetch_bucket, stage3_max_reuse_distance=args.max_reuse_distance)
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": zero,
            "steps_per_print": 10**9}


def build_model(args: argparse.Namespace, config: Any, settings: dict[str, Any]) -> Any:
    """The model with random weights as the Trainer builds it: under ZeRO-3 transformers creates it partitioned
    (zero.Init, told by HfDeepSpeedConfig) and initializes each weight gathered; LoRA's adapters are added after, as
    peft adds them to a loaded model (DeepSpeed partitions them in initialize())."""
    torch.manual_seed(0)
    kept = HfDeepSpeedConfig(settings)  # transformers reads it through a weak reference while the model is built
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    del kept
    if args.method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, target_modules="all-linear",
                          task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    return model


def estimators(config: Any, stage: int, offload: bool, world: int) -> dict[str, Any]:
    """DeepSpeed's own estimates of model states (runtime/zero/stage_1_and_2.py and stage3.py): (cpu, gpu) bytes for
    this model over `world` GPUs of one node; ZeRO-1 has none of its own, so ZeRO-2's."""
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in reference.parameters())  # tied weights once, as DeepSpeed's model_to_params
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in reference.modules())
    if stage < 3:
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, world, 1, cpu_offload=offload)
        return {"function": "estimate_zero2_model_states_mem_needs", "params": total, "gpu_bytes": gpu,
                "cpu_bytes_per_node": cpu}
    cpu, gpu, layer = estimate_zero3_model_states_mem_needs(total, largest, world, 1, cpu_offload=offload,
                                                           cpu_offload_params=False, zero_init=True)
    return {"function": "estimate_zero3_model_states_mem_needs", "params": total, "largest_layer_params": largest,
            "gpu_bytes": gpu, "cpu_bytes_per_node": cpu, "largest_layer_bytes": layer}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a directory holding config.json")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    parser.add_argument("--offload", action="store_true", help="offload_optimizer: cpu")
    parser.add_argument("--persistence", type=int, default=100_000, help="stage3_param_persistence_threshold")
    parser.add_argument("--reduce-bucket", type=int, default=500_000, help="reduce_bucket_size, elements")
    parser.add_argument("--prefetch-bucket", type=int, default=50_000_000, help="stage3_prefetch_bucket_size")
    parser.add_argument("--max-reuse-distance", type=int, default=1_000_000_000, help="stage3_max_reuse_distance")
    parser.add_argument("--method", choices=("full", "lora"), default="full")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", required=True, help="JSON lines, one per rank, appended")
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = AutoConfig.from_pretrained(args.model)
    settings = ds_config(args)
    model = build_model(args, config, settings)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=settings)
    zero = engine.optimizer

    # Every reduce bucket DeepSpeed allocates from now on (ZeRO-1/2 make theirs at each backward pass); ZeRO-3's
    # was made in initialize() and is held for the run.
    allocations: list[dict[str, Any]] = []
    empty = torch.empty

    def spied_empty(*shape: Any, **kwargs: Any) -> torch.Tensor:
        tensor = empty(*shape, **kwargs)
        if tensor.dim() == 1 and tensor.numel() == args.reduce_bucket:
            allocations.append({"dtype": str(tensor.dtype), "elements": tensor.numel(),
                                "bytes": tensor.untyped_storage().nbytes()})
        return tensor

    torch.empty = spied_empty
    if args.stage == 3:
        allocations += [{"dtype": str(b.buffer.dtype), "elements": b.buffer.numel(),
                         "bytes": b.buffer.untyped_storage().nbytes()}
                        for b in zero.ipg_buckets.values() if b.buffer is not None]

    moments: list[dict[str, Any]] = []
    watching = {"phase": ""}

    flat = {"bytes": 0}  # ZeRO-1/2's flattened copy of the 16-bit gradient partition, made in the step

    def probe(point: str) -> None:
        if not watching["phase"]:
            return
        moments.append({"phase": watching["phase"], "point": point, **census(engine, args.offload, args.stage)})
        if point == "free_grad_in_param_list" and flat["bytes"]:
            # The step flattens the 16-bit partition and casts the copy to fp32 (stage_1_and_2.py:3117-3119): while
            # the cast runs, the copy lives beside what this call sees (the partition and the fp32 gradient)
            moment = json.loads(json.dumps(moments[-1]))
            moment["point"] = "flattened partition cast to fp32"
            moment["bytes"]["flat16"] = flat["bytes"]
            moment["sides"]["device"] += flat["bytes"]
            moment["names"]["flat16:flatten"] = flat["bytes"]
            moments.append(moment)
            flat["bytes"] = 0

    def spy_flatten(method: str) -> None:
        original = getattr(zero, method)

        @functools.wraps(original)
        def wrapped(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(tensors, *args, **kwargs)
            if watching["phase"] == "optimizer" and any(tensors is g for g in zero.averaged_gradients.values()):
                flat["bytes"] = result.untyped_storage().nbytes()
            return result

        setattr(zero, method, wrapped)

    if args.stage < 3:
        before(zero, "_release_ipg_buffers", probe)
        before(zero, "free_grad_in_param_list", probe)
        spy_flatten("flatten")
        spy_flatten("flatten_dense_tensors_aligned")
    else:
        after(zero, "independent_gradient_partition_epilogue", probe)
    before(zero.optimizer, "step", probe)

    # ZeRO-3: the most weights gathered at once in the forward pass, seen as each module starts (after DeepSpeed's own
    # pre-forward hook has gathered its parameters and prefetched the next ones)
    gathered = {"peak": 0}

    def on_forward(module: Any, inputs: Any) -> None:
        if watching["phase"] == "forward":
            now = Census(args.offload, args.stage)
            now.claim("gathered", "parameters", [p.data for p in engine.module.parameters()
                                                 if not getattr(p, "ds_persist", True)])
            gathered["peak"] = max(gathered["peak"], sum(size for *_, size in now.rows))

    if args.stage == 3:
        for module in engine.module.modules():
            module.register_forward_pre_hook(on_forward)

    generator = torch.Generator().manual_seed(1234 + rank)
    losses = []
    started = time.perf_counter()
    for step in range(2):
        ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), generator=generator)
        watching["phase"] = "forward" if step == 1 else ""
        loss = engine(input_ids=ids, labels=ids).loss
        watching["phase"] = "backward" if step == 1 else ""
        engine.backward(loss)
        watching["phase"] = ""
        if step == 1:
            moments.append({"phase": "after_backward", "point": "backward returned",
                            **census(engine, args.offload, args.stage)})
        watching["phase"] = "optimizer" if step == 1 else ""
        engine.step()
        watching["phase"] = ""
        losses.append(round(loss.item(), 4))
    torch.empty = empty

    result = {
        "rank": rank, "world": world, "stage": args.stage, "offload": args.offload, "method": args.method,
        "persistence": args.persistence, "reduce_bucket": args.reduce_bucket, "prefetch_bucket": args.prefetch_bucket,
        "max_reuse_distance": args.max_reuse_distance, "losses": losses,
        "train_s": round(time.perf_counter() - started, 2), "moments": moments, "bucket_allocations": allocations,
        "gathered_forward_peak": gathered["peak"],
        "overlap_comm": bool(engine._config.zero_config.overlap_comm),
        "inner_optimizer": type(zero.optimizer).__name__, "trained_params": sum(p.ds_numel if hasattr(p, "ds_numel")
                                                                               else p.numel() for p in trained),
        "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "backend": dist.get_backend(), "accelerator": os.environ.get("DS_ACCELERATOR", ""),
        "estimator": estimators(config, args.stage, args.offload, world) if args.method == "full" else None,
    }
    for turn in range(world):  # one rank at a time appends its line
        if turn == rank:
            with open(args.out, "a") as out:
                out.write(json.dumps(result) + "\n")
        dist.barrier()
    engine.destroy()
    dist.destroy_process_group()  # without it a rank aborts at exit (docs/research/deepspeed-cpu.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
