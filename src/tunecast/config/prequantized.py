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


# A repository of bitsandbytes-quantized weights by its name, as unsloth names its uploads: `llama-3-8b-bnb-4bit`,
# `Qwen2.5-7B-Instruct-unsloth-bnb-4bit` (its dynamic quantization, which leaves some layers in 16 bits).
_BNB_NAME = re.compile(r"(?:[-_]unsloth)?[-_]bnb[-_]([48])bit$", re.IGNORECASE)


def bnb_bits(model: ModelConfig) -> int | None:
    """4 or 8 when `model`'s weights are stored quantized by bitsandbytes: its config.json's `quantization_config`
    (quant_method `bitsandbytes`, load_in_4bit or load_in_8bit, as transformers' BitsAndBytesConfig writes it; older
    files hold `_load_in_4bit`); None otherwise. LoRA on such weights is QLoRA."""
    quantization = model.data.get("quantization_config")
    if not isinstance(quantization, dict) or str(quantization.get("quant_method", "")).lower() != "bitsandbytes":
        return None
    if quantization.get("load_in_4bit") or quantization.get("_load_in_4bit"):
        return 4
    if quantization.get("load_in_8bit") or quantization.get("_load_in_8bit"):
        return 8
    return None


def bnb_name(name: str) -> tuple[str, int] | None:
    """(the name without its bitsandbytes part, the bits) for a name that says its weights are bitsandbytes' 4 or 8
    bits (`unsloth/llama-3-8b-bnb-4bit` → (`unsloth/llama-3-8b`, 4)); None for another name."""
    found = _BNB_NAME.search(name.rstrip("/"))
    return (name.rstrip("/")[:found.start()], int(found.group(1))) if found else None


def bnb_quantization_config(bits: int) -> dict[str, object]:
    """The `quantization_config` transformers writes for a bitsandbytes checkpoint of `bits` bits (the part read
    here): what a repository named for its bitsandbytes weights holds beside its base model's config."""
    return {"quant_method": "bitsandbytes", "load_in_4bit": bits == 4, "load_in_8bit": bits == 8}
