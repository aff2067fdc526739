"""Token counts and loss masks with a real tokenizer (a BPE trained here with `tokenizers`), against counts
made directly in the test; and the estimate's stated basis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from tunecast.data.counters import estimate_for
from tunecast.data.formats import Example, Segment
from tunecast.data.tokens import EstimateCounter, load_tokenizer

SPECIAL = ["[PAD]", "[BOS]", "[EOS]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = [line for path in Path(__file__).resolve().parents[3].glob("examples/data/*.jsonl")
          for line in path.read_text().splitlines()]


def train_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[PAD]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tokenizer.token_to_id("[BOS]")
    tokenizer.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", bos)])
    return tokenizer


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe()


@pytest.fixture(scope="module")
def tokenizer_file(bpe, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_dir(bpe, tmp_path_factory) -> Path:
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf")
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                            chat_template=TEMPLATE).save_pretrained(str(folder))
    return folder


def ids(bpe: Tokenizer, text: str, special: bool) -> list[int]:
    return bpe.encode(text, add_special_tokens=special).ids


def test_prompt_completion_counts_and_mask_equal_direct_counts(bpe, tokenizer_file) -> None:
    counter = load_tokenizer(str(tokenizer_file))
    prompt, completion = "Question: What is 12 times 34?\nAnswer:", " 12 × 34 = 408."
    example = Example(1, 1, (Segment("prompt", prompt, False), Segment("completion", completion, True)), chat=False)
    tokens, mask = counter.encode(example)  # type: ignore[attr-defined]
    eos = bpe.token_to_id("[EOS]")
    assert tokens == ids(bpe, prompt, True) + ids(bpe, completion, False) + [eos]
    assert sum(mask) == len(ids(bpe, completion, False)) + 1
    counted = counter.count(example, seq_len=5)
    assert (counted.tokens, counted.kept) == (len(tokens), 5)
    assert counted.trained_kept == sum(mask[:5])


def test_chat_template_marks_the_assistant_turns(bpe, tokenizer_dir) -> None:
    counter = load_tokenizer(str(tokenizer_dir))
    turns = [("system", "Answer in one sentence."), ("user", "What is 2 plus 2?"), ("assistant", "2 + 2 = 4."),
             ("user", "And 3 plus 3?"), ("assistant", "3 + 3 = 6.")]
    example = Example(1, 1, tuple(Segment(r, t, r == "assistant") for r, t in turns), chat=True)
    _, mask = counter.encode(example)  # type: ignore[attr-defined]
    counted = counter.count(example, seq_len=10_000)
    # Each turn renders as <|role|> content <|end|>; an assistant turn's content and <|end|> are trained.
    assert counted.tokens == sum(1 + len(ids(bpe, t, False)) + 1 for _, t in turns)
    assert counted.trained == sum(len(ids(bpe, t, False)) + 1 for r, t in turns if r == "assistant") == sum(mask)


def test_the_data_command_equals_a_direct_count_over_a_file(cli, bpe, tokenizer_file) -> None:
    source = Path(__file__).resolve().parents[3] / "examples/data/prompt-completion.jsonl"
    records = [json.loads(line) for line in source.read_text().splitlines()]
    eos_id = bpe.token_to_id("[EOS]")
    assert eos_id is not None
    lengths = [len(ids(bpe, r["prompt"], True)) + len(ids(bpe, r["completion"], False)) + 1 for r in records]
    trained = [len(ids(bpe, r["completion"], False)) + 1 for r in records]
    result = cli("data", str(source), "--tokenizer", str(tokenizer_file), "--seq-len", "4096", "--json")
    assert result.code == 0, result.stderr
    document = result.json()
    assert document["tokenizer_exact"] is True
    assert document["examples"] == len(records)
    assert document["total_tokens"] == sum(lengths)
    assert document["trained_tokens"] == sum(trained)
    assert document["length_percentiles"]["max"] == max(lengths)


def test_an_estimate_never_counts_a_non_empty_field_as_zero() -> None:
    counter = EstimateCounter(4.0, "test")
    example = Example(1, 1, (Segment("prompt", "a", False), Segment("completion", "b", True)), chat=False)
    counted = counter.count(example, seq_len=100)
    assert counted.tokens == 1 + 1 + 1 + 1  # BOS, a, b, EOS
    assert counted.trained == 2


def test_the_estimate_states_its_basis() -> None:
    llama3 = estimate_for("llama", 128256)
    assert llama3.chars_per_token == pytest.approx(4.58694) and "llama-3" in llama3.description
    unknown = estimate_for("llama", 64000)
    assert unknown.chars_per_token == 4.0 and "no measured figure" in unknown.description
    assert "help.openai.com" in estimate_for(None).description
