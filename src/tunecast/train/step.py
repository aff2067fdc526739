"""One forward and backward pass of the training step, as the trainer and the memory tracer run it."""

from __future__ import annotations

from typing import Any

import torch

from tunecast.train.loss import causal_lm_loss
from tunecast.train.setup import autocast_dtype


def forward_backward(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, *, precision: str,
                     chunked_loss: bool, on_backward: Any = None) -> float | None:
    """Loss under the run's autocast, then its backward pass. `on_backward` is called between the two
    (the tracer marks the phase there). Returns the loss value on real tensors, None on fake ones."""
    cast = autocast_dtype(precision)
    with torch.autocast(input_ids.device.type, dtype=cast, enabled=cast is not None):
        loss = causal_lm_loss(model, input_ids, labels, chunked=chunked_loss)
    if on_backward is not None:
        on_backward()
    loss.backward()
    from torch._subclasses.fake_tensor import FakeTensor

    return None if isinstance(loss, FakeTensor) else float(loss.detach())
