"""The run specification (`RunSpec`): one YAML file that every command reads.

This module is the single source of defaults. Each field's docstring states its default and, where it
follows a library's default, which one; `tunecast init` writes these docstrings as comments.
Cross-field rules live in `checks.py`; reading YAML and applying overrides lives in `load.py`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

Method = Literal["full", "lora", "qlora"]
# Bits per frozen base weight of a QLoRA-like run: bitsandbytes' NF4 (Linear4bit) or LLM.int8 (Linear8bitLt).
QuantBits = Literal[4, 8]
Precision = Literal["bf16", "bf16-mixed", "fp16-mixed", "fp32", "fp8"]
Optimizer = Literal["adamw", "adamw-foreach", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "sgd", "adafactor"]
# torch's own AdamW kernels (fused and multi-tensor): two states per parameter, traced as they run
TORCH_ADAMW = ("adamw", "adamw-foreach")
Attention = Literal["sdpa", "flash", "eager"]
Loss = Literal["standard", "chunked"]
# The training tools whose steps tunecast estimates; config/runner.py says how each differs (a test keeps the two
# lists equal).
Runner = Literal["tunecast", "hf-trainer", "trl", "axolotl", "llamafactory", "unsloth", "torchtune",
                 "diffusers", "kohya", "simpletuner", "ai-toolkit"]
# The runners of diffusion pipelines (config/diffusion_runner.py); the others run language models.
DIFFUSION_RUNNERS = ("diffusers", "kohya", "simpletuner", "ai-toolkit")
# Which LoRA layers of a diffusion denoiser are adapted where `lora.targets` does not list them (step/diffusion.py).
LoraLayers = Literal["examples", "attention", "blocks"]
Schedule = Literal["linear", "cosine", "constant", "constant_with_warmup"]
Strategy = Literal["ddp", "fsdp", "fsdp-grad-op", "zero1", "zero2", "zero3"]
# DeepSpeed's stages: estimated as DeepSpeed allocates them (estimate/deepspeed.py) for the tools that run it through
# accelerate (the Trainer, TRL, axolotl, LLaMA-Factory); tunecast's own loop runs DDP and FSDP2 only.
DEEPSPEED_STRATEGIES = ("zero1", "zero2", "zero3")
# The FSDP2 strategy tunecast trains that shards what each DeepSpeed stage does (ZeRO-1 too shards the optimizer).
FSDP_EQUIVALENT = {"zero1": "fsdp-grad-op", "zero2": "fsdp-grad-op", "zero3": "fsdp"}
# What runs each strategy (train/distributed.py for DDP and FSDP2), as the runner and the plan name it.
STRATEGY_ENGINES = {"ddp": "DDP", "fsdp": "FSDP2 full shard", "fsdp-grad-op": "FSDP2, gradients and optimizer sharded",
                    "zero1": "DeepSpeed ZeRO-1", "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3"}
Offload = Literal["none", "optimizer", "params"]
DatasetFormat = Literal["auto", "text", "prompt-completion", "alpaca", "sharegpt", "messages"]
TrainOn = Literal["auto", "completion", "all"]
PlanAllowance = Literal[
    "lora", "qlora", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "optimizer_in_backward",
    "activation_offload", "chunked_loss", "offload", "fsdp",
]

# Keys whose value is text even when it reads as a number (a version): `--set` takes them as written.
TEXT_KEYS = ("runner_version", "bitsandbytes_version", "transformers_version")

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
DEFAULT_MICRO_BATCH = 8
# Upper bounds that only a typo reaches, so that no command is asked to do absurd work (a global batch of
# 32,000,000,000 for 32 had the planner weigh every divisor of it). Fine-tunes use global batches of tens to a few
# thousand sequences; 2^22 is a thousand times the largest of them.
MAX_GLOBAL_BATCH = 4_194_304
# Sequences per GPU per forward pass: 65,536 sequences of even 16 tokens is a million tokens in one pass.
MAX_MICRO_BATCH = 65_536


def _takes(annotation: Any) -> frozenset[str]:
    """Which of bool, int and float a field's annotation takes."""
    if annotation in (bool, int, float):
        return frozenset({annotation.__name__})
    if typing.get_origin(annotation) is Literal:
        return frozenset({"bool"}) if any(isinstance(v, bool) for v in typing.get_args(annotation)) else frozenset()
    return frozenset().union(*(_takes(argument) for argument in typing.get_args(annotation)))


@functools.cache
def _numeric_only(annotation: Any) -> str | None:
    """'a whole number' or 'a number' when `annotation` takes numbers and not true/false, else None."""
    takes = _takes(annotation)
    if "bool" in takes or not takes:
        return None
    return "a number" if "float" in takes else "a whole number"


def _name_list(value: object, expected: str) -> list[str]:
    """Accept a YAML list of names or one comma-separated string (as `--set lora.targets=q_proj,v_proj`
    gives); anything else is an error that says what was expected."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ValueError(f"must be {expected}")


class _Section(BaseModel):
    """Common settings: unknown keys are errors, numbers are finite (YAML's `.inf` and `.nan` are no epochs, rate or
    price), field docstrings become descriptions (`_attach_docstrings`)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_truth_values_as_numbers(cls, value: object, info: ValidationInfo) -> object:
        """true/false is not a number: pydantic reads `seq_len: true` as 1 and `epochs: false` as 0, which nobody
        means (YAML's `yes`/`on` are true too)."""
        if isinstance(value, bool) and info.field_name is not None:
            annotation: Any = cls.model_fields[info.field_name].annotation
            expected = _numeric_only(annotation)
            if expected is not None:
                raise ValueError(f"must be {expected}, not true or false")
        return value


class LoraSpec(_Section):
    """LoRA adapter settings (used by `method: lora` and `method: qlora`)."""

    rank: PositiveInt = Field(8, examples=[16])
    """Rank r of each adapter matrix. Default 8, as peft's `LoraConfig(r=8)`."""

    alpha: int = Field(8, ge=1, examples=[16])
    """Scaling numerator: updates are scaled by alpha / rank. Default 8, as peft's `lora_alpha=8`."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0, examples=[0.05])
    """Dropout on the adapter input. Default 0.0, as peft's `lora_dropout=0.0`."""

    targets: list[str] | Literal["all-linear"] = Field("all-linear", examples=[["q_proj", "v_proj"]])
    """Modules that get adapters: a list of module names (`[q_proj, v_proj]`, or a comma list) or
    `all-linear` (every linear layer but the output head, as in the QLoRA paper). Default `all-linear`;
    peft's own default when nothing is given is a per-architecture list such as q_proj, v_proj."""

    dora: bool = False
    """Weight-decomposed LoRA (DoRA, peft's `use_dora`). Default false."""

    fp32_adapters: bool = True
    """Keep adapter weights in fp32 on a bf16 or fp16 model, as peft does by default
    (`autocast_adapter_dtype=True`): every adapted layer then casts its input to fp32 and its adapter output
    back, which costs memory and time. False keeps adapters in the model's dtype, as litgpt and NeMo do.
    Default true."""

    double_quant: bool = True
    """QLoRA on 4-bit weights: quantize their block constants too (bitsandbytes' `bnb_4bit_use_double_quant`, litgpt's
    `bnb.nf4-dq`): one byte per 64 weights instead of four (Dettmers et al. 2023, section 3). Default true, as tunecast
    trains; transformers' own BitsAndBytesConfig leaves it off, litgpt's `bnb.nf4` too."""

    modules_to_save: list[str] = Field(default_factory=list, examples=[["lm_head"]])
    """Modules trained in full next to the adapters and saved with them (peft's `modules_to_save`),
    for example `[lm_head, embed_tokens]` when new tokens are added. Default: none."""

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, value: object) -> object:
        if value == "all-linear":
            return value
        names = _name_list(value, "a list of module names (q_proj, v_proj, …) or all-linear")
        if not names:
            raise ValueError("must name at least one module (q_proj, v_proj, …), or be all-linear")
        return names

    @field_validator("modules_to_save", mode="before")
    @classmethod
    def _modules(cls, value: object) -> object:
        return _name_list(value, "a list of module names (lm_head, embed_tokens, …)")


class QuantizationSpec(_Section):
    """How the frozen base weights of `method: qlora` are quantized (bitsandbytes)."""

    bits: QuantBits = Field(4, examples=[8])
    """Bits per frozen base weight: 4 (NF4, bitsandbytes' Linear4bit, the QLoRA paper's) or 8 (LLM.int8,
    bitsandbytes' Linear8bitLt: one int8 per weight and one fp32 scale per output row; what `load_in_8bit: true`
    loads in axolotl and TRL, and `quantization_bit: 8` in LLaMA-Factory). 8 needs `method: qlora`. Default 4."""


class DatasetSpec(_Section):
    """The training data: a file to read, or a declared size when planning without data at hand."""

    path: str | None = Field(None, examples=["data/train.jsonl"])
    """File or directory (JSONL, JSON, CSV, Parquet, a `datasets` save) or an fsspec URL
    (`s3://bucket/train.jsonl`). A relative path is taken relative to the config file. Default: none."""

    format: DatasetFormat = "auto"
    """Record layout: `text`, `prompt-completion`, `alpaca`, `sharegpt`, `messages`, or `auto` to
    detect it from the first rows. Default `auto`."""

    tokenizer: str | None = Field(None, examples=["models/my-model", "tokenizer.json"])
    """Tokenizer to count and train with: a folder holding tokenizer files or a tokenizer.json. Default: the
    model's own when it is on disk (a model folder, or the local Hugging Face cache), else a stated
    bytes-per-token estimate for counting."""

    train_on: TrainOn = "auto"
    """Which tokens count in the loss: `completion` (responses: the completion, alpaca's output, assistant
    turns), `all`, or `auto` (completion, but everything for plain text). Default `auto`."""

    skip_invalid: bool = False
    """Skip rows that cannot be read (and report how many and which) instead of stopping. Default false."""

    examples: PositiveInt | None = Field(None, examples=[50000])
    """Declared number of examples, for planning without the file. Needs `mean_tokens`. Default: none."""

    mean_tokens: float | None = Field(None, gt=0, examples=[512])
    """Declared mean tokens processed per example, prompt included. Default: none."""

    mean_trained_tokens: float | None = Field(None, gt=0, examples=[256])
    """Declared mean tokens per example that count in the loss (completion only). Default: the same
    as `mean_tokens`."""

    length_spread: float | None = Field(None, ge=0, le=3, examples=[0.46])
    """Declared spread of example lengths, the σ of their log (log-normal around `mean_tokens`), for the
    padding of an unpacked run: `0` when examples are all alike or batches are grouped by length. Default:
    the catalog's `declared_length_sigma` (0.46, measured padding of a real instruction dataset)."""


class DeepSpeedSpec(_Section):
    """The sizes of DeepSpeed's ZeRO buffers, as its JSON config names them under `zero_optimization` (counts of
    elements, not bytes). `auto` is what the transformers integration fills in for `"auto"` from the model's hidden
    size (h): h² for the reduce bucket, 0.9·h² for the prefetch bucket, 10·h for the persistence threshold."""

    reduce_bucket_size: PositiveInt | Literal["auto"] = Field(500_000_000, examples=["auto", 50_000_000])
    """Elements of gradients reduced together; ZeRO-1/2 hold one such buffer during the backward pass (two with
    overlap_comm), ZeRO-3 one for the whole run. Default DeepSpeed's 5e8."""

    overlap_comm: bool | None = None
    """Reduce gradients while the backward pass goes on. Default DeepSpeed's: on for ZeRO-3, off for ZeRO-1/2."""

    stage3_prefetch_bucket_size: NonNegativeInt | Literal["auto"] = Field(50_000_000, examples=["auto", 0])
    """ZeRO-3: elements of parameters gathered ahead of the layer that needs them (0: none). Default DeepSpeed's 5e7."""

    stage3_param_persistence_threshold: NonNegativeInt | Literal["auto"] = Field(100_000, examples=["auto", 0])
    """ZeRO-3: parameters with fewer elements stay whole on every GPU (norms, biases, small LoRA matrices).
    Default DeepSpeed's 1e5."""

    stage3_max_live_parameters: NonNegativeInt = Field(1_000_000_000, examples=[300_000_000])
    """ZeRO-3: elements of parameters gathered at most at once. Default DeepSpeed's 1e9."""

    stage3_max_reuse_distance: NonNegativeInt = Field(1_000_000_000, examples=[0])
    """ZeRO-3: a gathered parameter used again within this many elements of others' stays gathered (the last layers at
    the turn from the forward to the backward pass). Default DeepSpeed's 1e9."""


class GpuSpec(_Section):
    """Which GPUs, how many, and how the work is spread over them."""

    gpu: str | None = Field(None, examples=["a100-80gb"])
    """GPU model: a catalog slug (`rtx-4090`, `a100-80gb`, `h100-sxm`, …) or an alias (`4090`,
    `A100-80GB`, `H100`). Default: none (the planner compares every GPU in the catalog)."""

    count: PositiveInt = Field(1, examples=[8])
    """Number of GPUs. Default 1."""

    strategy: Strategy = "ddp"
    """How work is spread over GPUs: `ddp` (a full replica per GPU), `fsdp` (FSDP2 full shard: parameters,
    gradients and optimizer states sharded), `fsdp-grad-op` (FSDP2 keeping each layer's parameters gathered from
    the forward pass to the backward pass: gradients and optimizer states sharded, accelerate's SHARD_GRAD_OP), or
    DeepSpeed's `zero1` (optimizer states sharded), `zero2` (gradients too) and `zero3` (parameters too), as the
    Trainer, TRL, axolotl and LLaMA-Factory run them (tunecast's own loop runs DDP and FSDP2). Default `ddp`."""

    offload: Offload = "none"
    """What lives in CPU memory: `none`, `optimizer` (optimizer states and step), or `params`
    (parameters too). Needs a sharded strategy. Default `none`."""

    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    """DeepSpeed's buffers, for the zero1/zero2/zero3 strategies only."""


class CheckpointSpec(_Section):
    """How often training state is saved. Leave both intervals unset for the automatic interval."""

    every_steps: PositiveInt | None = Field(None, examples=[500])
    """Save every this many optimizer steps. Default: unset."""

    every_minutes: float | None = Field(None, gt=0, examples=[30])
    """Save every this many minutes of training. Default: unset. With both unset the interval is
    automatic: the one that minimises expected lost work on spot GPUs (Young/Daly), else 30 minutes."""

    keep: PositiveInt = Field(2, examples=[3])
    """Number of newest complete checkpoints kept; older ones are deleted. Default 2."""


class EvalSpec(_Section):
    """Evaluation on held-out examples while training: forward passes only, counted in the run's time."""

    examples: int = Field(0, ge=0, examples=[500])
    """Examples evaluated each time: held out of the dataset file (not trained on); with a declared size,
    in addition to `dataset.examples`, which counts training examples. Default 0: no evaluation."""

    every_steps: PositiveInt | None = Field(None, examples=[200])
    """Evaluate every this many optimizer steps. Default: unset, which evaluates at the end of each epoch
    when `examples` is above 0."""


class PricingSpec(_Section):
    """Which price offers the planner considers."""

    spot: bool = True
    """Also price spot (interruptible) capacity where an offer has it, with the expected cost of preemptions.
    Default true; false compares on-demand prices only."""

    providers: list[str] = Field(default_factory=list, examples=[["lambda", "runpod"]])
    """Only these providers (names as in `tunecast offers`). Default: all."""

    usd_per_hour: float | None = Field(None, ge=0, examples=[2.49])
    """What the machine a run trains on costs per hour, all its GPUs together: `tunecast train` reports the
    cost so far and at the end at this price. Default: unset (train then uses the cheapest on-demand offer
    of the GPU it runs on, and says so)."""

    @field_validator("providers", mode="before")
    @classmethod
    def _providers(cls, value: object) -> object:
        return _name_list(value, "a list of provider names (lambda, runpod, …)")


class PlanSpec(_Section):
    """What the planner may change on its own to make a run fit or go faster."""

    allow: list[PlanAllowance] = Field(default_factory=list, examples=[["qlora", "adamw-8bit"]])
    """Changes the planner may make beyond micro-batch, accumulation and checkpointing: `lora`,
    `qlora`, `adamw-8bit`, `paged-adamw`, `paged-adamw-8bit`, `optimizer_in_backward`,
    `activation_offload`, `chunked_loss`, `offload`, `fsdp`. Default: none."""

    memory_margin: float = Field(0.05, ge=0.0, lt=0.5, examples=[0.1])
    """Share of each GPU's usable memory the planner leaves free, for what an estimate cannot see (other
    processes, allocator behaviour under pressure). Default 0.05."""

    optimize: Literal["cost", "time"] = "cost"
    """Rank the runs by the `cost` of the whole run or by `time` (hours; hours within 5% count as equal and
    the cheaper comes first). `tunecast plan --optimize` overrides it. Default `cost`."""

    budget_usd: float | None = Field(None, gt=0, examples=[50.0])
    """Only runs whose whole cost is at most this many USD. `tunecast plan --budget` overrides it. Default:
    no budget."""

    deadline_hours: float | None = Field(None, gt=0, examples=[12.0])
    """Only runs done within this many hours (wall clock, preemptions included). `tunecast plan --deadline`
    overrides it. Default: no deadline."""

    @field_validator("allow", mode="before")
    @classmethod
    def _allow(cls, value: object) -> object:
        return _name_list(value, "a list of allowed changes (qlora, adamw-8bit, …)")


class DiffusionSpec(_Section):
    """The images (or clips) a diffusion model trains on, for a `model` that is a diffusers pipeline
    (docs/diffusion.md). Language models ignore it."""

    resolution: PositiveInt | str | None = Field(None, examples=[1024, "768x512"])
    """The largest training image, which sets the peak (the largest aspect bucket): pixels per side (`1024`), or
    width × height (`768x512`). Default: the pipeline's own size (its denoiser's `sample_size` in latent pixels,
    times the VAE's downsampling; 1024 where the config does not say)."""

    @field_validator("resolution", mode="before")
    @classmethod
    def _resolution(cls, value: object) -> object:
        """A side in pixels, or `WIDTHxHEIGHT`; a flag gives text ('1024' is 1024)."""
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        text = str(value).strip().lower().replace("×", "x") if isinstance(value, str) else ""
        if text.isdigit() and int(text) >= 1:
            return int(text)
        width, _, height = text.partition("x")
        if width.strip().isdigit() and height.strip().isdigit() and int(width) >= 1 and int(height) >= 1:
            return f"{int(width)}x{int(height)}"
        raise ValueError("must be pixels per side (1024) or width x height (768x512)")

    @property
    def sides(self) -> tuple[int, int] | None:
        """(width, height) in pixels; None for the pipeline's own size."""
        if self.resolution is None:
            return None
        if isinstance(self.resolution, int):
            return self.resolution, self.resolution
        width, height = self.resolution.split("x")
        return int(width), int(height)

    frames: PositiveInt | None = Field(None, examples=[16])
    """Frames per clip, for a video model. Default 16."""

    cache_latents: bool = False
    """The VAE's latents computed once before training: the VAE is then not loaded while training. Default false,
    as diffusers' examples."""

    cache_text: bool | None = None
    """The text encoders' outputs computed once before training: the encoders are then not loaded. Default: as
    diffusers' example for the model does (FLUX and SD3 cache them and unload the encoders; SD 1.5 and SDXL keep
    them)."""

    images: PositiveInt | None = Field(None, examples=[500])
    """Declared number of training images (or clips), for planning without the folder at hand; `dataset.path`, a
    folder, is counted instead. Default: none."""

    repeats: PositiveInt = 1
    """How many times each image is seen per epoch (kohya's folder repeats: 10 images × 20 repeats is an epoch of
    200). Default 1."""

    buckets: bool = False
    """Aspect-ratio buckets (kohya's `enable_bucket`): each image trained at the bucket nearest its aspect ratio, of
    at most the resolution's pixels (sides on a 64 px grid, half to twice the resolution's side), a micro-batch
    holding one bucket's images; the resolution's own shape sets the peak. Default false: every image scaled and
    cropped to the resolution around its centre, as diffusers' examples."""

    vae_fp32: bool | None = None
    """The frozen VAE kept in fp32 whatever the weight dtype (kohya's `no_half_vae`). Default: as diffusers' example
    for the model does (fp32 for SDXL and SD3, "to avoid NaN losses"; the weight dtype otherwise)."""

    base_8bit: bool = False
    """The frozen denoiser's and text encoders' linear weights stored in 8 bits (float8) and upcast layer by layer
    in the forward pass: kohya's `fp8_base`, ai-toolkit's `quantize` (optimum-quanto qfloat8). Not with full
    fine-tuning. Default false."""

    lora_layers: LoraLayers = "examples"
    """The denoiser's layers LoRA adapts where `lora.targets` does not list them: `examples` (diffusers' training
    examples' targets for the model), `attention` (the attention projections only, joint attention's included),
    `blocks` (every linear layer of the transformer blocks, as kohya's and ai-toolkit's networks do). Default
    `examples`."""


class RunSpec(_Section):
    """A fine-tuning run: model, method, batch shape, optimisation, data, hardware, output."""

    model: str = Field(min_length=1, examples=["meta-llama/Llama-3.1-8B"])
    """Model: a catalog name (`meta-llama/Llama-3.1-8B`), a local model directory holding
    config.json, or a path to a config JSON file of any name. Required."""

    random_weights: bool = False
    """Train weights drawn from the seed when the model has none (a folder holding only config.json, or a
    config file): for tests, demos and timing runs. Otherwise a model without weights is an error naming the
    files looked for (a download that stopped half-way would make a useless fine-tune). Default false."""

    method: Method = "lora"
    """`full` (every weight trained), `lora` (adapters on frozen weights), or `qlora` (adapters on
    quantized frozen weights: 4-bit NF4, or 8-bit LLM.int8 with `quantization.bits: 8`). Default `lora`."""

    lora: LoraSpec = Field(default_factory=LoraSpec)
    """LoRA adapter settings; ignored by `method: full`."""

    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    """How QLoRA's frozen base weights are quantized; for `method: qlora` only."""

    precision: Precision = "bf16"
    """`bf16` (weights, gradients and optimizer states in bf16, as when a model is loaded in bf16 and
    trained), `bf16-mixed` (fp32 master weights, bf16 compute), `fp16-mixed`, `fp32`, or `fp8` (FP8
    matmuls with bf16 master weights; GPUs with FP8 tensor cores only). Default `bf16`."""

    optimizer: Optimizer = "adamw"
    """`adamw` (torch's fused AdamW kernel, transformers' `adamw_torch_fused`), `adamw-foreach` (torch's
    multi-tensor AdamW: what `torch.optim.AdamW` runs on a GPU when neither `fused` nor `foreach` is given,
    and transformers' `adamw_torch`; about three times the memory traffic of the fused kernel), `adamw-8bit`,
    `paged-adamw`, `paged-adamw-8bit` (bitsandbytes), `sgd`, or `adafactor`. Default `adamw`, as transformers'
    `optim`."""

    optimizer_in_backward: bool = False
    """Step the optimizer inside the backward pass, freeing each gradient at once. Default false."""

    micro_batch: PositiveInt | Literal["auto"] = Field(8, examples=[4, "auto"])
    """Sequences per GPU per forward pass, or `auto`: `tunecast train` takes the largest that fits the device
    it runs on (with `plan.memory_margin` left free, and gradient accumulation to keep the global batch);
    `plan` and `memory` treat `auto` as left open. Default 8, as transformers' per_device_train_batch_size."""

    grad_accum: PositiveInt = Field(1, le=MAX_GLOBAL_BATCH, examples=[4])
    """Micro-batches accumulated per optimizer step. Default 1, as transformers'
    gradient_accumulation_steps. Set this or `global_batch`, not both."""

    global_batch: PositiveInt | None = Field(None, le=MAX_GLOBAL_BATCH, examples=[64])
    """Sequences per optimizer step over all GPUs (micro_batch × grad_accum × data-parallel GPUs).
    Default: unset (then micro_batch × grad_accum × GPUs)."""

    seq_len: PositiveInt = Field(1024, examples=[2048])
    """Maximum tokens per sequence; longer examples are truncated. Default 1024, as TRL's
    SFTConfig.max_length."""

    grad_checkpointing: Literal[True, False, "auto"] = False
    """Recompute activations in the backward pass instead of storing them: true, false, or `auto`
    (only when needed to fit). Default false, as transformers' gradient_checkpointing."""

    activation_offload: bool = False
    """Keep saved activations in CPU memory between forward and backward. Default false."""

    attention: Attention = "sdpa"
    """Attention kernel: `sdpa` (torch scaled_dot_product_attention), `flash` (flash-attn 2), or
    `eager`. Default `sdpa`, as transformers' attn_implementation."""

    loss: Loss = "standard"
    """`standard` (full logits, then cross-entropy) or `chunked` (logits and loss computed in chunks of
    tokens, never all at once). Default `standard`."""

    compile: bool = False
    """The step compiled with torch.compile, as the runner does it (torchtune's `compile`, the Trainer's
    `torch_compile`): estimated for the cross-entropy, whose compiled backward keeps the logits in their own dtype and
    one log-sum-exp per token instead of fp32 log-probabilities; the other fusions are not modelled (the estimate is a
    little high). `tunecast train` runs eager, so this needs another `runner`. Default false."""

    runner: Runner = "tunecast"
    """The tool that runs the training step, whose memory and speed are estimated: `tunecast` (its own loop, the one
    `tunecast train` runs), `hf-trainer` (transformers Trainer with peft), `trl` (TRL's SFTTrainer), `axolotl`,
    `llamafactory` (LLaMA-Factory), `unsloth` or `torchtune`, each with its own defaults where this config leaves a
    key unset (docs/runners.md lists every difference and its source). Default `tunecast`."""

    runner_version: str | None = Field(None, examples=["0.13", "1.12"])
    """The version of the runner's tool whose step and defaults are estimated, where they changed between versions
    (`0.13` with `runner: trl` is TRL 0.13's step: full fp32 logits, as the transformers Trainer; docs/runners.md lists
    the versions each runner knows). Written as text: in a YAML file in quotes ('1.10'; unquoted, YAML reads it as the
    number 1.1); `--set runner_version=1.10` takes it as written. Default: unset, the versions the runner's entry
    describes (today's, config/runner.py)."""

    bitsandbytes_version: str | None = Field(None, examples=["0.41.1"])
    """The bitsandbytes whose quantized layers a QLoRA estimate follows: before 0.43.2 each 4-bit one kept its input
    for the backward pass (config/runner.py BITSANDBYTES); the 8-bit layers are known from 0.50 (BITSANDBYTES_INT8).
    Written as text, like `runner_version`. Default: unset, today's."""

    transformers_version: str | None = Field(None, examples=["4.48.1"])
    """The transformers whose causal-LM loss an estimate follows, for a runner that takes the loss from the model's
    full logits (the transformers Trainer, TRL before 1.7, axolotl, LLaMA-Factory): 4.46-4.48 took it from a
    contiguous fp32 copy of the shifted logits, which 4.49 and later do not make (config/runner.py TRANSFORMERS).
    Not with runner tunecast, whose step runs the transformers installed. Written as text, like `runner_version`.
    Default: unset, today's."""

    packing: bool = False
    """Pack several examples into each sequence (no cross-attention between them). Default false, as
    TRL's SFTConfig.packing."""

    epochs: float = Field(3.0, gt=0, examples=[1])
    """Passes over the dataset. Default 3, as transformers' num_train_epochs."""

    max_steps: PositiveInt | None = Field(None, examples=[1000])
    """End the run after this many optimizer steps. With `epochs` set too (in the file or on the command line), the
    run is the first max_steps steps of the epochs' run (fewer when the epochs end first), on the epochs' learning-rate
    schedule: `--max-steps 6` makes a smoke run of a real config. Without `epochs`, the run is max_steps steps, over
    as many passes as they take. Default: unset."""

    learning_rate: float = Field(5e-5, gt=0, examples=[2e-4])
    """Peak learning rate. Default 5e-5, as transformers' learning_rate."""

    schedule: Schedule = "linear"
    """Learning-rate schedule after warm-up: `linear` decay to zero, `cosine`, `constant`, or
    `constant_with_warmup`. Default `linear`, as transformers' lr_scheduler_type."""

    warmup_steps: int = Field(0, ge=0, examples=[100])
    """Optimizer steps of linear warm-up. Default 0, as transformers."""

    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, examples=[0.03])
    """Warm-up as a fraction of all steps; set this or `warmup_steps`. Default 0.0."""

    weight_decay: float = Field(0.0, ge=0.0, examples=[0.01])
    """AdamW weight decay. Default 0.0, as transformers."""

    max_grad_norm: float = Field(1.0, ge=0.0, examples=[1.0])
    """Gradient clipping norm (0 turns clipping off). Default 1.0, as transformers."""

    seed: int = Field(42, ge=0, examples=[1234])
    """Seed for every random number generator. Default 42, as transformers."""

    log_every_steps: PositiveInt = Field(1, examples=[10])
    """`tunecast train` writes a line to metrics.jsonl every this many optimizer steps. Default 1."""

    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    """The training data, or its declared size."""

    gpus: GpuSpec = Field(default_factory=GpuSpec)
    """GPU model, count, and multi-GPU strategy."""

    diffusion: DiffusionSpec = Field(default_factory=DiffusionSpec)
    """Image size and caching, for a diffusion pipeline."""

    output: str | None = Field(None, examples=["runs/llama-lora", "s3://bucket/runs/llama-lora"])
    """Where checkpoints, metrics and the final model go: a path or an fsspec URL. A relative path is
    taken relative to the config file. Default: `runs/<model name>-<method>` in the current directory."""

    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """How often training state is saved, and how many checkpoints are kept."""

    eval: EvalSpec = Field(default_factory=EvalSpec)
    """Evaluation on held-out examples."""

    pricing: PricingSpec = Field(default_factory=PricingSpec)
    """Which price offers are compared."""

    plan: PlanSpec = Field(default_factory=PlanSpec)
    """What the planner may change by itself."""

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _micro_batch(cls, value: object) -> object:
        """A whole number or `auto` (a flag gives text: '4' is 4); one clear message for anything else."""
        if isinstance(value, bool):
            raise ValueError("must be a whole number or auto, not true or false")
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_MICRO_BATCH:
            raise ValueError(f"must be at most {MAX_MICRO_BATCH:,} sequences per GPU per forward pass")
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError("must be a whole number ≥ 1 or auto")

    @field_validator("runner_version", "bitsandbytes_version", "transformers_version", mode="before")
    @classmethod
    def _version_text(cls, value: object) -> object:
        """A version is text: YAML reads an unquoted 1.10 as the number 1.1, another version."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"must be written in quotes ('{value}'): unquoted, YAML reads a version as a number, "
                             "and 1.10 as 1.1")
        return value

    def with_changes(self, changes: Mapping[str, Any]) -> RunSpec:
        """A copy with `changes` (dotted keys, as `--set` takes them: `gpus.strategy`) applied and validated. The keys
        set stay those of this spec and the changed ones (`fixed`): a default stays a default."""
        data = self.model_dump(exclude_unset=True)
        for key, value in changes.items():
            section, _, leaf = key.partition(".")
            if leaf:
                data.setdefault(section, {})[leaf] = value
            else:
                data[key] = value
        return RunSpec.model_validate(data)

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch where a number is needed before one is chosen: `micro_batch`, or for `auto` the
        default (8) until the planner or the trainer chooses."""
        return DEFAULT_MICRO_BATCH if self.micro_batch == "auto" else self.micro_batch

    @property
    def sequences_per_step(self) -> int:
        """Sequences per optimizer step: `global_batch`, or micro_batch × grad_accum × gpus.count (the default
        micro-batch for `auto`)."""
        return self.global_batch or self.micro_batch_size * self.grad_accum * self.gpus.count

    def fixed(self, dotted_key: str) -> bool:
        """True when the user set this key (in the file or on the command line) rather than the default;
        `micro_batch: auto` leaves the micro-batch open."""
        if dotted_key == "micro_batch" and self.micro_batch == "auto":
            return False
        node: BaseModel = self
        *parents, leaf = dotted_key.split(".")
        for part in parents:
            if part not in node.model_fields_set:
                return False
            node = getattr(node, part)
        return leaf in node.model_fields_set

    @property
    def default_output(self) -> str:
        short = self.model.rstrip("/").split("/")[-1].removesuffix(".json")
        return f"runs/{short}-{self.method}"


def _field_docstrings(source: str) -> dict[str, dict[str, str]]:
    """Each class's field docstrings (a string right after an annotated field), by class and field name."""
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = found.setdefault(node.name, {})
        for field, after in zip(node.body, node.body[1:], strict=False):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[field.target.id] = inspect.cleandoc(after.value.value)
    return found


def _attach_docstrings() -> None:
    """Field docstrings become the fields' descriptions (what `tunecast init` and the flags' help print).
    One parse of this module: pydantic's `use_attribute_docstrings` finds each class's source again, a
    tenth of a warm `tunecast memory` on a 2-core machine. Without the source (a build that ships bytecode
    only) fields have no description."""
    try:
        docs = _field_docstrings(Path(__file__).read_text(encoding="utf-8"))
    except OSError:
        return
    module = sys.modules[__name__]
    for value in vars(module).values():
        if not (isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == __name__):
            continue
        for name, field in value.model_fields.items():
            if field.description is None:
                field.description = next((docs[base.__name__][name] for base in value.__mro__
                                          if name in docs.get(base.__name__, {})), None)


_attach_docstrings()
