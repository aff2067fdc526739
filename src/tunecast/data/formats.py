"""Record layouts, their detection, and one normal form for all of them: an `Example` of segments, each a
piece of text with a role and whether it counts in the loss.

Layouts: `text`; `prompt-completion`; `alpaca` (instruction, input, output, optional system); `sharegpt`
(`conversations` of from/value); `messages` (OpenAI style, role/content).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tunecast.data.readers import BadRow, Row
from tunecast.errors import TunecastError

FORMATS = ("text", "prompt-completion", "alpaca", "sharegpt", "messages")
REQUIRED: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "prompt-completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "messages": ("messages",),
}
SHOWN_FIELDS: dict[str, tuple[str, ...]] = {**REQUIRED, "alpaca": ("instruction", "input", "output")}
DETECTION_ROWS = 1000
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
CHAT_ROLES = ("system", "user", "assistant", "tool")

# The Stanford Alpaca prompt (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT), the layout the
# alpaca format is rendered in when no chat template is used.
ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


@dataclass(frozen=True)
class Segment:
    role: str  # text, prompt, completion, system, user, assistant, tool
    text: str
    trained: bool


@dataclass(frozen=True)
class Example:
    number: int
    line: int | None
    segments: tuple[Segment, ...]
    chat: bool  # True for conversations (rendered with a chat template when the tokenizer has one)


@dataclass(frozen=True)
class Detection:
    format: str
    explanation: str


def detect_format(records: Iterable[dict[str, Any]]) -> Detection:
    """The layout most of the first rows have, and why."""
    rows = list(records)[:DETECTION_ROWS]
    if not rows:
        raise TunecastError("the dataset has no rows", field="dataset.path", hint="check the file")
    shares = {name: sum(all(key in row for key in keys) for row in rows) / len(rows) for name, keys in REQUIRED.items()}
    best = max(FORMATS, key=lambda name: (shares[name], len(REQUIRED[name])))
    if shares[best] < 0.5:
        seen = Counter(key for row in rows for key in row)
        fields = ", ".join(f"{key} ({count / len(rows):.0%})" for key, count in seen.most_common(8))
        raise TunecastError(f"cannot detect the dataset format; fields seen: {fields}", field="dataset.format",
                            hint=f"set dataset.format (--format) to one of: {', '.join(FORMATS)}")
    present = [key for key in SHOWN_FIELDS[best] if any(key in row for row in rows)]
    explanation = (f"detected {best}: fields {', '.join(present)} in {shares[best]:.0%} of the first "
                   f"{len(rows)} rows")
    return Detection(best, explanation)


def _text(row: Row, key: str, *, required: bool = True) -> str | BadRow:
    value = row.data.get(key)
    if value is None or (isinstance(value, float) and value != value):  # missing, null or a CSV/Parquet NaN
        if required:
            return BadRow(row.number, row.line, f"has no '{key}' field", field=key,
                          hint=f"add '{key}', set dataset.format if the layout is another one, or pass --skip-invalid")
        return ""
    if not isinstance(value, str):
        return BadRow(row.number, row.line, f"'{key}' is {type(value).__name__}, not text", field=key,
                      hint=f"make '{key}' a string")
    return value


def to_example(row: Row, layout: str, train_on: str) -> Example | BadRow:
    """The row as segments; `train_on` is `completion` (responses only) or `all`."""
    everything = train_on == "all"
    if layout == "text":
        text = _text(row, "text")
        if isinstance(text, BadRow):
            return text
        return Example(row.number, row.line, (Segment("text", text, True),), chat=False)
    if layout in ("prompt-completion", "alpaca"):
        if layout == "alpaca":
            parts = {key: _text(row, key, required=key in REQUIRED["alpaca"])
                     for key in ("instruction", "input", "output", "system")}
            bad = next((p for p in parts.values() if isinstance(p, BadRow)), None)
            if bad is not None:
                return bad
            template = ALPACA_WITH_INPUT if parts["input"] else ALPACA_NO_INPUT
            prompt = template.format(instruction=parts["instruction"], input=parts["input"])
            if parts["system"]:
                prompt = f"{parts['system']}\n\n{prompt}"
            completion = parts["output"]
        else:
            prompt_or_bad, completion_or_bad = _text(row, "prompt"), _text(row, "completion")
            if isinstance(prompt_or_bad, BadRow):
                return prompt_or_bad
            if isinstance(completion_or_bad, BadRow):
                return completion_or_bad
            prompt, completion = prompt_or_bad, completion_or_bad
        assert isinstance(prompt, str) and isinstance(completion, str)
        return Example(row.number, row.line, (Segment("prompt", prompt, everything),
                                              Segment("completion", completion, True)), chat=False)
    return _conversation(row, layout, everything)


def _conversation(row: Row, layout: str, everything: bool) -> Example | BadRow:
    key, role_key, text_key = ("conversations", "from", "value") if layout == "sharegpt" else (
        "messages", "role", "content")
    turns = row.data.get(key)
    if turns is None:
        return BadRow(row.number, row.line, f"has no '{key}' field", field=key,
                      hint=f"add '{key}', set dataset.format if the layout is another one, or pass --skip-invalid")
    if isinstance(turns, str):
        try:
            import json

            turns = json.loads(turns)  # CSV cells hold conversations as JSON text
        except ValueError:
            pass
    if not isinstance(turns, list):
        return BadRow(row.number, row.line, f"'{key}' is {type(turns).__name__}, not a list of turns", field=key,
                      hint=f"make '{key}' a list of {{{role_key!r}: …, {text_key!r}: …}}")
    if not turns:
        return BadRow(row.number, row.line, f"'{key}' is an empty conversation", field=key,
                      hint="remove the row or give it at least one turn")
    segments: list[Segment] = []
    for index, turn in enumerate(turns):
        where = f"{key}[{index}]"
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            return BadRow(row.number, row.line, f"{where} needs '{role_key}' and '{text_key}'", field=where,
                          hint=f"write each turn as {{{role_key!r}: …, {text_key!r}: …}}")
        raw_role, text = turn[role_key], turn[text_key]
        role = SHAREGPT_ROLES.get(str(raw_role).lower()) if layout == "sharegpt" else str(raw_role)
        if role not in CHAT_ROLES:
            known = sorted(SHAREGPT_ROLES) if layout == "sharegpt" else list(CHAT_ROLES)
            return BadRow(row.number, row.line, f"{where} has the unknown role {raw_role!r}",
                          field=f"{where}.{role_key}", hint=f"use one of: {', '.join(known)}")
        if not isinstance(text, str):
            return BadRow(row.number, row.line, f"{where}.{text_key} is {type(text).__name__}, not text",
                          field=f"{where}.{text_key}", hint="make each turn's text a string")
        segments.append(Segment(role, text, role == "assistant" or everything))
    if not any(segment.role == "assistant" for segment in segments):
        return BadRow(row.number, row.line, f"'{key}' has no assistant turn, so nothing would be trained", field=key,
                      hint="add the assistant's reply, or remove the row")
    return Example(row.number, row.line, tuple(segments), chat=True)
