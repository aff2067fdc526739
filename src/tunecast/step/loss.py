"""The training loss: next-token cross-entropy, whole or in chunks.

`standard` lets the model compute full logits (batch, seq, vocab) and transformers' loss upcasts them to
fp32 — for a 128k vocabulary that is the largest temporary of a LoRA step. `chunked` computes logits and
loss in a fixed number of chunks along the sequence, each recomputed in the backward pass, so at most one
chunk's logits exist at a time (the approach of torchtune's chunked cross-entropy, 8 chunks).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tunecast.step import observer
from tunecast.step.chunking import LOSS_CHUNKS, Chunks, chunks_of, split
from tunecast.step.setup import decoder_and_head
from tunecast.step.variants import SEGMENT_LOSSES, STUB_CALLS_HEAD, STUB_INPUTS, STUBS

IGNORE_INDEX = -100


def causal_lm_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, *, chunked: bool,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   num_items: torch.Tensor | None = None, fp32_outputs: bool = False,
                   runner_step: tuple[str, ...] = ()) -> torch.Tensor:
    """Next-token loss over the positions whose label is not IGNORE_INDEX: their mean, or with `num_items`
    their sum divided by it (the trained tokens of a whole optimizer step). `fp32_outputs` (standard loss) also
    makes the fp32 copy of the logits that accelerate's mixed precision returns, held until the loss is returned:
    how the transformers Trainer's step holds memory. `runner_step` may name another tool's loss (`fused-head`,
    `output-chunks`, `fused-chunks`, `compiled-loss`), or an older transformers' loss for the model to take
    (`shifted-logits-copy`): step/variants.py STEP_VARIANTS."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if any(variant in runner_step for variant in (*SEGMENT_LOSSES, *STUBS.values(), "fused-head-cpu")):
        return _own_loss(model, inputs, labels, num_items, runner_step)
    if not chunked and "compiled-loss" in runner_step:
        outputs = model(**inputs)
        logits = outputs.logits  # (batch, seq, vocab): the model's own, kept for the backward pass
        if fp32_outputs:
            outputs["logits"] = logits.float()
        shifted = _next_tokens(labels)
        return _per_item(CompiledCrossEntropy.apply(logits.flatten(0, 1), shifted.flatten()), shifted, num_items)
    if not chunked:
        if num_items is not None:
            inputs["num_items_in_batch"] = num_items
        with _model_loss(model, runner_step):
            outputs = model(labels=labels, **inputs)
        if fp32_outputs:
            outputs["logits"] = outputs.logits.float()  # (batch, seq, vocab), dropped with `outputs` on return
        if "accuracy-copy" in runner_step:
            # TRL 0.16-1.5's token accuracy: argmax over a contiguous copy of the logits but the last position
            shifted_logits = outputs.logits[..., :-1, :].contiguous()  # (batch, seq - 1, vocab)
            predictions = shifted_logits.argmax(dim=-1)
            del predictions, shifted_logits
        return outputs.loss
    decoder, head = decoder_and_head(model)
    hidden = decoder(**inputs).last_hidden_state  # (batch, seq, hidden)
    shifted = _next_tokens(labels)
    softcap = getattr(decoder.config, "final_logit_softcapping", None)
    return _per_item(_chunked_total(hidden, head, shifted, split(hidden.shape[1], LOSS_CHUNKS), softcap), shifted,
                     num_items)


@contextlib.contextmanager
def _model_loss(model: Any, runner_step: tuple[str, ...]) -> Iterator[None]:
    """While the model computes its loss from its labels: the loss of an older transformers where `runner_step`
    names one (`shifted-logits-copy`), in place of the installed transformers' ForCausalLMLoss. It runs where that
    one runs, inside the model's forward, before accelerate's fp32 copy of the outputs, as it did in those versions."""
    if "shifted-logits-copy" not in runner_step:
        yield
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = base.__dict__.get("_loss_function")
    base.loss_function = shifted_copy_loss
    try:
        yield
    finally:
        if own is None:
            del base._loss_function
        else:
            base.loss_function = own


def shifted_copy_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      num_items_in_batch: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                      **_: Any) -> torch.Tensor:
    """transformers 4.46-4.48's ForCausalLMLoss (loss/loss_utils.py, with fixed_cross_entropy): the logits upcast to
    fp32, then a contiguous copy of them but each sequence's last position, the cross-entropy taken from the copy.
    4.49 dropped the copy (PR #35646): it pads the labels instead and reads the upcast logits as they are."""
    logits = logits.float()  # (batch, seq, vocab); the model's own when they are fp32 already
    shift_logits = logits[..., :-1, :].contiguous()  # (batch, seq - 1, vocab): the copy
    shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(shift_logits.view(-1, vocab_size), shift_labels.view(-1), ignore_index=ignore_index,
                           reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def _chunked_total(hidden: torch.Tensor, head: Any, shifted: torch.Tensor, lengths: tuple[int, ...],
                   softcap: float | None) -> torch.Tensor:
    """The summed loss of chunks of `lengths` along the sequence, each chunk's logits recomputed in the backward
    pass."""
    total = hidden.new_zeros((), dtype=torch.float32)
    lengths = observer.pieces(lengths)
    for hidden_chunk, label_chunk in observer.chunks_run(list(zip(hidden.split(list(lengths), dim=1),
                                                                  shifted.split(list(lengths), dim=1), strict=True))):
        total = total + checkpoint(_chunk_loss, head, hidden_chunk, label_chunk, softcap, use_reentrant=False)
    return total


def _next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts: position t predicts token t+1; the last predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def _per_item(total: torch.Tensor, shifted: torch.Tensor, num_items: torch.Tensor | None) -> torch.Tensor:
    """A summed loss over its trained tokens: `num_items` (the whole optimizer step's), else this batch's."""
    count = num_items if num_items is not None else (shifted != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


def _chunk_loss(head: Any, hidden: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = head(hidden).float()  # (batch, seq/LOSS_CHUNKS, vocab)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _own_loss(model: Any, inputs: dict[str, Any], labels: torch.Tensor, num_items: torch.Tensor | None,
              runner_step: tuple[str, ...]) -> torch.Tensor:
    """A loss another tool takes from the hidden states itself (the model returns no logits): TRL's fused LM head
    (`fused-head`), TRL 1.7-1.14's chunked loss (`trl-chunks`) and torchtune's LinearCrossEntropyLoss
    (`output-chunks`) over the trained tokens, gathered into a new tensor (traced, every token is trained: the
    trace's labels); unsloth's fused cross-entropy (`fused-chunks`) over the hidden states as they are. Where
    `runner_step` names a stub of SegmentStub instead, the loss is a stand-in the estimator replaces with a
    trace of the loss alone (estimate/compose.py)."""
    decoder, head = decoder_and_head(model)
    hidden = decoder(**inputs).last_hidden_state  # (batch, seq, hidden)
    shifted = _next_tokens(labels)
    softcap = getattr(decoder.config, "final_logit_softcapping", None)
    stub = next((v for v in runner_step if v in STUB_INPUTS), None)
    variant = next((v for v in runner_step if v in (*SEGMENT_LOSSES, "fused-head-cpu")), None)
    if (stub and STUB_INPUTS[stub] == "hidden") or variant == "fused-chunks":
        inputs_, targets = hidden, shifted
    else:
        inputs_ = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (trained tokens, hidden): a gathered copy
        targets = shifted[:, :-1].reshape(-1)
    if stub is not None:
        total = SegmentStub.apply(inputs_, head.weight, head.bias, targets, stub)
    elif variant == "fused-head-cpu":
        total = _trl_head_without_triton(inputs_, head.weight, targets)
    else:
        total = segment_total(str(variant), inputs_, head, targets, softcap, compiled="compiled-loss" in runner_step)
    return _per_item(total, shifted, num_items)


def segment_total(variant: str, inputs: torch.Tensor, head: Any, targets: torch.Tensor, softcap: float | None, *,
                  compiled: bool = False, chunks: Chunks | None = None) -> torch.Tensor:
    """The summed loss of `variant` (one of SEGMENT_LOSSES) over `inputs` (the trained tokens' hidden states, or
    the hidden states for `fused-chunks`) and their `targets`: the part of the step a template cannot hold.
    `compiled`: torchtune's chunks' cross-entropy under torch.compile (`compiled-loss`). `chunks`: the chunks it
    runs, as the runner splits them (step/chunking.py) unless given (a form's read, estimate/forms.py)."""
    if chunks is None:
        chunks = chunks_of(variant, tuple(inputs.shape), int(head.weight.shape[0]))
    if variant in ("fused-chunks", "loss-chunks"):
        return _chunked_total(inputs, head, targets, chunks.rows, softcap)
    if variant == "fused-head":
        return FusedHeadLoss.apply(inputs, head.weight, targets, chunks)
    total = inputs.new_zeros((), dtype=torch.float32)
    if variant == "trl-chunks":
        for first, length in observer.chunks_run(_offsets(chunks.rows)):
            rows = slice(first, first + length)
            loss, _, _ = checkpoint(_trl_chunk, inputs[rows], head.weight, targets[rows], use_reentrant=False)
            total = total + loss
        return total
    # every chunk's logits are kept for the backward pass: not chunks that repeat (observer.chunks_run), and 8 at most
    for chunk, target in zip(inputs.split(list(chunks.rows)), targets.split(list(chunks.rows)), strict=True):
        if compiled:  # torchtune compiles each chunk's cross-entropy
            total = total + CompiledCrossEntropy.apply(head(chunk), target)
        else:
            total = total + F.cross_entropy(head(chunk).float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
    return total


def _offsets(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each chunk's (first index, length)."""
    return list(zip(itertools.accumulate(lengths, initial=0), lengths, strict=False))


class SegmentStub(torch.autograd.Function):  # type: ignore[misc]
    """A stand-in for a loss of SEGMENT_LOSSES in a step template: it marks where the loss runs in each pass
    (tracer.segment_mark) and returns a summed loss and its inputs' gradients of the real ones' sizes, allocated where
    the tracer does not count them. It keeps none of its inputs: which the loss keeps for its backward pass, and
    where it frees them, its trace says. An estimate
    replaces each mark with a trace of the loss alone at the real size (estimate/compose.py)."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, stub: str) -> torch.Tensor:
        tracer = observer.OBSERVER
        ctx.inputs = (inputs.shape, inputs.dtype, inputs.device)  # kept by the loss or not: its trace says
        ctx.weight, ctx.bias = weight, bias
        if tracer is None:
            return inputs.new_zeros((), dtype=torch.float32)
        tracer.segment_mark("forward", stub, inputs, weight, bias, targets, None)
        for name, tensor in (("weight", weight), ("bias", bias)):
            if tensor is not None and tensor.requires_grad:
                tracer.mark_accumulation(name, tensor)
        with tracer.uncounted():
            out = inputs.new_zeros((), dtype=torch.float32)
        if stub in STUB_CALLS_HEAD:
            tracer.head_called()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tracer = observer.OBSERVER
        shape, dtype, device = ctx.inputs
        if tracer is not None:
            tracer.segment_mark("backward", "", None, ctx.weight, ctx.bias, None, grad)
        with tracer.uncounted() if tracer is not None else contextlib.nullcontext():
            grads = (torch.zeros(shape, dtype=dtype, device=device),
                     torch.zeros_like(ctx.weight) if ctx.needs_input_grad[1] else None,
                     torch.zeros_like(ctx.bias) if ctx.needs_input_grad[2] else None)
        return (*grads, None, None)


def _trl_chunk(hidden: torch.Tensor, weight: torch.Tensor,
               targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of TRL 1.7-1.14's chunked_nll (trl/trainer/sft_trainer.py `_chunk`): fp32 copies of the chunk's
    hidden states and of the whole output head, fp32 logits and log-probabilities, and the statistics TRL reports
    (accuracy, entropy) beside the summed loss."""
    logits = hidden.float() @ weight.float().t()  # (chunk, vocab)
    log_p = F.log_softmax(logits, dim=-1)
    loss = F.nll_loss(log_p, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = (logits.argmax(dim=-1) == targets).sum().float()
    entropy = -(log_p.exp() * log_p).sum(dim=-1).sum()
    return loss, correct, entropy


def _trl_head_without_triton(tokens: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed loss through TRL's own fused head where it has no Triton (trl/trainer/utils.py `_fused_forward`:
    every position scored, the targets clamped, the entropy and top-1 statistics its SFTTrainer asks for); without
    TRL installed, its memory as on a GPU (FusedHeadLoss)."""
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
    except ImportError:
        return FusedHeadLoss.apply(tokens, weight, targets, chunks_of("fused-head", tuple(tokens.shape),
                                                                       int(weight.shape[0])))
    log_probs = ChunkedLogProbFunction.apply(tokens, weight, None, targets.clamp(min=0), 1.0,
                                             _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy", "is_top1"))[0]
    return -log_probs.masked_fill(targets == IGNORE_INDEX, 0).sum()


class FusedHeadLoss(torch.autograd.Function):  # type: ignore[misc]
    """The memory of TRL's fused LM head (trl/kernels/chunked_logprob.py, ChunkedLogProbFunction) as it runs on a
    GPU: logits only ever one tile of 4,096 tokens × 32,768 entries in the compute dtype; per-token fp32
    statistics; the backward pass recomputes each tile and accumulates the hidden states' gradient (and the head's,
    when it trains) in fp32. The statistics here are a log-sum-exp over the tiles: the same sizes, simpler
    arithmetic (TRL's kernel also folds the entropy and accuracy in)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunks: Chunks) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        count = hidden.shape[0]
        log_z = torch.full((count,), float("-inf"), device=hidden.device, dtype=torch.float32)
        target_logit = torch.zeros((count,), device=hidden.device, dtype=torch.float32)
        tile = torch.empty(chunks.tile, device=hidden.device, dtype=dtype)
        for first, rows_in in observer.chunks_run(_offsets(chunks.rows)):
            last = first + rows_in
            rows = hidden[first:last].to(dtype)
            for start, width in observer.chunks_run(_offsets(chunks.columns)):
                end = start + width
                logits = tile[: last - first, : end - start]
                torch.mm(rows, weight[start:end].to(dtype).t(), out=logits)
                log_z[first:last] = torch.logaddexp(log_z[first:last], torch.logsumexp(logits, dim=-1).float())
                inside, column = _in_tile(targets[first:last], start, end)
                picked = logits.gather(1, column[:, None]).squeeze(1).float()
                target_logit[first:last] += torch.where(inside, picked, 0.0)
        ctx.save_for_backward(hidden, weight, targets, log_z)
        ctx.dtype, ctx.chunks = dtype, chunks
        return torch.where(targets != IGNORE_INDEX, log_z - target_logit, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets, log_z = ctx.saved_tensors
        dtype, chunks = ctx.dtype, ctx.chunks
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) \
            if ctx.needs_input_grad[1] else None
        tile = torch.empty(chunks.tile, device=hidden.device, dtype=dtype)
        for first, rows_in in observer.chunks_run(_offsets(chunks.rows)):
            last = first + rows_in
            rows = hidden[first:last].to(dtype)
            for start, width in observer.chunks_run(_offsets(chunks.columns)):
                end = start + width
                block = weight[start:end].to(dtype)
                logits = tile[: last - first, : end - start]
                torch.mm(rows, block.t(), out=logits)
                logits.sub_(log_z[first:last, None].to(dtype)).exp_()  # softmax
                inside, column = _in_tile(targets[first:last], start, end)
                logits.scatter_add_(1, column[:, None], -inside.to(dtype)[:, None])  # minus the target's one-hot
                logits.mul_((targets[first:last] != IGNORE_INDEX).to(dtype)[:, None] * grad.to(dtype))
                grad_hidden[first:last] += logits @ block  # fp32 accumulation (CUDA: addmm with out_dtype)
                if grad_weight is not None:
                    grad_weight[start:end] += logits.t() @ rows
        return (grad_hidden.to(hidden.dtype), None if grad_weight is None else grad_weight.to(weight.dtype), None,
                None)


def _in_tile(targets: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which targets fall in the vocabulary tile [start, end), and their column in it (0 for the others)."""
    inside = (targets >= start) & (targets < end) & (targets != IGNORE_INDEX)
    return inside, torch.where(inside, targets - start, 0)


# Rows of logits a compiled cross-entropy's fused kernel works on at a time: its temporaries are per block, never of
# the whole logits.
COMPILED_ROWS = 64


class CompiledCrossEntropy(torch.autograd.Function):  # type: ignore[misc]
    """The memory of a cross-entropy under torch.compile (inductor fuses the upcast, the log-softmax and the loss):
    the logits are kept in their own dtype with one fp32 log-sum-exp per row, and the backward pass recomputes the
    softmax into a gradient of the logits' dtype. No fp32 copy of the logits exists; temporaries are a block of
    COMPILED_ROWS rows at a time. Summed over rows whose target is not IGNORE_INDEX."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        picked = logits.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1).float()
        lse = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
        for first in range(0, logits.shape[0], COMPILED_ROWS):
            lse[first:first + COMPILED_ROWS] = torch.logsumexp(logits[first:first + COMPILED_ROWS].float(), dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        return torch.where(valid, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for first in range(0, logits.shape[0], COMPILED_ROWS):
            rows = slice(first, first + COMPILED_ROWS)
            probs = (logits[rows].float() - lse[rows, None]).exp()  # softmax of the block, in fp32
            valid = targets[rows] != IGNORE_INDEX
            probs.scatter_add_(1, torch.where(valid, targets[rows], 0)[:, None], -valid.float()[:, None])
            grad_logits[rows] = probs * (valid.float()[:, None] * grad)
        return grad_logits, None
