"""Write the bundled sample datasets (examples/data/): the same kinds of small tasks in every supported
layout, written for tunecast's tests and examples. Deterministic: rerunning rewrites identical files.

Run:  .venv/bin/python scripts/make_sample_data.py
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "data"
UNITS = [("GiB", "bytes", 2**30), ("GB", "bytes", 10**9), ("MiB", "bytes", 2**20), ("hour", "seconds", 3600),
         ("day", "hours", 24), ("TFLOP", "FLOP", 10**12)]
TERMS = {
    "LoRA": "trains two small matrices per adapted layer while the original weights stay frozen",
    "QLoRA": "trains LoRA adapters on top of base weights stored in 4-bit NormalFloat",
    "gradient checkpointing": "stores only some activations and recomputes the rest during the backward pass",
    "gradient accumulation": "adds up the gradients of several micro-batches before one optimizer step",
    "a micro-batch": "is the set of sequences one GPU processes in a single forward pass",
    "packing": "places several short examples into one sequence so that less of it is padding",
    "a learning-rate warm-up": "raises the learning rate from near zero over the first steps",
    "weight decay": "shrinks weights slightly at every step to discourage large values",
    "bf16": "is a 16-bit floating-point format with the exponent range of fp32",
    "a checkpoint": "is a saved copy of the training state from which a run can resume",
    "spot capacity": "is cheaper GPU time that the provider may take back at short notice",
    "FSDP": "shards parameters, gradients and optimizer states across the GPUs of a job",
}


def arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    if rng.random() < 0.5:
        return f"What is {a} times {b}?", f"{a} × {b} = {a * b}."
    return f"What is {a} plus {b}?", f"{a} + {b} = {a + b}."


def conversion(rng: random.Random) -> tuple[str, str]:
    unit, base, factor = rng.choice(UNITS)
    count = rng.randint(2, 40)
    return (f"How many {base} are in {count} {unit}?",
            f"One {unit} is {factor:,} {base}, so {count} {unit} is {count * factor:,} {base}.")


def definition(rng: random.Random) -> tuple[str, str]:
    term = rng.choice(sorted(TERMS))
    return f"Explain {term} in one sentence.", f"{term[0].upper()}{term[1:]} {TERMS[term]}."


def task(rng: random.Random) -> tuple[str, str]:
    return rng.choice([arithmetic, conversion, definition])(rng)


def main() -> int:
    rng = random.Random(2026)
    OUT.mkdir(parents=True, exist_ok=True)
    systems = ["You are a concise assistant.", "Answer in one sentence.", ""]

    text = [{"text": f"{q} {a}"} for q, a in (task(rng) for _ in range(40))]
    (OUT / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))

    pairs = [task(rng) for _ in range(40)]
    prompt_completion = [{"prompt": f"Question: {q}\nAnswer:", "completion": f" {a}"} for q, a in pairs]
    (OUT / "prompt-completion.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompt_completion))
    with (OUT / "prompt-completion.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "completion"])
        writer.writeheader()
        writer.writerows(prompt_completion[:30])

    alpaca = []
    for _ in range(40):
        q, a = task(rng)
        if rng.random() < 0.4:
            alpaca.append({"instruction": "Answer the question.", "input": q, "output": a})
        else:
            alpaca.append({"instruction": q, "input": "", "output": a})
    # The original alpaca_data.json is one JSON array with an indent of 4.
    (OUT / "alpaca.json").write_text(json.dumps(alpaca, indent=4, ensure_ascii=False) + "\n")
    (OUT / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca))

    def dialogue(role: str, text: str, names: tuple[str, str, str]) -> list[dict[str, str]]:
        """A conversation with an optional system turn and 1-3 exchanges, in one layout's key names."""
        system_name, user_name, assistant_name = names
        turns = []
        system = rng.choice(systems)
        if system:
            turns.append({role: system_name, text: system})
        for _ in range(rng.randint(1, 3)):
            q, a = task(rng)
            turns += [{role: user_name, text: q}, {role: assistant_name, text: a}]
        return turns

    sharegpt = [{"conversations": dialogue("from", "value", ("system", "human", "gpt"))} for _ in range(30)]
    (OUT / "sharegpt.json").write_text(json.dumps(sharegpt, indent=2) + "\n")

    messages = [{"messages": dialogue("role", "content", ("system", "user", "assistant"))} for _ in range(40)]
    (OUT / "messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in messages))

    import datasets

    datasets.Dataset.from_list(alpaca).to_parquet(str(OUT / "alpaca.parquet"))
    datasets.Dataset.from_list(text[:20]).save_to_disk(str(OUT / "text-saved"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
