"""The optimizer as the loop drives it, and the learning-rate schedule.

Schedule: the learning rate of optimizer step s (0-based) is `learning_rate × factor(s)`, with transformers'
factors (transformers/optimization.py), so a run here and one with `Trainer` follow the same curve:

* warm-up: factor = s / W for s < W (W = warmup_steps, or ⌈warmup_ratio × total steps⌉);
* `linear`: then (T − s) / (T − W), down to 0 at the last step T;
* `cosine`: then ½ (1 + cos(π · (s − W) / (T − W)));
* `constant`: 1 from the first step (no warm-up, as transformers' `constant`); `constant_with_warmup`: 1 after W.

The schedule is a pure function of the step, so its state in a checkpoint is the step itself.

`optimizer_in_backward` steps each parameter's own optimizer as soon as its gradient is complete (a
post-accumulate-grad hook) and frees the gradient at once — the step the memory estimator traces. Gradient
clipping needs every gradient at once, so it does not apply there.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tunecast.config.spec import RunSpec
from tunecast.step.setup import make_optimizer


def warmup_steps(spec: RunSpec, total_steps: int) -> int:
    if spec.warmup_steps:
        return spec.warmup_steps
    return math.ceil(spec.warmup_ratio * total_steps)


def lr_factor(schedule: str, step: int, *, warmup: int, total: int) -> float:
    """transformers' schedule factor at optimizer step `step` (0-based)."""
    if schedule == "constant":
        return 1.0
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant_with_warmup":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return max(0.0, (total - step) / max(1, total - warmup))  # linear


class TrainOptimizer:
    """One optimizer over the trainable parameters, or one per parameter stepped inside the backward pass."""

    def __init__(self, spec: RunSpec, params: list[torch.nn.Parameter]) -> None:
        self.in_backward = spec.optimizer_in_backward
        self.params = params
        if self.in_backward:
            self._each = [make_optimizer(spec.optimizer, [p], lr=spec.learning_rate, weight_decay=spec.weight_decay)
                          for p in params]
            self._hooks = [p.register_post_accumulate_grad_hook(self._step_one(i)) for i, p in enumerate(params)]
        else:
            self._each = [make_optimizer(spec.optimizer, params, lr=spec.learning_rate,
                                         weight_decay=spec.weight_decay)]
            self._hooks = []

    def _step_one(self, index: int) -> Any:
        def hook(parameter: torch.nn.Parameter) -> None:
            self._each[index].step()
            parameter.grad = None

        return hook

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._each

    def set_lr(self, lr: float) -> None:
        for optimizer in self._each:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def step(self, scaler: Any = None) -> None:
        """The optimizer step after the backward passes (nothing to do when it ran inside them)."""
        if self.in_backward:
            return
        if scaler is not None:
            scaler.step(self._each[0])
            scaler.update()
        else:
            self._each[0].step()

    def zero_grad(self) -> None:
        for optimizer in self._each:
            optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self._each]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["optimizers"]
        if len(saved) != len(self._each):
            raise ValueError(f"the checkpoint has {len(saved)} optimizer(s), the run {len(self._each)}")
        for optimizer, one in zip(self._each, saved, strict=True):
            optimizer.load_state_dict(one)
