"""Fitting a GPU: limits found by search, and what to change when a run does not fit. The logic is tested
on a synthetic memory model; tests/integration covers it with the real estimator."""

from typing import Any

import pytest

from tunecast.catalog.gpus import Gpu
from tunecast.catalog.store import load_catalog
from tunecast.config.spec import RunSpec
from tunecast.estimate.fit import SOLVE_TOLERANCE, _largest, _largest_along, _solved, fit_report
from tunecast.estimate.memory import MemoryEstimate
from tunecast.estimate.profiles import NeedsTrace


def test_largest_finds_the_edge_of_a_monotone_predicate() -> None:
    assert _largest(lambda n: n <= 37, 1, 4096) == 37
    assert _largest(lambda n: n <= 5000, 1, 4096) == 4096
    assert _largest(lambda n: False, 1, 4096) == 0


@pytest.mark.parametrize("label, loss", [
    ("a loss whose memory is constant (fixed-size chunks)", lambda n: 3.0),
    ("a loss whose memory grows with n (a fixed number of chunks)", lambda n: 0.02 * n),
    ("a loss whose memory steps with the allocator's rounding", lambda n: 0.02 * n + 0.5 * (n % 7 == 0)),
])
def test_a_composed_step_s_limit_is_solved_from_its_stand_in_and_checked_with_few_traces(label: str, loss: Any) -> None:
    """The stand-in's memory (cheap) plus the loss's (each value a trace) against a capacity: the limit is within
    the tolerance of the exact one, verified to fit, and found with a handful of the costly evaluations."""
    def proxy(n: int) -> float:
        return 10.0 + 0.05 * n

    traced: list[int] = []

    def exact(n: int) -> float:
        traced.append(n)
        return proxy(n) + loss(n)

    capacity = 80.0
    truth = _largest(lambda n: proxy(n) + loss(n) <= capacity, 1, 1 << 20)
    found = _solved(exact, proxy, (8, proxy(8) + loss(8)), capacity, 1, 1 << 20)
    assert exact(found) <= capacity, label
    assert truth - int(truth * SOLVE_TOLERANCE) <= found <= truth, label
    assert len(traced) <= 8, f"{label}: {len(traced)} traces"


@pytest.mark.parametrize("label, proxy, exact", [
    ("the stand-in's peak in another phase (an optimizer step constant in n)",
     lambda n: max(70.0, 10 + 0.05 * n), lambda n: max(70.0, 10 + 0.55 * n)),
    ("the stand-in holding more than the loss as n grows (a gap line falling)",
     lambda n: 10 + 0.3 * n, lambda n: max(75.0, 10 + 0.2 * n)),
    ("the allocator's reserve adding up to 0.8 GiB that no line follows",
     lambda n: 10 + 0.005 * n, lambda n: 10.5 + 0.005 * n + 0.8 * (n * 2654435761 % 97) / 97),
])
@pytest.mark.parametrize("asked", [1, 8, 64])
def test_a_limit_the_stand_in_misleads_about_is_closed_on_the_composed_step_s_own_measurements(
        label: str, proxy: Any, exact: Any, asked: int) -> None:
    """Where proxy plus the gap line guesses far off, the measurements that do not fit give the limit (memory is
    convex in n), not a walk from the last one."""
    traced: list[int] = []

    def measured(n: int) -> float:
        traced.append(n)
        return float(exact(n))

    capacity = 80.0
    found = _solved(measured, proxy, (asked, exact(asked)), capacity, 1, 1 << 20)
    # the contract (memory with noise has no one limit): what is returned fits, and past the tolerance does not
    assert exact(found) <= capacity < exact(found + 1 + int(found * SOLVE_TOLERANCE)), label
    assert len(traced) <= 8, f"{label}: {traced}"


@pytest.mark.parametrize("asked", [8, 64])
def test_a_limit_is_solved_on_the_loss_interpolated_between_the_checks_traces(asked: int) -> None:
    """Where the stand-in plus a line has not closed the limit in its rounds, the composed step with the loss
    interpolated between the checks' traces (`near`, which answers from two measured points) is solved: with the stand-in far off and a reserve of up to
    4 GiB that no line follows (what a depth extrapolation makes of the copies' rounding), the limit holds its contract
    in fewer traces than without."""
    def proxy(n: int) -> float:
        return 10 + 0.05 * n

    def exact(n: int) -> float:
        return 10.5 + 0.9 * n + 4.0 * (n * 2654435761 % 97) / 97

    def solve(with_near: bool) -> tuple[int, list[int]]:
        traced: list[int] = []

        def measured(n: int) -> float:
            traced.append(n)
            return exact(n)

        def near(n: int, points: Any) -> float | None:  # interpolation: exact between traces (a linear loss)
            return exact(n) if len(set(points)) >= 2 else None

        return _solved(measured, proxy, (asked, exact(asked)), 80.0, 1, 1 << 20, near if with_near else None), traced

    found, traced = solve(True)
    assert exact(found) <= 80.0 < exact(found + 1 + int(found * SOLVE_TOLERANCE))
    assert len(traced) < len(solve(False)[1]) and len(traced) <= 6, traced


def test_a_solved_limit_is_exact_below_a_hundred_and_zero_when_nothing_fits() -> None:
    def proxy(n: int) -> float:
        return 1.0 * n

    assert _solved(lambda n: proxy(n) + 2.0 + 0.01 * n * n, proxy, (4, 4 + 2.0 + 0.16), 60.0, 1, 4096) == \
        _largest(lambda n: n + 2.0 + 0.01 * n * n <= 60.0, 1, 4096)
    assert _solved(lambda n: 100.0 + n, proxy, (4, 104.0), 60.0, 1, 4096) == 0


def gpu(usable_gib: float) -> Gpu:
    row = load_catalog(None).gpus.get("rtx-4090")
    return row.model_copy(update={"usable_memory_gib": usable_gib, "memory_gib": usable_gib})


def synthetic_total(run: RunSpec, micro_batch: int | None = None, seq_len: int | None = None,
                    exact: bool = False, trace: bool = True) -> float:
    """GiB: weights 4 (1 as QLoRA), 0.5 per 1k tokens of activations (0.1 with checkpointing), ÷ GPUs."""
    batch = micro_batch or run.micro_batch
    seq = seq_len or run.seq_len
    weights = 1.0 if run.method == "qlora" else 4.0
    per_k_tokens = 0.1 if run.grad_checkpointing is True else 0.5
    if run.activation_offload:
        per_k_tokens *= 0.2
    sharded = weights / run.gpus.count if run.gpus.strategy == "fsdp" else weights
    return sharded + per_k_tokens * batch * seq / 1000


def estimate_of(spec: RunSpec) -> Any:
    total = synthetic_total(spec)
    return MemoryEstimate("cuda", total, total, total, total, total, "backward", 0.0, 0.0, {}, {}, spec.micro_batch,
                          spec.seq_len, ())


def test_the_search_along_lines_finds_what_bisection_finds_in_fewer_evaluations() -> None:
    """On memory that never falls and is linear in pieces (a step's, with the allocator's reserve stepping up), the
    largest n that fits is bisection's, exactly, in under half its evaluations on average."""
    import random

    along = halving = 0
    for trial in range(2000):
        draw = random.Random(trial)
        slope, base, capacity = draw.uniform(0.01, 2.0), draw.uniform(0.0, 50.0), draw.uniform(10.0, 200.0)
        low = draw.randint(1, 20)
        high = draw.choice([draw.randint(low, 5000), 1 << 20])
        kink, jump = draw.randint(low, high), draw.uniform(0.0, 5.0)
        counted = [0]

        def memory(n: int, slope: float = slope, base: float = base, kink: int = kink, jump: float = jump,
                   counted: list[int] = counted) -> float:
            counted[0] += 1
            return base + slope * n + (jump if n >= kink else 0.0)

        found = _largest_along(memory, capacity, low, high)
        along += counted[0]
        counted[0] = 0
        assert found == _largest(lambda n, cap=capacity: memory(n) <= cap, low, high), trial  # type: ignore[misc]
        halving += counted[0]
    assert along < halving / 2


def test_limits_are_the_largest_values_that_fit() -> None:
    spec = RunSpec(model="x", micro_batch=4, seq_len=1000)
    fit = fit_report(spec, estimate_of(spec), gpu(10.0), synthetic_total, context_len=131072)
    assert fit.fits and fit.headroom_gib == pytest.approx(4.0)
    assert fit.max_micro_batch == 12  # 4 + 0.5 × 12 = 10
    assert fit.max_seq_len == 3000  # 4 + 0.5 × 4 × 3 = 10
    assert not fit.suggestions


@pytest.mark.parametrize(("least", "at_edge"), [(9.5, True), (10.0, True), (10.5, False)])
def test_a_run_that_fits_only_once_the_allocator_releases_its_cache_fits_at_the_edge(least: float,
                                                                                        at_edge: bool) -> None:
    """12 GiB with the cache as it grows on a 10 GiB card: at the edge where what it needs at least fits."""
    from dataclasses import replace

    spec = RunSpec(model="x", micro_batch=8, seq_len=2000)  # 4 + 8 = 12 GiB
    estimate = replace(estimate_of(spec), least_reserved_gib=least, least_device_total_gib=least)
    fit = fit_report(spec, estimate, gpu(10.0), synthetic_total, context_len=None)
    assert not fit.fits and fit.at_edge == at_edge and fit.as_dict()["fits_at_edge"] == at_edge
    assert any(w.startswith("fits only at the edge") for w in fit.warnings) == at_edge
    assert fit.suggestions  # changes that leave room are still offered


@pytest.mark.parametrize(("least", "reserved", "device_total"), [(11.0, 11.5, 12.0), (9.5, 9.5, 10.0),
                                                                 (10.5, 11.5, 12.0)])
def test_the_peak_on_the_card_is_the_estimate_where_it_fits_and_the_card_at_the_edge(
        least: float, reserved: float, device_total: float) -> None:
    """The allocator's cache grows to the card and is released there: at the edge no counter passes the card's
    memory. A run that fits keeps its estimate; one that fits not even at the edge asks for it and fails."""
    from dataclasses import replace

    spec = RunSpec(model="x", micro_batch=8, seq_len=2000)
    estimate = replace(estimate_of(spec), peak_reserved_gib=11.5, device_total_gib=12.0, least_device_total_gib=least)
    card = 12.0 if least == 11.0 else 10.0
    assert estimate.on_device(card) == pytest.approx((reserved, device_total))
    fit = fit_report(spec, estimate, gpu(card), synthetic_total, context_len=None)
    assert (fit.reserved_gib, fit.device_total_gib) == pytest.approx((reserved, device_total))
    assert fit.as_dict()["device_total_on_gpu_gib"] == pytest.approx(device_total)


def test_the_context_length_caps_the_longest_sequence() -> None:
    spec = RunSpec(model="x", micro_batch=1, seq_len=1000)
    fit = fit_report(spec, estimate_of(spec), gpu(80.0), synthetic_total, context_len=4096)
    assert fit.max_seq_len == 4096 and fit.max_seq_len_capped


def test_a_run_that_does_not_fit_gets_changes_with_their_peaks() -> None:
    spec = RunSpec(model="x", micro_batch=8, seq_len=2000)  # 4 + 8 = 12 GiB
    fit = fit_report(spec, estimate_of(spec), gpu(10.0), synthetic_total, context_len=None)
    assert not fit.fits and fit.headroom_gib == pytest.approx(-2.0)
    changes = {s.change: s for s in fit.suggestions}
    assert changes["turn on gradient checkpointing"].device_total_gib == pytest.approx(4 + 1.6)
    assert changes["turn on gradient checkpointing"].fits
    assert changes["use QLoRA (4-bit NF4 base weights)"].device_total_gib == pytest.approx(9.0)
    assert changes["micro-batch 4 with gradient accumulation 2"].settings == {"micro_batch": 4, "grad_accum": 2}
    assert changes["shard over 2 GPUs with FSDP"].fits  # the fewest GPUs that make it fit
    assert "shard over 4 GPUs with FSDP" not in changes


def test_a_deepspeed_run_is_offered_deepspeeds_sharding() -> None:
    spec = RunSpec(model="x", micro_batch=8, seq_len=2000, gpus={"strategy": "zero2"})
    changes = {s.change: s for s in fit_report(spec, estimate_of(spec), gpu(10.0), synthetic_total,
                                                 context_len=None).suggestions}
    assert changes["offload parameters and optimizer states to CPU RAM (ZeRO-3)"].settings == {
        "gpus.strategy": "zero3", "gpus.offload": "params"}
    [sharded] = [s for change, s in changes.items() if change.startswith("shard over")]
    assert sharded.change.endswith("GPUs with ZeRO-3") and sharded.settings["gpus.strategy"] == "zero3"


def test_when_no_single_change_fits_the_changes_are_combined() -> None:
    spec = RunSpec(model="x", micro_batch=16, seq_len=4000)  # 4 + 32 GiB; one sequence alone needs 6
    fit = fit_report(spec, estimate_of(spec), gpu(5.0), synthetic_total, context_len=None)
    assert not any(s.fits for s in fit.suggestions if not s.change.startswith("combine"))
    [combined] = [s for s in fit.suggestions if s.change.startswith("combine")]
    assert combined.change == "combine gradient checkpointing + chunked loss + 8-bit AdamW + QLoRA + micro-batch 1"
    assert combined.fits and combined.device_total_gib == pytest.approx(1 + 0.1 * 4)


def test_a_micro_batch_of_one_or_two_is_flagged() -> None:
    spec = RunSpec(model="x", micro_batch=8, seq_len=4000)
    fit = fit_report(spec, estimate_of(spec), gpu(5.0), synthetic_total, context_len=None)  # 4 + 2 per sequence
    assert fit.max_micro_batch == 0 or fit.max_micro_batch <= 2
    spec = RunSpec(model="x", micro_batch=8, seq_len=2000)
    fit = fit_report(spec, estimate_of(spec), gpu(5.5), synthetic_total, context_len=None)  # one sequence: 5 GiB
    assert fit.max_micro_batch == 1
    assert any("micro-batch of 1" in w for w in fit.warnings)


def untemplated_chunked_loss(run: RunSpec, micro_batch: int | None = None, seq_len: int | None = None,
                             exact: bool = False, trace: bool = True) -> float:
    """synthetic_total, but the chunked loss has no template: without `trace` it cannot be estimated."""
    if run.loss == "chunked" and not trace:
        raise NeedsTrace("no template")
    return synthetic_total(run, micro_batch, seq_len, exact, trace) - (0.5 if run.loss == "chunked" else 0.0)


def test_a_change_that_needs_a_trace_is_listed_without_a_figure_unless_tracing_is_allowed() -> None:
    spec = RunSpec(model="x", micro_batch=16, seq_len=4000)  # no single change fits 5 GiB
    fit = fit_report(spec, estimate_of(spec), gpu(5.0), untemplated_chunked_loss, context_len=None)
    changes = {s.change: s for s in fit.suggestions}
    chunked = changes["compute the loss in chunks"]
    assert chunked.device_total_gib is None and chunked.fits is None
    assert chunked.as_dict()["estimated"] is False and chunked.as_dict()["device_total_gib"] is None
    [combined] = [s for s in fit.suggestions if s.change.startswith("combine")]
    assert combined.change == "combine gradient checkpointing + 8-bit AdamW + QLoRA + micro-batch 1"
    assert "loss" not in combined.settings and combined.fits

    traced = fit_report(spec, estimate_of(spec), gpu(5.0), untemplated_chunked_loss, context_len=None,
                        trace_suggestions=True)
    changes = {s.change: s for s in traced.suggestions}
    assert changes["compute the loss in chunks"].device_total_gib == pytest.approx(4 + 32 - 0.5)
    assert all(s.as_dict()["estimated"] for s in traced.suggestions)


def qlora_not_estimated(run: RunSpec, micro_batch: int | None = None, seq_len: int | None = None,
                        exact: bool = False, trace: bool = True, **_: Any) -> float:
    """A run whose QLoRA tunecast does not estimate (the Trainer's QLoRA of a mixture of experts)."""
    from tunecast.errors import TunecastError

    if run.method == "qlora":
        raise TunecastError("its QLoRA is not estimated", field="runner")
    return synthetic_total(run, micro_batch, seq_len, exact, trace)


def test_a_change_whose_run_is_not_estimated_is_listed_without_a_figure_and_left_out_of_the_combination() -> None:
    """The error belongs to the changed run, not to the one asked about: the LoRA run is still answered."""
    spec = RunSpec(model="x", micro_batch=16, seq_len=4000)
    fit = fit_report(spec, estimate_of(spec), gpu(5.0), qlora_not_estimated, context_len=None)
    changes = {s.change: s for s in fit.suggestions}
    assert changes["use QLoRA (4-bit NF4 base weights)"].device_total_gib is None
    [combined] = [s for s in fit.suggestions if s.change.startswith("combine")]
    assert "QLoRA" not in combined.change and "method" not in combined.settings


def test_on_several_gpus_only_what_trains_there_is_suggested() -> None:
    """The chunked loss and the optimizer in the backward pass run on one process; QLoRA under DDP only."""
    sharded = RunSpec(model="x", micro_batch=16, seq_len=4000, gpus={"count": 2, "strategy": "fsdp"})
    changes = {s.change for s in fit_report(sharded, estimate_of(sharded), gpu(5.0), synthetic_total,
                                            context_len=None).suggestions}
    assert "turn on gradient checkpointing" in changes
    assert not changes & {"compute the loss in chunks", "step the optimizer in the backward pass (grad_accum 1)",
                          "use QLoRA (4-bit NF4 base weights)"}
    replicas = RunSpec(model="x", micro_batch=16, seq_len=4000, gpus={"count": 2, "strategy": "ddp"})
    changes = {s.change for s in fit_report(replicas, estimate_of(replicas), gpu(5.0), synthetic_total,
                                            context_len=None).suggestions}
    assert "use QLoRA (4-bit NF4 base weights)" in changes and "compute the loss in chunks" not in changes
