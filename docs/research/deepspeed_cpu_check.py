"""Minimal DeepSpeed ZeRO 1/2/3 check on CPU (gloo), 2 ranks.

Usage (2 ranks):
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 /tmp/ds_check.py --stage 2 [--offload] [--persist0] [--small-buckets]
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 /tmp/ds_check.py --stage 2 ...

Writes one JSON line per rank to --out (default /tmp/ds_results.jsonl).
"""
import argparse, json, os, sys, time

import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, required=True)
p.add_argument("--offload", action="store_true", help="offload_optimizer: cpu")
p.add_argument("--persist0", action="store_true", help="stage3_param_persistence_threshold=0")
p.add_argument("--small-buckets", action="store_true", help="reduce/allgather bucket 5e5 instead of defaults")
p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
p.add_argument("--steps", type=int, default=3)
p.add_argument("--fixed", action="store_true", help="reuse one batch every step (loss should fall)")
p.add_argument("--out", default="/tmp/ds_results.jsonl")
p.add_argument("--local_rank", type=int, default=-1)  # deepspeed launcher passes this
args = p.parse_args()

torch.manual_seed(0)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()

zero = {"stage": args.stage}
if args.offload:
    zero["offload_optimizer"] = {"device": "cpu"}
if args.persist0:
    zero["stage3_param_persistence_threshold"] = 0
if args.small_buckets:
    zero["reduce_bucket_size"] = 500_000
    zero["allgather_bucket_size"] = 500_000
    zero["stage3_prefetch_bucket_size"] = 500_000
ds_config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": zero,
    "bf16": {"enabled": args.dtype == "bf16"},
    "steps_per_print": 1000,
}

cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                  tie_word_embeddings=False)

# Model built on every rank without zero.Init (used for counting and the estimator)
ref = LlamaForCausalLM(cfg)
n_params = sum(dict((q.data_ptr(), q.numel()) for q in ref.parameters()).values())
largest_layer = max(sum(q.numel() for q in m.parameters(recurse=False)) for m in ref.modules())

if args.stage == 3:
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(cfg)
else:
    model = ref

meas = []
engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

# Record every IPG (reduce) bucket buffer DeepSpeed allocates, by wrapping torch.empty calls made
# while a stage_1_and_2 / stage3 frame is on the stack with size == reduce_bucket_size.
import inspect
bucket_allocs = []
_orig_empty = torch.empty
def _spy_empty(*a, **k):
    t = _orig_empty(*a, **k)
    if t.dim() == 1 and t.numel() == int(engine._config.zero_config.reduce_bucket_size):
        fr = inspect.stack()[1]
        bucket_allocs.append((os.path.relpath(fr.filename, os.path.dirname(deepspeed.__file__)), fr.lineno,
                              fr.function, str(t.dtype), t.numel(), t.numel() * t.element_size()))
    return t
torch.empty = _spy_empty
if args.stage == 3:  # stage-3 buffers were allocated during initialize(); read them directly
    for dt, bk in engine.optimizer.ipg_buckets.items():
        if bk.buffer is not None:
            bucket_allocs.append(("runtime/zero/stage3.py", "init", "_setup_for_real_optimizer", str(bk.buffer.dtype),
                                  bk.buffer.numel(), bk.buffer.numel() * bk.buffer.element_size()))


def nb(t):
    return 0 if t is None else t.numel() * t.element_size()


def uniq_sum(ts):
    """bytes of distinct storages among the tensors (views of the same storage counted once)"""
    seen, tot = set(), 0
    for t in ts:
        if t is None or t.numel() == 0:
            continue
        k = t.untyped_storage().data_ptr()
        if k in seen:
            continue
        seen.add(k)
        tot += t.untyped_storage().nbytes()
    return tot


def opt_state_tensors(o):
    inner = o.optimizer
    return [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]


def measure(phase):
    o = engine.optimizer
    r = {"phase": phase}
    if args.stage in (1, 2):
        params16 = list(o.bit16_groups_flat)
        fp32 = list(o.single_partition_of_fp32_groups)
        gparts = {
            "fp32_partition.grad": [f.grad for f in fp32 if f.grad is not None],
            "grads_in_partition": [o.grads_in_partition] if getattr(o, "grads_in_partition", None) is not None else [],
            "averaged_gradients": [g for lst in o.averaged_gradients.values() for g in (lst or []) if g is not None],
            "param.grad": [q.grad for q in engine.module.parameters() if q.grad is not None],
            "param.grad_accum": [getattr(q, "grad_accum", None) for q in engine.module.parameters()
                                 if getattr(q, "grad_accum", None) is not None],
        }
        grads = [t for v in gparts.values() for t in v]
        r["grad_parts"] = {k: uniq_sum(v) for k, v in gparts.items()}
        buckets = [b for bk in o.ipg_buckets.values() for b in bk.buffer]
        r["params16_full_bytes"] = uniq_sum(params16)
    else:
        mp = list(engine.module.parameters())
        params16 = [q.ds_tensor for q in mp]
        r["params16_partition_bytes"] = uniq_sum(list(o.fp16_partitioned_groups_flat) or params16)
        r["params16_gathered_bytes"] = sum(nb(q.data) for q in mp)  # persistent / still-gathered params
        r["n_persistent_params"] = sum(1 for q in mp if getattr(q, "ds_persist", False))
        fp32 = list(o.fp32_partitioned_groups_flat)
        gparts = {
            "fp32_partition.grad": [f.grad for f in fp32 if f.grad is not None],
            "grad_partitions_flat_buffer": [o.grad_partitions_flat_buffer]
            if getattr(o, "grad_partitions_flat_buffer", None) is not None else [],
            "averaged_gradients": [g for lst in o.averaged_gradients.values() for g in (lst or []) if g is not None],
            "param.grad": [q.grad for q in mp if q.grad is not None],
        }
        grads = [t for v in gparts.values() for t in v]
        r["grad_parts"] = {k: uniq_sum(v) for k, v in gparts.items()}
        buckets = [bk.buffer for bk in o.ipg_buckets.values() if bk.buffer is not None]
    r["fp32_master_bytes"] = uniq_sum(fp32)
    r["engine_stage"] = engine.zero_optimization_stage()
    r["partition_gradients"] = getattr(o, "partition_gradients", None)
    if args.stage in (1, 2):
        r["partition_size_elems"] = [int(x) for x in o.partition_size]
        r["averaged_gradients_detail"] = [(tuple(g.shape), str(g.dtype), g.untyped_storage().nbytes())
                                          for lst in o.averaged_gradients.values() for g in (lst or [])][:3]
    r["grad_bytes"] = uniq_sum(grads)
    r["optim_state_bytes"] = uniq_sum(opt_state_tensors(o))
    r["ipg_bucket_buffers"] = [(str(b.dtype), b.numel(), nb(b)) for b in buckets]
    r["fp32_master_device"] = str(fp32[0].device)
    try:
        import psutil
        r["rss_MiB"] = round(psutil.Process().memory_info().rss / 2**20, 1)
    except Exception:
        pass
    return r


# Also measure inside the inner optimizer's step() on step 2 (optimizer states already exist and
# the transient fp32 gradient partition is alive): the closest point to the steady-state peak.
_inner = engine.optimizer.optimizer
_orig_step = _inner.step
_calls = [0]
def _spy_step(*a, **k):
    _calls[0] += 1
    if _calls[0] == 2:
        meas.append(measure("inside_inner_optimizer_step2"))
    return _orig_step(*a, **k)
_inner.step = _spy_step

vocab = cfg.vocab_size
g = torch.Generator().manual_seed(1234 + rank)
losses = []
t0 = time.time()
for step in range(args.steps):
    if step == 0 or not args.fixed:
        ids = torch.randint(0, vocab, (2, 32), generator=g)
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    if step == 0:
        meas.append(measure("after_backward_step1"))
    engine.step()
    if step == 0:
        meas.append(measure("after_optimizer_step1"))
    losses.append(round(out.loss.item(), 4))
elapsed = time.time() - t0

# consistency: full params must be identical across ranks
if args.stage == 3:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        csum = sum(float(q.detach().float().sum()) for q in engine.module.parameters())
else:
    csum = sum(float(q.detach().float().sum()) for q in engine.module.parameters())
cs = torch.tensor([csum], dtype=torch.float64)
allc = [torch.zeros_like(cs) for _ in range(world)]
dist.all_gather(allc, cs)

# DeepSpeed's own estimators (bytes), same model, world GPUs on 1 node
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
est = {
    "z2_offload": estimate_zero2_model_states_mem_needs(n_params, world, 1, cpu_offload=True),
    "z2_no_offload": estimate_zero2_model_states_mem_needs(n_params, world, 1, cpu_offload=False),
    "z3_offload_opt_only_zinit": estimate_zero3_model_states_mem_needs(n_params, largest_layer, world, 1, True, False, True),
    "z3_no_offload_zinit": estimate_zero3_model_states_mem_needs(n_params, largest_layer, world, 1, False, False, True),
}

zc = engine._config.zero_config
res = {
    "rank": rank, "world": world, "stage": args.stage, "offload": args.offload, "persist0": args.persist0,
    "dtype": args.dtype, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
    "accelerator": get_accelerator()._name, "backend": torch.distributed.get_backend(),
    "optimizer_class": type(engine.optimizer).__name__, "inner_optimizer": type(engine.optimizer.optimizer).__name__,
    "n_params": n_params, "largest_layer_params": largest_layer,
    "losses": losses, "elapsed_s": round(elapsed, 2), "param_checksums_all_ranks": [float(c) for c in allc],
    "reduce_bucket_size": zc.reduce_bucket_size, "allgather_bucket_size": zc.allgather_bucket_size,
    "prefetch_bucket_size": zc.prefetch_bucket_size, "overlap_comm": zc.overlap_comm,
    "contiguous_gradients": zc.contiguous_gradients,
    "measure": meas, "bucket_allocs": sorted(set(map(tuple, bucket_allocs)), key=str), "estimates_cpu_gpu_bytes": est,
}
for rk in range(world):
    if rk == rank:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
        print("RESULT", json.dumps(res), flush=True)
    dist.barrier()
if rank == 0:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    estimate_zero2_model_states_mem_needs_all_live(ref, num_gpus_per_node=world, num_nodes=1)
    estimate_zero3_model_states_mem_needs_all_live(ref, num_gpus_per_node=world, num_nodes=1)
dist.barrier()
torch.empty = _orig_empty
engine.destroy()
torch.distributed.destroy_process_group()  # avoids 'terminate called without an active exception' at exit
