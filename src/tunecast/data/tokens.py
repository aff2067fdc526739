"""Token counts and loss masks of examples: with the model's own tokenizer when one is on disk, else an
estimate whose basis is stated.

With a tokenizer, an example becomes exactly the token ids and loss mask tunecast trains on:

* text: the text with the tokenizer's special tokens (BOS) and EOS appended, every token trained;
* prompt/completion and alpaca: the prompt (with BOS), then the completion and EOS, tokenized separately
  (as TRL does) so that the boundary is exact; the completion and EOS are trained (everything with
  `train_on: all`);
* conversations: the tokenizer's chat template; each assistant turn's tokens are found by rendering the
  conversation up to that turn with and without it; without a chat template, each turn is written as
  `<|role|>\\n…\\n` and EOS ends the conversation.

Without a tokenizer: characters divided by a characters-per-token ratio measured on English text (that of
the model's tokenizer family, or a generic one), every non-empty text at least one token, plus BOS and EOS.
Text in other scripts tokenizes into more tokens per character than English; the estimate says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tunecast.data.formats import Example
from tunecast.errors import TunecastError

FALLBACK_TURN = "<|{role}|>\n{text}\n"


@dataclass(frozen=True)
class Counted:
    """Tokens of one example: before truncation, and after it at `seq_len`."""

    tokens: int  # all tokens, untruncated
    trained: int  # trained tokens, untruncated
    kept: int  # tokens within seq_len
    trained_kept: int  # trained tokens within seq_len


class TokenCounter(Protocol):
    description: str
    exact: bool

    def count(self, example: Example, seq_len: int) -> Counted: ...


def _counted(spans: list[tuple[int, bool]], seq_len: int) -> Counted:
    """From (length, trained) spans in order."""
    tokens = trained = kept = trained_kept = 0
    for length, is_trained in spans:
        inside = max(0, min(length, seq_len - tokens))
        tokens += length
        kept += inside
        if is_trained:
            trained += length
            trained_kept += inside
    return Counted(tokens, trained, kept, trained_kept)


@dataclass(frozen=True)
class EstimateCounter:
    """Characters ÷ `chars_per_token`, stated with its basis."""

    chars_per_token: float
    basis: str
    exact: bool = False

    @property
    def description(self) -> str:
        return f"estimate: {self.chars_per_token:g} characters per token ({self.basis})"

    def _tokens(self, text: str) -> int:
        return max(1, math.ceil(len(text) / self.chars_per_token)) if text else 0

    def count(self, example: Example, seq_len: int) -> Counted:
        spans: list[tuple[int, bool]] = [(1, False)]  # BOS
        for segment in example.segments:
            if example.chat:
                header = FALLBACK_TURN.format(role=segment.role, text="")
                spans.append((self._tokens(header), False))
            spans.append((self._tokens(segment.text), segment.trained))
        spans.append((1, example.segments[-1].trained))  # EOS, trained with the last response
        return _counted(spans, seq_len)


class Encoder(Protocol):
    def encode(self, text: str, special: bool) -> list[int]: ...


@dataclass
class TokenizerCounter:
    """Exact counts with a real tokenizer (transformers' or a tokenizers.json file)."""

    tokenizer: Any
    description: str
    eos_id: int | None
    chat_template: bool
    exact: bool = True

    def _encode(self, text: str, special: bool) -> list[int]:
        if hasattr(self.tokenizer, "apply_chat_template"):  # transformers
            return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def encode(self, example: Example) -> tuple[list[int], list[bool]]:
        """Token ids and, per token, whether it counts in the loss."""
        ids: list[int] = []
        mask: list[bool] = []
        for piece, trained in self._pieces(example):
            ids += piece
            mask += [trained] * len(piece)
        return ids, mask

    def count(self, example: Example, seq_len: int) -> Counted:
        return _counted([(len(piece), trained) for piece, trained in self._pieces(example)], seq_len)

    def _pieces(self, example: Example) -> list[tuple[list[int], bool]]:
        """The example's tokens in runs that are all trained or all not."""
        if example.chat and self.chat_template:
            return self._chat_pieces(example)
        pieces: list[tuple[list[int], bool]] = []
        first = True
        for segment in example.segments:
            if example.chat:
                pieces.append((self._encode(FALLBACK_TURN.format(role=segment.role, text=""), special=first), False))
                first = False
            pieces.append((self._encode(segment.text, special=first), segment.trained))
            first = False
        last = next((piece for piece, _ in reversed(pieces) if piece), [])
        if self.eos_id is not None and (not last or last[-1] != self.eos_id):
            pieces.append(([self.eos_id], example.segments[-1].trained))
        return pieces

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)
        return self._encode(text, special=False)

    def _chat_pieces(self, example: Example) -> list[tuple[list[int], bool]]:
        """The rendered conversation, split where trained turns start and end. A turn's tokens are found
        by rendering the conversation up to it (with the generation prompt) and up to its end."""
        messages = [{"role": s.role, "content": s.text} for s in example.segments]
        ids = self._render(messages)
        pieces: list[tuple[list[int], bool]] = []
        position = 0
        for index, segment in enumerate(example.segments):
            if not segment.trained:
                continue
            start = len(self._render(messages[:index], generation_prompt=segment.role == "assistant")) if index else 0
            end = min(len(self._render(messages[: index + 1])), len(ids))
            start = max(start, position)
            if start > position:
                pieces.append((ids[position:start], False))
            if end > start:
                pieces.append((ids[start:end], True))
            position = max(position, end)
        if position < len(ids):
            pieces.append((ids[position:], False))
        return pieces


def load_tokenizer(path: str) -> TokenCounter:
    """A tokenizer from a model or tokenizer folder, or a tokenizer.json file."""
    location = Path(path).expanduser()
    if location.is_file() and location.suffix == ".json":
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(location))
        except Exception as error:  # tokenizers raises its own exception types
            raise TunecastError(f"{location} is not a tokenizers file: {error}", field="--tokenizer",
                                hint="give a tokenizer.json, or the folder of a saved tokenizer") from None
        eos = _eos_from_config(location.parent)
        eos_id = tokenizer.token_to_id(eos) if eos else None
        return TokenizerCounter(tokenizer, f"tokenizer {location} (vocabulary {tokenizer.get_vocab_size():,})",
                                eos_id, chat_template=False)
    if location.is_dir():
        return _transformers_tokenizer(str(location), f"tokenizer in {location}")
    raise TunecastError(f"no tokenizer at {path}", field="--tokenizer",
                        hint="give a folder holding tokenizer files, or a tokenizer.json file")


def _eos_from_config(folder: Path) -> str | None:
    import json

    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("eos_token")
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _transformers_tokenizer(name: str, description: str) -> TokenCounter:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as error:
        raise TunecastError(f"no tokenizer could be loaded from {name}: {error}", field="--tokenizer",
                            hint="give a folder saved with save_pretrained, or a tokenizer.json") from None
    return TokenizerCounter(tokenizer, f"{description} (vocabulary {len(tokenizer):,})", tokenizer.eos_token_id,
                            chat_template=bool(getattr(tokenizer, "chat_template", None)))


def cached_tokenizer(model_name: str) -> TokenCounter | None:
    """The model's tokenizer if it is in the local Hugging Face cache (nothing is downloaded)."""
    try:
        return _transformers_tokenizer(model_name, f"{model_name}'s tokenizer (local Hugging Face cache)")
    except TunecastError:
        return None
