"""The training loss: next-token cross-entropy, whole or in chunks.

`standard` lets the model compute full logits (batch, seq, vocab) and transformers' loss upcasts them to
fp32 — for a 128k vocabulary that is the largest temporary of a LoRA step. `chunked` computes logits and
loss in a fixed number of chunks along the sequence, each recomputed in the backward pass, so at most one
chunk's logits exist at a time (the approach of torchtune's chunked cross-entropy, 8 chunks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tunecast.train.setup import decoder_and_head

IGNORE_INDEX = -100
LOSS_CHUNKS = 8


def causal_lm_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, *, chunked: bool,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   num_items: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token loss over the positions whose label is not IGNORE_INDEX: their mean, or with `num_items`
    their sum divided by it (the trained tokens of a whole optimizer step)."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if not chunked:
        if num_items is not None:
            inputs["num_items_in_batch"] = num_items
        return model(labels=labels, **inputs).loss
    decoder, head = decoder_and_head(model)
    hidden = decoder(**inputs).last_hidden_state  # (batch, seq, hidden)
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # position t predicts token t+1
    softcap = getattr(decoder.config, "final_logit_softcapping", None)
    total = hidden.new_zeros((), dtype=torch.float32)
    for hidden_chunk, label_chunk in zip(hidden.chunk(LOSS_CHUNKS, dim=1), shifted.chunk(LOSS_CHUNKS, dim=1),
                                         strict=True):
        total = total + checkpoint(_chunk_loss, head, hidden_chunk, label_chunk, softcap, use_reentrant=False)
    count = num_items if num_items is not None else (shifted != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


def _chunk_loss(head: Any, hidden: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = head(hidden).float()  # (batch, seq/LOSS_CHUNKS, vocab)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
