"""When a run checkpoints and evaluates. Checkpoints: every N steps, every N minutes, or by the Young/Daly rule, which
balances the time a write costs against the work a preemption loses; the plan prices a run's checkpoints by the same
rule (plan/cost.py). Evaluations: after every `eval.every_steps` steps, else at the end of every epoch, and after the
last step. Calibrate counts both, and the plan its evaluations, with the loop's own rules (`checkpoints_in_run`,
`evaluations_in_run`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from tunecast.config.spec import RunSpec
from tunecast.units import SECONDS_PER_HOUR

MIN_CHECKPOINT_HOURS = 1 / 60  # no automatic interval shorter than a minute, however cheap a write is


def young_daly_interval(checkpoint_hours: float, interruptions_per_hour: float) -> float:
    """√(2 C / λ): the checkpoint interval that minimises expected lost work plus checkpoint cost."""
    return max(MIN_CHECKPOINT_HOURS, math.sqrt(2 * checkpoint_hours / interruptions_per_hour))


@dataclass
class CheckpointPolicy:
    """When to checkpoint: every N steps, every N seconds, or automatically every √(2 C / λ) (Young/Daly),
    C being the last measured write time and λ the preemption rate assumed for the machine."""

    every_steps: int | None
    every_s: float | None
    automatic: bool
    interruptions_per_hour: float
    rate_source: str
    write_s: float  # the last measured write (estimated until the first one)
    last_at: float = field(default_factory=time.monotonic)

    @classmethod
    def for_spec(cls, spec: RunSpec, *, interruptions_per_hour: float, rate_source: str,
                 estimated_write_s: float) -> CheckpointPolicy:
        every_s = spec.checkpoint.every_minutes * 60 if spec.checkpoint.every_minutes else None
        automatic = spec.checkpoint.every_steps is None and every_s is None
        policy = cls(spec.checkpoint.every_steps, every_s, automatic, interruptions_per_hour, rate_source,
                     estimated_write_s)
        if automatic:
            policy._update_interval()
        return policy

    def _update_interval(self) -> None:
        self.every_s = young_daly_interval(self.write_s / SECONDS_PER_HOUR,
                                           self.interruptions_per_hour) * SECONDS_PER_HOUR

    def due(self, step: int) -> bool:
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_s is not None and time.monotonic() - self.last_at >= self.every_s

    def saved(self, write_s: float) -> None:
        self.last_at = time.monotonic()
        self.write_s = write_s
        if self.automatic:
            self._update_interval()

    def describe(self) -> str:
        if self.every_steps is not None:
            return f"every {self.every_steps} steps" + (f" and every {self.every_s / 60:g} min" if self.every_s else "")
        if not self.automatic:
            return f"every {self.every_s / 60:g} min"  # type: ignore[operator]
        return (f"every {self.every_s / 60:.1f} min (Young/Daly: √(2 × {self.write_s:.2f} s write ÷ "  # type: ignore[operator]
                f"{self.interruptions_per_hour:g} preemptions/h, {self.rate_source}), at least one minute")


def evaluation_due(step: int, total_steps: int, *, epoch_ended: bool, every_steps: int | None) -> bool:
    """Whether the loop evaluates at the boundary after `step` (of `total_steps`; `epoch_ended` when the step ended
    an epoch): every `every_steps` steps, else at the end of every epoch; and after the last step either way."""
    if step == 0:
        return False
    if step == total_steps:
        return True
    return step % every_steps == 0 if every_steps is not None else epoch_ended


def evaluations_in_run(steps: int, steps_per_epoch: int, every_steps: int | None) -> int:
    """How many times the loop evaluates over a run of `steps` optimizer steps (`evaluation_due` at each step)."""
    every = every_steps or steps_per_epoch
    return steps // every + (1 if steps % every else 0)


def checkpoints_in_run(spec: RunSpec, steps: int, train_seconds: float, write_seconds: float,
                       interruptions_per_hour: float) -> int:
    """How many checkpoints the loop writes over a run of `steps` steps taking `train_seconds`, each write taking
    `write_seconds` (CheckpointPolicy): one before every step the policy finds due, and one at the end."""
    policy = CheckpointPolicy.for_spec(spec, interruptions_per_hour=interruptions_per_hour, rate_source="",
                                       estimated_write_s=write_seconds)
    by_steps = (steps - 1) // policy.every_steps if policy.every_steps else 0
    by_time = int(train_seconds // policy.every_s) if policy.every_s else 0
    return min(max(0, steps - 1), by_steps + by_time) + 1
