"""A run's length in the plan: the steps `tunecast train` runs, max_steps capping the epochs, whole-run tokens."""

import pytest

from tunecast.config.spec import RunSpec
from tunecast.plan.workload import Workload, optimizer_steps


def workload(examples: int, epochs: float, *, max_steps: int | None = None, epochs_set: bool = True,
             global_batch: int = 8) -> Workload:
    """`examples` examples of 100 tokens (40 trained), unpacked."""
    return Workload(examples, examples * 100, examples * 40, epochs, 256, False, False, "declared", 0,
                    max_steps=max_steps, epochs_set=epochs_set, global_batch=global_batch)


@pytest.mark.parametrize(("examples", "epochs", "max_steps", "epochs_set"), [
    (32, 10, None, True), (33, 3, None, True), (32, 10, 6, True), (32, 10, 500, True), (32, 3, 500, False),
    (1000, 0.5, None, True), (1000, 2.5, 7, True),
])
def test_the_plan_counts_the_steps_train_runs(examples: int, epochs: float, max_steps: int | None,
                                              epochs_set: bool) -> None:
    from tunecast.train.run import run_length

    spec = RunSpec.model_validate({"model": "m", "epochs": epochs, "max_steps": max_steps})
    trained = run_length(spec, examples, 8, epochs_set=epochs_set)
    planned = workload(examples, epochs, epochs_set=epochs_set).length(8, max_steps)
    assert (planned.steps, planned.per_epoch) == (trained.steps, trained.per_epoch)
    if trained.by_epochs:  # the epochs set the schedule: their steps are the same count
        assert planned.epoch_steps == trained.schedule_steps
    assert optimizer_steps(workload(examples, epochs, epochs_set=epochs_set), 8, max_steps) == trained.steps


def test_a_step_limit_cuts_the_whole_runs_tokens_and_says_so() -> None:
    capped = workload(32, 10, max_steps=6).as_dict()  # 4 steps an epoch, 40 in all
    assert (capped["steps"], capped["steps_per_epoch"], capped["passes"]) == (6, 4, 1.5)
    assert (capped["processed_tokens"], capped["trained_tokens"]) == (32 * 100 * 1.5, 32 * 40 * 1.5)
    assert capped["length"] == "6 steps (max_steps ends the run early: the first of the 40 steps of 10 epochs)"
    whole = workload(32, 10).as_dict()
    assert (whole["steps"], whole["processed_tokens"], whole["length"]) == (40, 32000, "10 epochs (40 steps)")
    beyond = workload(32, 10, max_steps=100).as_dict()
    assert beyond["steps"] == 40 and beyond["length"] == "10 epochs (40 steps); max_steps 100 is beyond them"


def test_max_steps_alone_passes_over_the_data_as_often_as_it_takes() -> None:
    alone = workload(32, 3, max_steps=10, epochs_set=False).as_dict()
    assert (alone["steps"], alone["passes"], alone["processed_tokens"]) == (10, 2.5, 8000)
    assert alone["length"] == "10 steps (max_steps: 2.5 passes over the data)"


def test_an_epochs_short_last_step_costs_its_fixed_parts_and_its_share_of_the_work() -> None:
    from tunecast.plan.planner import train_seconds
    from tunecast.plan.throughput import StepTime

    # 4 micro-batch rounds of 2 sequences a step: 1.0 s of computation and 0.4 s of dispatch, and 0.2 s optimizer
    step = StepTime(compute_s=1.0, dequantize_s=0.0, dispatch_s=0.4, optimizer_s=0.2, communication_s=0.0,
                    offload_s=0.0, tokens_per_step=800)
    assert train_seconds(workload(32, 10), step, 2, 4, 40) == pytest.approx(40 * 1.6)  # 8 divides 32: all full
    # 33 examples: 4 full steps and one of a single sequence, which pays the optimizer, one round's dispatch and
    # half a round's computation
    short = 0.2 + 0.1 + 0.5 * 0.25
    assert train_seconds(workload(33, 3), step, 2, 4, 15) == pytest.approx(3 * (4 * 1.6 + short))
    # a step limit within an epoch runs full steps only
    assert train_seconds(workload(33, 3), step, 2, 4, 7) == pytest.approx(4 * 1.6 + short + 2 * 1.6)
