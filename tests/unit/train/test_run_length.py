"""How long a run is (`run_length`): max_steps alone, epochs alone, or both, where the epochs set the learning-rate
schedule and max_steps ends the run early (the Trainer's, axolotl's and torchtune's convention)."""

from __future__ import annotations

import pytest

from tunecast.config.spec import RunSpec
from tunecast.train.optim import lr_factor, warmup_steps
from tunecast.train.run import RunLength, run_length


def spec(**values: object) -> RunSpec:
    return RunSpec.model_validate({"model": "m", **values})


@pytest.mark.parametrize(("values", "epochs_set", "expected"), [
    ({"max_steps": 6}, False, RunLength(6, 6, 9, by_epochs=False)),
    ({"epochs": 2}, True, RunLength(18, 18, 9, by_epochs=True)),
    ({}, False, RunLength(27, 27, 9, by_epochs=True)),  # the default 3 epochs
    ({"epochs": 2, "max_steps": 6}, True, RunLength(6, 18, 9, by_epochs=True)),
    ({"epochs": 0.5, "max_steps": 100}, True, RunLength(5, 5, 9, by_epochs=True)),
])
def test_the_length_of_a_run(values: dict, epochs_set: bool, expected: RunLength) -> None:
    assert run_length(spec(**values), 36, 4, epochs_set=epochs_set) == expected


def test_a_capped_run_follows_the_schedule_of_its_epochs() -> None:
    """The first steps of a capped run have the learning rates of the uncapped run's first steps."""
    capped = run_length(spec(epochs=2, max_steps=6, warmup_ratio=0.1), 36, 4, epochs_set=True)
    whole = run_length(spec(epochs=2, warmup_ratio=0.1), 36, 4, epochs_set=True)
    assert capped.capped and not whole.capped
    rates = [lr_factor("cosine", step, warmup=warmup_steps(spec(warmup_ratio=0.1), length.schedule_steps),
                       total=length.schedule_steps) for length in (capped, whole) for step in range(6)]
    assert rates[:6] == rates[6:]
    assert warmup_steps(spec(warmup_ratio=0.1), capped.schedule_steps) == 2  # ⌈0.1 × 18⌉, not ⌈0.1 × 6⌉
