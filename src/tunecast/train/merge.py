"""`tunecast merge RUN_DIR`: the run's adapter merged into its base weights, saved as a plain model.

For QLoRA the adapter was trained against NF4 (or LLM.int8) weights, so those are what it is merged into: the base is
quantized as in training (train/quantize.py) and dequantized back to the compute dtype before the merge,
the usual practice for QLoRA adapters (merging into the original weights would add the quantization error
the adapter learned to correct for).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from tunecast.catalog.store import Catalog
from tunecast.errors import TunecastError
from tunecast.storage.store import Storage, read_set, write_set
from tunecast.train.run import CONFIG_FILE, FINAL, final_complete

MERGED = "merged"


def _dequantize(model: Any, dtype: Any) -> Any:
    """Every bitsandbytes Linear4bit or Linear8bitLt back to a plain Linear holding its dequantized weight (an 8-bit
    one in `dtype`, the model's: its int8 rows times their absmax / 127, bitsandbytes' int8_vectorwise_dequant)."""
    import bitsandbytes as bnb
    import torch

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
                if isinstance(child, bnb.nn.Linear4bit):
                    weight = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state)
                else:  # the row scales sit on the weight until a forward pass moves them to the layer's state
                    scales = child.weight.SCB if child.weight.SCB is not None else child.state.SCB
                    weight = bnb.functional.int8_vectorwise_dequant(child.weight.data, scales).to(dtype)
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        dtype=weight.dtype, device=weight.device)
                plain.weight.data.copy_(weight)
                if child.bias is not None:
                    plain.bias.data.copy_(child.bias.data)
                setattr(parent, name, plain)
    return model


def merge_run(run_dir: str, output: str | None, catalog: Catalog) -> dict[str, Any]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tunecast.config.spec import RunSpec
    from tunecast.train.model import folder_files, quantize_for_qlora

    storage = Storage(run_dir)
    if not storage.exists(CONFIG_FILE):
        raise TunecastError(f"{run_dir} is not a tunecast run (no {CONFIG_FILE})", field="RUN_DIR",
                            hint="give the output directory of `tunecast train`")
    if not final_complete(storage):
        raise TunecastError(f"{run_dir} has no complete final/ model: the run has not finished", field="RUN_DIR",
                            hint="run the same `tunecast train` command until it finishes")
    spec = RunSpec.model_validate(yaml.safe_load(storage.read(CONFIG_FILE)))
    if spec.method == "full":
        raise TunecastError("a full fine-tune has no adapter to merge: final/ already holds the whole model",
                            field="RUN_DIR", hint="load final/ with from_pretrained")
    _, files = read_set(storage, FINAL)
    from tunecast.train.diffusion_parts import LORA_WEIGHTS

    if LORA_WEIGHTS in files:
        raise TunecastError(f"{run_dir} trained a diffusion pipeline: its LoRA is in diffusers' format, which "
                            "tunecast merge does not take", field="RUN_DIR",
                            hint="load it with load_lora_weights and merge it with the pipeline's fuse_lora() "
                                 "(final/README.md shows how to load it)")
    with tempfile.TemporaryDirectory(prefix="tunecast-merge-") as temporary:
        adapter = Path(temporary) / "adapter"
        for name, content in files.items():
            (adapter / name).parent.mkdir(parents=True, exist_ok=True)
            (adapter / name).write_bytes(content)
        import json

        base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        base_folder = _local_base(base_path, Path(temporary) / "base")
        from tunecast.step.setup import compute_dtype, param_dtype

        dtype = compute_dtype(spec.precision) if spec.method == "qlora" else param_dtype(spec.precision)
        base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=dtype, local_files_only=True)
        if spec.method == "qlora":
            base = _dequantize(quantize_for_qlora(base, spec, torch.device("cpu")), dtype)
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        result_dir = Path(temporary) / "merged"
        merged.save_pretrained(str(result_dir))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (adapter / name).exists():
                (result_dir / name).write_bytes((adapter / name).read_bytes())
        parent, _, folder = (output or storage.url_of(MERGED)).rstrip("/").rpartition("/")
        target = Storage(parent or ".")
        write_set(target, folder, folder_files(result_dir), {"kind": "merged", "base": base_path})
        parameters = sum(p.numel() for p in merged.parameters())
    return {"output": target.url_of(folder), "base": base_path, "parameters": parameters}


def _local_base(base_path: str, scratch: Path) -> str:
    """A local folder holding the base: itself, a copy of a stored `base/` set, or a Hub id (cached)."""
    if Path(base_path).is_dir():
        return base_path
    if "://" in base_path:
        parent, _, name = base_path.rstrip("/").rpartition("/")
        _, files = read_set(Storage(parent), name)
        for file_name, data in files.items():
            (scratch / file_name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / file_name).write_bytes(data)
        return str(scratch)
    return base_path
