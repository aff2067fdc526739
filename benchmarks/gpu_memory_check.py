"""The memory estimate against real training steps on a CUDA GPU.

Builds each model from its published config with random weights on the GPU (NF4-quantized for QLoRA),
runs two real training steps with tunecast's own step (tunecast.train), and compares
torch.cuda.max_memory_allocated / max_memory_reserved, and the process's device memory in use
(cudaMemGetInfo, what nvidia-smi shows), with `tunecast memory` for the same run and GPU. Each case runs
in a fresh process. Peak statistics are reset after the weights are built, so they cover the steps.

Run on a CUDA machine (bitsandbytes needed for the QLoRA and 8-bit cases):
    python benchmarks/gpu_memory_check.py --gpu h200 [--out results.json]
    python benchmarks/gpu_memory_check.py --device cpu --smoke     (exercises the script on a CPU)
Then record the table it prints in docs/validation/memory.md (section "GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

LLAMA = "meta-llama/Llama-3.1-8B"
LORA = {"rank": 16, "alpha": 32, "targets": "all-linear"}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen2.5-0.5b full", "Qwen/Qwen2.5-0.5B", {"method": "full", "micro_batch": 4, "seq_len": 1024}),
    ("8b full adamw-8bit ckpt", LLAMA, {"method": "full", "optimizer": "adamw-8bit", "micro_batch": 1,
                                        "seq_len": 2048, "grad_checkpointing": True}),
    ("8b lora mb1", LLAMA, {"method": "lora", "lora": LORA, "micro_batch": 1, "seq_len": 2048}),
    ("8b lora mb2 ckpt", LLAMA, {"method": "lora", "lora": LORA, "micro_batch": 2, "seq_len": 2048,
                                 "grad_checkpointing": True}),
    ("8b qlora mb1", LLAMA, {"method": "qlora", "lora": LORA, "micro_batch": 1, "seq_len": 2048}),
    ("8b qlora mb4 ckpt", LLAMA, {"method": "qlora", "lora": LORA, "micro_batch": 4, "seq_len": 2048,
                                  "grad_checkpointing": True}),
]
SMOKE = [("tiny qlora", {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000},
          {"method": "qlora", "lora": {"rank": 8}, "micro_batch": 2, "seq_len": 128})]


def run_case(config: dict[str, Any], settings: dict[str, Any], device: str) -> dict[str, Any]:
    """In a fresh process: build, two steps, read the allocator's statistics."""
    import torch
    from transformers import AutoModelForCausalLM

    from tunecast.config.spec import RunSpec
    from tunecast.step.forward import forward_backward
    from tunecast.step.settings import TraceSettings
    from tunecast.step.setup import compute_dtype, make_optimizer, param_dtype, prepare_for_training, training_config
    from tunecast.step.shape import hf_config
    from tunecast.train.quantize import quantize_nf4

    spec = RunSpec.model_validate({"model": "x", **settings})
    trace = TraceSettings.from_spec(spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(training_config(config)), dtype=param_dtype(spec.precision),
                                                 attn_implementation=trace.attention)
    if spec.method == "qlora":
        model = quantize_nf4(model, compute_dtype=compute_dtype(spec.precision), double_quant=True, device=device)
    model = prepare_for_training(model, trace)
    optimizer = make_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, config["vocab_size"], (spec.micro_batch, spec.seq_len), device=device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    in_use = 0
    started = time.perf_counter()
    for _ in range(2):
        forward_backward(model, ids, ids, precision=spec.precision, chunked_loss=spec.loss == "chunked")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            free, total = torch.cuda.mem_get_info()
            in_use = max(in_use, total - free)
    if cuda:
        torch.cuda.synchronize()
        return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                "device_in_use": in_use, "seconds": time.perf_counter() - started,
                "gpu_name": torch.cuda.get_device_name()}
    return {"allocated": 0, "reserved": 0, "device_in_use": 0, "seconds": time.perf_counter() - started,
            "gpu_name": "cpu"}


def predict(config: dict[str, Any], settings: dict[str, Any], gpu: str) -> dict[str, Any]:
    from tunecast.catalog.store import load_catalog
    from tunecast.config.spec import RunSpec
    from tunecast.estimate.memory import estimate_memory

    catalog = load_catalog(None)
    spec = RunSpec.model_validate({"model": "x", **settings})
    return estimate_memory(spec, config, device="cuda", gpu=catalog.gpus.get(gpu),
                           overheads=catalog.overheads).as_dict()


def cell(measured_bytes: float, predicted_gib: float) -> str:
    """'measured / predicted (error)' in GiB; a dash where nothing was measured (CPU smoke run)."""
    if not measured_bytes:
        return f"— / {predicted_gib:.2f}"
    measured = measured_bytes / 2**30
    return f"{measured:.2f} / {predicted_gib:.2f} ({(predicted_gib - measured) / measured:+.1%})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", default="h200", help="catalog slug of the GPU this runs on")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="one tiny QLoRA case (for a CPU)")
    parser.add_argument("--out")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        config, settings = json.loads(args.child)
        print(json.dumps(run_case(config, settings, args.device)))
        return 0

    from tunecast.catalog.store import load_catalog

    catalog = load_catalog(None)
    cases = [(name, config, settings) for name, config, settings in SMOKE] if args.smoke else [
        (name, catalog.models.find(model).data, settings) for name, model, settings in CASES]  # type: ignore[union-attr]
    results = []
    print("| case | allocated GiB measured / predicted | reserved GiB measured / predicted | device GiB in use / "
          "predicted |\n|---|---|---|---|")
    for name, config, settings in cases:
        completed = subprocess.run([sys.executable, __file__, "--device", args.device, "--child",
                                    json.dumps([config, settings])], capture_output=True, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
        if completed.returncode != 0:
            print(f"| {name} | failed: {completed.stderr.strip().splitlines()[-1] if completed.stderr else '?'} |")
            results.append({"case": name, "error": completed.stderr[-2000:]})
            continue
        measured = json.loads(completed.stdout.strip().splitlines()[-1])
        predicted = predict(config, settings, args.gpu)
        print(f"| {name} | {cell(measured['allocated'], predicted['peak_allocated_gib'])} | "
              f"{cell(measured['reserved'], predicted['peak_reserved_gib'])} | "
              f"{cell(measured['device_in_use'], predicted['device_total_gib'])} |", flush=True)
        results.append({"case": name, "settings": settings, "measured": measured, "predicted": predicted})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
