"""The loop evaluates and checkpoints where one rule says (train/policy.py), and the plan and calibrate count them
with the same rules: a run's predicted time holds exactly the evaluations and checkpoints the run will do."""

from __future__ import annotations

import pytest

from tunecast.config.spec import RunSpec
from tunecast.plan.workload import Workload, evaluations
from tunecast.train.policy import checkpoints_in_run, evaluation_due, evaluations_in_run


def due_steps(steps: int, per_epoch: int, every_steps: int | None) -> list[int]:
    """The boundaries the loop evaluates at, step by step (loop._eval_due asks evaluation_due at each)."""
    return [step for step in range(1, steps + 1)
            if evaluation_due(step, steps, epoch_ended=step % per_epoch == 0, every_steps=every_steps)]


@pytest.mark.parametrize("steps", [1, 3, 4, 10, 12, 45])
@pytest.mark.parametrize("per_epoch", [1, 4, 5])
@pytest.mark.parametrize("every_steps", [None, 1, 3, 10])
def test_the_count_is_the_loops_own(steps: int, per_epoch: int, every_steps: int | None) -> None:
    assert evaluations_in_run(steps, per_epoch, every_steps) == len(due_steps(steps, per_epoch, every_steps))


def test_where_the_loop_evaluates() -> None:
    assert due_steps(45, 4, 10) == [10, 20, 30, 40, 45]  # every 10 steps, and after the last
    assert due_steps(10, 4, None) == [4, 8, 10]  # ends of epochs, and after the last
    assert due_steps(8, 4, None) == [4, 8]  # the last step ends an epoch: once


def workload(eval_examples: int) -> Workload:
    return Workload(examples=1_000, processed_tokens=100_000, trained_tokens=50_000, epochs=3.0, seq_len=512,
                    packed=False, measured=False, tokenizer="t", dataset_bytes=1, eval_examples=eval_examples)


def test_the_plan_counts_the_evaluation_after_the_last_step() -> None:
    held_out = workload(50)
    assert held_out.length(8, None).per_epoch == 125  # 1,000 examples at 8 sequences a step
    assert evaluations(held_out, 375, 8, None) == 3
    assert evaluations(held_out, 300, 8, None) == 3  # max_steps 300: epochs end at 125 and 250, then the last
    assert evaluations(held_out, 375, 8, 100) == 4  # at 100, 200, 300, and after step 375
    assert evaluations(workload(0), 375, 8, 100) == 0


def spec(**changes: object) -> RunSpec:
    return RunSpec.model_validate({"model": "x", **changes})


def test_checkpoints_are_counted_as_the_loop_schedules_them() -> None:
    assert checkpoints_in_run(spec(checkpoint={"every_steps": 10}), 40, 100.0, 1.0, 0.5) == 4
    assert checkpoints_in_run(spec(checkpoint={"every_minutes": 1}), 1000, 330.0, 1.0, 0.5) == 6  # 5 and the end
    # automatic (Young/Daly): every √(2 × 0.01 h write ÷ 0.5 preemptions/h) = 0.2 h = 720 s; never more than one a step
    assert checkpoints_in_run(spec(), 1000, 7200.0, 36.0, 0.5) == 7200 // 720 + 1
    assert checkpoints_in_run(spec(checkpoint={"every_minutes": 1}), 3, 3600.0, 1.0, 0.5) == 3
