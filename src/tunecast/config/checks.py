"""Rules that involve several fields or the catalog. Each returns Problems; none raises."""

from __future__ import annotations

from collections.abc import Callable

from tunecast.catalog.store import Catalog
from tunecast.config.spec import RunSpec
from tunecast.errors import Problem, suggestion_text

# Where a key's value came from, for messages: "line 7", "--seq-len", or None for a default.
Locate = Callable[[str], "str | None"]


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
    if spec.fixed("epochs") and spec.max_steps is not None:
        add("max_steps", "is set together with epochs; the run would stop at whichever comes first",
            "keep one of epochs and max_steps")
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
    if spec.method == "qlora" and spec.precision == "fp8":
        add("precision", "fp8 matmuls cannot run on 4-bit QLoRA weights",
            "use precision bf16 with qlora, or method lora with fp8")
    if spec.attention == "flash" and spec.precision == "fp32":
        add("attention", "flash attention runs in bf16 or fp16 only, not with precision fp32",
            "use attention sdpa, or precision bf16 / bf16-mixed")
    if spec.gpus.offload != "none" and spec.gpus.strategy == "ddp":
        add("gpus.offload", "needs a sharded strategy: DDP keeps everything on each GPU",
            "set gpus.strategy to fsdp, zero2 or zero3, or gpus.offload to none")
    if spec.gpus.offload == "params" and spec.gpus.strategy == "zero2":
        add("gpus.offload", "params offload needs parameters sharded (fsdp or zero3); zero2 keeps them whole",
            "set gpus.strategy to fsdp or zero3, or gpus.offload to optimizer")
    if spec.method == "full" and spec.fixed("lora"):
        add("lora", "is ignored with method full", "remove the lora section or use method lora",
            severity="warning")
    _dataset_problems(spec, add)
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
    """GPU names, FP8 support and provider names, checked against the catalog."""
    problems: list[Problem] = []
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
