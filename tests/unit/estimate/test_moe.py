"""The MoE experts formulas against what transformers' Experts modules really allocate (tiny layers, real CPU
tensors, every new storage recorded below the autograd layer), and what fake tensors can and cannot see."""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tunecast.catalog.store import load_catalog
from tunecast.errors import TunecastError
from tunecast.estimate.moe import ExpertBytes, ExpertShape, expert_bytes, expert_tokens, moe_layers, untraced_bytes

EXPERTS_CLASS = {"qwen3_moe": "Qwen3MoeExperts", "mixtral": "MixtralExperts", "gpt_oss": "GptOssExperts"}
# Tiny dimensions, all distinct; widths are multiples of 8 (the CPU grouped matmul wants 16-byte strides in
# bf16). One width below the hidden size and one above it: different moments set the peaks.
TOKENS, HIDDEN, EXPERTS, TOP_K = 24, 40, 6, 2


def config(model_type: str, width: int) -> dict[str, Any]:
    width_key = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    experts_key = "num_experts" if model_type == "qwen3_moe" else "num_local_experts"
    return {"model_type": model_type, "hidden_size": HIDDEN, width_key: width, experts_key: EXPERTS,
            "num_experts_per_tok": TOP_K}


class _Allocations(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive (freed when their storage is)."""

    def __init__(self, ignored: set[int]) -> None:
        super().__init__()
        self.ignored = ignored  # storages that existed before (weights, inputs)
        self.alive: dict[int, int] = {}
        self.live = self.peak = 0

    def _free(self, key: int) -> None:
        self.live -= self.alive.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = storage._cdata
                if key in self.alive or key in self.ignored or not storage.nbytes():
                    continue
                self.alive[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key)
        return out


def routing(pattern: str) -> torch.Tensor:
    """The (token, slot) -> expert choice of each assumption: balanced (every expert the same count), worst
    (every token the same TOP_K experts)."""
    if pattern == "balanced":
        return (torch.arange(TOKENS * TOP_K) % EXPERTS).view(TOKENS, TOP_K)
    return torch.arange(TOP_K).repeat(TOKENS, 1)


def measure(model_type: str, width: int, implementation: str, pattern: str,
            mode: Callable[[], Any] | None = None, dtype: torch.dtype = torch.bfloat16) -> ExpertBytes:
    """One forward and backward of a frozen Experts module on inputs that need gradients (what LoRA on the
    attention sends it), in `dtype`."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**config(model_type, width))
    hf._experts_implementation = implementation
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    with mode() if mode is not None else torch.device("cpu"):
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # not .to(): a fake module's parameters cannot be swapped
        try:
            experts = getattr(module, EXPERTS_CLASS[model_type])(hf)
        finally:
            torch.set_default_dtype(default)
        for parameter in experts.parameters():
            torch.nn.init.normal_(parameter, 0.0, 0.5)
            parameter.requires_grad_(False)
        hidden = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
        weights = torch.rand(TOKENS, TOP_K, dtype=dtype, requires_grad=True)
        chosen = routing(pattern)
        before = {t.untyped_storage()._cdata for t in (*experts.parameters(), hidden, weights, chosen)}
        recorder = _Allocations(before)
        with recorder:
            out = experts(hidden, chosen, weights)
        forward_peak, out_bytes = recorder.peak, out.untyped_storage().nbytes()
        kept = recorder.live - out_bytes
        gradient = torch.ones_like(out)
        recorder.ignored.add(gradient.untyped_storage()._cdata)
        start = recorder.peak = recorder.live
        with recorder:
            out.backward(gradient)
        return ExpertBytes(kept, forward_peak, recorder.peak - start)


SHAPES = [(family, width) for family in ("qwen3_moe", "mixtral", "gpt_oss") for width in (24, 56)]


@pytest.mark.parametrize(("family", "width"), SHAPES, ids=[f"{f}-{w}" for f, w in SHAPES])
@pytest.mark.parametrize("pattern", ["balanced", "worst"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_formulas_equal_the_real_allocations(family, width, pattern, implementation) -> None:
    shape = ExpertShape.from_config(config(family, width))
    predicted = expert_bytes(shape, TOKENS, implementation=implementation, dtype_bytes=2, routing=pattern)
    assert measure(family, width, implementation, pattern) == predicted


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_memory_does_not_depend_on_routing(family) -> None:
    assert measure(family, 24, "grouped_mm", "balanced") == measure(family, 24, "grouped_mm", "worst")


def test_fake_tensors_see_every_grouped_byte_and_cannot_run_the_loop() -> None:
    """The tracer's view: grouped_mm on fake tensors allocates exactly what it does on real ones; the eager loop
    asks for the tokens of each expert, which fake tensors do not know."""
    assert measure("qwen3_moe", 24, "grouped_mm", "balanced", mode=FakeTensorMode) == \
        measure("qwen3_moe", 24, "grouped_mm", "balanced")
    with pytest.raises(DynamicOutputShapeException):
        measure("qwen3_moe", 24, "eager", "balanced", mode=FakeTensorMode)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fake_tensors_trace_float32_experts_as_the_real_kernel_runs_them(family) -> None:
    """Float32 experts (fp32, or mixed precision's master weights) run the grouped matmul's float32 kernel. torch's
    fake kernel takes bf16 only; the tracer lets it take what the real kernels take, and then the fake step
    allocates what the real one does, which is the formula in 4-byte elements."""
    from tunecast.estimate.tracer import _as_on_real_tensors

    real = measure(family, 24, "grouped_mm", "balanced", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="BF16"):
        measure(family, 24, "grouped_mm", "balanced", mode=FakeTensorMode, dtype=torch.float32)
    with _as_on_real_tensors():
        fake = measure(family, 24, "grouped_mm", "balanced", mode=FakeTensorMode, dtype=torch.float32)
    assert fake == real
    assert real == expert_bytes(ExpertShape.from_config(config(family, 24)), TOKENS, implementation="grouped_mm",
                                dtype_bytes=4, routing="balanced")
    FakeTensorMode.cache_clear()  # fake tensors cache an op's output by its inputs' metadata
    with pytest.raises(RuntimeError, match="BF16"):  # torch's own check again once the trace is over
        measure(family, 24, "grouped_mm", "balanced", mode=FakeTensorMode, dtype=torch.float32)


def test_nothing_untraced_when_the_step_runs_the_traced_kernel() -> None:
    shape = ExpertShape.from_config(load_catalog(None).models.find("Qwen/Qwen3-30B-A3B").data)
    for routing_ in ("balanced", "worst"):
        assert untraced_bytes(shape, 2, 1024, runs="grouped_mm", dtype_bytes=2, routing=routing_) == \
            ExpertBytes(0, 0, 0)
    # The loop keeps S·(c·H - 8) - 4·E more per layer: its down output and the weighted copy both stay.
    eager = untraced_bytes(shape, 2, 1024, runs="eager", dtype_bytes=2)
    pairs = 2 * 1024 * 8
    assert eager.kept == pairs * (2 * 2048 - 8) - 4 * 128


def test_shapes_of_the_bundled_configs() -> None:
    models = load_catalog(None).models
    assert ExpertShape.from_config(models.find("Qwen/Qwen3-30B-A3B").data) == ExpertShape(2048, 768, 128, 8)
    assert ExpertShape.from_config(models.find("mistralai/Mixtral-8x7B-v0.1").data) == ExpertShape(4096, 14336, 8, 2)
    assert ExpertShape.from_config(models.find("openai/gpt-oss-20b").data) == \
        ExpertShape(2880, 2880, 32, 4, clamped_glu=True, biased=True, sentinel_class=False)
    assert ExpertShape.from_config(models.find("Qwen/Qwen3-0.6B").data) is None
    with pytest.raises(TunecastError, match="no memory model for the experts"):
        ExpertShape.from_config({"model_type": "dbrx", "moe_num_experts": 16})


def test_layers_with_experts_and_tokens_per_expert() -> None:
    assert moe_layers({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, 8) == 3  # layers 1, 5, 7
    assert moe_layers({}, 4) == 4
    shape = ExpertShape(2048, 768, 128, 8)
    assert expert_tokens(1024, shape, "balanced") == (64, 128)
    assert expert_tokens(5, shape, "balanced") == (1, 40)
    assert expert_tokens(1024, shape, "worst") == (1024, 8)
    with pytest.raises(ValueError, match="routing must be one of"):
        expert_tokens(1024, shape, "random")
