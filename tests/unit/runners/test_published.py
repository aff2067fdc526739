"""The tools' own published example configs (tests/data/runners/published/README.md): every key accounted for."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.runners.helpers import DATA, checked

from tunecast.errors import TunecastError
from tunecast.runners import axolotl, llamafactory, torchtune

PUBLISHED = DATA / "published"
READERS = {"axolotl": axolotl.read, "llamafactory": llamafactory.read, "torchtune": torchtune.read}
REFUSED = {"llamafactory/qwen3_lora_dpo.yaml": "stage 'dpo'"}
FILES = sorted(p for p in PUBLISHED.rglob("*.y*ml") if p.relative_to(PUBLISHED).as_posix() not in REFUSED)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(PUBLISHED).as_posix())
def test_every_key_accounted_for(path: Path) -> None:
    imported = READERS[path.parent.name](path)
    spec = checked(imported)
    assert spec.runner == path.parent.name
    assert not [item.key for item in imported.unmapped if "misspelt" in item.reason]


@pytest.mark.parametrize(("name", "match"), sorted(REFUSED.items()))
def test_published_runs_tunecast_cannot_estimate(name: str, match: str) -> None:
    path = PUBLISHED / name
    with pytest.raises(TunecastError, match=match):
        READERS[path.parent.name](path)


def test_published_qlora_values() -> None:
    spec = checked(axolotl.read(PUBLISHED / "axolotl" / "qlora.yml"))
    assert (spec.method, spec.lora.rank, spec.lora.alpha, spec.seq_len, spec.packing) == ("qlora", 32, 16, 4096, True)
    assert (spec.optimizer, spec.micro_batch, spec.grad_accum, spec.attention) == ("paged-adamw", 2, 4, "flash")


def test_published_lora_on_an_8bit_base() -> None:
    """axolotl's examples/llama-3/lora-8b.yml: LoRA on an LLM.int8 base (load_in_8bit: true, adapter: lora)."""
    spec = checked(axolotl.read(PUBLISHED / "axolotl" / "lora-8b.yml"))
    assert (spec.method, spec.quantization.bits, spec.lora.rank, spec.lora.alpha) == ("qlora", 8, 32, 16)
    assert (spec.seq_len, spec.packing, spec.optimizer, spec.lora.modules_to_save) == \
        (4096, True, "adamw-8bit", ["embed_tokens", "lm_head"])


def test_published_torchtune_full_recipe() -> None:
    spec = checked(torchtune.read(PUBLISHED / "torchtune" / "8B_full_single_device.yaml"))
    assert (spec.model, spec.optimizer, spec.optimizer_in_backward, spec.precision) == \
        ("meta-llama/Llama-3.1-8B", "paged-adamw-8bit", True, "bf16")
