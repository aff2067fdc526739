"""Does the fake-tensor trace of an MoE step see what the real step allocates? One real CPU training step of a
shrunk catalog model (its first layers), recorded three ways, next to `tunecast memory --device cpu`:

* every tensor storage created, by a TorchDispatchMode over the real tensors (the tracer's own view, on real
  data: per-expert counts are real here), as the peak of live tensor bytes — against the estimate's
  `peak_allocated_gib`;
* the process's peak resident memory above its start (ru_maxrss, MALLOC_MMAP_THRESHOLD_=65536 so that freed
  blocks go back at once), as the CPU ground truth measures it — against the estimate's `device_total_gib`;
* the operations during which the peak resident memory rose, and by how much.

Run:  .venv/bin/python benchmarks/moe_trace_check.py Qwen/Qwen3-30B-A3B --layers 4 --seq-len 256
      (about 25 min on an AVX2-only CPU, whose bf16 backward matmuls run at ~0.2 GFLOP/s)
`--vocab` shrinks the vocabulary so that the experts, not the logits, set the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import weakref

MB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(config: dict, settings: dict) -> dict:
    import realstep
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from tunecast.step.forward import forward_backward

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    class Live(TorchDispatchMode):
        """Live bytes of every storage seen (their peak), and by how much each operation raised peak RSS."""

        def __init__(self) -> None:
            super().__init__()
            self.alive: dict[int, int] = {}
            self.live = self.peak = 0
            self.raised: dict[str, int] = {}

        def add(self, tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.alive:
                return
            self.alive[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)

        def _free(self, key: int) -> None:
            self.live -= self.alive.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            before = peak()
            out = func(*args, **(kwargs or {}))
            if peak() > before:
                self.raised[str(func)] = self.raised.get(str(func), 0) + peak() - before
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.add(leaf)
            return out

    baseline = _rss()
    spec, model, optimizer = realstep.build(config, settings)
    live = Live()
    for tensor in (*model.parameters(), *model.buffers()):
        live.add(tensor)
    built = peak() - baseline
    ids = torch.randint(0, config["vocab_size"], (spec.micro_batch, spec.seq_len))
    with live:
        forward_backward(model, ids, ids, precision=spec.precision, chunked_loss=spec.loss == "chunked")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    top = sorted(live.raised.items(), key=lambda item: -item[1])[:6]
    return {"live_peak_bytes": live.peak, "resident_peak_bytes": peak() - baseline, "built_peak_bytes": built,
            "raised_by": dict(top)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0

    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.memory import estimate_memory
    from tunecast.step.shape import shallow_config_data

    found = load_catalog(None).models.find(args.model)
    assert found is not None, args.model
    config = shallow_config_data(found.data, args.layers)
    if args.vocab:
        config["vocab_size"] = args.vocab
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            config.pop(key, None)
    settings = {"method": "lora", "lora": {"rank": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                "micro_batch": args.micro_batch, "seq_len": args.seq_len}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, __file__, "x", "--child", json.dumps([config, settings])],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    real = json.loads(done.stdout.strip().splitlines()[-1])
    spec = RunSpec.model_validate({"model": "x", **settings})
    traced = estimate_memory(spec, config, device="cpu", gpu=None, overheads=load_catalog(None).overheads)
    print(f"{args.model}, {args.layers} layer(s), {settings}")
    print(f"  live tensors, real step : {real['live_peak_bytes'] / MB:10.1f} MiB")
    print(f"  live tensors, estimate  : {traced.peak_allocated_gib * 1024:10.1f} MiB  "
          f"({traced.peak_allocated_gib * 2**30 / real['live_peak_bytes'] - 1:+.2%})")
    print(f"  resident growth, real   : {real['resident_peak_bytes'] / MB:10.1f} MiB  "
          f"({real['built_peak_bytes'] / MB:.1f} MiB once the model was built)")
    print(f"  resident, estimate      : {traced.device_total_gib * 1024:10.1f} MiB  "
          f"({traced.device_total_gib * 2**30 / real['resident_peak_bytes'] - 1:+.2%})")
    print("  peak resident raised by : " + ", ".join(f"{op} {n / MB:.1f} MiB" for op, n in real["raised_by"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
