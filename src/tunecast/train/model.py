"""The model and tokenizer a run trains: weights from disk (or the Hub when allowed), or built from the config.

* A model directory holding weights, or a Hub id (a catalog model, or one whose config was fetched): `from_pretrained`,
  in the run's parameter dtype, from the local Hugging Face cache or downloaded from the Hub, unless offline mode
  (`--offline`, HF_HUB_OFFLINE) keeps it to the cache.
* A config without weights (a config JSON file, a directory with only config.json), when the config says
  `random_weights: true` (or the run only measures speed): random weights drawn from the run's seed — for tests,
  demos and timing runs; otherwise preflight.py stops the run before anything loads. Random weights are saved
  once under the run's `base/`, so the final adapter has a base that `PeftModel.from_pretrained` and
  `tunecast merge` can load.
* QLoRA (`quantize_for_qlora`): the decoder layers' Linear weights become NF4 with double quantization and bf16 compute
  (bitsandbytes Linear4bit, train/quantize.py), or with `quantization.bits: 8` LLM.int8 (Linear8bitLt, as
  transformers' BitsAndBytesConfig(load_in_8bit=True) makes them); the output head and embeddings stay in bf16, and
  so do decoder weights that are not Linear modules: a mixture of experts' fused experts and router (the run says so).

Then `prepare_for_training` applies the same adapters, dtypes and checkpointing the memory estimator traces.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunecast.catalog.hub import offline_reason
from tunecast.catalog.models import ModelConfig, bnb_bits
from tunecast.config.spec import RunSpec
from tunecast.data.tokens import TokenizerCounter, load_tokenizer
from tunecast.errors import TunecastError
from tunecast.step.setup import compute_dtype, param_dtype, training_config
from tunecast.step.shape import hf_config
from tunecast.train.preflight import check_weights, has_weights

BASE_SAVED = "base"  # where a run keeps the random base weights it drew (beside checkpoints/)


@dataclass(frozen=True)
class BaseModel:
    model: Any
    origin: str  # what the weights are: "loaded from …" or "random (seed N)"
    random: bool


def load_base(spec: RunSpec, resolved: ModelConfig, *, offline: bool, random_allowed: bool = False
              ) -> BaseModel:
    """The base model of `spec` on the CPU, before quantization and adapters. Random weights only when the config
    asks for them, or `random_allowed` (a measuring run)."""
    dtype = compute_dtype(spec.precision) if spec.method == "qlora" else param_dtype(spec.precision)
    attention = "eager" if spec.attention == "eager" else ("flash_attention_2" if spec.attention == "flash" else "sdpa")
    bits = bnb_bits(resolved)
    if bits is not None:  # transformers would load them into bitsandbytes' layers, which train/quantize.py makes itself
        made_from = f" ({resolved.alias_of})" if resolved.alias_of else ""
        raise TunecastError(f"{resolved.name} holds bitsandbytes' {bits}-bit weights: tunecast trains QLoRA by "
                            "quantizing the unquantized model itself", field="model",
                            hint=f"give the model it was made from{made_from} with method: qlora and "
                                 f"quantization.bits: {bits}")
    config = hf_config(training_config(resolved.data), name=resolved.name)
    check_weights(spec, resolved, random_allowed=random_allowed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if resolved.origin == "directory" and has_weights(resolved):
            folder = resolved.path.parent
            model = _pretrained(str(folder), config, dtype, attention, folder=True)
            origin = f"loaded from {folder}"
            random_weights = False
        elif resolved.origin in ("catalog", "downloaded"):
            model = _pretrained(resolved.name, config, dtype, attention, offline=offline_reason(offline))
            origin = f"loaded from {resolved.name}"
            random_weights = False
        else:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
            why = "random_weights: true" if spec.random_weights else "a measuring run"
            origin = (f"random weights drawn from seed {spec.seed} ({why}; {resolved.path.name} has no weights "
                      "beside it)")
            random_weights = True
    return BaseModel(model, origin, random_weights)


def quantize_for_qlora(model: Any, spec: RunSpec, device: torch.device) -> Any:
    """QLoRA's base: NF4 decoder Linear weights, with double quantization unless `lora.double_quant` is off, compute
    in the run's compute dtype; any width (train/quantize.py turns off bitsandbytes' CPU repacking, which takes only
    some). With `quantization.bits: 8`, LLM.int8 decoder Linear weights (bitsandbytes Linear8bitLt), which compute in
    their input's dtype."""
    from tunecast.train.quantize import quantize_int8, quantize_nf4

    if spec.quantization.bits == 8:
        return quantize_int8(model, device=str(device))
    return quantize_nf4(model, compute_dtype=compute_dtype(spec.precision), double_quant=spec.lora.double_quant,
                        device=str(device))


def _pretrained(name: str, config: Any, dtype: torch.dtype, attention: str, *, offline: str | None = None,
                folder: bool = False) -> Any:
    """`from_pretrained` of a folder or a Hub id (the cache only when `offline` says why); weights that cannot be read
    are a user error naming them."""
    import pickle

    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype, attn_implementation=attention,
                                                    local_files_only=folder or offline is not None)
    except (SafetensorError, EOFError, pickle.UnpicklingError) as error:  # a file cut short or damaged
        where = f"the weights in {name}" if folder else f"the cached weights of {name}"
        raise TunecastError(f"cannot read {where}: {str(error).splitlines()[0]} (a truncated or damaged file: a "
                            "download that did not finish?)", field="model",
                            hint="download the weights again") from None
    except OSError as error:
        if folder:
            hint = "check that the folder holds every file of the model (the weights, and the index of sharded ones)"
        elif offline is not None:
            hint = (f"offline mode ({offline}) keeps to the weights in the local Hugging Face cache: download them "
                    f"where the Hub can be reached (`hf download {name}`), or run without it")
        else:
            hint = ("check the model id, the network and HF_TOKEN (a gated model: accept its licence on the Hub, then "
                    "set HF_TOKEN or run `hf auth login`)")
        raise TunecastError(f"cannot load the weights of {name}: {str(error).splitlines()[0]}", field="model",
                            hint=hint) from None


def load_run_tokenizer(spec: RunSpec, resolved: ModelConfig) -> TokenizerCounter:
    """The tokenizer to train with: `dataset.tokenizer`, else the model directory's, else the model's own
    in the local Hugging Face cache. Training needs exact tokens: an estimate will not do."""
    if spec.dataset.tokenizer is not None:
        counter = load_tokenizer(spec.dataset.tokenizer)
    elif resolved.origin == "directory" and any((resolved.path.parent / name).exists()
                                                 for name in ("tokenizer.json", "tokenizer_config.json")):
        counter = load_tokenizer(str(resolved.path.parent))
    else:
        from tunecast.data.tokens import cached_tokenizer

        found = cached_tokenizer(resolved.name) if resolved.origin in ("catalog", "downloaded") else None
        if found is None:
            raise TunecastError(f"no tokenizer for {resolved.name} on this machine", field="dataset.tokenizer",
                                hint="set dataset.tokenizer to a folder holding tokenizer files or a tokenizer.json")
        counter = found
    assert isinstance(counter, TokenizerCounter)
    return counter


def pad_id(counter: TokenizerCounter) -> int:
    """The id padding is written with (never trained on): the tokenizer's pad token, else EOS, else 0."""
    tokenizer = counter.tokenizer
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    if counter.eos_id is not None:
        return counter.eos_id
    return 0


def save_tokenizer(counter: TokenizerCounter, folder: Path) -> None:
    tokenizer = counter.tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
    else:
        tokenizer.save(str(folder / "tokenizer.json"))


def folder_files(folder: Path) -> dict[str, bytes | Path]:
    """Every file under `folder`, by relative path (what write_set stores, copying each in chunks)."""
    return {str(path.relative_to(folder)): path for path in sorted(folder.rglob("*")) if path.is_file()}


def save_base(model: Any, counter: TokenizerCounter, storage: Any) -> None:
    """Keep random base weights with the run (`base/`), so the adapter has a base to load and merge into."""
    import tempfile

    from tunecast.storage.store import write_set

    with tempfile.TemporaryDirectory(prefix="tunecast-base-") as temporary:
        folder = Path(temporary)
        model.save_pretrained(str(folder))
        save_tokenizer(counter, folder)
        write_set(storage, BASE_SAVED, folder_files(folder), {"kind": "base model (random weights)"})


def enable_float8(model: Any, device: torch.device) -> Any:
    """`precision: fp8`: the Linear layers' matmuls in FP8 through torchao's float8 training (bf16 master
    weights, dynamic scaling), the output head excluded and layers whose sizes FP8 kernels cannot take
    (multiples of 16) left in bf16."""
    if device.type != "cuda":
        raise TunecastError(f"precision fp8 needs a GPU with FP8 tensor cores; this run is on {device.type}",
                            field="precision", hint="use precision bf16 here")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise TunecastError("precision fp8 trains through torchao's float8 training, which is not installed",
                            field="precision", hint="pip install torchao, or use precision bf16") from None

    def eligible(module: torch.nn.Module, name: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, module_filter_fn=eligible)
    return model
