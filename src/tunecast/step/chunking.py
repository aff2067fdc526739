"""How each runner's own loss splits its work into chunks: the lengths, in order, worked out without torch.

The losses (step/loss.py) run these very chunks, and an estimate reads from them which of a loss's forms holds at a
shape (estimate/forms.py), where the same loss at other lengths has the same events of other sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

# tunecast's own `loss: chunked` (and axolotl's Liger fused cross-entropy): 8 chunks along the sequence.
LOSS_CHUNKS = 8
# TRL's fused LM head projects 4,096 tokens × 32,768 vocabulary entries at a time (trl/kernels/chunked_logprob.py
# TOKEN_CHUNK_SIZE; trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE); torchtune's LinearCrossEntropyLoss projects
# the trained tokens in 8 chunks (num_output_chunks).
TRL_TILE_TOKENS = 4096
TRL_TILE_VOCAB = 32768
TORCHTUNE_CHUNKS = 8
# TRL 1.7-1.14's chunked_nll takes the loss 256 trained tokens at a time (trl/trainer/sft_trainer.py
# _CHUNKED_LM_HEAD_CHUNK_SIZE).
TRL_CHUNK_TOKENS = 256
# unsloth's fused cross-entropy sizes its chunks so that one chunk's fp32 logits take at most min(half the free
# device memory, 4 GiB) (unsloth_zoo/fused_losses/cross_entropy_loss.py); the trace assumes the 4 GiB.
UNSLOTH_CHUNK_BYTES = 4 * 2**30


@dataclass(frozen=True)
class Chunks:
    """A loss's chunks: `rows`, the lengths of its chunks along the sequence (of hidden states) or the tokens; for
    TRL's fused head also `columns`, the widths of its vocabulary tiles, and `tile`, the rows and columns of the one
    logits buffer its tiles are computed into."""

    rows: tuple[int, ...]
    columns: tuple[int, ...] = ()
    tile: tuple[int, int] = (0, 0)


def split(length: int, chunks: int) -> tuple[int, ...]:
    """The lengths torch.chunk splits `length` into for `chunks` chunks: each ⌈length / chunks⌉, the last what is
    left (so there may be fewer chunks)."""
    return tiles(length, -(-length // max(1, chunks)))


def tiles(length: int, size: int) -> tuple[int, ...]:
    """`length` in pieces of `size`, the last what is left."""
    return tuple(min(size, length - start) for start in range(0, length, size))


def chunks_of(variant: str, inputs_shape: tuple[int, ...], vocab: int) -> Chunks:
    """The chunks of the loss `variant` (step/variants.py SEGMENT_LOSSES) over inputs of `inputs_shape`: the hidden
    states (batch, length, hidden) for `fused-chunks` and `loss-chunks`, the trained tokens (tokens, hidden) for
    the others."""
    if variant == "fused-chunks":
        batch, length = inputs_shape[0], inputs_shape[1]
        return Chunks(split(length, max(1, -(-batch * length * vocab * 4 // UNSLOTH_CHUNK_BYTES))))
    if variant == "loss-chunks":
        return Chunks(split(inputs_shape[1], LOSS_CHUNKS))
    if variant == "trl-chunks":
        return Chunks(tiles(inputs_shape[0], TRL_CHUNK_TOKENS))
    if variant == "output-chunks":
        return Chunks(split(inputs_shape[0], TORCHTUNE_CHUNKS))
    if variant == "fused-head":
        tokens = inputs_shape[0]
        return Chunks(tiles(tokens, TRL_TILE_TOKENS), tiles(vocab, TRL_TILE_VOCAB),
                      (min(tokens, TRL_TILE_TOKENS), TRL_TILE_VOCAB))
    raise ValueError(f"no chunks for the loss {variant!r}")
