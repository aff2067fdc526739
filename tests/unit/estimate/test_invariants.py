"""The memory estimate keeps the invariants a GPU keeps (issue 11): reserved at least allocated, the device's
total at least reserved, and no figure falls as micro-batch or length grows — held property-based, over tiny
models of several families (bundled configs, shrunk), methods, precisions, checkpointing and shapes, on a
simulated CUDA device and on the CPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.models import tiny_llama

from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.estimate import memory
from tunecast.estimate.fit import estimator_total, fit_report
from tunecast.estimate.memory import MemoryEstimate, estimate_memory
from tunecast.estimate.profile import PhasePeak, Replay

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256}
WINDOW = 200  # a shrunk sliding window, inside the lengths drawn: both sides of it are estimated


def tiny_config(name: str, layers: int) -> dict[str, Any]:
    """The bundled config of `name` at `layers` layers, hidden size 64 and a vocabulary of 256."""
    found = load_catalog(None).models.find(name)
    assert found is not None, name
    config = {**found.data, **TINY, "num_hidden_layers": layers}
    if "head_dim" in config:
        config["head_dim"] = 16
    if config.get("sliding_window"):
        config["sliding_window"] = WINDOW
    for key in ("torch_dtype", "dtype"):
        config.pop(key, None)
    return config


# Each entry is traced once (10–40 s of CPU each on a 2-core machine); the shapes and the device are drawn
# freely, and replaying a traced step at a new shape is cheap. Together: three families (Llama at 10 layers,
# traced at 4 and 8 and extrapolated, where the reserve went below allocated; Mistral with a sliding window
# the lengths cross; Qwen3), the three methods, bf16 and fp32, checkpointing on and off.
RUNS = {
    "llama-lora": (tiny_llama(), {"method": "lora"}),
    "mistral-qlora-checkpointed": (tiny_config("mistralai/Mistral-7B-v0.1", 2),
                                   {"method": "qlora", "grad_checkpointing": True}),
    "qwen3-full-fp32": (tiny_config("Qwen/Qwen3-0.6B", 2), {"method": "full", "precision": "fp32"}),
}


def _figures(estimate: MemoryEstimate) -> tuple[float, float, float]:
    return estimate.peak_allocated_gib, estimate.peak_reserved_gib, estimate.device_total_gib


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(run=st.sampled_from(sorted(RUNS)), device=st.sampled_from(["cuda", "cuda", "cpu"]),
       batches=st.sets(st.integers(1, 8), min_size=2, max_size=3),
       lengths=st.sets(st.integers(16, 512), min_size=2, max_size=3))
def test_the_estimate_keeps_the_invariants_of_a_gpu(run: str, device: str, batches: set[int],
                                                    lengths: set[int]) -> None:
    catalog = load_catalog(None)
    config, settings_ = RUNS[run]
    spec = RunSpec.model_validate({"model": "x", **settings_})
    gpu = catalog.gpus.get("h100") if device == "cuda" else None
    grid = {(b, s): _figures(estimate_memory(spec, config, device=device, gpu=gpu, overheads=catalog.overheads,
                                             micro_batch=b, seq_len=s))
            for b in batches for s in lengths}
    for shape, (allocated, reserved, total) in grid.items():
        assert 0 < allocated <= reserved <= total, (shape, grid[shape])
    for b in batches:  # what the process needs at least lies between what it allocates and what it reserves
        for s in lengths:
            estimate = estimate_memory(spec, config, device=device, gpu=gpu, overheads=catalog.overheads,
                                       micro_batch=b, seq_len=s)
            assert estimate.peak_allocated_gib <= estimate.least_reserved_gib <= estimate.peak_reserved_gib
            assert estimate.least_device_total_gib - estimate.least_reserved_gib == pytest.approx(
                estimate.device_total_gib - estimate.peak_reserved_gib)
    # No figure falls from a shape to the next larger micro-batch or length (and so to any larger one).
    for (b, s), figures in grid.items():
        nexts = [(min(x for x in batches if x > b), s)] if b < max(batches) else []
        nexts += [(b, min(x for x in lengths if x > s))] if s < max(lengths) else []
        for larger in nexts:
            assert all(x <= y for x, y in zip(figures, grid[larger], strict=True)), ((b, s), figures, larger,
                                                                                      grid[larger])


def test_the_reserve_of_a_deep_model_never_goes_below_allocated() -> None:
    """Issue 11 on a tiny model: at micro-batch 1 the 8-layer copy of this Llama reserved less beyond its peak
    than the 4-layer copy, and the reserve extrapolated to 10 layers went below zero (reserved < allocated)."""
    catalog = load_catalog(None)
    spec = RunSpec(model="x", method="lora", micro_batch=1, seq_len=50)
    estimate = estimate_memory(spec, tiny_llama(), device="cuda", gpu=catalog.gpus.get("h100"),
                               overheads=catalog.overheads)
    assert estimate.peak_reserved_gib >= estimate.peak_allocated_gib


def _replay(allocated: int, reserved: int) -> Replay:
    return Replay({"backward": PhasePeak(allocated)}, reserved, 0)


@pytest.mark.parametrize(("shallow", "deeper", "expected"), [
    ((100, 160), (200, 240), 40),  # falls from 60 to 40: the deeper copy's, not 40 - 20 × 6 / 4 < 0
    ((100, 120), (200, 240), 40 + 20 * 6 / 4),  # grows from 20 to 40: linear in depth, as before
    ((100, 140), (200, 240), 40),  # flat
])
def test_the_reserve_grows_with_depth_or_is_the_deeper_copys(shallow: tuple[int, int], deeper: tuple[int, int],
                                                             expected: float) -> None:
    pair = SimpleNamespace(shallow=SimpleNamespace(layers=4), deeper=SimpleNamespace(layers=8), layers=14)
    assert memory._depth_reserve(pair, _replay(*shallow), _replay(*deeper)) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("composed", "rest", "expected"), [
    # the loss's fragmentation in the deeper copy (4 then 10 beyond the peak), the rest flat: the larger copy's
    # 10, not 10 + 6 × 6 / 4 = 19 as a per-layer growth
    (((100, 104), (200, 210)), ((90, 92), (190, 192)), 10),
    (((100, 110), (200, 204)), ((90, 92), (190, 192)), 10),  # the same in the shallow copy: the same figure
    # the rest grows with depth (2 then 4: 4 + 2 × 6 / 4 = 7 at 14 layers): the larger copy's plus that growth
    (((100, 104), (200, 210)), ((90, 92), (190, 194)), 10 + 3),
])
def test_a_composed_reserve_is_the_larger_copys_grown_as_the_rest_of_the_step(
        composed: tuple[tuple[int, int], tuple[int, int]], rest: tuple[tuple[int, int], tuple[int, int]],
        expected: float) -> None:
    """unsloth's QLoRA of Gemma 2 9B on an A100: the composed loss's blocks left 10.5 GiB free in the 4-layer copy and
    4.5 in the 8-layer one at micro-batch 109, then 3.7 and 10.7 at 111, and the second extrapolated as a per-layer
    growth to 42 layers said 131 GiB where 109 said 65."""
    pair = SimpleNamespace(shallow=SimpleNamespace(layers=4), deeper=SimpleNamespace(layers=8), layers=14)
    replays = [_replay(*figures) for figures in (*composed, *rest)]
    assert memory._composed_reserve(pair, *replays) == expected  # type: ignore[arg-type]


def test_a_composed_estimate_rises_with_the_micro_batch() -> None:
    """The same run on the estimator itself (unsloth's QLoRA of Gemma 2 9B, composed at each micro-batch): the
    reserve no longer swings by tens of GiB from one micro-batch to the next."""
    from tunecast.config.runner import apply_runner

    catalog = load_catalog(None)
    model = catalog.models.find("google/gemma-2-9b")
    totals = []
    for batch in (107, 109, 111, 123, 137):
        spec = apply_runner(RunSpec.model_validate({"model": model.name, "method": "qlora", "runner": "unsloth",
                                                    "micro_batch": batch, "seq_len": 1024}))
        totals.append(estimate_memory(spec, model.data, device="cuda", gpu=catalog.gpus.get("a100-80gb"),
                                      overheads=catalog.overheads).device_total_gib)
    assert totals == sorted(totals), totals


def test_a_larger_shape_is_never_reported_to_fit_where_a_smaller_did_not() -> None:
    """The fit search on the real estimator: every micro-batch up to the largest reported fits, the next does
    not; likewise lengths."""
    catalog = load_catalog(None)
    config, card = tiny_llama(), catalog.gpus.get("rtx-4090")
    spec = RunSpec(model="x", method="lora", micro_batch=3, seq_len=300)
    total = estimator_total(config, card, catalog.overheads)
    capacity = (total(spec, micro_batch=3) + total(spec, micro_batch=7)) / 2
    small = card.model_copy(update={"usable_memory_gib": capacity, "memory_gib": capacity})
    estimate = estimate_memory(spec, config, device="cuda", gpu=small, overheads=catalog.overheads)
    report = fit_report(spec, estimate, small, total, context_len=4096)
    assert report.fits and 3 <= report.max_micro_batch < 7
    assert all(total(spec, micro_batch=b) <= capacity for b in range(1, report.max_micro_batch + 1))
    assert total(spec, micro_batch=report.max_micro_batch + 1) > capacity
    assert 300 <= report.max_seq_len < 4096
    shorter = [1 << k for k in range(report.max_seq_len.bit_length())] + [report.max_seq_len - 1]
    assert all(total(spec, seq_len=s) <= capacity for s in shorter)
    assert total(spec, seq_len=report.max_seq_len + 1) > capacity
