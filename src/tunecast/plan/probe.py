"""The device probe: in under a minute, what the throughput model needs to know about the device at hand.

What is measured, and how (each figure the median of several short timed rounds after a warm-up call: on a
machine shared with other processes a round that lost its cores is slower, and the median ignores up to half of
them, while it stays what a training step meets; on CUDA between `synchronize()` calls, so the time is the
device's; on a CPU with freed memory kept for reuse, as the runner keeps it, so that no figure includes the kernel
faulting fresh pages in):

* matmul rates: the three products of a Linear layer's training step — forward (x @ Wᵀ), the input's
  gradient (g @ W) and the weight's gradient (gᵀ @ x) — for M tokens and a K × N weight, counted as
  2·M·K·N FLOPs each, at small and large token counts and several weight shapes (square ones from a small
  model's width to a large one's, one as wide as an output head, and on a CPU one as narrow as a LoRA adapter of
  rank 8), their operands out of cache as in a training step, in every dtype a run computes in on that device
  (fp32 and bf16; fp16 too on CUDA). The throughput model interpolates between them (by √(K·N)), so small
  micro-batches and narrow layers get the rate they really reach: a CPU library runs a small product on one core
  and a narrow one at a fraction of a square one's rate, which a large product does not show;
* attention: causal scaled-dot-product attention, forward and backward, counted as the tracer counts it
  (7·B·H·S²·D FLOPs: torch's formulas, halved for the causal mask), from a small model's shape to a large
  one's: the model interpolates by the work of one call;
* memory bandwidth: a copy of a tensor that fits the last-level cache and of one that does not
  (bytes read + bytes written per second);
* an eager elementwise operation by size (a CPU): `torch.add` of two tensors into a new one, from a thousand
  values to a million, the time of one call. A small model's step is thousands of such calls on tensors of a
  few ten thousand values: what each costs beyond the smallest (whose cost the host overhead below already
  holds) is not its bytes at the bandwidth of a large copy: past a size torch splits it over the cores, paying
  to start and join them, and below that it runs on one;
* host overhead per operation: a training step (forward and backward) of a model so small that no kernel
  takes measurable time — a 2-layer Llama of width 64, fully trained, and with LoRA adapters through peft
  (hooks, dropout, casts and all) — divided by the number of operations the tracer counts in that step.
  That is what each eager operation costs the host: Python, autograd, dispatch and, on CUDA, the launch;
* the optimizer: torch's AdamW (fused, as the runner uses it, and the multi-tensor `foreach` variant) over
  large tensors, per parameter, and over many small tensors (LoRA's), per tensor;
* bitsandbytes' 4-bit layer (where installed and supported on the device): a forward and backward pass on a
  handful of tokens, per call — the dequantize-and-launch cost every QLoRA layer pays on each pass;
* memory: CUDA's `total_memory` (what the driver gives PyTorch); on a CPU, the total and the memory
  available when probed.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import torch

from tunecast.catalog.devices import PRODUCTS, DeviceRow, MeasurementRow, device_slug, this_host
from tunecast.catalog.gpus import GpuIndex
from tunecast.train.host_memory import keep_freed_memory
from tunecast.units import BYTES_PER_GIB

MIB = 2**20
ROUND_S = {"cpu": 0.01, "cuda": 0.01}  # the least time one timed round covers
# Rounds timed; their median counts. Short rounds, several of them: on a shared machine some rounds lose a core to
# another process (a 2-core VM's other tenants slow a round several-fold), and the median ignores up to half of
# them. Not the fastest round: a training step meets the allocator, the caches and the cores as a typical round
# does, and the fastest of seven rounds planned the demo 12–50% faster than its steps ran (issue 29).
ROUNDS = 9
# A matmul shape is skipped when one call of it would take longer than this at the rate of the shape before it
# (bf16 on a CPU without bf16 instructions): the rate has flattened out by then, and the probe stays short.
LONGEST_CALL_S = 0.4
MIN_TOKEN_COUNTS = 2  # every weight shape is timed at this many token counts at least, however slow
# Operands of the matmul measurements, in all: more than the largest last-level caches hold.
COLD_BYTES = {"cpu": 256 * MIB, "cuda": 1024 * MIB}
RANDOM_ELEMENTS = 1 << 22
# Sizes (values) of the eager elementwise operations timed on a CPU: around torch's grain for splitting an operation
# over threads (32,768 values) and up to where the bandwidth of a large copy takes over.
ELEMENTWISE_SIZES = (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20)
TRANSCENDENTAL_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ProbeShapes:
    """What the probe measures on one kind of device: token counts, weight sizes, sizes of copies."""

    tokens: tuple[int, ...]
    weights: tuple[tuple[int, int], ...]  # (in, out) of the Linear layers timed: square ones, and a head's shape
    dtypes: tuple[str, ...]
    attention: tuple[tuple[int, int, int, int], ...]  # batch, heads, sequence, head size: small to large calls
    copy_mib: tuple[int, ...]
    optimizer_params: int
    small_tensors: int


SHAPES = {
    "cpu": ProbeShapes(tokens=(16, 128, 1024),
                       weights=((128, 8), (128, 128), (512, 512), (2048, 2048), (1024, 16384)),
                       dtypes=("fp32", "bf16"),
                       attention=((4, 4, 64, 32), (4, 4, 256, 32), (1, 8, 512, 64)), copy_mib=(4, 512),
                       optimizer_params=2**22,
                       small_tensors=256),
    "cuda": ProbeShapes(tokens=(64, 256, 1024, 4096, 16384),
                        weights=((256, 256), (1024, 1024), (8192, 8192), (4096, 131072)),
                        dtypes=("bf16", "fp16", "fp32"),
                        attention=((4, 8, 256, 64), (4, 32, 2048, 128)), copy_mib=(16, 2048),
                        optimizer_params=2**26, small_tensors=512),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The tiny model of the host-overhead measurement: Llama-shaped, every kernel negligible.
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
TINY_BATCH = (2, 32)
BNB_WIDTHS = (256, 1024)


@dataclass
class ProbeResult:
    device: DeviceRow
    measurements: list[MeasurementRow] = field(default_factory=list)
    seconds: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, rounds: int = ROUNDS) -> float:
    """Seconds per call of `fn`: the median of `rounds` rounds of at least ROUND_S each, after a warm-up call (a
    call that takes longer than a round by itself: of three calls, or of the rounds asked beyond ROUNDS)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-7)
    long = once >= ROUND_S[device.type]
    calls = 1 if long else max(1, int(ROUND_S[device.type] / once))
    times = [once]
    for _ in range(max(2, rounds - ROUNDS) if long else rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def device_row(device: torch.device, gpus: GpuIndex) -> DeviceRow:
    """Name, count and memory of the device at hand."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        total = props.total_memory / BYTES_PER_GIB
        usable = total
        count = torch.cuda.device_count()
        threads = os.cpu_count() or 1
    else:
        name = _cpu_name()
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / BYTES_PER_GIB
        usable = _available_gib() or total
        count = 1
        threads = torch.get_num_threads()
    short = name.removeprefix("NVIDIA ").removeprefix("GeForce ").strip()
    kind = "cuda" if device.type == "cuda" else "cpu"
    return DeviceRow(slug=device_slug(short, kind, gpus), name=name, kind=kind, host=this_host(), count=count,
                     memory_gib=round(total, 3), usable_memory_gib=round(min(usable, total), 3), threads=threads,
                     torch_version=torch.__version__.split("+")[0], as_of=date.today(),
                     source=f"tunecast probe on {this_host()}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / BYTES_PER_GIB
    except OSError:
        pass
    return None


class Probe:
    """Runs the measurements one by one, each a row with the device's slug."""

    def __init__(self, device: torch.device, gpus: GpuIndex, progress: Callable[[str], None] | None = None) -> None:
        self.device = device
        self.shapes = SHAPES["cuda" if device.type == "cuda" else "cpu"]
        self.row = device_row(device, gpus)
        self.rows: list[MeasurementRow] = []
        self.progress = progress or (lambda message: None)

    def add(self, quantity: str, value: float, unit: str, *, dtype: str = "", shape: str = "", notes: str = "") -> None:
        self.rows.append(MeasurementRow.model_validate(
            {"device": self.row.slug, "quantity": quantity, "dtype": dtype, "shape": shape,
             "value": float(f"{value:.6g}"), "unit": unit, "as_of": self.row.as_of, "source": self.row.source,
             "notes": notes}))

    def run(self) -> ProbeResult:
        started = time.monotonic()
        if self.device.type == "cpu":
            keep_freed_memory()  # as the runner does: a probe that faulted fresh pages in would time the kernel
        with torch.no_grad():
            self.matmuls()
            self.bandwidth()
            self.elementwise()
            self.transcendental()
            self.random()
        self.attention()
        self.op_overhead()
        self.optimizer()
        self.bnb_call()
        return ProbeResult(self.row, self.rows, time.monotonic() - started)

    def _supported(self, dtype: str) -> bool:
        if self.device.type == "cuda" and dtype == "bf16":
            return bool(torch.cuda.is_bf16_supported())
        return True

    def matmuls(self) -> None:
        for dtype in self.shapes.dtypes:
            if not self._supported(dtype):
                continue
            self.progress(f"matmul {dtype}")
            for inputs, outputs in self.shapes.weights:
                rate = 0.0
                for index, tokens in enumerate(self.shapes.tokens):
                    flops = 2 * tokens * inputs * outputs
                    if index >= MIN_TOKEN_COUNTS and 3 * flops / rate > LONGEST_CALL_S:
                        break
                    layer = _ColdLinear(tokens, inputs, outputs, DTYPES[dtype], self.device)
                    shape = f"{tokens}x{inputs}x{outputs}"
                    seconds = {product: timed(functools.partial(layer, product), self.device)
                               for product in PRODUCTS}
                    for product, taken in seconds.items():
                        self.add(f"matmul_{product}", flops / taken / 1e12, "TFLOPS", dtype=dtype, shape=shape,
                                 notes=f"the {product.replace('_', ' ')} product of a Linear layer, its operands "
                                       "out of cache")
                    rate = 3 * flops / sum(seconds.values())
                    self.add("matmul", rate / 1e12, "TFLOPS", dtype=dtype, shape=shape,
                             notes="forward, input gradient and weight gradient of a Linear layer together, its "
                                   "operands out of cache")

    def elementwise(self) -> None:
        """`torch.add` of two tensors into a new one, by size: seconds per call (a CPU)."""
        if self.device.type != "cpu":
            return  # a GPU queues its kernels: their host time is the overhead below, their work the bandwidth
        for dtype in self.shapes.dtypes:
            self.progress(f"elementwise operations {dtype}")
            for size in ELEMENTWISE_SIZES:
                a, b = (torch.randn(size, device=self.device, dtype=DTYPES[dtype]) for _ in range(2))
                seconds = timed(functools.partial(torch.add, a, b), self.device)
                self.add("elementwise", seconds * 1e6, "us per operation", dtype=dtype, shape=str(size),
                         notes=f"torch.add of two tensors of {size:,} values into a new one (three tensors moved)")

    def transcendental(self) -> None:
        """GELU, log-softmax and SiLU over a tensor larger than the caches: bytes written per second."""
        for dtype in self.shapes.dtypes:
            if not self._supported(dtype):
                continue
            self.progress(f"elementwise {dtype}")
            x = torch.randn(TRANSCENDENTAL_ELEMENTS // 1024, 1024, device=self.device, dtype=DTYPES[dtype])

            def mix(x: torch.Tensor = x) -> None:
                torch.nn.functional.gelu(x)
                torch.log_softmax(x, dim=-1)
                torch.nn.functional.silu(x)

            seconds = timed(mix, self.device)
            self.add("transcendental", 3 * x.numel() * x.element_size() / seconds / 1e9, "GB/s", dtype=dtype,
                     notes="GELU, log-softmax and SiLU over 16M values: bytes written per second")

    def random(self) -> None:
        self.progress("random numbers")
        mask = torch.empty(RANDOM_ELEMENTS, device=self.device)
        seconds = timed(functools.partial(mask.bernoulli_, 0.9), self.device)
        self.add("random", seconds / RANDOM_ELEMENTS * 1e9, "ns per element", dtype="fp32",
                 notes="a dropout mask: bernoulli_ over 4M values")

    def bandwidth(self) -> None:
        self.progress("memory bandwidth")
        for mib in self.shapes.copy_mib:
            source = torch.empty(mib * MIB, dtype=torch.uint8, device=self.device)
            target = torch.empty_like(source)
            seconds = timed(functools.partial(target.copy_, source), self.device)
            self.add("bandwidth", 2 * mib * MIB / seconds / 1e9, "GB/s", shape=f"{mib}MiB",
                     notes="a copy: bytes read + bytes written")
            del source, target

    def attention(self) -> None:
        for dtype in self.shapes.dtypes:
            if not self._supported(dtype):
                continue
            self.progress(f"attention {dtype}")
            for batch, heads, seq, size in self.shapes.attention:
                q, k, v = (torch.randn(batch, heads, seq, size, device=self.device, dtype=DTYPES[dtype],
                                       requires_grad=True) for _ in range(3))

                def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                    out.sum().backward()

                seconds = timed(step, self.device)
                self.add("attention", 7 * batch * heads * seq * seq * size / seconds / 1e12, "TFLOPS", dtype=dtype,
                         shape=f"{batch}x{heads}x{seq}x{size}", notes="causal SDPA forward + backward")

    def op_overhead(self) -> None:
        from tunecast.config.spec import RunSpec
        from tunecast.estimate.tracer import trace_step
        from tunecast.step.settings import TraceSettings

        for method in ("full", "lora"):
            self.progress(f"host overhead per operation ({method})")
            spec = RunSpec.model_validate({"model": "tiny", "method": method, "precision": "fp32",
                                           "lora": {"rank": 8, "targets": "all-linear"}})
            settings = TraceSettings.from_spec(spec, grad_checkpointing=False)
            kernels = trace_step(TINY_LLAMA, settings, *TINY_BATCH, count_flops=False).flops["kernels"]
            with warnings.catch_warnings():  # the libraries' deprecation notices are for their maintainers
                warnings.simplefilter("ignore")
                model = _tiny_model(settings, self.device)
            # the figure a small model's plan rests on most: three times the rounds (a second in all)
            seconds = timed(functools.partial(_tiny_step, model), self.device, rounds=3 * ROUNDS)
            self.add("op_overhead", seconds / kernels * 1e6, "us per operation", shape=method,
                     notes=f"a training step of a 2-layer width-64 Llama ({method}) ÷ its {kernels:.0f} operations")

    def optimizer(self) -> None:
        self.progress("optimizer")
        count = self.shapes.optimizer_params
        for variant in ("fused", "foreach"):
            big = [torch.nn.Parameter(torch.zeros(count // 4, device=self.device)) for _ in range(4)]
            for parameter in big:
                parameter.grad = torch.full_like(parameter, 1e-3)
            optimizer = torch.optim.AdamW(big, lr=1e-4, **{variant: True})
            seconds = timed(optimizer.step, self.device)
            self.add("optimizer", seconds / count * 1e9, "ns per parameter", dtype="fp32", shape=variant,
                     notes="AdamW over 4 large fp32 tensors")
            del big, optimizer
        small = [torch.nn.Parameter(torch.zeros(8, 64, device=self.device)) for _ in range(self.shapes.small_tensors)]
        for parameter in small:
            parameter.grad = torch.full_like(parameter, 1e-3)
        for variant in ("fused", "foreach"):
            optimizer = torch.optim.AdamW(small, lr=1e-4, **{variant: True})
            seconds = timed(optimizer.step, self.device)
            self.add("optimizer_tensor", seconds / len(small) * 1e6, "us per tensor", dtype="fp32", shape=variant,
                     notes=f"{variant} AdamW over {len(small)} tensors of 512 values")

    def bnb_call(self) -> None:
        try:
            import bitsandbytes as bnb
        except Exception:  # absent, or unusable on this device: nothing to measure
            return
        for dtype in self.shapes.dtypes:  # per compute dtype: a CPU without native bf16 is far slower in bf16
            if not self._supported(dtype):
                continue
            self.progress(f"bitsandbytes 4-bit layer {dtype}")
            seconds = {}
            try:
                for width in BNB_WIDTHS:
                    layer = bnb.nn.Linear4bit(width, width, bias=False, compute_dtype=DTYPES[dtype], quant_type="nf4")
                    layer = layer.to(self.device)
                    x = torch.randn(8, width, device=self.device, dtype=DTYPES[dtype], requires_grad=True)
                    seconds[width] = timed(functools.partial(_layer_step, layer, x), self.device) / 2
            except Exception:  # bitsandbytes without a backend for this device or dtype
                continue
            # a pass (forward or backward) costs a fixed part and a part per weight: two sizes separate them
            small, large = BNB_WIDTHS
            per_weight = max(0.0, (seconds[large] - seconds[small]) / (large**2 - small**2))
            per_call = max(1e-9, seconds[small] - per_weight * small**2)
            notes = (f"a forward or backward pass of a bitsandbytes Linear4bit (NF4, computing in {dtype}) on 8 "
                     "tokens, from two layer sizes")
            self.add("bnb_4bit_call", per_call * 1e6, "us per pass", dtype=dtype, shape="nf4", notes=notes)
            self.add("bnb_4bit_dequantize", max(per_weight * 1e9, 1e-6), "ns per weight per pass", dtype=dtype,
                     shape="nf4", notes=notes)


class _ColdLinear:
    """One of a Linear layer's three products, cycling through enough distinct operands that each call reads them
    from memory, not from a cache warmed by the call before (in training every layer has its own weight and
    activations)."""

    def __init__(self, tokens: int, inputs: int, outputs: int, dtype: torch.dtype, device: torch.device) -> None:
        element = torch.empty((), dtype=dtype).element_size()
        per_set = element * (inputs * outputs + tokens * (inputs + outputs))
        copies = max(1, min(16, -(-COLD_BYTES[device.type] // per_set)))
        self.sets = [(torch.randn(tokens, inputs, device=device, dtype=dtype),
                      torch.randn(tokens, outputs, device=device, dtype=dtype),
                      torch.randn(outputs, inputs, device=device, dtype=dtype)) for _ in range(copies)]
        self.next = 0

    def __call__(self, product: str) -> None:
        x, grad, weight = self.sets[self.next]
        self.next = (self.next + 1) % len(self.sets)
        if product == "forward":
            torch.mm(x, weight.t())
        elif product == "input_grad":
            torch.mm(grad, weight)
        else:
            torch.mm(grad.t(), x)


def _layer_step(layer: Any, x: torch.Tensor) -> None:
    layer(x).sum().backward()


def _tiny_model(settings: Any, device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunecast.step.setup import prepare_for_training, training_config

    data = training_config(TINY_LLAMA)
    config = AutoConfig.for_model(**data)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    model = prepare_for_training(model, settings)
    model.train()
    return model


def _tiny_step(model: Any) -> None:
    from tunecast.step.forward import forward_backward

    device = next(model.parameters()).device
    batch, seq = TINY_BATCH
    ids = torch.zeros((batch, seq), dtype=torch.long, device=device)
    forward_backward(model, ids, ids, precision="fp32", chunked_loss=False)
    model.zero_grad(set_to_none=True)


def run_probe(gpus: GpuIndex, *, device: str | None = None,
              progress: Callable[[str], None] | None = None) -> ProbeResult:
    """Probe `device` (the CUDA GPU when there is one, else the CPU)."""
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return Probe(chosen, gpus, progress).run()
