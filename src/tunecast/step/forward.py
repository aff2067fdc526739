"""One forward and backward pass of the training step, as the trainer and the memory tracer run it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from tunecast.step.loss import causal_lm_loss
from tunecast.step.setup import autocast_dtype


def forward_backward(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, *, precision: str,
                     chunked_loss: bool, attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, num_items: torch.Tensor | None = None,
                     on_backward: Any = None, backward: Callable[[torch.Tensor], None] | None = None,
                     offload_activations: bool = False, runner_step: tuple[str, ...] = ()) -> float | None:
    """Loss under the run's autocast, then its backward pass.

    `attention_mask` marks padding (padded batches); `position_ids` restarting at 0 mark packed examples
    (transformers then keeps each example's attention to itself). `num_items` is the number of trained
    tokens in the whole optimizer step: the loss is summed over this micro-batch's tokens and divided by it,
    so that accumulated micro-batches of different lengths weigh every token alike. `on_backward` is called
    between forward and backward (the tracer marks the phase there); `backward` replaces `loss.backward()`
    (a gradient scaler's). `offload_activations` keeps the tensors saved for the backward pass in pinned CPU
    memory (torch's `save_on_cpu`; the estimator models this term, activation offload). `runner_step` names the
    ways another tool's step differs (step/variants.py STEP_VARIANTS): the tracer runs them to estimate that
    tool; tunecast's own runs pass none. Returns the loss value on real tensors, None on fake ones.
    """
    cast = autocast_dtype(precision)
    if cast is None and "autocast" in runner_step:
        cast = torch.bfloat16
    offload = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload_activations else contextlib.nullcontext()
    with offload, torch.autocast(input_ids.device.type, dtype=cast, enabled=cast is not None):
        loss = causal_lm_loss(model, input_ids, labels, chunked=chunked_loss, attention_mask=attention_mask,
                              position_ids=position_ids, num_items=num_items,
                              fp32_outputs=cast is not None and "fp32-outputs" in runner_step,
                              runner_step=runner_step)
    if on_backward is not None:
        on_backward()
    if backward is None:
        loss.backward()
    else:
        backward(loss)
    from torch._subclasses.fake_tensor import FakeTensor

    return None if isinstance(loss, FakeTensor) else float(loss.detach())


def forward_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, *, precision: str, chunked_loss: bool,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 num_items: torch.Tensor | None = None) -> torch.Tensor:
    """The same loss without gradients (evaluation): summed over the batch's trained tokens ÷ `num_items`."""
    cast = autocast_dtype(precision)
    with torch.no_grad(), torch.autocast(input_ids.device.type, dtype=cast, enabled=cast is not None):
        return causal_lm_loss(model, input_ids, labels, chunked=chunked_loss, attention_mask=attention_mask,
                              position_ids=position_ids, num_items=num_items)
