"""Rules that involve several fields, the catalog or the model. Each returns Problems; none raises."""

from __future__ import annotations

from collections.abc import Callable

from tunecast.catalog.models import ModelConfig
from tunecast.catalog.store import Catalog
from tunecast.config.runner import version_problem
from tunecast.config.spec import DEEPSPEED_STRATEGIES, FSDP_EQUIVALENT, MAX_GLOBAL_BATCH, STRATEGY_ENGINES, RunSpec
from tunecast.errors import Problem, suggestion_text

# Where a key's value came from, for messages: "line 7", "--seq-len", or None for a default.
Locate = Callable[[str], "str | None"]

# How far past a model's context `seq_len` may go. Rotary position embeddings run at any length, and fine-tunes do
# extend a context by position interpolation (2 to 4 times in its paper, Chen et al. 2023, arXiv:2306.15595);
# beyond that a length is a typo. Learned absolute positions (GPT-2's `n_positions`) have no row past the context.
CONTEXT_MARGIN = 4
# GPUs of one machine: the planner plans 1 to 8 GPUs of any GPU, pricing single-GPU offers as 8 of them on one machine
# (plan/cost.py GPUS_PER_NODE; a test keeps the two equal).
NODE_GPUS = 8
# Nodes of one run that the gpus.count bound allows on offers that publish a network between nodes (the planner
# joins 8-GPU nodes of those offers; a fine-tune over more than 64 nodes is not one this tool plans).
MAX_NODES = 64


def cross_field_problems(spec: RunSpec, locate: Locate) -> list[Problem]:
    """Combinations of values that cannot work together."""
    problems: list[Problem] = []

    def add(key: str, message: str, hint: str, severity: str = "error") -> None:
        problems.append(Problem(key, message, hint, severity=severity, location=locate(key)))

    if spec.fixed("grad_accum") and spec.fixed("global_batch"):
        add("global_batch", "is set together with grad_accum; one follows from the other",
            "keep global_batch (sequences per optimizer step) and remove grad_accum, or the reverse")
    if spec.global_batch is not None:
        data_parallel = spec.gpus.count
        per_step = spec.micro_batch_size * data_parallel if spec.fixed("micro_batch") else data_parallel
        if spec.global_batch % per_step:
            what = f"micro_batch × gpus.count = {per_step}" if spec.fixed("micro_batch") else (
                f"gpus.count = {per_step}")
            lower = spec.global_batch // per_step * per_step
            options = [n for n in (lower, lower + per_step) if n > 0]
            add("global_batch", f"{spec.global_batch} is not a multiple of {what}",
                f"set global_batch to {' or '.join(str(n) for n in options)}")
    if spec.global_batch is None:
        product = spec.micro_batch_size * spec.grad_accum * spec.gpus.count
        if product > MAX_GLOBAL_BATCH:
            sizes = {"grad_accum": spec.grad_accum, "micro_batch": spec.micro_batch_size, "gpus.count": spec.gpus.count}
            key = max(sizes, key=lambda k: (spec.fixed(k), sizes[k]))  # the largest of those the user set
            add(key, f"micro_batch × grad_accum × gpus.count = {product:,} sequences per optimizer step, over the "
                f"{MAX_GLOBAL_BATCH:,} a run may take", "fine-tunes take tens to a few thousand sequences per step: "
                "check micro_batch, grad_accum and gpus.count for a typo")
    version = version_problem(spec)
    if version is not None:
        add(*version)
    if spec.warmup_steps and spec.warmup_ratio:
        add("warmup_ratio", "is set together with warmup_steps", "keep one of warmup_steps and warmup_ratio")
    if spec.optimizer_in_backward and spec.grad_accum > 1:
        add("optimizer_in_backward", "steps the optimizer in every backward pass, so gradients cannot be "
            f"accumulated over grad_accum = {spec.grad_accum} micro-batches",
            "set grad_accum to 1 (raise micro_batch instead) or optimizer_in_backward to false")
    if spec.compile and spec.runner == "tunecast":
        add("compile", "tunecast's own loop runs eager: a compiled step is estimated for another runner",
            "set runner to the tool that compiles (torchtune, hf-trainer, trl, axolotl, llamafactory), or compile: "
            "false")
    _quantization_problems(spec, add)
    if spec.method == "qlora" and spec.precision == "fp8":
        add("precision", f"fp8 matmuls cannot run on QLoRA's {spec.quantization.bits}-bit weights",
            "use precision bf16 with qlora, or method lora with fp8")
    if spec.attention == "flash" and spec.precision == "fp32":
        add("attention", "flash attention runs in bf16 or fp16 only, not with precision fp32",
            "use attention sdpa, or precision bf16 / bf16-mixed")
    strategy = spec.gpus.strategy
    if spec.gpus.offload != "none" and strategy == "ddp":
        add("gpus.offload", "needs a sharded strategy: DDP keeps everything on each GPU",
            "set gpus.strategy to fsdp, fsdp-grad-op, zero1, zero2 or zero3, or gpus.offload to none")
    if spec.gpus.offload == "params" and strategy in ("fsdp-grad-op", "zero1", "zero2"):
        add("gpus.offload", f"params offload needs parameters sharded (fsdp or zero3); {strategy} keeps them whole",
            "set gpus.strategy to fsdp or zero3, or gpus.offload to optimizer")
    if strategy in DEEPSPEED_STRATEGIES and spec.runner in ("torchtune", "unsloth"):
        add("gpus.strategy", f"{strategy} is DeepSpeed's, which {spec.runner} does not run",
            "set gpus.strategy to fsdp (or ddp), or runner to a tool that runs DeepSpeed: hf-trainer, trl, axolotl or "
            "llamafactory")
    if spec.method == "full" and spec.fixed("lora"):
        add("lora", "is ignored with method full", "remove the lora section or use method lora",
            severity="warning")
    if spec.runner == "tunecast":  # another tool's limits are its own; global_batch is checked above
        problems.extend(p for p in distributed_problems(spec, spec.gpus.count, locate, training=False)
                        if p.field != "global_batch")
    _dataset_problems(spec, add)
    return problems


def _quantization_problems(spec: RunSpec, add: Callable[..., None]) -> None:
    """An 8-bit base belongs to QLoRA (4, the default, is what `method: qlora` means alone), and the 4-bit settings
    to 4-bit weights."""
    bits = spec.quantization.bits
    if bits == 8 and spec.method != "qlora":
        add("quantization.bits", f"8 quantizes QLoRA's frozen base weights, and method is {spec.method}",
            "set method: qlora for adapters on the 8-bit base, or remove quantization.bits")
    if bits == 8 and spec.fixed("lora.double_quant"):
        add("lora.double_quant", "quantizes the block constants of 4-bit NF4 weights, and quantization.bits is 8 "
            "(LLM.int8 keeps one fp32 scale per output row, which nothing quantizes again)",
            "remove lora.double_quant, or set quantization.bits: 4")


def distributed_problems(spec: RunSpec, processes: int, locate: Locate | None = None, *,
                         training: bool = True) -> list[Problem]:
    """What tunecast's own loop cannot do over several processes. `validate` asks with gpus.count, `tunecast train`
    and the run itself (train/session.py) with its real number of processes, so that both refuse the same runs before
    anything starts. Without `training` (`validate`, for `memory` and `plan`), what other tools run and tunecast
    estimates — QLoRA sharded over GPUs, DeepSpeed — is a warning: the estimate is of tunecast's step run so."""
    if processes <= 1:
        return []
    problems: list[Problem] = []

    def add(key: str, message: str, hint: str, *, estimated: bool = False) -> None:
        severity = "warning" if estimated and not training else "error"
        if severity == "warning":
            message += ": tunecast train refuses it; the estimate is of tunecast's step run so, as other tools run it"
        problems.append(Problem(key, message, hint, severity=severity,
                                location=locate(key) if locate is not None else None))

    if spec.loss == "chunked":
        add("loss", f"chunked computes the loss outside the model's forward pass, which DDP and FSDP2 need to "
            f"see ({processes} processes)", "use loss: standard with several GPUs, or train on one")
    if spec.method == "qlora" and spec.gpus.strategy != "ddp":
        bits = spec.quantization.bits
        add("gpus.strategy", f"QLoRA's {bits}-bit weights cannot be sharded by "
            f"{STRATEGY_ENGINES[spec.gpus.strategy]} ({processes} processes)",
            f"use gpus.strategy: ddp for QLoRA (each GPU holds the {bits}-bit base), or method: lora with fsdp",
            estimated=True)
    if spec.optimizer_in_backward:
        add("optimizer_in_backward", "steps each parameter inside the backward pass, before its gradient is averaged "
            f"over the {processes} processes", "set optimizer_in_backward: false with several GPUs, or train on one")
    if spec.gpus.strategy in DEEPSPEED_STRATEGIES:
        stage = spec.gpus.strategy
        add("gpus.strategy", f"{stage} is DeepSpeed ZeRO-{stage[-1]}, which tunecast's own loop does not run (it "
            f"trains with DDP and FSDP2; {processes} processes)",
            f"set gpus.strategy to {FSDP_EQUIVALENT[stage]} to train it with tunecast (FSDP2 shards the same states), "
            "or runner to the tool that runs DeepSpeed (hf-trainer, trl, axolotl or llamafactory) for its step",
            estimated=True)
    if spec.global_batch is not None and spec.global_batch % processes:
        lower = spec.global_batch // processes * processes
        options = [n for n in (lower, lower + processes) if n > 0]
        add("global_batch", f"{spec.global_batch} does not divide over {processes} processes",
            f"set global_batch to {' or '.join(str(n) for n in options)}")
    return problems


def model_problems(spec: RunSpec, model: ModelConfig, locate: Locate) -> list[Problem]:
    """Values the model's config bounds: the length against its context, the LoRA targets against its modules."""
    from tunecast.config.targets import targets_problem

    problems: list[Problem] = []
    context = model.max_position_embeddings
    if context is not None:
        learned = "n_positions" in model.text_config and "max_position_embeddings" not in model.text_config
        most = context if learned else context * CONTEXT_MARGIN
        if spec.seq_len > most:
            key = "n_positions" if learned else "max_position_embeddings"
            why = ("its positions are learned, one row per position" if learned
                   else f"{CONTEXT_MARGIN} × that is the most a fine-tune stretches a context")
            problems.append(Problem("seq_len", f"{spec.seq_len:,} tokens is over the {most:,} allowed for "
                                    f"{model.name}: its context is {context:,} tokens ({key} in {model.path}), and "
                                    f"{why}", f"set seq_len to at most {most:,}, for example {min(context, 2048)}",
                                    location=locate("seq_len")))
    if spec.method != "full":
        problem = targets_problem(spec.lora.targets, model)
        if problem is not None:
            problems.append(Problem(problem.field, problem.message, problem.hint, location=locate("lora.targets")))
    return problems


def _dataset_problems(spec: RunSpec, add: Callable[..., None]) -> None:
    data = spec.dataset
    declared = data.examples is not None or data.mean_tokens is not None
    if data.path is not None and declared:
        add("dataset.examples", "a dataset path and a declared size are both given",
            "keep dataset.path to measure the file, or examples and mean_tokens to plan without it")
    if data.examples is not None and data.mean_tokens is None:
        add("dataset.mean_tokens", "is needed with dataset.examples",
            "add dataset.mean_tokens: mean tokens per example, prompt included (for example 512)")
    if data.mean_tokens is not None and data.examples is None:
        add("dataset.examples", "is needed with dataset.mean_tokens",
            "add dataset.examples: the number of training examples (for example 50000)")
    if data.mean_trained_tokens is not None:
        if data.mean_tokens is None:
            add("dataset.mean_trained_tokens", "needs dataset.mean_tokens", "add dataset.mean_tokens")
        elif data.mean_trained_tokens > data.mean_tokens:
            add("dataset.mean_trained_tokens", f"{data.mean_trained_tokens} exceeds mean_tokens "
                f"{data.mean_tokens}: trained tokens are a part of the processed ones",
                "set it to at most dataset.mean_tokens")
    if data.length_spread is not None and data.mean_tokens is None:
        add("dataset.length_spread", "describes a declared size, and none is given",
            "remove dataset.length_spread, or declare dataset.examples and dataset.mean_tokens")
    if data.path is None and declared and "format" in data.model_fields_set:
        add("dataset.format", "is ignored with a declared size", "remove dataset.format", severity="warning")
    if spec.eval.every_steps is not None and spec.eval.examples == 0:
        add("eval.every_steps", "has no effect: eval.examples is 0, so nothing is evaluated",
            "set eval.examples to the number of held-out examples, or remove eval.every_steps", severity="warning")


def catalog_problems(spec: RunSpec, catalog: Catalog, locate: Locate) -> list[Problem]:
    """GPU names, FP8 support, provider names and the number of GPUs, checked against the catalog."""
    problems: list[Problem] = []
    most, where = _most_gpus(catalog)
    if spec.gpus.count > most:
        problems.append(Problem("gpus.count", f"{spec.gpus.count:,} GPUs is more than any offer in the catalog has "
                                f"({most}: {where})", f"set gpus.count to at most {most}; `tunecast offers` lists "
                                "the offers", location=locate("gpus.count")))
    if spec.gpus.gpu is not None:
        gpu = catalog.gpus.find(spec.gpus.gpu)
        if gpu is None:
            problems.append(Problem("gpus.gpu", f"unknown GPU {spec.gpus.gpu!r}",
                                    catalog.gpus.unknown_hint(spec.gpus.gpu), location=locate("gpus.gpu")))
        elif spec.precision == "fp8" and not gpu.has_fp8:
            problems.append(Problem("precision", f"fp8 needs FP8 tensor cores, which the {gpu.name} lacks",
                                    "use precision bf16, or a GPU with FP8 (Ada, Hopper, Blackwell, MI300X)",
                                    location=locate("precision")))
    known = catalog.providers
    for i, provider in enumerate(spec.pricing.providers):
        if provider not in known:
            near = suggestion_text(provider, known)
            problems.append(Problem(f"pricing.providers[{i}]", f"unknown provider {provider!r}",
                                    near or f"known providers: {', '.join(known)}",
                                    location=locate("pricing.providers")))
    return problems


def _most_gpus(catalog: Catalog) -> tuple[int, str]:
    """The most GPUs one run can have among the catalog's offers (and measured machines), and how."""
    most, where = NODE_GPUS, f"{NODE_GPUS} GPUs on one machine"
    for offer in catalog.offers:
        nodes = MAX_NODES if offer.internode_gb_per_s else 1
        if offer.gpu_count * nodes > most:
            most = offer.gpu_count * nodes
            where = (f"{nodes} nodes of {offer.gpu_count} {offer.gpu} joined by their network" if nodes > 1 else
                     f"{offer.gpu_count} × {offer.gpu} on one machine")
    for gpu in catalog.gpus:
        if gpu.measured is not None and gpu.measured.device.count > most:
            most, where = gpu.measured.device.count, f"the {gpu.measured.device.count} devices probed on {gpu.slug}"
    return most, where
