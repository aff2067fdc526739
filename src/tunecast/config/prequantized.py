"""Checkpoints whose weights another method already quantized (AWQ, GPTQ), which tunecast cannot fine-tune.

LoRA trains adapters on weights in the compute dtype, and tunecast's QLoRA quantizes those itself with bitsandbytes
(NF4, or LLM.int8 with `quantization.bits: 8`). An AWQ or GPTQ checkpoint holds packed integer weights that only its
own kernels run: its memory and speed are neither of those, and `tunecast train` cannot load it into bitsandbytes.
So it is refused, pointing at the unquantized model it was made from. How one is recognised, most certain first:

* its config.json says so: `quantization_config.quant_method` is `awq` or `gptq` (how transformers' AutoAWQ and
  GPTQ integrations write it, utils/quantization_config.py `QuantizationMethod`);
* a model folder holds the file the quantizing tool writes beside config.json: AutoGPTQ's `quantize_config.json`,
  AutoAWQ's `quant_config.json` (older checkpoints carry only that);
* its Hub id has AWQ or GPTQ as a part of its name (`TheBloke/Llama-2-7B-GPTQ`,
  `hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4`), as the repositories that publish them name them: also when
  its config.json cannot be read (offline, or the Hub unreachable), so the reason is the real one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tunecast.catalog.models import ModelConfig

PREQUANTIZED_METHODS = {"awq": "AWQ", "gptq": "GPTQ"}
# The file each quantizing tool writes beside config.json, and the tool.
PREQUANTIZED_FILES = {"quantize_config.json": ("gptq", "AutoGPTQ"), "quant_config.json": ("awq", "AutoAWQ")}
_NAME_PART = re.compile(r"(?:^|[-_.])(awq|gptq)(?=$|[-_.])", re.IGNORECASE)


@dataclass(frozen=True)
class Prequantized:
    """Why a model reads as pre-quantized: what says so (`evidence`, naming the key or file), and the `method`."""

    evidence: str
    method: str  # awq or gptq

    def message(self) -> str:
        return (f"{self.evidence}: its weights are already quantized by {PREQUANTIZED_METHODS[self.method]}, which "
                "neither LoRA nor tunecast's QLoRA (bitsandbytes) can train on")

    def hint(self, suggestion: str | None) -> str:
        return ("give the unquantized model it was made from, by its Hub id or folder"
                + (f" ({suggestion})" if suggestion else "")
                + "; method: qlora quantizes that with bitsandbytes (quantization.bits: 4 or 8)")


def prequantized_name(name: str) -> str | None:
    """awq or gptq when the last part of `name` (a Hub id or a path) has that method as a part of it."""
    found = _NAME_PART.search(name.rstrip("/").rsplit("/", 1)[-1])
    return found.group(1).lower() if found else None


def prequantized(model: ModelConfig) -> Prequantized | None:
    """Why `model` is an AWQ or GPTQ checkpoint; None when nothing says it is."""
    quantization = model.data.get("quantization_config")
    method = str(quantization.get("quant_method", "")).lower() if isinstance(quantization, dict) else ""
    if method in PREQUANTIZED_METHODS:
        return Prequantized(f"{model.path} has quantization_config.quant_method {method!r}", method)
    if model.origin == "directory":
        for file_name, (method, tool) in PREQUANTIZED_FILES.items():
            if (model.path.parent / file_name).is_file():
                return Prequantized(f"{model.path.parent} holds {file_name} ({tool}'s)", method)
    if model.origin in ("catalog", "downloaded"):
        return by_name(model.name)
    return None


def by_name(name: str) -> Prequantized | None:
    """The model named `name` read as pre-quantized from its name alone; None when its name does not say."""
    method = prequantized_name(name)
    if method is None:
        return None
    article = "an" if method == "awq" else "a"  # "an AWQ", "a GPTQ": as the letters are read
    return Prequantized(f"model {name!r} is {article} {PREQUANTIZED_METHODS[method]} checkpoint by its name", method)


def unquantized_name(name: str) -> str:
    """The last part of `name` without its AWQ/GPTQ part and what follows (`TheBloke/Llama-2-7B-GPTQ` →
    `Llama-2-7B`), to look up the model it was made from."""
    last = name.rstrip("/").rsplit("/", 1)[-1]
    found = _NAME_PART.search(last)
    return last[:found.start()] if found else last

