"""Write the bundled tiny model (examples/tiny-model/): a Llama config small enough to fine-tune on a laptop
CPU in about a minute, and a byte-level BPE tokenizer trained on the bundled sample data (examples/data/).
No weights are written: `tunecast train` builds random weights from the config and the run's seed, so the
demo needs nothing from the Hugging Face Hub.

What is written, and why:

* tokenizer.json: byte-level BPE (GPT-2's pre-tokenizer, so any text encodes and nothing is unknown) with
  VOCAB_SIZE entries: the special tokens first (ids 0-6), then the 256 bytes, then merges learned from every
  string in the sample JSON/JSONL files and from the alpaca prompts in the Stanford layout tunecast renders
  them in (without those the sample text runs out of merges at 1,002 entries). Encoding with special tokens
  puts `<s>` in front, as Llama's tokenizers do.
* tokenizer_config.json (and special_tokens_map.json, for older readers): a fast tokenizer
  (`PreTrainedTokenizerFast`), its special tokens, and a chat template in the Zephyr layout: `<s>` once, then
  `<|role|>\\n{content}</s>` per turn; the generation prompt is `<|assistant|>\\n`. The role tags are single
  special tokens, so a conversation rendered in part splits into tokens where the whole one does.
* config.json: a 4-layer Llama (hidden 128, grouped-query attention with 2 KV heads, untied embeddings),
  1.0M parameters, whose vocabulary and special-token ids are the tokenizer's.

Deterministic: rerunning rewrites byte-identical files (inputs are read in name order, the BPE trainer learns
the same merges from the same texts, and JSON is written in a fixed key order).

Run:  .venv/bin/python scripts/make_tiny_model.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
OUT = ROOT / "examples" / "tiny-model"

VOCAB_SIZE = 1024
MAX_LENGTH = 1024  # tokens: the model's position limit and the tokenizer's model_max_length
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TAGS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, *ROLE_TAGS]  # ids 0-6, in this order

# Zephyr's layout (as TinyLlama-Chat's): BOS once, each turn `<|role|>\n{content}</s>`, and for generation
# the assistant tag and its newline. EOS closes every turn, so the model learns to stop after its answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Llama architecture at toy size: head_dim = 128 / 4 = 32, intermediate ≈ 8/3 × hidden rounded to 32.
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value, in document order (texts, prompts, turns, role names)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def alpaca_prompt(record: dict[str, Any]) -> str:
    """An alpaca record's prompt in the Stanford layout that tunecast renders it in, so that the layout's
    words are in the vocabulary as the sample data's are."""
    from tunecast.data.formats import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

    template = ALPACA_WITH_INPUT if record.get("input") else ALPACA_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", ""))


def corpus() -> list[str]:
    """Every string of the sample JSON and JSONL files (the CSV, Parquet and `datasets` copies repeat them),
    and the alpaca records' prompts as tunecast renders them."""
    texts: list[str] = []
    for path in sorted(DATA.glob("*.json*")):
        content = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in content.splitlines() if line.strip()]
        else:
            records = [json.loads(content)]
        for record in records:
            texts.extend(strings(record))
            if path.name == "alpaca.jsonl":
                texts.append(alpaca_prompt(record))
    return texts


def train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # As Llama 3's tokenizer: byte-level offsets, then BOS in front of each sequence.
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=False, trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": MAX_LENGTH,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(tokenizer: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(),
        **MODEL_SHAPE,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_LENGTH,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "pad_token_id": tokenizer.token_to_id(PAD),
        "torch_dtype": "float32",
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> int:
    texts = corpus()
    tokenizer = train_tokenizer(texts)
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"), pretty=True)
    write_json(OUT / "tokenizer_config.json", tokenizer_config())
    write_json(OUT / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                                                 "unk_token": UNK, "additional_special_tokens": ROLE_TAGS})
    config = model_config(tokenizer)
    write_json(OUT / "config.json", config)
    print(f"wrote {OUT.relative_to(ROOT)}/: vocabulary {config['vocab_size']} from {len(texts)} texts, "
          f"{config['num_hidden_layers']} layers × hidden {config['hidden_size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
